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

Each wave is judged as if on its own, but the work is batched like token_repeat's: a wave only
queues its drafted and returned counts (plain lists, no numpy), and every `batch_waves(rows)`
waves the batch is judged at once. The engine-wide window and the baseline step wave by wave
in Python (a few operations per wave); each request's window is a ring row indexed by its slot,
and its sum at every wave of the batch comes from one cumulative sum over the ring's entries
followed by the batch's; an episode's state at each wave is the value at the key's last judged
wave before it. A finding names its wave and is reported at the batch's end.
"""

from __future__ import annotations

import array
import collections
import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from guard.config.detectors import SpecAcceptanceConfig
from guard.detectors.slots import (
    SlotMap,
    batch_waves,
    grown,
    power_of_two,
    rank_in_group,
)
from guard.wave.schedule import WaveTokens


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


class WindowSums(NamedTuple):
    """A window's sums as they were when it was judged."""

    drafted: int
    accepted: int

    @property
    def rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class Judged(NamedTuple):
    """A window found out of line at `wave`: its key ("" = the wave window), its sums, why
    ("band" or "jump") and the baseline it was judged against."""

    wave: int
    key: str
    window: WindowSums
    kind: str
    baseline: float


class _Queued(NamedTuple):
    """One wave's counts, as it came: row i is request `slots[i]`."""

    wave: int
    slots: np.ndarray
    drafted: bytes | array.array  # drafts per row (`_counts`)
    returned: bytes | array.array | None  # tokens back per row; None: one each


