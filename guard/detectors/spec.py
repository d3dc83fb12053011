"""Acceptance of speculative draft tokens, per request and per wave, over sliding windows.

A request with k drafts scheduled in a wave that returns m tokens accepted m - 1 of them (the
last token is the target model's own); this is the same rule vLLM's scheduler uses for its
spec-decode counters, so the guard's totals can be checked against `vllm:spec_decode_*`.

A window is judged two ways, each reported once per episode:
- band: its rate is outside [min_rate, max_rate];
- jump: its rate is `jump_above` or more over the engine's baseline, a slow average of the
  per-wave rate (about `baseline_waves` waves). Degenerate, repetitive output makes drafts easy
  to accept, so acceptance rising far above what this engine usually gets is a warning sign
  that no fixed band catches. The baseline is judged against only once it has seen
  `window_waves` waves with drafts, and each wave is folded into it after it was judged.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from guard.detectors.config import SpecAcceptanceConfig


class Window:
    """Sums of (drafted, accepted) over the last `size` entries."""

    __slots__ = ("accepted", "drafted", "entries", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: collections.deque[tuple[int, int]] = collections.deque()
        self.drafted = 0
        self.accepted = 0

    def add(self, drafted: int, accepted: int) -> None:
        self.entries.append((drafted, accepted))
        self.drafted += drafted
        self.accepted += accepted
        while len(self.entries) > self.size:
            old_d, old_a = self.entries.popleft()
            self.drafted -= old_d
            self.accepted -= old_a

    @property
    def rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class Judged(NamedTuple):
    """A window found out of line just now: its key ("" = the wave window), the window, why
    ("band" or "jump") and the baseline it was judged against."""

    key: str
    window: Window
    kind: str
    baseline: float


class AcceptanceTracker:
    """Totals, the engine-wide wave window and baseline, and one window per request."""

    def __init__(self, config: SpecAcceptanceConfig) -> None:
        self.config = config
        self.waves = Window(config.window_waves)
        self.requests: dict[str, Window] = {}
        self.out_of_band: set[str] = set()  # request ids ("" = the wave window) now outside
        self.jumped: set[str] = set()  # ... now far above the baseline
        self.drafted_total = 0
        self.accepted_total = 0
        self.baseline = 0.0  # the per-wave rate's slow average
        self.baseline_waves = 0  # waves with drafts folded into it
        self._alpha = 1.0 / config.baseline_waves

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.out_of_band.discard(request_id)
        self.jumped.discard(request_id)

    def update_baseline(self, drafted: int, accepted: int) -> None:
        """Fold one wave's rate into the baseline (after the wave was judged against it)."""
        if not drafted:
            return
        rate = accepted / drafted
        if self.baseline_waves == 0:
            self.baseline = rate
        else:
            self.baseline += self._alpha * (rate - self.baseline)
        self.baseline_waves += 1

    @property
    def baseline_ready(self) -> bool:
        return self.config.jump_above > 0 and self.baseline_waves >= self.config.window_waves

    def observe(
        self,
        drafts: Mapping[str, Sequence[int]],
        req_ids: Sequence[str],
        sampled: Sequence[Sequence[int]],
    ) -> tuple[int, int, dict[str, tuple[int, int]]]:
        """One wave: returns (drafted, accepted, per-request (drafted, accepted))."""
        per_request = {}
        wave_drafted = wave_accepted = 0
        for index, req_id in enumerate(req_ids):
            draft = drafts.get(req_id)
            if not draft or index >= len(sampled) or not sampled[index]:
                continue
            drafted = len(draft)
            accepted = max(len(sampled[index]) - 1, 0)
            per_request[req_id] = (drafted, accepted)
            wave_drafted += drafted
            wave_accepted += accepted
            window = self.requests.get(req_id)
            if window is None:
                window = self.requests[req_id] = Window(self.config.request_window)
            window.add(drafted, accepted)
        if wave_drafted:
            self.waves.add(wave_drafted, wave_accepted)
            self.drafted_total += wave_drafted
            self.accepted_total += wave_accepted
        return wave_drafted, wave_accepted, per_request

    def newly_out_of_band(self, request_ids: Sequence[str]) -> list[Judged]:
        """Windows (the wave window as "") that left the band or jumped above the baseline just
        now; each once per episode. A window outside the band is not also a jump."""
        config = self.config
        ready = self.baseline_ready
        baseline = self.baseline
        found = []
        for key in ("", *request_ids):
            window = self.waves if key == "" else self.requests.get(key)
            if window is None or window.drafted < config.min_drafts:
                continue
            rate = window.rate
            outside = not config.min_rate <= rate <= config.max_rate
            if outside and key not in self.out_of_band:
                self.out_of_band.add(key)
                found.append(Judged(key, window, "band", baseline))
            elif not outside:
                self.out_of_band.discard(key)
            if not ready:
                continue
            jump = rate - baseline >= config.jump_above
            if jump and not outside and key not in self.jumped:
                found.append(Judged(key, window, "jump", baseline))
            if jump:
                self.jumped.add(key)
            else:
                self.jumped.discard(key)
        return found
