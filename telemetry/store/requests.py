"""Request membership in the store: the writer's half (rows and blocks) and the reads by request id,
trace and wave.

Tables (in the same SQLite file as the wave blocks, telemetry/store/schema.py; pruned by the
writer's retention):

    requests        (rank, pid, idx) -> request_id, trace id, first wave and time,   one row
                    finish wave and time, the W3C traceparent it came with         per request
    request_blocks  (rank, first_wave) -> pid, last_wave, start_ns, rows, columns  one row per
                                                                                  batch

`rank` is the `ranks` row of the tp0 rank that sent the membership (one per replica and PP
stage), `idx` the worker's integer for the request (unique in its process: `pid`). A block's
`columns` is the batch's `RequestColumns` without its names (they are in `requests`), zlib'd.
Request traces are built from these rows by telemetry/spans/requests.py.

A request's `traceparent` (sent with its name: guard/trace_context.py) is parsed here
(telemetry/wire/traceparent.py); a malformed one is counted (`traceparents()`, on /metrics)
and the request stored without it.
"""

from __future__ import annotations

import dataclasses
import sqlite3
import threading
import time
import zlib
from collections.abc import Callable

import numpy as np

from telemetry.store.blocks import OVERLAP_LOOKBACK
from telemetry.wire.proto import guard_pb2
from telemetry.wire.request_columns import Entries, entries, flat_per_row
from telemetry.wire.trace_ids import (
    format_trace_id,
    request_trace_id,
)
from telemetry.wire.traceparent import TraceParent, parse_traceparent

MAX_MATCHES = 64  # requests one look-up by id may return (n > 1 children, prefixes)


_NAMES = ("name_index", "name_request_id", "traceparent_index", "traceparent")
LINKED, MALFORMED = "linked", "malformed"  # what became of a request's traceparent


def _signed(value: int) -> int:
    return value - 2**64 if value >= 2**63 else value


def _halves(trace_id: int) -> tuple[int, int]:
    return _signed(trace_id >> 64), _signed(trace_id & (2**64 - 1))


def encode(cols: guard_pb2.RequestColumns) -> bytes:
    stripped = guard_pb2.RequestColumns()
    stripped.CopyFrom(cols)
    for name in _NAMES:
        stripped.ClearField(name)
    return zlib.compress(stripped.SerializeToString(), 1)


def decode(blob: bytes) -> guard_pb2.RequestColumns:
    return guard_pb2.RequestColumns.FromString(zlib.decompress(blob))


