"""Per-block duration histograms: what a range query over whole blocks reads instead of the
blocks' columns.

Every stored wave block carries, per phase (the rank span, execute_model, sample_tokens), a
histogram of its spans' durations on fixed log buckets: bucket b holds durations in
[2^(b/16), 2^((b+1)/16)) ns (bucket 0 also holds 0 and 1 ns), so a bucket is 4.4 % wide and
the same buckets serve every block, rank and store. A histogram is stored densely from its
lowest to its highest used bucket, as little-endian uint16: [lowest bucket, count, count, ...]
(a block of 256 waves whose steps vary 3..8 ms uses about 23 buckets: 48 bytes, 0.2 B per
wave). Blocks of more than 65,535 waves get no histogram (NULL: readers decode the block).

A quantile read off merged histograms interpolates like numpy's default quantile between the
two order statistics around its rank, each placed inside its bucket, so it is within one
bucket's width (4.4 %) of the exact quantile. Counts are exact.
"""

from __future__ import annotations

import dataclasses
import math
import sqlite3
from collections.abc import Iterable, Sequence

import numpy as np

PER_OCTAVE = 16
# 2^47 ns is 39 hours: longer than any duration validation lets through (1 day)
BUCKETS = 47 * PER_OCTAVE
MAX_COUNT = 2**16 - 1
RELATIVE_WIDTH = 2 ** (1 / PER_OCTAVE) - 1


def bucket_of(durations: np.ndarray) -> np.ndarray:
    """The bucket of each duration (ns)."""
    d = np.maximum(np.asarray(durations, dtype=np.float64), 1.0)
    return np.minimum(np.floor(np.log2(d) * PER_OCTAVE).astype(np.int64), BUCKETS - 1)


def lower_edge(bucket: np.ndarray | int) -> np.ndarray:
    return np.exp2(np.asarray(bucket, dtype=np.float64) / PER_OCTAVE)


def encode(durations: np.ndarray) -> bytes | None:
    """The stored histogram of these durations (b"" for none; None if a count would overflow)."""
    if len(durations) > MAX_COUNT:
        return None
    if not len(durations):
        return b""
    buckets = bucket_of(durations)
    low = int(buckets.min())
    counts = np.bincount(buckets - low)
    return np.concatenate(([low], counts)).astype("<u2").tobytes()


def decode(blob: bytes) -> np.ndarray:
    """One stored histogram as counts over all BUCKETS."""
    out = np.zeros(BUCKETS, np.int64)
    if blob:
        values = np.frombuffer(blob, "<u2")
        out[values[0] : values[0] + len(values) - 1] = values[1:]
    return out


def accumulate(blobs: Sequence[bytes], groups: np.ndarray, n_groups: int) -> np.ndarray:
    """Sum stored histograms into [n_groups, BUCKETS] counts; blob i goes to row groups[i].
    Vectorized over all blobs at once (a range query reads thousands of them)."""
    out = np.zeros((n_groups, BUCKETS), np.int64)
    if not len(blobs):
        return out
    lengths = np.fromiter(map(len, blobs), np.int64, len(blobs)) // 2
    values = np.frombuffer(b"".join(blobs), "<u2").astype(np.int64)
    used = lengths > 0
    lengths, groups = lengths[used], np.asarray(groups, np.int64)[used]
    if not len(lengths):
        return out
    heads = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    per_blob = lengths - 1  # counts after each blob's lowest bucket
    owner = np.repeat(np.arange(len(lengths)), per_blob)
    k = np.arange(len(owner)) - np.repeat(np.cumsum(per_blob) - per_blob, per_blob)
    index = np.repeat(heads + 1, per_blob) + k
    bucket = np.repeat(values[heads], per_blob) + k
    flat = groups[owner] * BUCKETS + bucket
    summed = np.bincount(flat, weights=values[index], minlength=n_groups * BUCKETS)
    return summed.reshape(n_groups, BUCKETS).astype(np.int64)


def quantile(counts: np.ndarray, q: float) -> float:
    """The q-quantile (ns) of the durations a histogram counts, as numpy's default (linear)
    quantile takes it: between the order statistics at ranks floor(q*(n-1)) and the one
    after, each read off its bucket. Within RELATIVE_WIDTH of the exact quantile (each order
    statistic is within its bucket, and the result lies between them)."""
    n = int(counts.sum())
    if n == 0:
        return math.nan
    rank = q * (n - 1)
    low = math.floor(rank)
    cumulative = np.cumsum(counts)
    below = _order_statistic(counts, cumulative, low)
    if rank == low:
        return below
    above = _order_statistic(counts, cumulative, min(low + 1, n - 1))
    return below + (rank - low) * (above - below)


def _order_statistic(counts: np.ndarray, cumulative: np.ndarray, k: int) -> float:
    """The k-th smallest duration (0-based), placed evenly inside its bucket."""
    b = min(int(np.searchsorted(cumulative, k, side="right")), len(counts) - 1)
    before = int(cumulative[b] - counts[b])
    inside = (k - before + 0.5) / counts[b] if counts[b] else 0.5
    return float(lower_edge(b)) * 2 ** (min(max(inside, 0.0), 1.0) / PER_OCTAVE)


# -- block summaries (telemetry/store/block_summary.py) -------------------------------------------
HIST_COLUMNS = {
    "rank": "rank_hist",
    "execute_model": "execute_hist",
    "sample_tokens": "sample_hist",
}


@dataclasses.dataclass
class BlockHistograms:
    """One phase's stored histograms of the blocks that start in a window, as columns."""

    rowid: np.ndarray
    rank: np.ndarray
    start_ns: np.ndarray
    end_ns: np.ndarray
    blobs: list  # bytes, or None where the block has no histogram


def wave_histograms(
    conn: sqlite3.Connection, rank_ids: Iterable[int], phase: str, lo: int, hi: int
) -> BlockHistograms:
    """The `phase` histograms ("rank", "execute_model", "sample_tokens") of the ranks' wave
    blocks whose first span starts in [lo, hi); no block is decoded."""
    column = HIST_COLUMNS[phase]
    rows: list = []
    for rank_id in rank_ids:
        rows += conn.execute(
            f"SELECT rowid, rank, start_ns, end_ns, {column} FROM wave_blocks "
            "WHERE rank = ? AND start_ns >= ? AND start_ns < ?",
            (rank_id, lo, hi),
        ).fetchall()
    n = len(rows)
    columns = list(zip(*rows, strict=True)) if rows else [()] * 5
    return BlockHistograms(
        np.fromiter(columns[0], np.int64, n),
        np.fromiter(columns[1], np.int64, n),
        np.fromiter(columns[2], np.int64, n),
        np.fromiter(columns[3], np.int64, n),
        list(columns[4]),
    )
