"""Per-request state in arrays: a slot per request id, and one wave's tokens as arrays.

Detectors keep each request's state in preallocated numpy arrays indexed by a slot. A wave
maps its request ids to slots once (`SlotMap.slots`, cached while the batch's composition
stays the same, which is most waves) and then gathers, updates and scatters all rows at once in
C: the per-wave cost has no Python loop over requests. A finished request's slot is cleared
and reused, so a new request always starts from a clean row.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import numpy as np

INITIAL_SLOTS = 64

Clearer = Callable[[np.ndarray], None]
Grower = Callable[[int], None]


class SlotMap:
    """Request id → slot; detectors register how to grow and clear their arrays."""

    def __init__(self, capacity: int = INITIAL_SLOTS) -> None:
        self.capacity = capacity
        self.slot_of: dict[str, int] = {}
        self._free: list[int] = list(range(capacity - 1, -1, -1))
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
        """The slot of each request id, in order; new ids get a slot (cached per batch)."""
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
            self.slot_of[request_id] = self._free.pop()

    def _grow(self) -> None:
        old, new = self.capacity, self.capacity * 2
        for grow in self._growers:
            grow(new)
        self._free[:0] = range(new - 1, old - 1, -1)
        self.capacity = new

    def release(self, request_ids: Sequence[str] | set[str]) -> None:
        """Finished requests: clear their rows in every detector and free their slots."""
        freed = [
            s for s in map(self.slot_of.pop, request_ids, itertools.repeat(None)) if s is not None
        ]
        if not freed:
            return
        slots = np.array(freed, dtype=np.intp)
        for clear in self._clearers:
            clear(slots)
        self._free.extend(freed)
        self._cached_ids = None


def grown(array: np.ndarray, rows: int, fill: int | float | bool = 0) -> np.ndarray:
    """`array` with `rows` rows: the old rows copied, the new ones set to `fill`."""
    out = np.full((rows, *array.shape[1:]), fill, dtype=array.dtype)
    out[: array.shape[0]] = array
    return out


class WaveTokens:
    """One wave's sampled tokens as arrays: lengths per row and a padded [rows, width] matrix.

    `sampled` is the runner's list of token lists. Built with C-level iteration (`map`,
    `np.fromiter`); the common one-token-per-request wave costs two `fromiter` calls.
    """

    __slots__ = ("flat", "lengths", "padded", "uniform", "width")

    def __init__(self, sampled: Sequence[Sequence[int]]) -> None:
        rows = len(sampled)
        lengths = np.fromiter(map(len, sampled), dtype=np.intp, count=rows)
        total = int(lengths.sum())
        flat = np.fromiter(itertools.chain.from_iterable(sampled), dtype=np.int64, count=total)
        self.lengths = lengths
        self.flat = flat
        if total == rows and (rows == 0 or int(lengths.min()) == 1):
            self.uniform = True
            self.width = 1 if rows else 0
            self.padded = flat.reshape(rows, 1)
            return
        self.uniform = False
        width = int(lengths.max()) if rows else 0
        padded = np.zeros((rows, width), dtype=np.int64)
        if total:
            row = np.repeat(np.arange(rows), lengths)
            starts = np.cumsum(lengths) - lengths
            padded[row, np.arange(total) - starts[row]] = flat
        self.width = width
        self.padded = padded