# -- writes (the store's writer thread) ---------------------------------------------------------
class RequestWriter:
    """Collects a write's request rows (`collect`), then writes them in the store's
    transaction (`flush`). Keeps the workers' cumulative drop counts for /metrics."""

    def __init__(self) -> None:
        self._names: list[tuple] = []
        self._finishes: list[tuple] = []
        self._blocks: list[tuple] = []
        self._lock = threading.Lock()
        self._worker_drops: dict[tuple, tuple[int, int]] = {}
        self._traceparents: dict[tuple[str, str], int] = {}  # (engine, outcome) -> requests
        self.stored_rows = 0
        # called on the writer thread after each commit with the (rank, pid, idx) of the
        # requests that write finished (the OTLP exporter's request traces)
        self.finished_listeners: list[Callable[[list[tuple[int, int, int]]], None]] = []
        self._committed_finishes: list[tuple[int, int, int]] = []

    def collect(self, rank_id: int, rank: guard_pb2.RankInfo, engine: str, batch) -> None:
        cols = batch.request_columns
        process = (rank.run_id, engine, rank.dp_rank, rank.tp_rank, rank.pp_rank, rank.pid)
        with self._lock:
            self._worker_drops[process] = (cols.dropped_rows_total, cols.dropped_names_total)
        if not len(cols.wave):
            return
        waves = batch.wave_columns
        start_of = dict(zip(waves.wave, waves.start_unix_nano, strict=True))
        now = time.time_ns()
        first_wave, last_wave = min(cols.wave), max(cols.wave)
        block_start = min((start_of[w] for w in cols.wave if w in start_of), default=now)
        pid = rank.pid
        if len(cols.name_index):
            expanded = entries(cols)
            first_seen = _first_waves(expanded)
            parents = self._parents(cols, engine, counted=rank.pp_rank == 0)
            for idx, req_id in zip(cols.name_index, cols.name_request_id, strict=True):
                wave = first_seen.get(idx, first_wave)
                trace = request_trace_id(rank.run_id, engine, rank.dp_rank, req_id)
                parent = parents.get(idx) if parents else None
                link = (
                    (None,) * 4
                    if parent is None
                    else (*_halves(parent.trace_id), _signed(parent.span_id), parent.flags)
                )
                self._names.append(
                    (
                        rank_id,
                        pid,
                        idx,
                        req_id,
                        *_halves(trace),
                        wave,
                        start_of.get(wave, now),
                        *link,
                    )
                )
        for wave, numbers in flat_per_row(cols, "finished_count", "finished_index"):
            at = start_of.get(wave, now)
            self._finishes += [(wave, at, rank_id, pid, idx) for idx in numbers]
        self._blocks.append(
            (rank_id, first_wave, pid, last_wave, block_start, len(cols.wave), encode(cols))
        )

    def _parents(self, cols, engine: str, counted: bool) -> dict[int, TraceParent] | None:
        """Index -> the parsed traceparent of the batch's named requests that came with one;
        each counted (first PP stage only: every stage sends the same), a malformed one left
        out."""
        if not len(cols.traceparent_index):
            return None
        out: dict[int, TraceParent] = {}
        malformed = 0
        for idx, text in zip(cols.traceparent_index, cols.traceparent, strict=True):
            parsed = parse_traceparent(text)
            if parsed is None:
                malformed += 1
            else:
                out[idx] = parsed
        if counted:
            with self._lock:
                for outcome, count in ((LINKED, len(out)), (MALFORMED, malformed)):
                    if count:
                        key = (engine, outcome)
                        self._traceparents[key] = self._traceparents.get(key, 0) + count
        return out

    def traceparents(self) -> dict[tuple[str, str], int]:
        """(engine, outcome) -> requests whose traceparent was parsed (`linked`) or refused
        (`malformed`), cumulative."""
        with self._lock:
            return dict(self._traceparents)

    def pending(self) -> bool:
        return bool(self._names or self._finishes or self._blocks)

    def flush(self, conn: sqlite3.Connection) -> None:
        """Write what `collect` gathered (inside the caller's transaction)."""
        names, finishes, blocks = self._names, self._finishes, self._blocks
        self._names, self._finishes, self._blocks = [], [], []
        conn.executemany(
            "INSERT OR IGNORE INTO requests (rank, pid, idx, request_id, trace_hi, trace_lo, "
            "first_wave, start_ns, traceparent_hi, traceparent_lo, traceparent_span, "
            "traceparent_flags) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
            names,
        )
        for row in blocks:
            if conn.execute(
                "INSERT OR IGNORE INTO request_blocks VALUES (?,?,?,?,?,?,?)", row
            ).rowcount:
                self.stored_rows += row[5]
        conn.executemany(
            "UPDATE requests SET finished_wave = ?, end_ns = ? WHERE rank = ? AND pid = ? "
            "AND idx = ? AND finished_wave IS NULL",
            finishes,
        )
        if self.finished_listeners:
            self._committed_finishes += [(rank, pid, idx) for _, _, rank, pid, idx in finishes]

    def committed(self) -> None:
        """The transaction of the latest `flush` committed: tell the listeners what finished."""
        done, self._committed_finishes = self._committed_finishes, []
        if not done:
            return
        for listener in self.finished_listeners:
            listener(done)

    def discard(self) -> None:
        """A failed write: forget what it collected."""
        self._names, self._finishes, self._blocks = [], [], []
        self._committed_finishes = []

    def forget_drops(self, engine: str) -> int:
        """Drop counts of an engine that has left (telemetry/crossrank/roster.py); how many processes."""
        with self._lock:
            gone = [process for process in self._worker_drops if process[1] == engine]
            for process in gone:
                del self._worker_drops[process]
            for key in [key for key in self._traceparents if key[0] == engine]:
                del self._traceparents[key]
        return len(gone)

    def drops(self) -> dict[tuple[str, str, str, str], tuple[int, int]]:
        """(engine, dp, tp, pp) -> (rows, names) the workers of that rank dropped (cumulative,
        summed over its processes)."""
        with self._lock:
            items = list(self._worker_drops.items())
        out: dict[tuple[str, str, str, str], tuple[int, int]] = {}
        for (_, engine, dp, tp, pp, _), (rows, names) in items:
            key = (engine, str(dp), str(tp), str(pp))
            before = out.get(key, (0, 0))
            out[key] = (before[0] + rows, before[1] + names)
        return out


def _first_waves(expanded: Entries) -> dict[int, int]:
    """Worker index -> the first wave of the batch it ran in."""
    if not len(expanded.index):
        return {}
    unique, first = np.unique(expanded.index, return_index=True)
    return dict(zip(unique.tolist(), expanded.wave[first].tolist(), strict=True))


# -- reads ----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RequestRow:
    """One request as one stage's tp0 rank reported it."""

    rank: int
    pid: int
    idx: int
    request_id: str
    trace_id: int
    first_wave: int
    start_ns: int
    finished_wave: int | None
    end_ns: int | None
    run_id: str
    engine: str
    dp: int
    pp: int
    node: str
    traceparent: TraceParent | None = None  # the W3C traceparent it came with

    @property
    def trace_hex(self) -> str:
        return format_trace_id(self.trace_id)


_COLUMNS = (
    "q.rank, q.pid, q.idx, q.request_id, q.trace_hi, q.trace_lo, q.first_wave, "
    "q.start_ns, q.finished_wave, q.end_ns, u.run_id, r.engine, r.dp, r.pp, r.node"
)
_PARENT = "q.traceparent_hi, q.traceparent_lo, q.traceparent_span, q.traceparent_flags"
_FROM = "FROM requests q JOIN ranks r ON r.id = q.rank JOIN runs u ON u.id = r.run"
_SELECT = f"SELECT {_COLUMNS}, {_PARENT} {_FROM}"
# a store no writer of this version has opened yet (read-only) lacks the traceparent columns
_SELECT_OLD = f"SELECT {_COLUMNS}, NULL, NULL, NULL, NULL {_FROM}"


