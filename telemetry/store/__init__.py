"""The record store: typed tables in one SQLite file, written by the sidecar, read by everyone.

    pipeline ─▶ writer.py (the store sink: blocks, retention, restart gap)
                  ├─ codec.py     a batch's columns as one compressed block row
                  ├─ schema.py    tables, indexes, migrations of older files
                  ├─ files.py     opening the file, its health at start, moving a bad one aside
                  ├─ requests.py  request membership rows and blocks
                  └─ incidents.py the incident ledger
    blocks.py, block_summary.py  ◀─ spans/, traceql/, tempo_api/, cli/ (read-only connections)

Engine: SQLite in WAL mode. The sidecar is the one writer, and `ascend-guard query`, `trace`,
`incidents` and `hangs` read the same file at the same time from other processes, without going
through the sidecar (DuckDB is columnar but allows one writer process, so reads would then go
through the sidecar; a sidecar that is down or wedged would take the on-call tools with it).
SQLite ships with Python, and its file is one thing to copy or delete.

The names below are the store's API for the other packages (`from telemetry import store`,
then `store.connect(path, readonly=True)`, `store.blocks_by_time(...)`); modules inside the
store import each other directly.
"""

from telemetry.store.block_summary import wave_histograms
from telemetry.store.blocks import (
    COLLECTIVE_BLOCKS,
    WAVE_BLOCKS,
    BlockDirectory,
    BlockRow,
    RankRow,
    SlowCallRow,
    block_columns,
    blocks_by_rowid,
    blocks_by_time,
    blocks_by_wave,
    collective_blocks,
    collective_waves,
    count_waves,
    ranks,
    ranks_of_trace_key,
    slow_calls_in,
    time_bounds,
    time_of_waves,
    wave_block_by_rowid,
    wave_blocks,
    wave_range,
)
from telemetry.store.codec import decode_collectives, decode_waves
from telemetry.store.files import connect, default_store_path, prepare_store
from telemetry.store.schema import ADDED_COLUMNS, PAGE_SIZE
from telemetry.store.writer import DEFAULT_MAX_BYTES, DEFAULT_RETENTION_S, Store

__all__ = [
    "ADDED_COLUMNS",
    "COLLECTIVE_BLOCKS",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_RETENTION_S",
    "PAGE_SIZE",
    "WAVE_BLOCKS",
    "BlockDirectory",
    "BlockRow",
    "RankRow",
    "SlowCallRow",
    "Store",
    "block_columns",
    "blocks_by_rowid",
    "blocks_by_time",
    "blocks_by_wave",
    "collective_blocks",
    "collective_waves",
    "connect",
    "count_waves",
    "decode_collectives",
    "decode_waves",
    "default_store_path",
    "prepare_store",
    "ranks",
    "ranks_of_trace_key",
    "slow_calls_in",
    "time_bounds",
    "time_of_waves",
    "wave_block_by_rowid",
    "wave_blocks",
    "wave_histograms",
    "wave_range",
]
