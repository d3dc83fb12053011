"""The embedded record store: compact typed tables in SQLite, retention by age and by size.

Engine: SQLite in WAL mode. The sidecar is the one writer, and `ascend-guard query`, `trace`,
`incidents` and `hangs` read the same file at the same time from other processes, without
going through the sidecar (DuckDB is columnar but allows one writer process, so reads would
then go through the sidecar; a sidecar that is down or wedged would take the on-call tools
with it). SQLite ships with Python, and its file is one thing to copy or delete.

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

`columns` holds the batch's `WaveColumns` (or its `CollectiveColumns`) in the proto's own packed
encoding, zlib-compressed: the proto stays the one schema of a wave, a block costs one row
insert however many waves it holds, and a wave with 2 collective stats takes about 50 bytes on
disk (bench/README.md). Blocks live in rowid tables on 4 KiB pages: a WITHOUT ROWID table (or
larger pages) left most of each page empty with rows of a few KiB (146 B per wave at 16 KiB).
The block's typed columns (time range, wave range, slowest step) are what queries filter on
before a block is decoded. Inserts are `INSERT OR IGNORE` on the block key, so a batch sent
again is stored once.

Retention: rows older than `retention_s` are deleted, and while the file's used pages
(page_count - freelist_count, times page_size: no COUNT(*) scan) exceed `max_bytes`, the oldest
minute is deleted; both delete whole time buckets of `BUCKET_NS`, oldest first. Freed pages are
reused by later inserts, so the file stays near the cap. The default cap holds the default 24 h
of a 16-rank node at 200 steps/s per rank (see DEFAULT_MAX_BYTES).

Faults (docs/operations.md): at start the sidecar checks the file (`prepare_store`: header,
truncation, a time-boxed `PRAGMA quick_check`); a file SQLite cannot use is moved aside to
`<store>.corrupt-<UTC time>` (with its -wal and -shm) and a fresh store begins. A write that
fails (disk full, I/O error, corruption found later) is rolled back and its records are counted
as dropped with a reason (`disk_full`, `io_error`, `corrupt`, ...); the store is then degraded
(`ascend_guard_store_degraded` 1, one `store_degraded` log line) until a write succeeds again
(`store_resumed`). Serving, liveness and /metrics never wait on any of this.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import os
import sqlite3
import struct
import threading
import time
import zlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from telemetry.pipeline.writer import STAGE_STORE, Item
from telemetry.store import block_summary
from telemetry.wire.collective_columns import columns_of, to_waves
from telemetry.wire.proto import guard_pb2
from telemetry.wire.trace_ids import wave_trace_key

log = structlog.get_logger("ascend_guard.store")

DEFAULT_RETENTION_S = 24 * 3600.0
# 3,200 waves/s (16 ranks x 200 steps/s) x 86,400 s x ~50 B per wave with 2 collective stats
# (measured by bench/sidecar_ingest.py: ~17 B of wave columns, ~29 B of collectives, the rest
# SQLite's pages and keys) is about 13.8 GB (12.9 GiB) a day: 16 GiB holds the default 24 h
# with room for bursts, incidents and the WAL.
DEFAULT_MAX_BYTES = 16 * 1024**3
BUCKET_NS = 60 * 10**9
PAGE_SIZE = 4096
# time the start-up integrity check may take: a whole 16 GiB store takes minutes to check, and
# the ranks' records are dropped while the sidecar is not up; the header and size checks are O(1)
DEFAULT_CHECK_BUDGET_S = 2.0
_SQLITE_MAGIC = b"SQLite format 3\x00"

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
_ADDED_COLUMNS = (
    ("wave_blocks", "rank_hist", "BLOB"),
    ("wave_blocks", "execute_hist", "BLOB"),
    ("wave_blocks", "sample_hist", "BLOB"),
    ("wave_blocks", "dropped_before", "INTEGER"),
    ("collective_blocks", "end_ns", "INTEGER"),
    ("collective_blocks", "max_host_ns", "INTEGER"),
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
_RETAINED = (
    ("wave_blocks", "start_ns"),
    ("collective_blocks", "start_ns"),
    ("slow_calls", "start_ns"),
    ("requests", "start_ns"),  # telemetry/store/requests.py RETAINED
    ("request_blocks", "start_ns"),
)


def default_store_path() -> str:
    from telemetry.wire import paths

    return paths.default_store()


def store_file_problem(
    path: str | os.PathLike, *, check_budget_s: float = DEFAULT_CHECK_BUDGET_S
) -> str | None:
    """Why the file at `path` cannot be used as a store, or None (also for no file at all).

    O(1) checks first (the SQLite header, the file shorter than its header says), then
    `PRAGMA quick_check` for at most `check_budget_s` (a check cut short is no verdict).
    """
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return None
    if size == 0:
        return None  # SQLite's own empty database
    with open(path, "rb") as handle:
        header = handle.read(100)
    if len(header) < 100 or not header.startswith(_SQLITE_MAGIC):
        return (
            f"not an SQLite database (header of {len(header)} bytes does not start with its magic)"
        )
    (page_size,) = struct.unpack(">H", header[16:18])
    page_size = 65536 if page_size == 1 else page_size
    (change, pages) = struct.unpack(">II", header[24:32])
    (valid_for,) = struct.unpack(">I", header[92:96])
    wal = Path(f"{path}-wal")
    wal_pending = wal.exists() and wal.stat().st_size > 0  # a checkpoint cut short extends it
    if valid_for == change and pages and size < pages * page_size and not wal_pending:
        return f"truncated: its header says {pages * page_size} bytes, the file has {size}"
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
    except sqlite3.Error as exc:
        return f"SQLite cannot open it: {exc}"
    deadline = time.monotonic() + check_budget_s
    conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 10_000)
    try:
        rows = [row[0] for row in conn.execute("PRAGMA quick_check(5)")]
    except sqlite3.OperationalError as exc:
        if "interrupted" in str(exc):
            log.info("store_check_cut_short", path=str(path), budget_s=check_budget_s)
            return None
        return f"SQLite cannot read it: {exc}"
    except sqlite3.DatabaseError as exc:
        return f"SQLite cannot read it: {exc}"
    finally:
        conn.close()
    if rows != ["ok"]:
        return "integrity check failed: " + "; ".join(map(str, rows))
    return None


def move_aside(path: str | os.PathLike, *, now: float | None = None) -> Path:
    """Rename the store (and its -wal, -shm) to `<store>.corrupt-<UTC time>`; return the name."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    target = Path(f"{path}.corrupt-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = Path(f"{path}.corrupt-{stamp}-{n}")
    for suffix in ("-wal", "-shm", ""):
        source = Path(f"{path}{suffix}")
        if source.exists():
            os.replace(source, f"{target}{suffix}")
    return target


