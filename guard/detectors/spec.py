"""Acceptance of speculative draft tokens, per request and per wave, over sliding windows.

A request with k drafts scheduled in a wave that returns m tokens accepted m - 1 of them (the
last token is the target model's own); this is the same rule vLLM's scheduler uses for its
spec-decode counters, so the guard's totals can be checked against `vllm:spec_decode_*`.

Each request's window is a ring of (drafted, accepted) entries in arrays indexed by its slot
(`guard/detectors/slots.py`): a wave updates and judges every request with array operations.
Two judgements, each raised once per episode:

- band: a window's rate outside [min_rate, max_rate];
- jump: a window's rate far above the engine's baseline (a slow average of the per-wave rate).
  Degenerate, repetitive output makes drafts easy to accept, so acceptance rising sharply is a
  symptom as much as acceptance collapsing (shared/research/anchors_update.md §4).
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence

import numpy as np

from guard.detectors.config import SpecAcceptanceConfig
from guard.detectors.slots import SlotMap, WaveTokens, grown

WAVE_KEY = ""  # the engine-wide window's key among request ids


class Window:
    """Sums of (drafted, accepted) over the last `size` entries (the engine-wide window)."""

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


class Judged:
    """A window found out of line: which key, its sums, and why ("band" or "jump")."""

    __slots__ = ("accepted", "baseline", "drafted", "key", "kind", "rate")

    def __init__(self, key: str, drafted: int, accepted: int, kind: str, baseline: float) -> None:
        self.key = key
        self.drafted = drafted
        self.accepted = accepted
        self.rate = accepted / drafted if drafted else 0.0
        self.kind = kind
        self.baseline = baseline


class AcceptanceTracker:
    """Totals, the engine-wide wave window and baseline, and one window per request slot."""

    def __init__(self, config: SpecAcceptanceConfig, slots: SlotMap | None = None) -> None:
        self.config = config
        self.slots = slots if slots is not None else SlotMap()
        self._own_slots = slots is None
        self.waves = Window(config.window_waves)
        self.drafted_total = 0
        self.accepted_total = 0
        # the engine's baseline: an average of the per-wave rate over ~baseline_waves waves
        self.baseline = 0.0
        self.baseline_waves = 0
        self._alpha = 1.0 / config.baseline_waves
        self.wave_out_of_band = False
        self.wave_jumped = False
        rows, size = self.slots.capacity, config.request_window
        self.ring = np.zeros((rows, size, 2), dtype=np.int64)  # (drafted, accepted) entries
        self.entries = np.zeros(rows, dtype=np.int64)
        self.sums = np.zeros((rows, 2), dtype=np.int64)
        self.out_of_band = np.zeros(rows, dtype=bool)
        self.jumped = np.zeros(rows, dtype=bool)
        self._last: tuple[np.ndarray, list[str], np.ndarray] | None = None
        self.slots.register(self._grow, self._clear)

    def _grow(self, rows: int) -> None:
        self.ring = grown(self.ring, rows)
        self.entries = grown(self.entries, rows)
        self.sums = grown(self.sums, rows)
        self.out_of_band = grown(self.out_of_band, rows, False)
        self.jumped = grown(self.jumped, rows, False)

    def _clear(self, slots: np.ndarray) -> None:
        self.ring[slots] = 0
        self.entries[slots] = 0
        self.sums[slots] = 0
        self.out_of_band[slots] = False
        self.jumped[slots] = False

    def forget(self, request_id: str) -> None:
        if self._own_slots:
            self.slots.release([request_id])

    # -- one wave -------------------------------------------------------------------------
    def observe_wave(
        self, slots: np.ndarray, drafted: np.ndarray, wave: WaveTokens
    ) -> tuple[int, int, np.ndarray, np.ndarray, np.ndarray]:
        """Add one wave: returns (drafted, accepted, rows with drafts, their drafted, accepted)."""
        rows = np.flatnonzero((drafted > 0) & (wave.lengths > 0))
        if not len(rows):
            return 0, 0, rows, rows, rows
        d = drafted[rows]
        a = np.maximum(wave.lengths[rows] - 1, 0)
        sl = slots[rows]
        position = self.entries[sl] % self.config.request_window
        old = self.ring[sl, position]
        new = np.stack((d, a), axis=1)
        self.ring[sl, position] = new
        self.sums[sl] += new - old
        self.entries[sl] += 1
        wave_drafted, wave_accepted = int(d.sum()), int(a.sum())
        self.waves.add(wave_drafted, wave_accepted)
        self.drafted_total += wave_drafted
        self.accepted_total += wave_accepted
        return wave_drafted, wave_accepted, rows, d, a

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

    def judge(self, slots: np.ndarray, req_ids: Sequence[str], rows: np.ndarray) -> list[Judged]:
        """Windows (the wave window as "") that left the band or jumped just now; once each."""
        config = self.config
        found: list[Judged] = []
        ready = self.baseline_ready
        baseline = self.baseline
        window = self.waves
        if window.drafted >= config.min_drafts:
            rate = window.rate
            outside = not config.min_rate <= rate <= config.max_rate
            if outside and not self.wave_out_of_band:
                found.append(Judged(WAVE_KEY, window.drafted, window.accepted, "band", baseline))
            self.wave_out_of_band = outside
            if ready:
                jump = rate - baseline >= config.jump_above
                if jump and not self.wave_jumped and not outside:
                    found.append(
                        Judged(WAVE_KEY, window.drafted, window.accepted, "jump", baseline)
                    )
                self.wave_jumped = jump
        if not len(rows):
            return found
        sl = slots[rows]
        sums = self.sums[sl]
        drafted, accepted = sums[:, 0], sums[:, 1]
        judged = drafted >= config.min_drafts
        if not judged.any():
            return found
        rate = accepted / np.maximum(drafted, 1)
        outside = judged & ~((config.min_rate <= rate) & (rate <= config.max_rate))
        was = self.out_of_band[sl]
        band_new = outside & ~was
        self.out_of_band[sl] = np.where(judged, outside, was)
        jump_new = np.zeros_like(judged)
        if ready:
            jump = judged & (rate - baseline >= config.jump_above)
            was_jump = self.jumped[sl]
            jump_new = jump & ~was_jump & ~outside
            self.jumped[sl] = np.where(judged, jump, was_jump)
        for i in np.flatnonzero(band_new | jump_new).tolist():  # only rows that change
            kind = "band" if band_new[i] else "jump"
            key = req_ids[int(rows[i])]
            found.append(Judged(key, int(drafted[i]), int(accepted[i]), kind, baseline))
        return found

    # -- the per-request interface (tests, and callers without a slot map) -----------------
    def observe(
        self,
        drafts: Mapping[str, Sequence[int]],
        req_ids: Sequence[str],
        sampled: Sequence[Sequence[int]],
    ) -> tuple[int, int, dict[str, tuple[int, int]]]:
        """One wave: returns (drafted, accepted, per-request (drafted, accepted))."""
        slots = self.slots.slots(req_ids)
        drafted = draft_counts(drafts, req_ids)
        total_d, total_a, rows, d, a = self.observe_wave(slots, drafted, WaveTokens(sampled))
        self._last = (slots, list(req_ids), rows)
        per_request = {req_ids[r]: (int(x), int(y)) for r, x, y in zip(rows, d, a, strict=True)}
        return total_d, total_a, per_request

    def newly_out_of_band(self, request_ids: Sequence[str]) -> list[tuple[str, Judged]]:
        """After `observe`: the windows judged out of line just now, as (key, window)."""
        if self._last is None:
            return []
        slots, req_ids, rows = self._last
        wanted = set(request_ids)
        rows = np.array([r for r in rows.tolist() if req_ids[r] in wanted], dtype=np.intp)
        self._last = (slots, req_ids, rows[:0])
        return [(j.key, j) for j in self.judge(slots, req_ids, rows)]


def draft_counts(drafts: Mapping[str, Sequence[int]], req_ids: Sequence[str]) -> np.ndarray:
    """Drafts scheduled for each row (0 for none); C-level iteration over the rows."""
    empty = ()
    get = drafts.get
    return np.fromiter(
        map(len, map(get, req_ids, (empty,) * len(req_ids))), dtype=np.intp, count=len(req_ids)
    )
