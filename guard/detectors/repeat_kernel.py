"""token_repeat's rules, compiled: every token of a batch of waves, in order, at native speed.

`screen` is the whole per-token work of the repeat detector (`guard/detectors/tokens.py`): it
writes each token into its request's history ring, keeps the exact count of every n-gram in
the request's window, follows the n-gram episodes wave by wave, and at the batch's end looks
for loops. One call per batch (8-32 waves), with no Python per token or per request, and no
GIL held while it runs (`nogil`), so it costs the same whether the batch is on the engine thread
or on the streamer's.

The n-gram counts are exact: each request has an open-addressing table (linear probing,
backward-shift deletion) of the n-grams in its window, each entry holding the n-gram's 32-bit
hash, its count and where in the history ring it last started; two n-grams with the same hash
are told apart by comparing their tokens there. The window never holds more n-grams than
half the table, so probes are short.

The rules are those of `tests/unit/guard/test_repeat_batches.py`'s plain model:
- an n-gram episode starts when some n-gram of the window reaches `ngram_max_count` while
  none was; it is reported at the wave of that token, unless the request is in a loop at the
  batch's end; the episode lasts while some n-gram of the window is at the limit;
- an episode open when the batch began is judged at the batch's end, with no start inside it;
- at the batch's end a request with `check_every` or more new tokens is looked at for a loop
  (`tokens.find_loop` is the same rule in Python); a loop reports once, when it starts.

numba is vLLM's own dependency on every platform the guard runs on (its n-gram speculative
decoding needs it). `screen` is compiled for its one set of argument types (`SCREEN_TYPES`)
when this module is imported, not at its first call, and cached on disk by numba
(`cache=True`), so a worker after the first reads it instead of compiling it again.
`compiled.load` imports this module; nothing else should (see there for when).
"""

from __future__ import annotations

import numba
import numpy as np

from guard.detectors.repeat_layout import FOUND_FIELDS, GRAM_ENTRY, KIND_LOOP, KIND_NGRAM

_MIX = np.uint64(0x9E3779B97F4A7C15)
_STEP = np.uint64(1_000_003)
_LOW32 = np.int64(0xFFFFFFFF)
_HALF = np.uint64(32)

_OPTIONS = {"nogil": True, "cache": True, "boundscheck": False}
# the per-token helpers are inlined into `screen` by numba itself
_INLINE = {**_OPTIONS, "inline": "always"}


@numba.njit(**_INLINE)
def _gram_hash(ring: np.ndarray, start: int, size: int, mask: int) -> np.uint64:
    """The 32-bit hash of the n-gram at stream position `start` of a history ring: the high
    half of a well-mixed 64-bit one (the table's home slot is read from its top bits)."""
    h = np.uint64(size)
    for j in range(size):
        h = h * _STEP + np.uint64(np.int64(ring[(start + j) & mask]) & _LOW32)
    return np.uint32((h * _MIX) >> _HALF)


@numba.njit(**_INLINE)
def _same_gram(ring: np.ndarray, a: int, b: int, size: int, mask: int) -> bool:
    for j in range(size):  # noqa: SIM110 - a loop, which numba compiles flat
        if ring[(a + j) & mask] != ring[(b + j) & mask]:
            return False
    return True


@numba.njit(**_INLINE)
def _find(table, ring, h, start, size, mask, shift, tmask) -> int:
    """The table index of the n-gram at `start` (hash `h`), or of the empty entry where it
    would go."""
    i = np.int64(h >> shift)
    while True:
        entry = table[i]
        if entry.count == 0:
            return i
        if entry.key == h and _same_gram(ring, entry.start, start, size, mask):
            return i
        i = (i + 1) & tmask


@numba.njit(**_INLINE)
def _delete(table, i, shift, tmask) -> None:
    """Empty entry `i`, moving back each later entry of its probe run that may take its place
    (so that no lookup stops early at a hole)."""
    j = i
    while True:
        j = (j + 1) & tmask
        if table[j].count == 0:
            break
        home = np.int64(table[j].key >> shift)
        # entry j may move to i unless its home lies cyclically in (i, j]
        if (i < j and (home <= i or home > j)) or (i > j and home <= i and home > j):
            table[i] = table[j]
            i = j
    table[i].count = 0