def prepare_store(
    path: str | os.PathLike, *, check_budget_s: float = DEFAULT_CHECK_BUDGET_S
) -> Path | None:
    """Check the store file before the sidecar opens it; move a bad one aside (returns where)."""
    problem = store_file_problem(path, check_budget_s=check_budget_s)
    if problem is None:
        return None
    moved = move_aside(path)
    log.error(
        "store_moved_aside",
        path=str(path),
        moved_to=str(moved),
        problem=problem,
        action="starting a fresh store; the old file is kept for inspection",
    )
    return moved


def connect(path: str | os.PathLike, *, readonly: bool = False) -> sqlite3.Connection:
    """Open the store; read-only connections fail clearly when the file does not exist."""
    path = Path(path)
    if readonly:
        if not path.exists():
            raise FileNotFoundError(
                f"no trace store at {path}; is the sidecar running with --store {path}?"
            )
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(path, timeout=5.0, check_same_thread=False)
        conn.execute(f"PRAGMA page_size={PAGE_SIZE}")  # only takes effect on a new file
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.executescript(SCHEMA)
        from telemetry.store import (
            requests as request_store,  # its tables (request traces) live here too
        )

        conn.executescript(request_store.SCHEMA)
        _add_block_columns(conn)
    conn.row_factory = sqlite3.Row
    return conn


def _add_block_columns(conn: sqlite3.Connection) -> None:
    """Bring a store written by an earlier version up to the block schema (writer only)."""
    for table, column, kind in _ADDED_COLUMNS:
        present = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
        if column not in present:
            conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
    conn.executescript(_BLOCK_INDEXES)


def failure_reason(exc: BaseException) -> str:
    """The drop reason of a failed store write (a label value from a fixed set)."""
    if isinstance(exc, sqlite3.Error):
        name = getattr(exc, "sqlite_errorname", "") or ""
        text = str(exc).lower()
        if name.startswith("SQLITE_FULL") or "disk is full" in text:
            return "disk_full"
        if name.startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB")) or "malformed" in text:
            return "corrupt"
        if name.startswith("SQLITE_IOERR") or "disk i/o error" in text:
            return "io_error"
        if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "locked" in text:
            return "busy"
        if name.startswith(("SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_PERM")):
            return "not_writable"
        return "sqlite_error"
    if isinstance(exc, OSError):
        return "io_error"
    return "error"


def _signed(value: int) -> int:
    """A uint64 as SQLite's signed 64-bit integer (same bits)."""
    return value - 2**64 if value >= 2**63 else value