class AcceptanceTracker:
    """Totals, the engine-wide wave window and baseline, and one window per request."""

    def __init__(self, config: SpecAcceptanceConfig) -> None:
        self.config = config
        self.waves = Window(config.window_waves)
        self.drafted_total = 0
        self.accepted_total = 0
        self.baseline = 0.0  # the per-wave rate's slow average
        self.baseline_waves = 0  # waves with drafts folded into it
        self._alpha = 1.0 / config.baseline_waves
        self._wave_out_of_band = False  # the wave window's episodes
        self._wave_jumped = False
        self.requests = SlotMap()
        capacity = self.requests.capacity
        # each request's running totals (packed, `_pack`) after each of its last
        # request_window + 1 entries, and after its newest (`total`); a window is the
        # difference of two
        self._width = power_of_two(config.request_window + 1)  # at least the window and one
        self._mask = self._width - 1
        self.prefix = np.zeros((capacity, self._width), dtype=np.int64)
        self.total = np.zeros(capacity, dtype=np.int64)
        self.entries = np.zeros(capacity, dtype=np.int64)  # waves with drafts, ever
        self.out_of_band = np.zeros(capacity, dtype=bool)
        self.jumped = np.zeros(capacity, dtype=bool)
        self.requests.register(self._grow, self._clear)
        self._queue: list[_Queued] = []

    # -- slot lifecycle -------------------------------------------------------------------
    def _grow(self, rows: int) -> None:
        self.prefix = grown(self.prefix, rows)
        self.total = grown(self.total, rows)
        self.entries = grown(self.entries, rows)
        self.out_of_band = grown(self.out_of_band, rows, False)
        self.jumped = grown(self.jumped, rows, False)

    def _clear(self, slots: np.ndarray) -> None:
        self.prefix[slots] = 0
        self.total[slots] = 0
        self.entries[slots] = 0
        self.out_of_band[slots] = False
        self.jumped[slots] = False

    @property
    def pending(self) -> bool:
        """Waves queued for the next judgement."""
        return bool(self._queue)

    def forget_requests(self, request_ids: Iterable[str]) -> None:
        """Finished requests; their queued waves are still judged."""
        self.requests.release(request_ids)
        if not self._queue:
            self.requests.apply_releases()

    def window(self, request_id: str) -> WindowSums | None:
        """A request's window as of the last judged batch."""
        slot = self.requests.lookup(request_id)
        if slot is None:
            return None
        entries, size = int(self.entries[slot]), self.config.request_window
        before = 0 if entries <= size else int(self.prefix[slot, (entries - 1 - size) & self._mask])
        return WindowSums(*_unpack(int(self.total[slot]) - before))

    @property
    def baseline_ready(self) -> bool:
        return self.config.jump_above > 0 and self.baseline_waves >= self.config.window_waves

    # -- the per-wave update --------------------------------------------------------------
    def add_wave(
        self,
        wave: int,
        req_ids: Sequence[str],
        drafts: Mapping[str, Sequence[int]],
        tokens: WaveTokens,
    ) -> list[Judged]:
        """Queue one wave: the drafts scheduled for it, and the tokens each request got back
        (row i is `req_ids[i]`'s). Judges the batch when it is full and returns its findings,
        else nothing. No numpy runs here unless the wave's requests changed."""
        drafted = list(map(len, map(drafts.get, req_ids, itertools.repeat(()))))
        if not any(drafted):
            return []
        lengths = tokens.lengths
        returned = _counts(lengths) if lengths is not None else None
        self._queue.append(_Queued(wave, self.requests.slots(req_ids), _counts(drafted), returned))
        if len(self._queue) >= batch_waves(len(req_ids)):
            return self.flush()
        return []

    # -- the batch ------------------------------------------------------------------------
    def flush(self) -> list[Judged]:
        """Judge every queued wave; returns the windows found out of line, in wave order."""
        queue, self._queue = self._queue, []
        if not queue:
            self.requests.apply_releases()
            return []
        slots = np.concatenate([q.slots for q in queue])
        drafted = _array_of([q.drafted for q in queue])
        returned = _array_of([q.returned or _ONE_EACH * len(q.drafted) for q in queue])
        index = np.repeat(np.arange(len(queue)), [len(q.drafted) for q in queue])
        keep = np.flatnonzero((drafted > 0) & (returned > 0))  # a row with drafts, tokens back
        slots, drafted, index = slots[keep], drafted[keep], index[keep]
        accepted = returned[keep] - 1
        same = all(q.slots is queue[0].slots for q in queue) and len(keep) == len(returned)
        count = len(queue)
        wave_drafted = np.bincount(index, drafted, minlength=count).astype(np.int64).tolist()
        wave_accepted = np.bincount(index, accepted, minlength=count).astype(np.int64).tolist()
        found: list[tuple[int, int, Judged]] = []  # (batch wave, row order, finding)
        baselines, ready = [0.0] * count, [False] * count
        for k, item in enumerate(queue):
            if not wave_drafted[k]:
                continue
            baselines[k], ready[k] = self.baseline, self.baseline_ready
            judged = self._wave_window(item.wave, wave_drafted[k], wave_accepted[k])
            found += [(k, -1, j) for j in judged]
            self._fold_baseline(wave_drafted[k], wave_accepted[k])
        if len(slots):
            waves = [q.wave for q in queue]
            if same:  # the same requests every wave, all with drafts: a [waves, rows] grid
                rows = len(queue[0].slots)
                by_request = np.arange(len(slots)).reshape(count, rows).T.ravel()
                first = np.arange(0, len(slots), count)
            else:
                by_request = np.argsort(slots, kind="stable")
                ordered = slots[by_request]
                first = np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1])))
            packed = _pack(drafted, accepted)
            found += self._request_windows(
                slots, packed, index, by_request, first, waves, baselines, ready
            )
        self.requests.apply_releases()
        found.sort(key=lambda item: item[:2])
        return [judged for _, _, judged in found]

    def _wave_window(self, wave: int, drafted: int, accepted: int) -> list[Judged]:
        """Add one wave to the engine-wide window and judge it (before the baseline moves)."""
        self.waves.add(drafted, accepted)
        self.drafted_total += drafted
        self.accepted_total += accepted
        window, config = self.waves, self.config
        if window.drafted < config.min_drafts:
            return []
        rate, found = window.rate, []
        sums = WindowSums(window.drafted, window.accepted)
        outside = not config.min_rate <= rate <= config.max_rate
        if outside and not self._wave_out_of_band:
            found.append(Judged(wave, "", sums, "band", self.baseline))
        self._wave_out_of_band = outside
        if self.baseline_ready:
            jump = rate - self.baseline >= config.jump_above
            if jump and not outside and not self._wave_jumped:
                found.append(Judged(wave, "", sums, "jump", self.baseline))
            self._wave_jumped = jump
        return found

    def _fold_baseline(self, drafted: int, accepted: int) -> None:
        """Fold one wave's rate into the baseline (after the wave was judged against it)."""
        rate = accepted / drafted
        if self.baseline_waves == 0:
            self.baseline = rate
        else:
            self.baseline += self._alpha * (rate - self.baseline)
        self.baseline_waves += 1

    def _request_windows(
        self,
        slots: np.ndarray,
        packed: np.ndarray,
        index: np.ndarray,
        by_request: np.ndarray,
        first: np.ndarray,
        waves: list[int],
        baselines: list[float],
        ready: list[bool],
    ) -> list[tuple[int, int, Judged]]:
        """Each request's window at each of its entries in the batch, judged in arrays.

        `by_request` orders the entries by slot, in wave order within a slot; `first` is where
        each slot's group begins in that order. A request's running totals after each entry
        are its total before the batch plus a cumulative sum over its group; the window ending
        at an entry is that less the running totals `request_window` entries before, from the
        batch itself or from the slot's ring.
        """
        config, size = self.config, self.config.request_window
        width, mask = self._width, self._mask
        slots, index, packed = slots[by_request], index[by_request], packed[by_request]
        entries = len(slots)
        touched, per_group = slots[first], np.diff(first, append=entries)
        group = np.repeat(np.arange(len(first)), per_group)
        rank = rank_in_group(per_group)
        done = self.entries[touched]  # entries already behind each request
        running = np.cumsum(packed)
        before_group = self.total[touched] - (running[first] - packed[first])
        prefix = running + before_group[group]
        back = np.zeros(entries, dtype=np.int64)  # running totals `size` entries before
        in_batch = np.flatnonzero(rank >= size)
        back[in_batch] = prefix[in_batch - size]
        entry_back = done[group] + rank - size
        in_ring = np.flatnonzero((rank < size) & (entry_back >= 0))
        flat = self.prefix.reshape(-1)  # a view: the ring rows end to end
        back[in_ring] = flat[slots[in_ring] * width + (entry_back[in_ring] & mask)]
        win_drafted, win_accepted = _unpack(prefix - back)
        rate = np.divide(win_accepted, win_drafted, out=np.zeros(entries), where=win_drafted > 0)
        judged = win_drafted >= config.min_drafts
        outside = ~((rate >= config.min_rate) & (rate <= config.max_rate))
        band_before, band_after = _episode(judged, outside, group, first, self.out_of_band[touched])
        new_band = judged & outside & ~band_before
        self.out_of_band[touched] = band_after
        new_jump = np.zeros(entries, dtype=bool)
        if any(ready):
            judged_ready = judged & np.array(ready)[index]
            jump = rate - np.array(baselines)[index] >= config.jump_above
            jump_before, jump_after = _episode(
                judged_ready, jump, group, first, self.jumped[touched]
            )
            new_jump = judged_ready & jump & ~outside & ~jump_before
            self.jumped[touched] = jump_after
        # the newest `width` running totals of each request go into its ring
        write = np.flatnonzero(rank >= per_group[group] - width)
        flat[slots[write] * width + ((done[group[write]] + rank[write]) & mask)] = prefix[write]
        self.total[touched] = prefix[first + per_group - 1]
        self.entries[touched] = done + per_group
        found = []
        for i in np.flatnonzero(new_band | new_jump).tolist():
            k = int(index[i])
            sums = WindowSums(int(win_drafted[i]), int(win_accepted[i]))
            kind = "band" if new_band[i] else "jump"
            request_id = self.requests.id_of[int(slots[i])] or ""
            found.append(
                (k, int(by_request[i]), Judged(waves[k], request_id, sums, kind, baselines[k]))
            )
        return found