def _select(conn: sqlite3.Connection, tail: str, params) -> list:
    try:
        return conn.execute(f"{_SELECT} {tail}", params).fetchall()
    except sqlite3.OperationalError as exc:
        if "traceparent" not in str(exc):
            raise
        return conn.execute(f"{_SELECT_OLD} {tail}", params).fetchall()


def _row(row) -> RequestRow:
    hi, lo = row[4] % 2**64, row[5] % 2**64
    parent = None
    if row[15] is not None:
        parent = TraceParent((row[15] % 2**64) << 64 | (row[16] % 2**64), row[17] % 2**64, row[18])
    return RequestRow(row[0], row[1], row[2], row[3], hi << 64 | lo, *row[6:15], parent)


def has_request_tables(conn: sqlite3.Connection) -> bool:
    try:
        conn.execute("SELECT 1 FROM requests LIMIT 1")
    except sqlite3.OperationalError:
        return False  # a store written before request traces existed
    return True


def find_requests(
    conn: sqlite3.Connection, text: str, *, run_id: str | None = None, engine: str | None = None
) -> list[RequestRow]:
    """The requests a user's id names: an exact vLLM request id, else ids it is a prefix of
    (the API's id; vLLM suffixes it per prompt), else ids that contain it (n > 1 children are
    `<i>_<id>`). Newest first, at most MAX_MATCHES."""
    text = text.strip()
    if not text or not has_request_tables(conn):
        return []
    where, params = [], []
    if run_id:
        where.append("u.run_id = ?")
        params.append(run_id)
    if engine:
        where.append("r.engine = ?")
        params.append(engine)
    extra = "".join(f" AND {w}" for w in where)
    escaped = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    for clause, value in (
        ("q.request_id = ?", text),
        ("q.request_id LIKE ? ESCAPE '\\'", escaped + "%"),
        ("q.request_id LIKE ? ESCAPE '\\'", "%" + escaped + "%"),
    ):
        rows = _select(
            conn,
            f"WHERE {clause}{extra} ORDER BY q.start_ns DESC LIMIT ?",
            (value, *params, MAX_MATCHES),
        )
        if rows:
            return [_row(r) for r in rows]
    return []


def requests_of_trace(conn: sqlite3.Connection, trace_id: int) -> list[RequestRow]:
    if not has_request_tables(conn):
        return []
    hi, lo = _halves(trace_id)
    rows = _select(conn, "WHERE q.trace_hi = ? AND q.trace_lo = ?", (hi, lo))
    return [_row(r) for r in rows]


def request_blocks(conn: sqlite3.Connection, rank: int, pid: int, first: int, last: int | None):
    sql = (
        "SELECT columns FROM request_blocks WHERE rank = ? AND pid = ? AND last_wave >= ?"
        + (" AND first_wave <= ?" if last is not None else "")
        + " ORDER BY first_wave"
    )
    params: list = [rank, pid, first] + ([last] if last is not None else [])
    for (blob,) in conn.execute(sql, params):
        yield decode(blob)


def requests_in_waves(
    conn: sqlite3.Connection, rank_id: int, first: int, last: int
) -> dict[int, list[tuple[int, str]]]:
    """Wave -> (request trace id, request id) of each request that ran in it, for the waves
    first..last of one rank; each block over the range is read once."""
    found: dict[int, list[tuple[int, int]]] = {}  # wave -> (pid, idx)
    misses = 0  # blocks in a row that end before the range: walk back no further than that
    for pid, block_last, blob in conn.execute(
        "SELECT pid, last_wave, columns FROM request_blocks WHERE rank = ? AND first_wave <= ? "
        "ORDER BY first_wave DESC",
        (rank_id, last),
    ):
        if block_last < first:
            misses += 1
            if misses >= OVERLAP_LOOKBACK:
                break
            continue
        misses = 0
        got = entries(decode(blob))
        keep = (got.wave >= first) & (got.wave <= last)
        for wave, idx in zip(got.wave[keep].tolist(), got.index[keep].tolist(), strict=True):
            found.setdefault(wave, []).append((pid, idx))
    names: dict[tuple[int, int], tuple[int, str] | None] = {}
    out: dict[int, list[tuple[int, str]]] = {}
    for wave, keys in found.items():
        for key in keys:
            if key not in names:
                row = conn.execute(
                    "SELECT trace_hi, trace_lo, request_id FROM requests WHERE rank = ? "
                    "AND pid = ? AND idx = ?",
                    (rank_id, *key),
                ).fetchone()
                names[key] = (
                    None if row is None else ((row[0] % 2**64) << 64 | (row[1] % 2**64), row[2])
                )
            if names[key] is not None:
                out.setdefault(wave, []).append(names[key])
    return out