@numba.njit(**_OPTIONS)
def _loop_period(ring, total, window, max_period, min_repeats, min_span, mask) -> tuple:
    """(period, span) of the shortest loop at the tail of the last `window` tokens, or (0, 0):
    the block of `period` tokens repeats `min_repeats` times, over `span` >= `min_span`."""
    n = min(total, window)
    first = total - n  # stream position of the window's first token
    last = ring[(total - 1) & mask]
    for period in range(1, max_period + 1):
        need = max(min_repeats * period, min_span)
        if need > n:
            break
        if ring[(first + n - 1 - period) & mask] != last:  # cheap test first
            continue
        same = True
        for k in range(n - need + period, n):
            if ring[(first + k) & mask] != ring[(first + k - period) & mask]:
                same = False
                break
        if same:
            return period, need
    return 0, 0


@numba.njit(**_INLINE)
def _add_token(ring, table, position, token, params, mask, shift, tmask):
    """Write one token at `position` of a request's stream and count its n-gram in; returns
    (the new n-gram reached the limit, the n-gram leaving the window fell below it)."""
    size, limit, window = params[0], params[1], params[2]
    ring[position & mask] = token
    g = position - size + 1  # the new n-gram's start
    if g < 0:
        return False, False
    h = _gram_hash(ring, g, size, mask)
    entry = table[_find(table, ring, h, g, size, mask, shift, tmask)]
    entry.key = h
    entry.count += 1
    entry.start = g & mask  # its latest start: in the window (and the ring) while it counts
    reached = entry.count == limit
    old = g - (window - size + 1)  # the n-gram leaving the window
    if old < 0:
        return reached, False
    i = _find(table, ring, _gram_hash(ring, old, size, mask), old, size, mask, shift, tmask)
    entry = table[i]
    entry.count -= 1
    fell = entry.count == limit - 1
    if entry.count == 0:
        _delete(table, i, shift, tmask)
    return reached, fell


def _array(dtype: np.dtype | type, ndim: int = 1, readonly: bool = False) -> numba.types.Array:
    """numba's type for a C-contiguous numpy array of `dtype`."""
    sample = np.zeros((1,) * ndim, dtype=dtype)
    sample.flags.writeable = not readonly
    return numba.typeof(sample)


_INT64 = _array(np.int64)
_BOOL = _array(np.bool_)
# the arguments of `screen`, as `tokens.RepeatDetector.flush` makes them (the batch's ids are a
# read-only view of the waves' packed bytes); a call with other types is refused
SCREEN_TYPES = (
    _array(np.int32, 2),
    _INT64,
    _INT64,
    _INT64,
    _BOOL,
    _BOOL,
    _array(GRAM_ENTRY, 2),
    _INT64,
    _INT64,
    _INT64,
    _array(np.int64, readonly=True),
    _INT64,
)