def _counts(values: list[int]) -> bytes | array.array:
    """Per-row counts, stored compactly: bytes convert several times faster than a list does,
    and a count of 256 or more (never seen: drafts per wave are a handful) still fits."""
    try:
        return bytes(values)
    except ValueError:
        return array.array("q", values)


def _array_of(counts: list[bytes | array.array]) -> np.ndarray:
    """The waves' counts end to end, as int64."""
    if all(type(c) is bytes for c in counts):
        return np.frombuffer(b"".join(counts), dtype=np.uint8).astype(np.int64)
    return np.concatenate(
        [np.frombuffer(c, dtype=np.uint8 if type(c) is bytes else np.int64) for c in counts]
    ).astype(np.int64)


_ONE_EACH = b"\x01"  # a plain decode wave: one token back per row

# A request's (drafted, accepted) sums travel as one int64, drafted in the low 32 bits and
# accepted above, so one cumulative sum and one gather serve both. Neither can reach 2**31 in
# a request (that many tokens is far past any model's context).
_SHIFT = 32
_LOW = (1 << _SHIFT) - 1


def _pack(drafted: np.ndarray, accepted: np.ndarray) -> np.ndarray:
    return drafted + (accepted << _SHIFT)


def _unpack(packed: Any) -> tuple[Any, Any]:
    """(drafted, accepted) of a packed int or array."""
    return packed & _LOW, packed >> _SHIFT


def _episode(
    judged: np.ndarray,
    value: np.ndarray,
    group: np.ndarray,
    first: np.ndarray,
    before_batch: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """An episode flag stepped over entries grouped by request: at each judged entry it takes
    `value`, otherwise it keeps what it had. `group` is each entry's group, `first` each
    group's first entry, `before_batch` each group's flag before the batch. Returns the flag
    just before each entry, and each group's flag after its last entry."""
    at = np.arange(len(judged))
    start = first[group]
    # the last judged entry at or before each one (start - 1: none yet in its group)
    last = np.maximum.accumulate(np.where(judged, at, start - 1))
    previous = np.empty_like(last)
    previous[0], previous[1:] = -1, last[:-1]
    before = np.where(previous >= start, value[np.maximum(previous, 0)], before_batch[group])
    group_last = last[np.append(first[1:], len(judged)) - 1]
    after = np.where(group_last >= first, value[np.maximum(group_last, 0)], before_batch)
    return before, after
