"""Detectors on each request's sampled token stream: loops and n-gram repeats, ids out of range.

They run on the token lists the runner already hands back to the scheduler (no device work),
with every request's state in arrays indexed by a slot (`guard/detectors/slots.py`), so a wave
costs a fixed number of numpy operations whatever the batch size:

- Loops: for each period p ≤ max_period, `run[p]` counts how many tokens in a row equal the
  token p earlier. The stream's tail repeats with period p exactly when `run[p]` reaches
  `max(min_repeats·p, min_span) − p` (the same condition as `find_loop`, kept as the reference);
  a new token updates every period of every request with one comparison against the last
  max_period tokens.
- N-grams: each request's last `window − n + 1` n-grams are counted exactly in a small
  open-addressing table per slot (the n-gram's 64-bit key, `PROBES` places to look), updated
  as n-grams arrive and leave. The table has at least 16 places per n-gram, so an n-gram finds
  no place about once in a million; it is then left uncounted (that can miss a repeat, never
  raise a false one). Keys are 64-bit hashes of the n-gram's ids.

A loop or repeat raises one finding when it starts and another only after the stream has left
it ("episodes"), not one per token.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from guard.detectors.config import TokenRepeatConfig
from guard.detectors.slots import SlotMap, WaveTokens, grown

# (kind "loop" or "ngram", period or n, span or count, the repeated block)
RepeatFinding = tuple[str, int, int, list[int]]

NO_TOKEN = np.int64(-(2**62))  # fills history not yet seen: equal to no sampled id
PROBES = 4  # places an n-gram may take in its request's table
_HASH_MULT = np.uint64(0x9E3779B97F4A7C15)


class RepeatDetector:
    """Loop and n-gram episodes of every request, one batch per wave."""

    def __init__(self, config: TokenRepeatConfig, slots: SlotMap | None = None) -> None:
        self.config = config
        self.requests = slots if slots is not None else SlotMap()
        self._own_slots = slots is None
        size, periods = config.ngram_size, config.max_period
        self._size = size
        self._periods = periods
        self._lags = max(periods, size)  # recent tokens kept newest first
        self._grams = config.window - size + 1  # n-grams counted per request
        p = np.arange(1, periods + 1)
        # run length of matches at lag p that makes a loop of period p
        self._need_run = np.maximum(config.min_repeats * p, config.min_span) - p
        powers = np.ones(size, dtype=np.uint64)
        for i in range(1, size):
            powers[i] = powers[i - 1] * np.uint64(1_000_003)
        self._powers = powers
        rows = self.requests.capacity
        self.lag = np.full((rows, self._lags), NO_TOKEN, dtype=np.int64)
        self.run = np.zeros((rows, periods), dtype=np.int32)
        self.total = np.zeros(rows, dtype=np.int64)
        self.hist = np.zeros((rows, config.window), dtype=np.int64)
        bits = max(11, int(16 * self._grams - 1).bit_length())
        self._places = 1 << bits  # the table's last column (index `places`) takes overflows
        self._home_shift = np.uint64(64 - bits)
        self._probe = np.arange(PROBES)
        self.gram_place = np.zeros((rows, self._grams), dtype=np.intp)
        self.keys = np.zeros((rows, self._places + 1), dtype=np.uint64)
        self.counts = np.zeros((rows, self._places + 1), dtype=np.int32)
        self.hot = np.zeros(rows, dtype=np.int32)
        self.in_loop = np.zeros(rows, dtype=bool)
        self.in_ngram = np.zeros(rows, dtype=bool)
        self.requests.register(self._grow, self._clear)

    # -- slot lifecycle -------------------------------------------------------------------
    def _grow(self, rows: int) -> None:
        self.lag = grown(self.lag, rows, NO_TOKEN)
        self.run = grown(self.run, rows)
        self.total = grown(self.total, rows)
        self.hist = grown(self.hist, rows)
        self.gram_place = grown(self.gram_place, rows)
        self.keys = grown(self.keys, rows)
        self.counts = grown(self.counts, rows)
        self.hot = grown(self.hot, rows)
        self.in_loop = grown(self.in_loop, rows, False)
        self.in_ngram = grown(self.in_ngram, rows, False)

    def _clear(self, slots: np.ndarray) -> None:
        self.lag[slots] = NO_TOKEN
        self.run[slots] = 0
        self.total[slots] = 0
        self.counts[slots] = 0
        self.hot[slots] = 0
        self.in_loop[slots] = False
        self.in_ngram[slots] = False

    def forget(self, request_id: str) -> None:
        if self._own_slots:
            self.requests.release([request_id])

    def recent_tokens(self, request_id: str) -> list[int]:
        """The request's last `window` sampled tokens, oldest first (for evidence dumps)."""
        slot = self.requests.lookup(request_id)
        return [] if slot is None else self._window_tokens(slot)

    # -- the per-wave update --------------------------------------------------------------
    def add(self, request_id: str, new_tokens: Sequence[int]) -> list[RepeatFinding]:
        """One request's tokens of one wave (a batch of one); returns the episodes that start."""
        found = self.add_wave(self.requests.slots([request_id]), WaveTokens([list(new_tokens)]))
        return found[0][1] if found else []

    def add_wave(
        self, slots: np.ndarray, wave: WaveTokens
    ) -> list[tuple[int, list[RepeatFinding]]]:
        """Append one wave's tokens of every row; returns (row, findings) for rows with any."""
        if not len(slots):
            return []
        if wave.uniform:
            rows = None
            sl = slots
        else:
            rows = np.flatnonzero(wave.lengths)
            if not len(rows):
                return []
            sl = slots[rows]
        # one gather per state array; every token column updates these copies; one scatter
        state = _Rows(self, sl)
        if rows is None:
            self._step(state, wave.padded[:, 0])
        else:
            lengths, tokens = wave.lengths[rows], wave.padded[rows]
            for j in range(wave.width):  # k+1 columns on a spec-decode wave
                active = np.flatnonzero(lengths > j)
                if len(active) == len(sl):
                    self._step(state, tokens[:, j])
                else:
                    part = state.take(active)
                    self._step(part, tokens[active, j])
                    state.put(active, part)
        state.store(self)
        loop_now = (state.run >= self._need_run).any(axis=1)
        loop_start = loop_now & ~self.in_loop[sl]
        self.in_loop[sl] = loop_now
        self.in_ngram[sl] = state.hot > 0
        ngram_start = state.started & ~loop_now
        if not _count(loop_start) and not _count(ngram_start):
            return []
        return self._findings(sl, rows, state, loop_start, ngram_start)

    def _step(self, state: _Rows, x: np.ndarray) -> None:
        """One new token for each of the state's rows."""
        lag = state.lag
        # runs of "equal to the token p back", before x enters the lags
        np.multiply(state.run + 1, lag[:, : self._periods] == x[:, None], out=state.run)
        lag[:, 1:] = lag[:, :-1]  # numpy copes with the overlap
        lag[:, 0] = x
        state.total += 1
        total = state.total
        sl = state.slots
        self.hist[sl, (total - 1) % self.config.window] = x
        # n-gram counts: the newest n-gram enters its request's table, the oldest leaves
        size, grams, places = self._size, self._grams, self._places
        valid = total >= size
        if not _count(valid):
            return
        key = (lag[:, :size].view(np.uint64) * self._powers).sum(axis=1, dtype=np.uint64)
        home = ((key * _HASH_MULT) >> self._home_shift).astype(np.intp)
        probe = (home[:, None] + self._probe) & (places - 1)
        rows = sl[:, None]
        match = self.keys[rows, probe] == key[:, None]
        free = self.counts[rows, probe] == 0
        has_match = match.any(axis=1)
        ok = valid & (has_match | free.any(axis=1))
        choice = np.where(has_match, match.argmax(axis=1), free.argmax(axis=1))
        place = np.where(ok, probe[np.arange(len(sl)), choice], places)
        counts = self.counts
        self.keys[sl, place] = key
        count = counts[sl, place] + ok
        counts[sl, place] = count
        hit = ok & (count == self.config.ngram_max_count)
        if _count(hit):
            state.hot += hit
            first = hit & (state.hot == 1) & ~state.was_ngram
            if _count(first):
                state.started |= first
                if state.block is None:
                    state.block = np.zeros((len(first), size), dtype=np.int64)
                state.block[first] = lag[first, :size][:, ::-1]
        seen = total - size + 1  # n-grams so far, the newest included
        ring = (seen - 1) % grams
        leaving = valid & (seen > grams)
        if _count(leaving):
            old = self.gram_place[sl, ring]
            left = counts[sl, old] - leaving
            counts[sl, old] = left
            counted = old != places
            state.hot -= leaving & counted & (left == self.config.ngram_max_count - 1)
        self.gram_place[sl, ring] = place  # rows still short of an n-gram write unread places

    def _findings(
        self, sl, rows, state, loop_start, ngram_start
    ) -> list[tuple[int, list[RepeatFinding]]]:
        """The rare rows that start an episode: Python per finding, not per request."""
        config, size = self.config, self._size
        out = []
        for i in np.flatnonzero(loop_start | ngram_start).tolist():
            findings: list[RepeatFinding] = []
            if loop_start[i]:
                period = int(np.argmax(state.run[i] >= self._need_run)) + 1
                span = max(config.min_repeats * period, config.min_span)
                findings.append(("loop", period, span, state.lag[i, :period][::-1].tolist()))
            elif ngram_start[i]:
                findings.append(("ngram", size, config.ngram_max_count, state.block[i].tolist()))
            if findings:
                out.append((i if rows is None else int(rows[i]), findings))
        return out

    def _window_tokens(self, slot: int) -> list[int]:
        total, window = int(self.total[slot]), self.config.window
        if total <= window:
            return self.hist[slot, :total].tolist()
        start = total % window
        return np.concatenate((self.hist[slot, start:], self.hist[slot, :start])).tolist()


