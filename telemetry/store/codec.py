"""A block's encoding: the batch's `WaveColumns` (or `CollectiveColumns`) in the proto's own packed
encoding, zlib-compressed, and the rows a block is inserted as.

The proto stays the one schema of a wave, and a block costs one row insert however many waves
it holds. Inserts are `INSERT OR IGNORE` on the block key, so a batch sent again is stored once.
"""

from __future__ import annotations

import time
import zlib

import numpy as np

from telemetry.store import block_summary
from telemetry.wire.collective_columns import columns_of
from telemetry.wire.proto import guard_pb2
from telemetry.wire.protobuf_fields import length_delimited


def _signed(value: int) -> int:
    """A uint64 as SQLite's signed 64-bit integer (same bits)."""
    return value - 2**64 if value >= 2**63 else value


def encode_waves(cols: guard_pb2.WaveColumns) -> bytes:
    return zlib.compress(cols.SerializeToString(), 1)


def decode_waves(blob: bytes) -> guard_pb2.WaveColumns:
    return guard_pb2.WaveColumns.FromString(zlib.decompress(blob))


# A collective block is a `Batch` holding only the batch's `collective_columns` (field 32; wire
# v3): written as that field's tag and length before the columns' own encoding, so nothing is
# copied into a holder message. A block written from v2 messages (`collective_waves`) decodes
# to columns the same way.
_COLUMNS_FIELD = guard_pb2.Batch.DESCRIPTOR.fields_by_name["collective_columns"].number


def encode_collectives(cols: guard_pb2.CollectiveColumns) -> bytes:
    payload = cols.SerializeToString()
    return zlib.compress(length_delimited(_COLUMNS_FIELD, payload), 1)


def decode_collectives(blob: bytes) -> guard_pb2.CollectiveColumns:
    """A collective block's columns (a block of v2 `collective_waves` converted)."""
    return columns_of(guard_pb2.Batch.FromString(zlib.decompress(blob)))


def collective_block_row(rank_id: int, cols: guard_pb2.CollectiveColumns) -> tuple:
    """The `collective_blocks` row of one batch's collective columns."""
    numbers = np.array(cols.wave, dtype=np.int64)  # validated: at most 2^63 - 1
    arrivals = np.array(cols.first_arrival_unix_nano, dtype=np.int64)
    arrivals = arrivals[arrivals > 0]
    start = int(arrivals.min()) if arrivals.size else time.time_ns()
    end = int(arrivals.max()) if arrivals.size else start
    host = cols.stats.host_ns
    return (
        rank_id,
        int(numbers.min()),
        int(numbers.max()),
        start,
        len(numbers),
        encode_collectives(cols),
        end,
        max(host) if len(host) else 0,
    )


def wave_block_row(rank_id: int, cols: guard_pb2.WaveColumns, dropped_before: int) -> tuple:
    """The `wave_blocks` row of one batch's waves (columns must be validated and non-empty).

    `dropped_before` is the worker's cumulative drop count when it made the batch (the batch's
    `dropped_total`): what a restarted sidecar subtracts from a gap after this block."""
    n = len(cols.wave)
    starts = np.array(cols.start_unix_nano, np.int64)
    execute_end = starts + np.array(cols.execute_ns, np.int64)
    # a rank span ends at the later of execute_model's and sample_tokens' end
    sample_end = (
        starts + np.array(cols.sample_offset_ns, np.int64) + np.array(cols.sample_ns, np.int64)
    )
    sampled = np.array(cols.sampled, bool)
    ends = np.where(sampled, np.maximum(execute_end, sample_end), execute_end)
    waves = cols.wave
    return (
        rank_id,
        min(waves),
        max(waves),
        int(starts.min()),
        int(ends.max()),
        n,
        int((ends - starts).max()),
        encode_waves(cols),
        block_summary.encode(ends - starts),
        block_summary.encode(execute_end - starts),
        block_summary.encode(np.array(cols.sample_ns, np.int64)[sampled]),
        dropped_before,
    )


_INSERT_WAVE_BLOCK = (
    "INSERT OR IGNORE INTO wave_blocks (rank, first_wave, last_wave, start_ns, end_ns, waves, "
    "max_step_ns, columns, rank_hist, execute_hist, sample_hist, dropped_before) "
    "VALUES (?,?,?,?,?,?,?,?,?,?,?,?)"
)


_INSERT_COLLECTIVE_BLOCK = (
    "INSERT OR IGNORE INTO collective_blocks (rank, first_wave, last_wave, start_ns, waves, "
    "columns, end_ns, max_host_ns) VALUES (?,?,?,?,?,?,?,?)"
)