@numba.njit(SCREEN_TYPES, **_OPTIONS)
def screen(
    hist,  # int32[slots, ring]: each request's recent tokens (ring width a power of two)
    total,  # int64[slots]: tokens seen
    since,  # int64[slots]: tokens since the last loop check
    hot,  # int64[slots]: n-grams of the window at the limit
    in_loop,  # bool[slots]
    in_ngram,  # bool[slots]
    grams,  # tokens.GRAM_ENTRY[slots, table]: the n-grams of each request's window
    slots,  # int64[entries]: each row's slot, wave after wave
    wave_rows,  # int64[waves]: rows of each wave
    lengths,  # int64[entries]: tokens of each row (empty: one each)
    tokens,  # int64[tokens]: every row's tokens, in order
    params,  # int64[len(tokens.PARAMS)], in that order
):
    """Screen one batch of waves; returns (findings [n, FOUND_FIELDS], blocks [n, width]).

    Requests are independent, so the batch is gone through request by request, each over its
    waves in order: a request's table and ring stay in cache while its tokens are counted.
    """
    size, limit, window = params[0], params[1], params[2]
    max_period, min_repeats, min_span, check_every = params[3], params[4], params[5], params[6]
    mask = hist.shape[1] - 1
    tmask = grams.shape[1] - 1
    table_bits = 0
    while (1 << table_bits) < grams.shape[1]:
        table_bits += 1
    shift = np.uint32(32 - table_bits)
    uniform = len(lengths) == 0
    capacity = total.shape[0]
    entries = len(slots)

    # each row's wave and first token; the batch's requests in order of first appearance,
    # and each request's rows in wave order (a counting sort by slot)
    wave_of = np.empty(entries, dtype=np.int64)
    offset = np.empty(entries + 1, dtype=np.int64)
    rows_of = np.zeros(capacity + 1, dtype=np.int64)
    touched = np.empty(entries, dtype=np.int64)
    count_touched = 0
    entry = 0
    offset[0] = 0
    for w in range(len(wave_rows)):
        for _ in range(wave_rows[w]):
            s = slots[entry]
            if rows_of[s + 1] == 0:
                touched[count_touched] = s
                count_touched += 1
            rows_of[s + 1] += 1
            wave_of[entry] = w
            offset[entry + 1] = offset[entry] + (1 if uniform else lengths[entry])
            entry += 1
    first_row = np.empty(capacity, dtype=np.int64)
    placed = 0
    for t in range(count_touched):
        s = touched[t]
        first_row[s] = placed
        placed += rows_of[s + 1]
    by_request = np.empty(entries, dtype=np.int64)
    filled = first_row.copy()
    for e in range(entries):
        s = slots[e]
        by_request[filled[s]] = e
        filled[s] += 1

    # room for every finding there can be: an n-gram start per row and a loop per request
    # (a buffer grown in the loop below would cost numba its speed on every token)
    found = np.empty((entries + count_touched, FOUND_FIELDS), dtype=np.int64)
    blocks = np.empty((entries + count_touched, max(max_period, size)), dtype=np.int32)
    n_found = 0

    for t in range(count_touched):
        s = touched[t]
        ring, table = hist[s], grams[s]
        opened = in_ngram[s]  # an episode open when the batch began is judged at its end
        request_found = n_found
        new = 0
        last_wave = -1
        for r in range(first_row[s], first_row[s] + rows_of[s + 1]):
            e = by_request[r]
            started = -1  # stream position of the n-gram that opened an episode in this row
            for k in range(offset[e], offset[e + 1]):
                position = total[s]
                total[s] = position + 1
                reached, fell = _add_token(
                    ring, table, position, tokens[k], params, mask, shift, tmask
                )
                if reached:
                    hot[s] += 1
                    if hot[s] == 1 and not in_ngram[s]:
                        started = position - size + 1
                if fell:
                    hot[s] -= 1
            length = offset[e + 1] - offset[e]
            if not opened:
                if started >= 0:
                    row = found[n_found]
                    row[0], row[1], row[2], row[3], row[4] = KIND_NGRAM, wave_of[e], s, size, limit
                    for j in range(size):
                        blocks[n_found, j] = ring[(started + j) & mask]
                    n_found += 1
                in_ngram[s] = hot[s] > 0
            since[s] += length
            new += length
            if length:
                last_wave = wave_of[e]

        if new and since[s] >= check_every:
            since[s] = 0
            period, span = _loop_period(
                ring, total[s], window, max_period, min_repeats, min_span, mask
            )
            if period:
                n_found = request_found  # a loop hides its n-grams: the starts are dropped
                if not in_loop[s]:
                    row = found[n_found]
                    row[0], row[1], row[2], row[3], row[4] = KIND_LOOP, last_wave, s, period, span
                    for j in range(period):
                        blocks[n_found, j] = ring[(total[s] - period + j) & mask]
                    n_found += 1
            in_loop[s] = period > 0
        elif in_loop[s]:
            n_found = request_found  # still in the loop it was in: the starts are dropped
        if opened:
            in_ngram[s] = hot[s] > 0
    return found[:n_found], blocks[:n_found]