class _Rows:
    """Gathered copies of the state rows of one wave's requests (updated, then stored)."""

    __slots__ = ("block", "hot", "lag", "run", "slots", "started", "total", "was_ngram")

    def __init__(self, detector: RepeatDetector | None, slots: np.ndarray) -> None:
        self.slots = slots
        if detector is None:
            return
        self.lag = detector.lag[slots]
        self.run = detector.run[slots]
        self.total = detector.total[slots]
        self.hot = detector.hot[slots]
        self.was_ngram = detector.in_ngram[slots]
        self.started = np.zeros(len(slots), dtype=bool)
        self.block: np.ndarray | None = None  # the n-grams that start an episode, when any

    def take(self, index: np.ndarray) -> _Rows:
        part = _Rows(None, self.slots[index])
        for name in _ROW_ARRAYS:
            setattr(part, name, getattr(self, name)[index])
        part.block = None if self.block is None else self.block[index]
        return part

    def put(self, index: np.ndarray, part: _Rows) -> None:
        for name in _ROW_ARRAYS:
            getattr(self, name)[index] = getattr(part, name)
        if part.block is not None:
            if self.block is None:
                self.block = np.zeros((len(self.slots), part.block.shape[1]), dtype=np.int64)
            self.block[index] = part.block

    def store(self, detector: RepeatDetector) -> None:
        slots = self.slots
        detector.lag[slots] = self.lag
        detector.run[slots] = self.run
        detector.total[slots] = self.total
        detector.hot[slots] = self.hot


