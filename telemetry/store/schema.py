"""The store's tables, their indexes, what retention deletes, and the migration of older files.

Tables (integer keys throughout; strings live once, in the dimension tables):

    runs               id, run_id                                  dimension
    ranks              id, run, engine, dp, tp, pp, sizes, node,   dimension; trace_key finds
                       pid, runner, trace_key                      a rank from a trace id
    wave_blocks        (rank, first_wave) -> last_wave, start_ns,  waves of one rank, one row
                       end_ns, waves, max_step_ns, columns         per batch
    collective_blocks  (rank, first_wave) -> last_wave, start_ns,  collective stats per wave
                       waves, columns                              and rank, one row per batch
    slow_calls         (rank, group, seq) -> wave, op, backend,    one row per slow call
                       dtype, bytes, start_ns, host_ns
    incidents          telemetry/store/incidents.py (hang verdicts are the view `hang_verdicts`)
    requests,          telemetry/store/requests.py: request membership (and the W3C
    request_blocks     traceparent a request came with)

Blocks live in rowid tables on 4 KiB pages: a WITHOUT ROWID table (or larger pages) left most
of each page empty with rows of a few KiB. The block's typed columns (time range, wave range,
slowest step) are what queries filter on before a block is decoded.
"""

from __future__ import annotations

import sqlite3

PAGE_SIZE = 4096


SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id      INTEGER PRIMARY KEY,
    run_id  TEXT NOT NULL UNIQUE
);
CREATE TABLE IF NOT EXISTS ranks (
    id        INTEGER PRIMARY KEY,
    run       INTEGER NOT NULL REFERENCES runs (id),
    engine    TEXT NOT NULL,
    dp        INTEGER NOT NULL,
    tp        INTEGER NOT NULL,
    pp        INTEGER NOT NULL,
    dp_size   INTEGER NOT NULL,
    tp_size   INTEGER NOT NULL,
    pp_size   INTEGER NOT NULL,
    node      TEXT NOT NULL,
    pid       INTEGER NOT NULL,
    runner    TEXT NOT NULL,
    trace_key INTEGER NOT NULL,
    UNIQUE (run, engine, dp, tp, pp)
);
CREATE INDEX IF NOT EXISTS ranks_trace ON ranks (trace_key);
CREATE TABLE IF NOT EXISTS wave_blocks (
    rank        INTEGER NOT NULL,
    first_wave  INTEGER NOT NULL,
    last_wave   INTEGER NOT NULL,
    start_ns    INTEGER NOT NULL,
    end_ns      INTEGER NOT NULL,
    waves       INTEGER NOT NULL,
    max_step_ns INTEGER NOT NULL,
    columns     BLOB NOT NULL,
    rank_hist    BLOB,
    execute_hist BLOB,
    sample_hist  BLOB,
    dropped_before INTEGER,
    UNIQUE (rank, first_wave)
);
CREATE INDEX IF NOT EXISTS wave_blocks_start ON wave_blocks (start_ns);
CREATE TABLE IF NOT EXISTS collective_blocks (
    rank        INTEGER NOT NULL,
    first_wave  INTEGER NOT NULL,
    last_wave   INTEGER NOT NULL,
    start_ns    INTEGER NOT NULL,
    waves       INTEGER NOT NULL,
    columns     BLOB NOT NULL,
    end_ns      INTEGER,
    max_host_ns INTEGER,
    UNIQUE (rank, first_wave)
);
CREATE INDEX IF NOT EXISTS collective_blocks_start ON collective_blocks (start_ns);
CREATE TABLE IF NOT EXISTS slow_calls (
    rank        INTEGER NOT NULL,
    group_name  TEXT NOT NULL,
    seq         INTEGER NOT NULL,
    wave        INTEGER NOT NULL,
    op          TEXT NOT NULL,
    backend     TEXT NOT NULL,
    dtype       TEXT NOT NULL,
    bytes       INTEGER NOT NULL,
    start_ns    INTEGER NOT NULL,
    host_ns     INTEGER NOT NULL,
    PRIMARY KEY (rank, group_name, seq)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS slow_calls_start ON slow_calls (start_ns);
"""


# columns added to block tables after their first release: (table, column, type). A store
# written before has them added (NULL in its old rows: readers decode such a block), and the
# per-rank indexes the block readers walk are created after them. The indexes cover what
# the walks and the range queries read (a block's bounds, slowest span, histograms), so
# neither touches the table's pages, which hold the large `columns` blobs: about 190 bytes
# per block of 256 waves for the time indexes, 40 for the wave ones (bench/README.md,
# `query.py`). The wave walk (`blocks_by_wave`, `BlockDirectory`) reads the wave indexes; the
# UNIQUE (rank, first_wave) key holds only the key, so a walk down it read a table page
# per block.
ADDED_COLUMNS = (
    ("wave_blocks", "rank_hist", "BLOB"),
    ("wave_blocks", "execute_hist", "BLOB"),
    ("wave_blocks", "sample_hist", "BLOB"),
    ("wave_blocks", "dropped_before", "INTEGER"),
    ("collective_blocks", "end_ns", "INTEGER"),
    ("collective_blocks", "max_host_ns", "INTEGER"),
    # the W3C traceparent a request came with (telemetry/wire/traceparent.py): the trace id's
    # halves, the parent span id, the trace flags; NULL when it came without one
    ("requests", "traceparent_hi", "INTEGER"),
    ("requests", "traceparent_lo", "INTEGER"),
    ("requests", "traceparent_span", "INTEGER"),
    ("requests", "traceparent_flags", "INTEGER"),
)


_BLOCK_INDEXES = """
CREATE INDEX IF NOT EXISTS wave_blocks_by_rank_time ON wave_blocks (rank, start_ns, end_ns,
    first_wave, last_wave, max_step_ns, rank_hist, execute_hist, sample_hist);
CREATE INDEX IF NOT EXISTS collective_blocks_by_rank_time ON collective_blocks (rank, start_ns,
    end_ns, first_wave, last_wave, max_host_ns);
CREATE INDEX IF NOT EXISTS wave_blocks_by_rank_wave ON wave_blocks (rank, first_wave, last_wave,
    start_ns, end_ns, max_step_ns);
CREATE INDEX IF NOT EXISTS collective_blocks_by_rank_wave ON collective_blocks (rank, first_wave,
    last_wave, start_ns, end_ns, max_host_ns);
"""


# (table, time column) pairs retention deletes from, in time buckets
# request membership (telemetry/store/requests.py), in the same file as the wave blocks
REQUEST_SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    rank           INTEGER NOT NULL,
    pid            INTEGER NOT NULL,
    idx            INTEGER NOT NULL,
    request_id     TEXT NOT NULL,
    trace_hi       INTEGER NOT NULL,
    trace_lo       INTEGER NOT NULL,
    first_wave     INTEGER NOT NULL,
    start_ns       INTEGER NOT NULL,
    finished_wave  INTEGER,
    end_ns         INTEGER,
    PRIMARY KEY (rank, pid, idx)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS requests_trace ON requests (trace_hi, trace_lo);
CREATE INDEX IF NOT EXISTS requests_id ON requests (request_id);
CREATE INDEX IF NOT EXISTS requests_start ON requests (start_ns);
CREATE TABLE IF NOT EXISTS request_blocks (
    rank        INTEGER NOT NULL,
    first_wave  INTEGER NOT NULL,
    pid         INTEGER NOT NULL,
    last_wave   INTEGER NOT NULL,
    start_ns    INTEGER NOT NULL,
    rows        INTEGER NOT NULL,
    columns     BLOB NOT NULL,
    UNIQUE (rank, first_wave)
);
CREATE INDEX IF NOT EXISTS request_blocks_start ON request_blocks (start_ns);
"""

_RETAINED = (
    ("wave_blocks", "start_ns"),
    ("collective_blocks", "start_ns"),
    ("slow_calls", "start_ns"),
    ("requests", "start_ns"),
    ("request_blocks", "start_ns"),
)


def _add_block_columns(conn: sqlite3.Connection) -> None:
    """Bring a store written by an earlier version up to the block schema (writer only)."""
    for table, column, kind in ADDED_COLUMNS:
        present = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
        if column not in present:
            conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
    conn.executescript(_BLOCK_INDEXES)
