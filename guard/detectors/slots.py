"""Per-request state in arrays: a slot per request id, and batches of waves' tokens.

A detector keeps each request's state in preallocated numpy rows indexed by a slot. A wave maps
its request ids to slots once (`SlotMap.slots`, cached while the batch's composition stays the
same, which is most waves); the detector then gathers and scatters all rows at once in C, with
no Python loop over requests. A finished request's slot is cleared before it is reused, so a
new request always starts from a clean row.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from guard.wave.schedule import WaveTokens

INITIAL_SLOTS = 64
# waves a batching detector screens together: about BATCH_IDS rows' worth, within
# [MIN_BATCH_WAVES, MAX_BATCH_WAVES]; a screen costs a fixed few dozen array calls, so small
# batches wait for more waves
BATCH_IDS = 4096
MIN_BATCH_WAVES, MAX_BATCH_WAVES = 8, 32

Clearer = Callable[[np.ndarray], None]
Grower = Callable[[int], None]


class SlotMap:
    """Request id → slot; the owner registers how to grow and clear its arrays.

    `release` takes a finished request's id away; its slot is only cleared and reused at the
    next `apply_releases`, since a detector that batches waves may still have the request's
    queued tokens to process under that slot.
    """

    def __init__(self, capacity: int = INITIAL_SLOTS) -> None:
        self.capacity = capacity
        self.slot_of: dict[str, int] = {}
        self.id_of: list[str | None] = [None] * capacity
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self._released: list[int] = []
        self._growers: list[Grower] = []
        self._clearers: list[Clearer] = []
        self._cached_ids: list[str] | None = None
        self._cached_slots = np.zeros(0, dtype=np.intp)

    def register(self, grow: Grower, clear: Clearer) -> None:
        self._growers.append(grow)
        self._clearers.append(clear)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.slot_of

    def __len__(self) -> int:
        return len(self.slot_of)

    def slots(self, req_ids: Sequence[str]) -> np.ndarray:
        """The slot of each request id, in order; new ids get a slot. The same array comes
        back while the ids stay the same (callers must not write to it)."""
        cached = self._cached_ids
        if cached is not None and (req_ids is cached or req_ids == cached):
            return self._cached_slots
        slot_of = self.slot_of
        missing = [r for r in req_ids if r not in slot_of]  # only when the batch changed
        if missing:
            self._assign(missing)
        slots = np.fromiter(map(slot_of.__getitem__, req_ids), dtype=np.intp, count=len(req_ids))
        self._cached_ids = list(req_ids)
        self._cached_slots = slots
        return slots

    def lookup(self, request_id: str) -> int | None:
        return self.slot_of.get(request_id)

    def _assign(self, ids: list[str]) -> None:
        while len(self._free) < len(ids):
            self._grow()
        for request_id in ids:
            slot = self._free.pop()
            self.slot_of[request_id] = slot
            self.id_of[slot] = request_id

    def _grow(self) -> None:
        old, new = self.capacity, self.capacity * 2
        for grow in self._growers:
            grow(new)
        self._free[:0] = range(new - 1, old - 1, -1)
        self.id_of.extend([None] * (new - old))
        self.capacity = new

    def release(self, request_ids: Iterable[str]) -> None:
        """Finished requests: their slots are cleared and freed at `apply_releases`."""
        pop = self.slot_of.pop
        freed = [s for s in map(pop, request_ids, itertools.repeat(None)) if s is not None]
        if freed:
            self._cached_ids = None
            self._released.extend(freed)

    def apply_releases(self) -> None:
        freed, self._released = self._released, []
        if not freed:
            return
        slots = np.array(freed, dtype=np.intp)
        for clear in self._clearers:
            clear(slots)
        for slot in freed:
            self.id_of[slot] = None
        self._free.extend(freed)


def batch_waves(rows: int) -> int:
    """Waves screened together when a wave has `rows` requests."""
    return min(MAX_BATCH_WAVES, max(MIN_BATCH_WAVES, BATCH_IDS // max(rows, 1)))


def power_of_two(n: int) -> int:
    """The least power of two that is at least n: a ring of that width finds a position's
    place with one bitwise and (`& (width - 1)`) instead of an integer division."""
    return 1 << max(0, n - 1).bit_length()


def grown(array: np.ndarray, rows: int, fill: int | float | bool = 0) -> np.ndarray:
    """`array` with `rows` rows: the old rows copied, the new ones set to `fill`."""
    out = np.full((rows, *array.shape[1:]), fill, dtype=array.dtype)
    out[: array.shape[0]] = array
    return out


def packed_batch(waves: Sequence[WaveTokens]) -> np.ndarray:
    """Every id of `waves`, wave after wave, in one int64 array (one copy of their bytes)."""
    return np.frombuffer(b"".join([tokens.packed for tokens in waves]), dtype=np.int64)


def rank_in_group(counts: np.ndarray) -> np.ndarray:
    """For groups of `counts` items laid end to end, each item's place in its group:
    [2, 0, 3] -> [0, 1, 0, 1, 2]."""
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