_ROW_ARRAYS = ("hot", "lag", "run", "started", "total", "was_ngram")
_count = np.count_nonzero  # truth of a bool array: much cheaper than .any() on small arrays


def find_loop(
    window: Sequence[int], max_period: int, min_repeats: int, min_span: int
) -> tuple[int, int, list[int]] | None:
    """The shortest period p ≤ max_period with which the window's tail repeats itself.

    Returns (period, span, block) when the last `span` tokens equal the `span` tokens p earlier,
    where span ≥ max(min_repeats·p, min_span) − p, i.e. the block occurs min_repeats times.
    The reference for `RepeatDetector`'s running counts (and its unit test's oracle).
    """
    n = len(window)
    last = window[-1] if n else None
    for period in range(1, max_period + 1):
        need = max(min_repeats * period, min_span)
        if need > n:
            break
        if window[n - 1 - period] != last:  # cheap test first: most periods fail here
            continue
        tail = window[n - need + period :]
        if tail == window[n - need : n - period]:
            return period, need, list(window[n - period :])
    return None


def out_of_range(tokens: Sequence[int], vocab_size: int) -> list[int]:
    """Sampled ids outside [0, vocab_size); the common case costs one min and one max."""
    if not len(tokens):
        return []
    array = np.asarray(tokens)
    if int(array.min()) >= 0 and int(array.max()) < vocab_size:
        return []
    return array[(array < 0) | (array >= vocab_size)].tolist()


def rows_out_of_range(wave: WaveTokens, vocab_size: int) -> np.ndarray:
    """Rows holding a sampled id outside [0, vocab_size): two reductions in the common case."""
    flat = wave.flat
    if not len(flat) or (int(flat.min()) >= 0 and int(flat.max()) < vocab_size):
        return _NO_ROWS
    bad = (flat < 0) | (flat >= vocab_size)
    row = np.repeat(np.arange(len(wave.lengths)), wave.lengths)
    return np.unique(row[bad])


_NO_ROWS = np.zeros(0, dtype=np.intp)
