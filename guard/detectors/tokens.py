"""Detectors on each request's sampled token stream: loops and n-gram repeats, ids out of range.

They run on the token lists the runner already hands back to the scheduler (no device work),
with every request's state in numpy rows indexed by a slot (`guard/detectors/slots.py`), so
the work per batch of waves is a fixed number of array operations whatever the batch size,
and Python runs per suspect request, not per request:

- Each wave's ids are queued as they came, with no numpy: inside the engine, numpy's first
  calls after the model's own work cost several times their figure in a loop.
- Every `batch_waves(requests)` waves (8-32, about `BATCH_IDS` ids) the batch is written into
  each request's history ring and screened at once. New n-grams enter a per-request count
  sketch (each n-gram's count lands in one of `buckets` cells, shared with the n-grams that
  hash there, so a cell never reads below the n-gram's true count); a request whose cell
  reaches `ngram_max_count` is a suspect. Requests with `CHECK_EVERY` new tokens are looked
  at for loops: a vectorised match of the window's tail against itself at each period.
- A suspect's batch is replayed exactly in Python from its history, token by token. An
  episode already open when the batch began is judged at its end instead: it goes on while
  some n-gram of the window is still at the limit (exact: the window's keys sorted).

A loop or repeat raises one finding when it starts and another only after the stream has left
it ("episodes"), not one per token. A finding names the wave its token arrived in, though it
is reported at the batch's end (at most `MAX_BATCH_WAVES - 1` waves later; when the engine goes
idle, the streamer thread screens what is left, `DetectorSuite.flush_idle`).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np

from guard.detectors.config import TokenRepeatConfig
from guard.detectors.slots import (
    SlotMap,
    WaveTokens,
    batch_waves,
    grown,
    packed_batch,
    power_of_two,
    rank_in_group,
)

CHECK_EVERY = 8  # new tokens of a request before its stream is looked at for loops again
BATCH_TOKENS = 256  # most tokens of one request in one batch (a longer `add` is cut up)
_HASH_MULT = np.uint64(0x9E3779B97F4A7C15)
_POWER = np.uint64(1_000_003)
_ONE = np.int16(1)  # np.add.at takes its fast path only with the target's own dtype
_LOOP_CELLS = 1 << 20  # bound on one vectorised loop test's [requests, periods, tail] cells

# (kind "loop" or "ngram", period or n, span or count, the repeated block)
RepeatFinding = tuple[str, int, int, list[int]]
# a finding with the wave it belongs to and its request
WaveFinding = tuple[int, str, RepeatFinding]


class RepeatDetector:
    """Loop and n-gram episodes of every request, batched over waves."""

    def __init__(self, config: TokenRepeatConfig) -> None:
        self.config = config
        self.requests = SlotMap()
        self.requests.register(self._grow, self._clear)
        window, size = config.window, config.ngram_size
        self._size = size
        self._grams = window - size + 1  # n-grams counted per request
        self._batch_tokens = max(window, BATCH_TOKENS)
        # the window before a batch, and the batch; ring widths are powers of two, so a stream
        # position's place is one bitwise and (`& mask`), not an integer division
        self._ring = power_of_two(window + self._batch_tokens)
        self._mask = self._ring - 1
        self._gram_ring = power_of_two(self._grams + self._batch_tokens)
        self._gram_mask = self._gram_ring - 1
        bits = max(10, (8 * self._grams - 1).bit_length())
        self._buckets = 1 << bits
        self._bucket_shift = np.uint64(64 - bits)
        periods = np.arange(1, config.max_period + 1)
        self._need = np.maximum(config.min_repeats * periods, config.min_span)
        self._tail = min(int(self._need.max()), window)  # a loop is looked for in the window
        lag_span = max(1, int((self._need - periods).max()))
        offsets = np.arange(lag_span)
        self._lag_index = np.minimum(offsets + periods[:, None], self._tail - 1)
        self._lag_ignored = offsets >= (self._need - periods)[:, None]  # past a period's span
        self._tail_offsets = np.arange(self._tail)
        self._near_offsets = np.arange(config.max_period + 1)
        rows = self.requests.capacity
        # narrow types keep the rows few cache lines: the engine's own work evicts them between
        # waves (ids past 2**31 wrap here; token_range reads the runner's own lists)
        self.hist = np.zeros((rows, self._ring), dtype=np.int32)
        self.total = np.zeros(rows, dtype=np.int64)  # tokens seen
        self.flushed = np.zeros(rows, dtype=np.int64)  # tokens seen at the last screen
        self.since_check = np.zeros(rows, dtype=np.int64)
        self.in_loop = np.zeros(rows, dtype=bool)
        self.in_ngram = np.zeros(rows, dtype=bool)
        self.sketch = np.zeros((rows, self._buckets), dtype=np.int16)  # a cell <= grams < 2**15
        self.gram_bucket = np.zeros((rows, self._gram_ring), dtype=np.int16)
        # waves queued as they came: (wave, slots of its rows, its tokens)
        self._queue: list[tuple[int, np.ndarray, WaveTokens]] = []
        # waves written into the rows, not yet screened: (wave, slots, each row's total after)
        self._pending: list[tuple[int, np.ndarray, np.ndarray]] = []
        self._queued_tokens = 0  # the most tokens any one request may have in the batch

    # -- slot lifecycle -------------------------------------------------------------------
    def _grow(self, rows: int) -> None:
        self.hist = grown(self.hist, rows)
        self.total = grown(self.total, rows)
        self.flushed = grown(self.flushed, rows)
        self.since_check = grown(self.since_check, rows)
        self.in_loop = grown(self.in_loop, rows, False)
        self.in_ngram = grown(self.in_ngram, rows, False)
        self.sketch = grown(self.sketch, rows)
        self.gram_bucket = grown(self.gram_bucket, rows)

    def _clear(self, slots: np.ndarray) -> None:
        self.total[slots] = 0
        self.flushed[slots] = 0
        self.since_check[slots] = 0
        self.in_loop[slots] = False
        self.in_ngram[slots] = False
        self.sketch[slots] = 0

    @property
    def pending(self) -> bool:
        """Waves queued for the next screen."""
        return bool(self._queue or self._pending)

    def forget(self, request_id: str) -> None:
        """A finished request; its queued tokens are still screened."""
        self.requests.release([request_id])
        if not self.pending:
            self.requests.apply_releases()

    def recent_tokens(self, request_id: str) -> list[int]:
        """The request's recent sampled tokens, oldest first, as many as its ring holds (the
        window and a batch; for evidence dumps)."""
        slot = self.requests.lookup(request_id)
        if slot is None:
            return []
        self._write_queue()
        end = int(self.total[slot])
        return self._history(slot, max(0, end - self._ring), end)

    def _history(self, slot: int, start: int, end: int) -> list[int]:
        """Tokens at stream positions [start, end) of a slot (all within the ring)."""
        return self.hist[slot, np.arange(start, end) & self._mask].tolist()

    # -- the per-wave update --------------------------------------------------------------
    def add(self, request_id: str, new_tokens: Sequence[int]) -> list[RepeatFinding]:
        """One request's tokens of one wave, screened at once; the episodes that start."""
        tokens, step = list(new_tokens), self._batch_tokens
        found = []
        for i in range(0, len(tokens), step):
            self.add_wave(0, [request_id], WaveTokens([tokens[i : i + step]]))
            found += self.flush()
        return [finding for _, _, finding in found]

    def add_wave(self, wave: int, req_ids: Sequence[str], tokens: WaveTokens) -> list[WaveFinding]:
        """Queue one wave's tokens (row i's are request `req_ids[i]`'s); screens the batch when
        it is full and returns that batch's findings, else nothing. No numpy runs here unless
        the batch's requests changed (their slots) or the batch is full."""
        found: list[WaveFinding] = []
        if self._queued_tokens + tokens.width > self._batch_tokens:
            found = self.flush()  # a request's batch must fit in its ring beside the window
        self._queue.append((wave, self.requests.slots(req_ids), tokens))
        self._queued_tokens += tokens.width
        if len(self._queue) >= batch_waves(tokens.rows):
            found += self.flush()
        return found

    def _write_queue(self) -> None:
        """Write the queued waves' tokens into the history rows (not yet screened)."""
        queue, self._queue = self._queue, []
        if not queue:
            return
        ring, mask, same = self._ring, self._mask, queue[0][1]
        hist = self.hist.reshape(-1)  # flat: one index per id is cheaper than a pair
        if all(slots is same and tokens.uniform for _, slots, tokens in queue):
            # a plain decode batch: the same requests, one token each, every wave: one scatter
            ids = packed_batch([tokens for _, _, tokens in queue]).reshape(len(queue), -1)
            position = self.total[same] + np.arange(len(queue))[:, None]
            hist[same * ring + (position & mask)] = ids
            end = position + 1
            self.total[same] = end[-1]
            self._pending += [(item[0], same, end[k]) for k, item in enumerate(queue)]
            return
        for wave, slots, tokens in queue:
            start = self.total[slots]
            if tokens.lengths is None:
                hist[slots * ring + (start & mask)] = tokens.flat
                end = start + 1
            else:
                lengths = np.array(tokens.lengths, dtype=np.intp)
                row = tokens.row_of_each()
                position = start[row] + rank_in_group(lengths)
                hist[slots[row] * ring + (position & mask)] = tokens.flat
                end = start + lengths
            self.total[slots] = end
            self._pending.append((wave, slots, end))

    # -- the batch screen -----------------------------------------------------------------
    def flush(self) -> list[WaveFinding]:
        """Screen every queued wave; returns the episodes that started, in wave order."""
        self._write_queue()
        pending = self._pending
        if not pending:
            self.requests.apply_releases()
            return []
        first_slots = pending[0][1]
        if all(slots is first_slots for _, slots, _ in pending):
            touched = first_slots  # the same batch every wave: the common case
        else:
            touched = np.unique(np.concatenate([slots for _, slots, _ in pending]))
        start, end = self.flushed[touched], self.total[touched]
        found: list[WaveFinding] = []
        for slot, finding in self._check_loops(touched, end - start):
            last_wave = self._waves_of(slot)[-1][0]  # the wave of the newest token checked
            found.append((last_wave, self.requests.id_of[slot], finding))
        open_now = touched[self.in_ngram[touched]]  # episodes open when the batch began
        for slot in self._screen_ngrams(touched, start, end, open_now).tolist():
            found += self._replay(slot)  # after the loop checks: a loop hides its n-grams
        if len(open_now):  # an open episode ends once no n-gram is at the limit
            self.in_ngram[open_now] = self._repeat_in_window(open_now)
        self.flushed[touched] = end
        self._pending = []
        self._queued_tokens = 0
        self.requests.apply_releases()
        found.sort(key=lambda item: item[0])
        return found

    def _check_loops(self, touched: np.ndarray, new: np.ndarray) -> list[tuple[int, RepeatFinding]]:
        """Requests with `CHECK_EVERY` new tokens: is the window's tail a loop now? Updates
        `in_loop`; returns (slot, finding) for each loop that starts."""
        since = self.since_check[touched] + new
        due = since >= CHECK_EVERY
        self.since_check[touched] = np.where(due, 0, since)
        slots = touched[due]
        if not len(slots):
            return []
        total = self.total[slots]
        # enough tokens for each period, and within the window
        possible = (total[:, None] >= self._need) & (self._need <= self._tail)
        # cheap test first: the newest token equals the one p back, for some period p
        near = self._newest(slots, total, self._near_offsets)
        maybe = np.flatnonzero(((near[:, 1:] == near[:, :1]) & possible).any(axis=1))
        was = self.in_loop[slots]
        self.in_loop[slots] = False
        if not len(maybe):
            return []
        slots, total, possible, was = slots[maybe], total[maybe], possible[maybe], was[maybe]
        tail = self._newest(slots, total, self._tail_offsets)
        looping = np.zeros(len(slots), dtype=bool)
        period = np.zeros(len(slots), dtype=np.intp)
        step = max(1, _LOOP_CELLS // self._lag_index.size)
        for i in range(0, len(slots), step):
            part = tail[i : i + step]
            same = part[:, None, : self._lag_index.shape[1]] == part[:, self._lag_index]
            loop = (same | self._lag_ignored).all(axis=2) & possible[i : i + step]
            looping[i : i + step] = loop.any(axis=1)
            period[i : i + step] = loop.argmax(axis=1) + 1
        self.in_loop[slots] = looping
        out = []
        for i in np.flatnonzero(looping & ~was).tolist():
            p = int(period[i])
            block = tail[i, :p][::-1].tolist()
            out.append((int(slots[i]), ("loop", p, int(self._need[p - 1]), block)))
        return out

    def _newest(self, slots: np.ndarray, total: np.ndarray, back: np.ndarray) -> np.ndarray:
        """[slot, j]: each slot's token `back[j]` places before its newest (0: the newest)."""
        position = (total[:, None] - 1 - back) & self._mask
        return self.hist.reshape(-1)[(slots * self._ring)[:, None] + position]

    def _screen_ngrams(
        self, touched: np.ndarray, start: np.ndarray, end: np.ndarray, open_now: np.ndarray
    ) -> np.ndarray:
        """Add the batch's n-grams to the sketch; the requests outside an open episode that
        may have started one (a cell at the limit)."""
        size, grams, buckets = self._size, self._grams, self._buckets
        first = np.maximum(start - size + 1, 0)  # index of the first new n-gram
        count = np.maximum(end - size + 1 - first, 0)
        longest = int(count.max())
        if not longest:
            return _NO_SLOTS
        row = np.repeat(touched, count)
        key, index = self._stretch_keys(touched, first, longest)
        if int(count.min()) == longest:  # as many n-grams in every slot: a decode batch
            key, index = key.reshape(-1), index.reshape(-1)
        else:
            keep = np.arange(longest) < count[:, None]  # a shorter slot's row ends early
            key, index = key[keep], index[keep]
        bucket = ((key * _HASH_MULT) >> self._bucket_shift).astype(np.intp)
        # written first: an n-gram leaving may have entered in this same batch
        places = self.gram_bucket.reshape(-1)
        at = row * self._gram_ring
        places[at + (index & self._gram_mask)] = bucket
        cells = self.sketch.reshape(-1)
        cell = row * buckets + bucket
        np.add.at(cells, cell, _ONE)
        # a cell never reads below its n-gram's true count at any token of the batch
        hot = cells[cell] >= self.config.ngram_max_count
        # the n-grams that the new ones push out of the window: in a long stream, all of them
        leaving = index >= grams
        left = _count(leaving)
        if left == len(index):
            old = places[at + ((index - grams) & self._gram_mask)]
            np.subtract.at(cells, row * buckets + old, _ONE)
        elif left:
            out = np.flatnonzero(leaving)
            old = places[at[out] + ((index[out] - grams) & self._gram_mask)]
            np.subtract.at(cells, row[out] * buckets + old, _ONE)
        if not _count(hot):
            return _NO_SLOTS
        suspect = np.zeros(self.requests.capacity, dtype=bool)
        suspect[row[hot]] = True
        suspect[open_now] = False
        return np.flatnonzero(suspect)

    def _stretch_keys(
        self, slots: np.ndarray, first: np.ndarray, length: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """[slot, j]: the 64-bit key of each slot's n-gram at stream index `first + j`, and
        that index. One gather reads each slot's stretch of the stream into a row; the keys
        are hashed over its columns (numpy sums over a short axis slowly)."""
        size = self._size
        offsets = np.arange(length + size - 1)
        at = (slots * self._ring)[:, None]
        stretch = self.hist.reshape(-1)[at + ((first[:, None] + offsets) & self._mask)]
        stretch = stretch.astype(np.uint64)
        key = stretch[:, :length]
        for j in range(1, size):
            key = key * _POWER + stretch[:, j : j + length]
        return key, first[:, None] + offsets[:length]

    def _repeat_in_window(self, slots: np.ndarray) -> np.ndarray:
        """Whether each slot's window holds an n-gram `ngram_max_count` times now (exact: the
        window's n-gram keys sorted, and the same key `ngram_max_count` places apart)."""
        size, grams, limit = self._size, self._grams, self.config.ngram_max_count
        if limit > grams:
            return np.zeros(len(slots), dtype=bool)
        first = self.total[slots] - size + 1 - grams  # index of the window's first n-gram
        key, index = self._stretch_keys(slots, first, grams)
        # places before the stream's first n-gram hold keys that cannot repeat
        key = np.where(index >= 0, key, ~np.uint64(0) - np.arange(grams, dtype=np.uint64))
        key.sort(axis=1)
        return (key[:, limit - 1 :] == key[:, : grams - limit + 1]).any(axis=1)

    def _replay(self, slot: int) -> list[WaveFinding]:
        """A suspect's batch token by token, with the exact n-gram counts over its window."""
        config, size, grams = self.config, self._size, self._grams
        limit = config.ngram_max_count
        start, end = int(self.flushed[slot]), int(self.total[slot])
        low = max(0, start - config.window)
        ids = self._history(slot, low, end)
        counts: collections.Counter[tuple[int, ...]] = collections.Counter()
        first_new = max(start - size + 1, 0)
        for g in range(max(0, first_new - grams), first_new):
            counts[tuple(ids[g - low : g - low + size])] += 1
        hot = sum(1 for c in counts.values() if c >= limit)
        in_ngram = bool(self.in_ngram[slot])
        in_loop = bool(self.in_loop[slot])
        request_id = self.requests.id_of[slot]
        found: list[WaveFinding] = []
        position = start
        for wave, end_of_wave in self._waves_of(slot):
            started = None
            for q in range(position, end_of_wave):
                g = q - size + 1
                if g < 0:
                    continue
                key = tuple(ids[g - low : g - low + size])
                c = counts[key] + 1
                counts[key] = c
                if c == limit:
                    hot += 1
                    if hot == 1 and not in_ngram:
                        started = list(key)
                if g >= grams:
                    old = tuple(ids[g - grams - low : g - grams - low + size])
                    left = counts[old] - 1
                    if left == limit - 1:
                        hot -= 1
                    if left:
                        counts[old] = left
                    else:
                        del counts[old]
            position = end_of_wave
            if started is not None and not in_loop:
                found.append((wave, request_id, ("ngram", size, limit, started)))
            in_ngram = hot > 0
        self.in_ngram[slot] = in_ngram
        return found

    def _waves_of(self, slot: int) -> list[tuple[int, int]]:
        """(wave, the slot's token total after it) for each queued wave that gave it tokens."""
        out = []
        last = int(self.flushed[slot])
        for wave, slots, end in self._pending:
            where = np.flatnonzero(slots == slot)
            if len(where):
                after = int(end[where[0]])
                if after > last:
                    out.append((wave, after))
                    last = after
        return out


_count = np.count_nonzero  # truth of a bool array: cheaper than .any() on small arrays
_NO_SLOTS = np.zeros(0, dtype=np.intp)


def find_loop(
    window: Sequence[int], max_period: int, min_repeats: int, min_span: int
) -> tuple[int, int, list[int]] | None:
    """The shortest period p ≤ max_period with which the window's tail repeats itself.

    Returns (period, span, block) when the last `span` tokens equal the `span` tokens p earlier,
    where span ≥ max(min_repeats·p, min_span) − p, i.e. the block occurs min_repeats times.
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
    if not tokens or (min(tokens) >= 0 and max(tokens) < vocab_size):
        return []
    return [t for t in tokens if t < 0 or t >= vocab_size]


# below this many ids a wave's range check runs on the list: builtins stay fast in the engine,
# where numpy's first calls after the model's own work cost several times their loop figure
SMALL_WAVE = 64


def rows_out_of_range(tokens: WaveTokens, vocab_size: int) -> list[int]:
    """Rows holding a sampled id outside [0, vocab_size); the common case is one reduction.

    Read as unsigned, a negative id is larger than any vocabulary, so the largest id alone
    tells whether every id is in range."""
    ids = tokens.ids
    if not ids:
        return []
    if len(ids) < SMALL_WAVE:
        if min(ids) >= 0 and max(ids) < vocab_size:
            return []
    elif int(tokens.flat.view(np.uint64).max()) < vocab_size:
        return []
    flat = tokens.flat
    bad = (flat < 0) | (flat >= vocab_size)
    return np.unique(tokens.row_of_each()[bad]).tolist()
