"""logits_finite's row check on host logits, compiled: one pass, one integer back.

A row is bad when its max is not finite (`logits.row_max`'s rule): a NaN or a +Inf anywhere,
or -Inf everywhere (nothing left to sample). -Inf entries alone are masks (grammar bitmask,
min_tokens, bad words) and pass. The pass keeps, per row, the sum of every entry times zero,
with -Inf entries taken as zero: it stays 0 for finite entries and turns NaN at a NaN or a
+Inf, and that stays NaN. With `reassoc` allowed (and no other fast-math flag, so NaN and Inf
keep their meaning), LLVM vectorises the sum: the pass runs at the speed of torch's own amax,
with no tensor made, no dispatch and no copy. On an engine thread that is most of the check's
cost at a small batch (torch's amax costs 5-7 µs in the engine on [16, 512] logits).

Compiled for C-contiguous float32 rows only (`ROW_CHECK_TYPES`); any other array is refused
with a TypeError, and the suite falls back to torch for good. `compiled.load` imports this
module; nothing else should.
"""

from __future__ import annotations

import numba
import numpy as np

_NEG_INF = np.float32(-np.inf)
_ZERO = np.float32(0.0)

ROW_CHECK_TYPES = (numba.types.Array(numba.float32, 2, "C", readonly=False),)


@numba.njit(ROW_CHECK_TYPES, nogil=True, cache=True, boundscheck=False, fastmath={"reassoc"})
def first_bad_row(logits: np.ndarray) -> int:
    """The index of the first row whose max is not finite, or -1 when every row's is."""
    rows, width = logits.shape
    for r in range(rows):
        poison = _ZERO  # NaN once a NaN or +Inf was added
        live = 0  # entries above -Inf
        for c in range(width):
            value = logits[r, c]
            masked = value == _NEG_INF
            live += not masked
            poison += (_ZERO if masked else value) * _ZERO
        if poison != poison or live == 0:
            return r
    return -1


@numba.njit(ROW_CHECK_TYPES, nogil=True, cache=True, boundscheck=False)
def health_readings(rows: np.ndarray) -> tuple[float, float, int]:
    """`logits.health_rows` and `logits.health_summary`'s readings of a host copy of the
    sampled rows, in one call: (max |logit|, the mean entropy in nats, healthy rows), over
    the rows whose max is finite, with -Inf entries masked out (not faults). It runs on the
    streamer thread, where torch's ops made every later wave of a CPU engine 1.5-2 times
    slower (`bench/toggle.py`; most likely an OpenMP team of that thread's own, whose idle
    workers spin beside the engine's). This holds no GIL and starts no thread. NaN for the
    entropy when no row is healthy."""
    count, width = rows.shape
    max_abs = 0.0
    entropy = 0.0
    healthy = 0
    for r in range(count):
        top = -np.inf
        row_abs = 0.0
        bad = False
        for c in range(width):
            value = np.float64(rows[r, c])
            if value != value or value == np.inf:
                bad = True
                break
            top = max(top, value)
            if value != -np.inf:
                row_abs = max(row_abs, abs(value))
        if bad or top == -np.inf:
            continue
        # p = e / z and log p = d - log z, with e = exp(d), d = value - top: the sum of
        # p·log p over the unmasked tokens is weighted / z - log z
        z = 0.0
        weighted = 0.0
        for c in range(width):
            d = np.float64(rows[r, c]) - top
            if d != -np.inf:
                e = np.exp(d)
                z += e
                weighted += e * d
        entropy += np.log(z) - weighted / z
        max_abs = max(max_abs, row_abs)
        healthy += 1
    return max_abs, entropy / healthy if healthy else np.nan, healthy