@dataclasses.dataclass(frozen=True)
class RankRow:
    """One rank as the store knows it (the `ranks` table joined with `runs`)."""

    id: int
    run_id: str
    engine: str
    dp: int
    tp: int
    pp: int
    node: str
    pid: int

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> RankRow:
        return cls(
            row["id"],
            row["run_id"],
            row["engine"],
            row["dp"],
            row["tp"],
            row["pp"],
            row["node"],
            row["pid"],
        )


def encode_waves(cols: guard_pb2.WaveColumns) -> bytes:
    return zlib.compress(cols.SerializeToString(), 1)


def decode_waves(blob: bytes) -> guard_pb2.WaveColumns:
    return guard_pb2.WaveColumns.FromString(zlib.decompress(blob))


# A collective block is a `Batch` holding only the batch's `collective_columns` (field 32; wire
# v3): written as that field's tag and length before the columns' own encoding, so nothing is
# copied into a holder message. A block written from v2 messages (`collective_waves`) decodes
# to columns the same way.
def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_COLUMNS_FIELD = guard_pb2.Batch.DESCRIPTOR.fields_by_name["collective_columns"].number
_COLUMNS_TAG = _varint(_COLUMNS_FIELD << 3 | 2)  # wire type 2: length-delimited


def encode_collectives(cols: guard_pb2.CollectiveColumns) -> bytes:
    payload = cols.SerializeToString()
    return zlib.compress(_COLUMNS_TAG + _varint(len(payload)) + payload, 1)


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


class Store:
    """The sidecar's writer into the store (a `BatchSink`); thread-safe."""

    stage = STAGE_STORE

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        retention_s: float = DEFAULT_RETENTION_S,
        max_bytes: int = DEFAULT_MAX_BYTES,
        prune_every_s: float = 30.0,
    ) -> None:
        self.path = str(path)
        self.retention_s = retention_s
        self.max_bytes = max_bytes
        self._prune_every_s = prune_every_s
        self._last_prune = time.monotonic()
        self._lock = threading.Lock()
        self._conn = connect(self.path)
        self._runs: dict[str, int] = {}
        self._ranks: dict[tuple, int] = {}
        self.stored_waves = 0
        self.ignored_waves = 0  # sent again: already stored
        # the write error path (write_started / write_failed / write_done, telemetry/pipeline/writer.py)
        self.degraded_reason = ""  # "" while writes succeed
        self.degraded_since = 0.0
        self.lost_while_degraded = 0
        self._counts_before_write = (0, 0)
        from telemetry.store.requests import RequestWriter

        self.requests = RequestWriter()  # request membership (telemetry/store/requests.py)
        # waves missing between a rank's last stored wave and the first this process receives
        self.restart_gap_waves = 0
        self._gap_checked: set[tuple] = set()

    # -- dimensions -----------------------------------------------------------------------
    def _run_id(self, run_id: str) -> int:
        known = self._runs.get(run_id)
        if known is not None:
            return known
        conn = self._conn
        conn.execute("INSERT OR IGNORE INTO runs (run_id) VALUES (?)", (run_id,))
        (key,) = conn.execute("SELECT id FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        self._runs[run_id] = key
        return key

    def rank_id(self, rank: guard_pb2.RankInfo, engine: str) -> int:
        """The integer key of a rank (inserted on first sight). Call with the lock held."""
        key = (rank.run_id, engine, rank.dp_rank, rank.tp_rank, rank.pp_rank)
        known = self._ranks.get(key)
        if known is not None:
            return known
        run = self._run_id(rank.run_id)
        conn = self._conn
        conn.execute(
            "INSERT INTO ranks (run, engine, dp, tp, pp, dp_size, tp_size, pp_size, node, pid, "
            "runner, trace_key) VALUES (?,?,?,?,?,?,?,?,?,?,?,?) "
            "ON CONFLICT (run, engine, dp, tp, pp) DO UPDATE SET node = excluded.node, "
            "pid = excluded.pid, runner = excluded.runner",
            (
                run,
                engine,
                rank.dp_rank,
                rank.tp_rank,
                rank.pp_rank,
                rank.dp_size,
                rank.tp_size,
                rank.pp_size,
                rank.node,
                rank.pid,
                rank.runner,
                _signed(wave_trace_key(rank.run_id, rank.dp_rank)),
            ),
        )
        (rank_key,) = conn.execute(
            "SELECT id FROM ranks WHERE run = ? AND engine = ? AND dp = ? AND tp = ? AND pp = ?",
            (run, engine, rank.dp_rank, rank.tp_rank, rank.pp_rank),
        ).fetchone()
        self._ranks[key] = rank_key
        return rank_key

    # -- writes -----------------------------------------------------------------------------
    def write(self, items: Sequence[Item]) -> None:
        wave_rows, coll_rows, slow_rows = [], [], []
        with self._lock:
            for item in items:
                batch = item.batch
                cols = columns_of(batch)
                if batch.HasField("request_columns"):
                    rank_id = self.rank_id(item.source.rank, item.source.engine)
                    self.requests.collect(rank_id, item.source.rank, item.source.engine, batch)
                if not item.records and not len(cols.wave):
                    continue
                rank_id = self.rank_id(item.source.rank, item.source.engine)
                if item.records:
                    wave_rows.append(
                        wave_block_row(rank_id, batch.wave_columns, batch.dropped_total)
                    )
                if len(cols.wave):
                    coll_rows.append(collective_block_row(rank_id, cols))
                    numbers = cols.wave
                    for call, row in zip(cols.slow_calls, cols.slow_call_wave_index, strict=True):
                        slow_rows.append(
                            (
                                rank_id,
                                call.group,
                                call.seq,
                                numbers[row],
                                call.op,
                                call.backend,
                                call.dtype,
                                call.bytes,
                                call.start_unix_nano,
                                call.host_ns,
                            )
                        )
            if not (wave_rows or coll_rows or slow_rows or self.requests.pending()):
                self._conn.commit()
                return
            conn = self._conn
            with conn:
                for row in wave_rows:  # one block per batch: a few rows per write
                    if conn.execute(_INSERT_WAVE_BLOCK, row).rowcount:
                        self.stored_waves += row[5]
                    else:
                        self.ignored_waves += row[5]
                conn.executemany(_INSERT_COLLECTIVE_BLOCK, coll_rows)
                conn.executemany(
                    "INSERT OR IGNORE INTO slow_calls VALUES (?,?,?,?,?,?,?,?,?,?)", slow_rows
                )
                self.requests.flush(conn)
        if time.monotonic() - self._last_prune >= self._prune_every_s:
            self.prune()

    # -- the write error path (called by the writer around `write`) ---------------------------
    def write_started(self, items: Sequence[Item] = ()) -> None:
        self._counts_before_write = (self.stored_waves, self.ignored_waves)
        for item in items:
            if item.records:
                self._check_restart_gap(item)

    def _check_restart_gap(self, item: Item) -> None:
        """Once per rank and process: count the waves between the last one the store holds and
        the first this sidecar receives that the worker has not counted as dropped. A sidecar
        that was killed loses what it had accepted and not yet written (the worker thinks it
        delivered it); this makes that loss seen. The worker's own drops in the gap (its buffer
        overflowing through a long outage, the batch in flight) are the growth of its cumulative
        drop count between the stored block and this batch: those are already in
        ascend_guard_records_dropped_total, and counting them here too would count them twice."""
        rank = item.source.rank
        key = (rank.run_id, item.source.engine, rank.dp_rank, rank.tp_rank, rank.pp_rank)
        if key in self._gap_checked:
            return
        self._gap_checked.add(key)
        try:
            with self._lock:
                # the block with the highest first wave, found through the (rank, first_wave)
                # index: no scan of the rank's day of blocks
                row = self._conn.execute(
                    "SELECT b.last_wave, b.dropped_before FROM ranks r JOIN runs u ON u.id = r.run "
                    "JOIN wave_blocks b ON b.rank = r.id WHERE u.run_id = ? AND r.engine = ? "
                    "AND r.dp = ? AND r.tp = ? AND r.pp = ? ORDER BY b.first_wave DESC LIMIT 1",
                    key,
                ).fetchone()
        except sqlite3.Error:
            return  # the write itself will find and count what is wrong
        if row is None:
            return
        last_stored, dropped_before = row
        first = min(item.batch.wave_columns.wave)
        if first <= last_stored + 1:
            return
        worker_dropped = 0  # a block written before the column existed (NULL): none known
        if dropped_before is not None:
            worker_dropped = max(0, item.batch.dropped_total - dropped_before)
        # a stored batch that the worker also counted (in flight at the kill) can make this
        # negative: then nothing is missing past what the worker counted
        gap = max(0, first - last_stored - 1 - worker_dropped)
        self.restart_gap_waves += gap
        # logged also when the worker counted every missing wave: the line says where the
        # restart left its hole in the rank's waves
        (log.warning if gap else log.info)(
            "store_restart_gap",
            engine=item.source.engine,
            dp=rank.dp_rank,
            tp=rank.tp_rank,
            pp=rank.pp_rank,
            last_stored_wave=last_stored,
            first_received_wave=first,
            missing_waves=gap,
            dropped_by_worker=worker_dropped,
            why=(
                "lost with a sidecar that stopped before writing them"
                if gap
                else "all dropped by the worker, and counted there"
            ),
        )

    def write_failed(self, exc: BaseException, records: int) -> str:
        """Roll back the failed write, enter the degraded state; return the drop reason."""
        reason = failure_reason(exc)
        with self._lock:
            with contextlib.suppress(sqlite3.Error):
                self._conn.rollback()
            # rows of a rolled-back transaction are gone: their keys must be looked up again
            self._runs.clear()
            self._ranks.clear()
            self.requests.discard()
            self.stored_waves, self.ignored_waves = self._counts_before_write
        if not self.degraded_reason:
            self.degraded_since = time.monotonic()
            log.error(
                "store_degraded",
                path=self.path,
                reason=reason,
                error=str(exc),
                action="records are counted as dropped (stage=store) until a write succeeds",
            )
        self.degraded_reason = reason
        self.lost_while_degraded += records
        return reason

    def write_done(self) -> None:
        if not self.degraded_reason:
            return
        log.warning(
            "store_resumed",
            path=self.path,
            reason=self.degraded_reason,
            lost_records=self.lost_while_degraded,
            degraded_s=round(time.monotonic() - self.degraded_since, 3),
        )
        self.degraded_reason = ""
        self.lost_while_degraded = 0

    # -- retention --------------------------------------------------------------------------
    def used_bytes(self) -> int:
        """Bytes of the file in use: (page_count - freelist_count) x page_size."""
        conn = self._conn
        (pages,) = conn.execute("PRAGMA page_count").fetchone()
        (free,) = conn.execute("PRAGMA freelist_count").fetchone()
        (size,) = conn.execute("PRAGMA page_size").fetchone()
        return (pages - free) * size

    def _oldest_ns(self) -> int | None:
        oldest = [
            self._conn.execute(f"SELECT MIN({column}) FROM {table}").fetchone()[0]
            for table, column in _RETAINED
        ]
        oldest = [t for t in oldest if t is not None]
        return min(oldest) if oldest else None

    def _delete_before(self, cutoff_ns: int) -> int:
        removed = 0
        with self._conn:
            for table, column in _RETAINED:
                removed += self._conn.execute(
                    f"DELETE FROM {table} WHERE {column} < ?", (cutoff_ns,)
                ).rowcount
        return removed

    def prune(self, now_ns: int | None = None) -> int:
        """Delete by age, then by size, a time bucket at a time; return the rows removed."""
        self._last_prune = time.monotonic()
        cutoff = (now_ns if now_ns is not None else time.time_ns()) - int(self.retention_s * 1e9)
        removed = 0
        with self._lock:
            try:
                oldest = self._oldest_ns()
                while oldest is not None and oldest < cutoff:
                    removed += self._delete_before(min(cutoff, oldest + BUCKET_NS))
                    oldest = self._oldest_ns()
                while oldest is not None and self.used_bytes() > self.max_bytes:
                    removed += self._delete_before(oldest + BUCKET_NS)
                    oldest = self._oldest_ns()
            except sqlite3.Error as exc:  # a delete needs WAL space too; the next prune retries
                log.warning("store_prune_failed", reason=failure_reason(exc), error=str(exc))
        if removed:
            log.info("store_pruned", removed_rows=removed)
        return removed

    def close(self) -> None:
        with self._lock:
            self._conn.close()


class StoreMetrics(Collector):
    """The store's health on /metrics, read from the sidecar's `Store` at scrape time."""

    def __init__(self, registry: CollectorRegistry | None, store: Store | None = None) -> None:
        self.store = store
        self.moved_aside = 0
        if registry is not None:
            registry.register(self)

    def collect(self):
        store = self.store
        degraded = GaugeMetricFamily(
            "ascend_guard_store_degraded",
            "1 while the store cannot write (disk full, I/O error, corruption); its records are "
            'counted in ascend_guard_pipeline_dropped_records_total{stage="store"}.',
        )
        degraded.add_metric([], 1.0 if store is not None and store.degraded_reason else 0.0)
        yield degraded
        committed = CounterMetricFamily(
            "ascend_guard_store_committed_records",
            "Wave records committed to the store by this sidecar (a batch sent again counts once).",
        )
        committed.add_metric([], float(store.stored_waves if store is not None else 0))
        yield committed
        gap = CounterMetricFamily(
            "ascend_guard_store_restart_gap_records",
            "Waves missing between a rank's last stored wave and the first this sidecar received, "
            "less those the worker counted in ascend_guard_records_dropped_total: lost with a "
            "previous sidecar that was killed before writing them.",
        )
        gap.add_metric([], float(store.restart_gap_waves if store is not None else 0))
        yield gap
        moved = CounterMetricFamily(
            "ascend_guard_store_moved_aside",
            "Store files this sidecar found unusable at start and moved aside (<store>.corrupt-*).",
        )
        moved.add_metric([], float(self.moved_aside))
        yield moved


# -- reads (the CLI, the exporter's look-ups) ---------------------------------------------------
_RANK_SELECT = (
    "SELECT ranks.id, runs.run_id, ranks.engine, ranks.dp, ranks.tp, ranks.pp, ranks.node, "
    "ranks.pid FROM ranks JOIN runs ON runs.id = ranks.run"
)


def ranks(conn: sqlite3.Connection, where: str = "", params: Sequence = ()) -> list[RankRow]:
    sql = _RANK_SELECT + (f" WHERE {where}" if where else "")
    return [RankRow.from_row(row) for row in conn.execute(sql, params)]


def ranks_of_trace_key(conn: sqlite3.Connection, trace_key: int) -> list[RankRow]:
    return ranks(conn, "ranks.trace_key = ?", (_signed(trace_key),))


# -- block readers: the one way to find a rank's blocks -----------------------------------------
# A rank's blocks hold consecutive waves, so they follow each other in wave and in time. The
# readers walk a rank's blocks back from the newest that can matter, down the (rank, first_wave)
# key or the (rank, start_ns) index, and stop once blocks end before the range: a filter like
# `last_wave >= ?` or `end_ns >= ?` would read every older block of the rank (neither is
# indexed). Blocks overlap only where a batch was cut differently and sent again, so the walk
# stops after OVERLAP_LOOKBACK blocks in a row that end before the range.
WAVE_BLOCKS = "wave_blocks"
COLLECTIVE_BLOCKS = "collective_blocks"
OVERLAP_LOOKBACK = 8
# per table: its block-wide slowest span (NULL in collective blocks stored before the column)
_MAX_COLUMN = {WAVE_BLOCKS: "max_step_ns", COLLECTIVE_BLOCKS: "max_host_ns"}


class BlockRow(NamedTuple):
    """A stored block's typed columns (no blob). `end_ns`: the latest span end in a wave block,
    the latest collective start in a collective block (None where not stored); `max_ns`: the
    longest rank span (wave block) or collective (op, group) host time (None: not stored).
    A named tuple: block walks make one per row read, and a frozen dataclass costs 2-3x more."""

    table: str
    rowid: int
    rank: int
    first_wave: int
    last_wave: int
    start_ns: int
    end_ns: int | None
    max_ns: int | None


def _block_select(table: str) -> str:
    return (
        f"SELECT rowid, rank, first_wave, last_wave, start_ns, end_ns, {_MAX_COLUMN[table]} "
        f"FROM {table}"
    )


def blocks_by_time(
    conn: sqlite3.Connection,
    table: str,
    rank_ids: Iterable[int],
    lo: int | None,
    hi: int | None,
    *,
    min_ns: int | None = None,
) -> Iterator[BlockRow]:
    """The blocks of these ranks that may hold spans in [lo, hi] (None: open), newest first
    per rank; with `min_ns`, only those whose slowest span (`max_ns`) may reach it."""
    select = _block_select(table)
    for rank_id in rank_ids:
        if hi is None:
            rows = conn.execute(f"{select} WHERE rank = ? ORDER BY start_ns DESC", (rank_id,))
        else:
            rows = conn.execute(
                f"{select} WHERE rank = ? AND start_ns <= ? ORDER BY start_ns DESC",
                (rank_id, hi),
            )
        before = 0
        for row in rows:
            block = BlockRow(table, *row)
            # a block without end_ns reaches at most to the start of the one after it
            end = block.end_ns if block.end_ns is not None else None
            if lo is not None and (end if end is not None else block.start_ns) < lo:
                if end is None and not before:
                    yield from _kept(block, min_ns)  # it may still hold spans after lo
                before += 1
                if before >= OVERLAP_LOOKBACK:
                    break
                continue
            yield from _kept(block, min_ns)


def _kept(block: BlockRow, min_ns: int | None) -> Iterator[BlockRow]:
    if min_ns is None or block.max_ns is None or block.max_ns >= min_ns:
        yield block


def blocks_by_wave(
    conn: sqlite3.Connection, table: str, rank_id: int, first_wave: int, last_wave: int
) -> Iterator[BlockRow]:
    """The blocks of one rank that hold waves in [first_wave, last_wave], newest first."""
    rows = conn.execute(
        f"{_block_select(table)} WHERE rank = ? AND first_wave <= ? ORDER BY first_wave DESC",
        (rank_id, last_wave),
    )
    yield from _holding(first_wave, (BlockRow(table, *row) for row in rows))


def _holding(first_wave: int, newest_first: Iterable[BlockRow]) -> Iterator[BlockRow]:
    """The blocks of a walk down the (rank, first_wave) key (each starting at or before the
    range's last wave) that reach `first_wave`: the walk stops after OVERLAP_LOOKBACK blocks
    in a row that end before it."""
    before = 0
    for block in newest_first:
        if block.last_wave < first_wave:
            before += 1
            if before >= OVERLAP_LOOKBACK:
                return
            continue
        yield block


class BlockDirectory:
    """One rank's blocks of one table, read down the (rank, first_wave) key a page at a time
    and kept: the blocks `blocks_by_wave` gives, for look-ups that walk back through nearby
    waves (a search loading trace after trace, newest first) without a query each. A look-up
    above what was read starts the directory again from there. Pages grow from FIRST_PAGE
    (about what one look-up reads: a block and the lookback) to MAX_PAGE."""

    FIRST_PAGE, MAX_PAGE = 16, 64  # first_wave is unique per rank: pages cannot overlap

    def __init__(self, conn: sqlite3.Connection, table: str, rank_id: int) -> None:
        self._conn, self._table, self._rank = conn, table, rank_id
        self._select = (
            f"{_block_select(table)} WHERE rank = ? AND first_wave <= ? "
            "ORDER BY first_wave DESC LIMIT ?"
        )
        self._top: int | None = None  # every block starting at or below it, down to _rows[-1]
        self._rows: list[BlockRow] = []
        self._keys: list[int] = []  # -first_wave of each row (ascending, for bisect)
        self._page = self.FIRST_PAGE
        self._complete = False  # the rank has no block below _rows[-1]
        self._last: tuple = (None, [])  # the last look-up's (range, answer)

    def blocks_by_wave(self, first_wave: int, last_wave: int) -> list[BlockRow]:
        if self._top is None or last_wave > self._top:
            self._top, self._rows, self._keys = last_wave, [], []
            self._page, self._complete = self.FIRST_PAGE, False
        if self._last[0] != (first_wave, last_wave):  # a trace asks twice: read ahead, read
            start = bisect.bisect_left(self._keys, -last_wave)
            self._last = ((first_wave, last_wave), list(_holding(first_wave, self._from(start))))
        return list(self._last[1])

    def _from(self, i: int) -> Iterator[BlockRow]:
        while True:
            while i < len(self._rows):
                yield self._rows[i]
                i += 1
            if self._complete:
                return
            self._read_page()

    def _read_page(self) -> None:
        below = self._rows[-1].first_wave - 1 if self._rows else self._top
        rows = self._conn.execute(self._select, (self._rank, below, self._page)).fetchall()
        table = self._table
        self._rows += [BlockRow(table, *row) for row in rows]
        self._keys += [-row[2] for row in rows]  # first_wave: the third column selected
        self._complete = len(rows) < self._page
        self._page = min(2 * self._page, self.MAX_PAGE)


def blocks_by_rowid(conn: sqlite3.Connection, table: str, rowids: Sequence[int]) -> list[BlockRow]:
    """The blocks with these row ids (as another reader listed them)."""
    select = _block_select(table)
    return [
        BlockRow(table, *row)
        for rowid in rowids
        for row in conn.execute(f"{select} WHERE rowid = ?", (rowid,))
    ]


def block_blob(conn: sqlite3.Connection, block: BlockRow) -> bytes:
    (blob,) = conn.execute(
        f"SELECT columns FROM {block.table} WHERE rowid = ?", (block.rowid,)
    ).fetchone()
    return blob


def block_columns(conn: sqlite3.Connection, block: BlockRow):
    """A block's decoded columns: `WaveColumns` or `CollectiveColumns` by its table."""
    blob = block_blob(conn, block)
    return decode_waves(blob) if block.table == WAVE_BLOCKS else decode_collectives(blob)


def wave_blocks(
    conn: sqlite3.Connection,
    rank_ids: Sequence[int],
    *,
    since_ns: int | None = None,
    until_ns: int | None = None,
    min_step_ns: int | None = None,
    wave: int | None = None,
) -> Iterator[tuple[int, guard_pb2.WaveColumns]]:
    """(rank id, columns) of the blocks that may hold matching waves."""
    for rank_id in rank_ids:
        if wave is not None:
            found = blocks_by_wave(conn, WAVE_BLOCKS, rank_id, wave, wave)
        else:
            found = blocks_by_time(
                conn, WAVE_BLOCKS, (rank_id,), since_ns, until_ns, min_ns=min_step_ns
            )
        for block in found:
            if wave is not None and not (
                (since_ns is None or (block.end_ns or 0) >= since_ns)
                and (until_ns is None or block.start_ns <= until_ns)
                and (min_step_ns is None or block.max_ns >= min_step_ns)
            ):
                continue
            yield rank_id, decode_waves(block_blob(conn, block))


def wave_range(
    conn: sqlite3.Connection, rank_id: int, since_ns: int, until_ns: int
) -> tuple[int, int] | None:
    """The waves a rank ran in [since, until] by its blocks' own bounds (no block decoded)."""
    blocks = list(blocks_by_time(conn, WAVE_BLOCKS, (rank_id,), since_ns, until_ns))
    if not blocks:
        return None
    return min(b.first_wave for b in blocks), max(b.last_wave for b in blocks)


def time_bounds(
    conn: sqlite3.Connection, rank_ids: Iterable[int], table: str = WAVE_BLOCKS
) -> tuple[int, int] | None:
    """(earliest block start, latest block end) of these ranks, from each rank's ends of the
    (rank, start_ns) index."""
    lows, highs = [], []
    for rank_id in rank_ids:
        (low,) = conn.execute(
            f"SELECT MIN(start_ns) FROM {table} WHERE rank = ?", (rank_id,)
        ).fetchone()
        if low is None:
            continue
        lows.append(low)
        newest = next(blocks_by_time(conn, table, (rank_id,), None, None))
        recent = [newest.end_ns or newest.start_ns]
        recent += [
            b.end_ns or b.start_ns
            for b in blocks_by_time(conn, table, (rank_id,), newest.start_ns, None)
        ]
        highs.append(max(recent))
    if not lows:
        return None
    return min(lows), max(highs)


def time_of_waves(
    conn: sqlite3.Connection, rank_ids: Iterable[int], first_wave: int, last_wave: int
) -> tuple[int, int] | None:
    """(earliest start, latest end) of the ranks' blocks that hold waves first..last."""
    blocks = [
        b
        for rank_id in rank_ids
        for b in blocks_by_wave(conn, WAVE_BLOCKS, rank_id, first_wave, last_wave)
    ]
    if not blocks:
        return None
    return min(b.start_ns for b in blocks), max(b.end_ns for b in blocks)


def collective_blocks(
    conn: sqlite3.Connection, rank_id: int, first_wave: int, last_wave: int
) -> Iterator[guard_pb2.CollectiveColumns]:
    """The collective columns of one rank's blocks that hold waves in [first, last]."""
    for block in blocks_by_wave(conn, COLLECTIVE_BLOCKS, rank_id, first_wave, last_wave):
        yield decode_collectives(block_blob(conn, block))


def collective_waves(
    conn: sqlite3.Connection, rank_id: int, wave: int
) -> list[guard_pb2.CollectiveWave]:
    """The collective records of one rank in one wave (as `CollectiveWave` messages, made
    from the stored columns)."""
    out: list[guard_pb2.CollectiveWave] = []
    for cols in collective_blocks(conn, rank_id, wave, wave):
        out += to_waves(cols, (wave,))
    return out


@dataclasses.dataclass(frozen=True)
class SlowCallRow:
    """One `slow_calls` row (CollectiveCall's fields, plus its rank and wave)."""

    rank: int
    group: str
    seq: int
    wave: int
    op: str
    backend: str
    dtype: str
    bytes: int
    start_unix_nano: int
    host_ns: int


def slow_calls_in(
    conn: sqlite3.Connection, rank_ids: Sequence[int], lo: int, hi: int
) -> list[SlowCallRow]:
    """The slow calls of these ranks that started in [lo, hi] (down the start_ns index)."""
    if not rank_ids:
        return []
    rows = conn.execute(
        "SELECT rank, group_name, seq, wave, op, backend, dtype, bytes, start_ns, host_ns "
        f"FROM slow_calls WHERE start_ns >= ? AND start_ns <= ? "
        f"AND rank IN ({','.join('?' * len(rank_ids))})",
        (lo, hi, *rank_ids),
    )
    return [SlowCallRow(*row) for row in rows]


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


def wave_block_by_rowid(conn: sqlite3.Connection, rowid: int) -> guard_pb2.WaveColumns:
    (blob,) = conn.execute("SELECT columns FROM wave_blocks WHERE rowid = ?", (rowid,)).fetchone()
    return decode_waves(blob)


def count_waves(conn: sqlite3.Connection) -> int:
    """Wave records stored (block sizes summed)."""
    (total,) = conn.execute("SELECT COALESCE(SUM(waves), 0) FROM wave_blocks").fetchone()
    return total
