"""Request membership in the store, and the request traces built from it (issue 12).

Tables (in the same SQLite file as the wave blocks; created by `telemetry/store/records.py`'s
`connect`, pruned by its retention):

    requests        (rank, pid, idx) -> request_id, trace id, first wave and time,   one row
                    finish wave and time                                           per request
    request_blocks  (rank, first_wave) -> pid, last_wave, start_ns, rows, columns  one row per
                                                                                  batch

`rank` is the `ranks` row of the tp0 rank that sent the membership (one per replica and PP
stage), `idx` the worker's integer for the request (unique in its process: `pid`). A block's
`columns` is the batch's `RequestColumns` without its names (they are in `requests`), zlib'd.

A request trace is built on demand (`request_trace_spans`): a `request` root span from its
first wave to its finish, one `prefill` or `decode` child span per wave it ran in (tokens
scheduled and sampled, preemptions), each linked to that wave's trace, and its incidents.
Wave spans link back to the request traces of the requests they ran (`link_wave_spans`).
"""

from __future__ import annotations

import dataclasses
import re
import sqlite3
import threading
import time
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from telemetry.spans.builders import Span, incident_span, rank_end_ns
from telemetry.wire import schema
from telemetry.wire.proto import guard_pb2
from telemetry.wire.request_columns import Entries, entries, flat_per_row
from telemetry.wire.trace_ids import (
    format_trace_id,
    request_incident_span_id,
    request_span_id,
    request_trace_id,
    request_wave_span_id,
    wave_span_id,
    wave_trace_id,
)

SCHEMA = """
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
RETAINED = (("requests", "start_ns"), ("request_blocks", "start_ns"))
REQUEST_SPAN = "request"
ATTR_REQUEST = schema.attr("request_id")
# attribute keys of request spans (TraceQL's short names come from these: telemetry/traceql/fields.py)
REQUEST_ATTRIBUTE_KEYS = (
    schema.ATTR_RUN, schema.ATTR_ENGINE, schema.ATTR_DP, schema.ATTR_WAVE, schema.ATTR_PP,
    ATTR_REQUEST,
    *(schema.attr(f"request.{name}") for name in (
        "waves", "prefill_waves", "scheduled_tokens", "sampled_tokens", "preemptions", "finished",
        "first_wave", "last_wave", "preempted", "recompute",
    )),
)  # fmt: skip
MAX_MATCHES = 64  # requests one look-up by id may return (n > 1 children, prefixes)
_NAMES = ("name_index", "name_request_id")


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
        self.stored_rows = 0

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
            for idx, req_id in zip(cols.name_index, cols.name_request_id, strict=True):
                wave = first_seen.get(idx, first_wave)
                trace = request_trace_id(rank.run_id, engine, rank.dp_rank, req_id)
                self._names.append(
                    (rank_id, pid, idx, req_id, *_halves(trace), wave, start_of.get(wave, now))
                )
        for wave, numbers in flat_per_row(cols, "finished_count", "finished_index"):
            at = start_of.get(wave, now)
            self._finishes += [(wave, at, rank_id, pid, idx) for idx in numbers]
        self._blocks.append(
            (rank_id, first_wave, pid, last_wave, block_start, len(cols.wave), encode(cols))
        )

    def pending(self) -> bool:
        return bool(self._names or self._finishes or self._blocks)

    def flush(self, conn: sqlite3.Connection) -> None:
        """Write what `collect` gathered (inside the caller's transaction)."""
        names, finishes, blocks = self._names, self._finishes, self._blocks
        self._names, self._finishes, self._blocks = [], [], []
        conn.executemany("INSERT OR IGNORE INTO requests VALUES (?,?,?,?,?,?,?,?,NULL,NULL)", names)
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

    def discard(self) -> None:
        """A failed write: forget what it collected."""
        self._names, self._finishes, self._blocks = [], [], []

    def forget_drops(self, engine: str) -> int:
        """Drop counts of an engine that has left (telemetry/crossrank/roster.py); how many processes."""
        with self._lock:
            gone = [process for process in self._worker_drops if process[1] == engine]
            for process in gone:
                del self._worker_drops[process]
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


class RequestMetrics(Collector):
    """Membership the workers shed (their buffer full, names forgotten), on /metrics."""

    def __init__(self, writer: RequestWriter | None = None) -> None:
        self.writer = writer

    def collect(self):
        family = CounterMetricFamily(
            "ascend_guard_request_membership_dropped",
            "Request membership the workers shed: rows (a wave's requests; the worker's buffer "
            "was full) and names (requests forgotten unfinished past the worker's cap). Their "
            "waves' request traces lack those entries.",
            labels=("engine", "dp", "tp", "pp", "kind"),
        )
        drops = self.writer.drops() if self.writer is not None else {}
        for labels, (rows, names) in sorted(drops.items()):
            family.add_metric([*labels, "rows"], float(rows))
            family.add_metric([*labels, "names"], float(names))
        yield family

    def forget(self, engine: str) -> int:
        """An engine left: its series go with the others (`roster.forget_series`)."""
        return self.writer.forget_drops(engine) if self.writer is not None else 0


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

    @property
    def trace_hex(self) -> str:
        return format_trace_id(self.trace_id)


_SELECT = (
    "SELECT q.rank, q.pid, q.idx, q.request_id, q.trace_hi, q.trace_lo, q.first_wave, "
    "q.start_ns, q.finished_wave, q.end_ns, u.run_id, r.engine, r.dp, r.pp, r.node "
    "FROM requests q JOIN ranks r ON r.id = q.rank JOIN runs u ON u.id = r.run"
)


def _row(row) -> RequestRow:
    hi, lo = row[4] % 2**64, row[5] % 2**64
    return RequestRow(row[0], row[1], row[2], row[3], hi << 64 | lo, *row[6:])


def _has_tables(conn: sqlite3.Connection) -> bool:
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
    if not text or not _has_tables(conn):
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
        rows = conn.execute(
            f"{_SELECT} WHERE {clause}{extra} ORDER BY q.start_ns DESC LIMIT ?",
            (value, *params, MAX_MATCHES),
        ).fetchall()
        if rows:
            return [_row(r) for r in rows]
    return []


def requests_of_trace(conn: sqlite3.Connection, trace_id: int) -> list[RequestRow]:
    if not _has_tables(conn):
        return []
    hi, lo = _halves(trace_id)
    rows = conn.execute(f"{_SELECT} WHERE q.trace_hi = ? AND q.trace_lo = ?", (hi, lo))
    return [_row(r) for r in rows]


@dataclasses.dataclass
class RequestWave:
    """One wave one request ran in, on one PP stage."""

    wave: int
    pp: int
    scheduled: int
    sampled: int  # -1: not known (an async output not counted)
    preempted: bool
    kind: str = "decode"  # prefill | decode
    recompute: bool = False  # a prefill after a preemption
    start_ns: int = 0
    end_ns: int = 0


def _blocks(conn: sqlite3.Connection, rank: int, pid: int, first: int, last: int | None):
    sql = (
        "SELECT columns FROM request_blocks WHERE rank = ? AND pid = ? AND last_wave >= ?"
        + (" AND first_wave <= ?" if last is not None else "")
        + " ORDER BY first_wave"
    )
    params: list = [rank, pid, first] + ([last] if last is not None else [])
    for (blob,) in conn.execute(sql, params):
        yield decode(blob)


def request_waves(conn: sqlite3.Connection, request: RequestRow) -> list[RequestWave]:
    """The waves one request ran in (on its stage), in wave order, with prefill/decode told
    apart: waves up to and including the first that sampled are prefill, and again after
    each preemption (recompute)."""
    out: dict[int, RequestWave] = {}
    preempted_at: set[int] = set()
    last = request.finished_wave
    for cols in _blocks(conn, request.rank, request.pid, request.first_wave, last):
        found = entries(cols)
        hit = np.flatnonzero(found.index == request.idx)
        for i in hit:
            wave = int(found.wave[i])
            if last is not None and wave >= last:
                continue
            out[wave] = RequestWave(
                wave, request.pp, int(found.scheduled[i]), int(found.sampled[i]), False
            )
        for wave, numbers in flat_per_row(cols, "preempted_count", "preempted_index"):
            if request.idx in numbers:
                preempted_at.add(wave)
    waves = [out[w] for w in sorted(out)]
    prefill, recompute = True, False
    marks = sorted(preempted_at)  # the wave a preemption was seen at (its own, or its resume)
    before = 0
    for item in waves:
        if any(before < mark <= item.wave for mark in marks):
            item.preempted = True  # the first wave back after it
            prefill, recompute = True, True
        before = item.wave
        item.kind = "prefill" if prefill else "decode"
        item.recompute = recompute and prefill
        if item.sampled > 0:
            prefill = recompute = False
    _wave_times(conn, request, waves)
    return waves


def _wave_times(conn: sqlite3.Connection, request: RequestRow, waves: list[RequestWave]) -> None:
    """Start and end of each wave on the request's rank (from its wave blocks)."""
    if not waves:
        return
    from telemetry.store import records as store

    wanted = {w.wave: w for w in waves}
    lo, hi = waves[0].wave, waves[-1].wave
    for (blob,) in conn.execute(
        "SELECT columns FROM wave_blocks WHERE rank = ? AND first_wave <= ? AND last_wave >= ?",
        (request.rank, hi, lo),
    ):
        cols = store.decode_waves(blob)
        for i, number in enumerate(cols.wave):
            item = wanted.get(number)
            if item is not None:
                item.start_ns = cols.start_unix_nano[i]
                item.end_ns = rank_end_ns(cols, i)


@dataclasses.dataclass
class RequestTrace:
    """One request's trace: its stages' rows, the waves it ran in, and its spans."""

    trace_id: int
    requests: list[RequestRow]
    waves: list[RequestWave]
    spans: list[Span]

    @property
    def request_id(self) -> str:
        return self.requests[0].request_id

    def sampled_tokens(self) -> int:
        """Tokens sampled for the request (last PP stage), unknown waves left out."""
        last = max((w.pp for w in self.waves), default=0)
        return sum(w.sampled for w in self.waves if w.pp == last and w.sampled > 0)

    def scheduled_tokens(self) -> int:
        first = min((w.pp for w in self.waves), default=0)
        return sum(w.scheduled for w in self.waves if w.pp == first)


def build_trace(conn: sqlite3.Connection, rows: Sequence[RequestRow]) -> RequestTrace | None:
    """The trace of one request from its stages' rows (all with one trace id)."""
    if not rows:
        return None
    rows = sorted(rows, key=lambda r: r.pp)
    head = rows[0]
    trace_id = head.trace_id
    waves: list[RequestWave] = []
    for row in rows:
        waves += request_waves(conn, row)
    waves.sort(key=lambda w: (w.wave, w.pp))
    starts = [w.start_ns for w in waves if w.start_ns] or [head.start_ns]
    ends = [w.end_ns for w in waves if w.end_ns]
    finished = [r.end_ns for r in rows if r.end_ns]
    start = min(starts)
    end = max([*ends, *finished, start])
    root_id = request_span_id(trace_id)
    common = {
        schema.ATTR_RUN: head.run_id,
        schema.ATTR_ENGINE: head.engine,
        schema.ATTR_DP: head.dp,
        ATTR_REQUEST: head.request_id,
    }
    last_pp = max((w.pp for w in waves), default=0)
    first_pp = min((w.pp for w in waves), default=0)
    root_attrs = {
        **common,
        schema.attr("request.waves"): len({w.wave for w in waves}),
        schema.attr("request.prefill_waves"): sum(
            1 for w in waves if w.kind == "prefill" and w.pp == first_pp
        ),
        schema.attr("request.scheduled_tokens"): sum(
            w.scheduled for w in waves if w.pp == first_pp
        ),
        schema.attr("request.sampled_tokens"): sum(
            w.sampled for w in waves if w.pp == last_pp and w.sampled > 0
        ),
        schema.attr("request.preemptions"): sum(
            1 for w in waves if w.preempted and w.pp == first_pp
        ),
        schema.attr("request.finished"): all(r.finished_wave is not None for r in rows),
    }
    if waves:
        root_attrs[schema.attr("request.first_wave")] = waves[0].wave
        root_attrs[schema.attr("request.last_wave")] = waves[-1].wave
    spans = [
        Span(trace_id, root_id, None, REQUEST_SPAN, start, end, head.run_id, head.engine,
             waves[0].wave if waves else head.first_wave, head.dp, attributes=root_attrs)
    ]  # fmt: skip
    for item in waves:
        attrs = {
            **common,
            schema.ATTR_WAVE: item.wave,
            schema.ATTR_PP: item.pp,
            schema.attr("request.scheduled_tokens"): item.scheduled,
            schema.attr("request.preempted"): item.preempted,
            schema.attr("request.recompute"): item.recompute,
        }
        if item.sampled >= 0:
            attrs[schema.attr("request.sampled_tokens")] = item.sampled
        link = {
            "trace_id": wave_trace_id(head.run_id, item.wave, head.dp),
            "span_id": wave_span_id(head.run_id, item.wave, head.dp),
            "attributes": {schema.ATTR_WAVE: item.wave},
        }
        spans.append(
            Span(trace_id, request_wave_span_id(trace_id, item.wave, item.pp), root_id, item.kind,
                 item.start_ns or start, item.end_ns or item.start_ns or start, head.run_id,
                 head.engine, item.wave, head.dp, None, item.pp, attributes=attrs, links=[link])
        )  # fmt: skip
    for incident in _incidents(conn, head):
        span = incident_span(incident)
        span.trace_id = trace_id
        span.span_id = request_incident_span_id(trace_id, incident["id"])
        span.parent_id = root_id
        span.attributes[ATTR_REQUEST] = head.request_id
        span.links = [{"trace_id": wave_trace_id(head.run_id, span.wave, head.dp),
                       "span_id": wave_span_id(head.run_id, span.wave, head.dp)}]  # fmt: skip
        spans.append(span)
    spans.sort(key=lambda s: (s.start_ns, s.name != REQUEST_SPAN, s.name))
    return RequestTrace(trace_id, list(rows), waves, spans)


def _incidents(conn: sqlite3.Connection, request: RequestRow) -> list[sqlite3.Row]:
    try:
        return conn.execute(
            "SELECT * FROM incidents WHERE request_id = ? AND run_id = ? AND engine = ? "
            "AND (dp = ? OR dp IS NULL) ORDER BY time_ns",
            (request.request_id, request.run_id, request.engine, request.dp),
        ).fetchall()
    except sqlite3.OperationalError:
        return []


def group_by_trace(rows: Iterable[RequestRow]) -> list[list[RequestRow]]:
    groups: dict[int, list[RequestRow]] = {}
    for row in rows:
        groups.setdefault(row.trace_id, []).append(row)
    return list(groups.values())


def load_request_trace(conn: sqlite3.Connection, trace_id: str) -> list[Span]:
    """Every span of one request trace by id ([] when no request has that id)."""
    text = trace_id.strip().lower()
    if not re.fullmatch(r"[0-9a-f]{32}", text):
        return []
    built = build_trace(conn, requests_of_trace(conn, int(text, 16)))
    return built.spans if built is not None else []


def request_traces(
    conn: sqlite3.Connection, text: str, *, run_id: str | None = None, engine: str | None = None
) -> list[RequestTrace]:
    """The traces of the requests a user's id names (see `find_requests`), newest first."""
    out = []
    for group in group_by_trace(find_requests(conn, text, run_id=run_id, engine=engine)):
        built = build_trace(conn, requests_of_trace(conn, group[0].trace_id))
        if built is not None:
            out.append(built)
    return out


# -- wave spans link to their requests ------------------------------------------------------------
MAX_LINKS = 1024  # links added to one wave span


def link_wave_spans(conn: sqlite3.Connection, spans: list[Span]) -> None:
    """Add to each `wave` root span links to the request traces of the requests it ran."""
    if not spans or not _has_tables(conn):
        return
    from telemetry.store import records as store

    for span in spans:
        if span.name != "wave" or span.parent_id is not None:
            continue
        ranks = store.ranks(
            conn,
            "runs.run_id = ? AND ranks.engine = ? AND ranks.dp = ? AND ranks.tp = 0",
            (span.run_id, span.engine, span.dp if span.dp is not None else 0),
        )
        seen: set[int] = set()
        for rank in ranks:
            for trace, req_id in _requests_in_wave(conn, rank.id, span.wave):
                if trace in seen or len(seen) >= MAX_LINKS:
                    continue
                seen.add(trace)
                span.links.append(
                    {
                        "trace_id": trace,
                        "span_id": request_span_id(trace),
                        "attributes": {ATTR_REQUEST: req_id},
                    }  # fmt: skip
                )


def _requests_in_wave(conn: sqlite3.Connection, rank_id: int, wave: int) -> list[tuple[int, str]]:
    found: list[tuple[int, int]] = []  # (pid, idx)
    for pid, blob in conn.execute(
        "SELECT pid, columns FROM request_blocks WHERE rank = ? AND first_wave <= ? "
        "AND last_wave >= ? ORDER BY first_wave DESC LIMIT 8",
        (rank_id, wave, wave),
    ):
        got = entries(decode(blob))
        found += [(pid, int(i)) for i in got.index[got.wave == wave]]
    out = []
    for pid, idx in found:
        row = conn.execute(
            "SELECT trace_hi, trace_lo, request_id FROM requests WHERE rank = ? AND pid = ? "
            "AND idx = ?",
            (rank_id, pid, idx),
        ).fetchone()
        if row is not None:
            out.append(((row[0] % 2**64) << 64 | (row[1] % 2**64), row[2]))
    return out


def spans_in_range(
    conn: sqlite3.Connection, start_ns: int, end_ns: int, request_id: str | None, limit: int
) -> Iterable[list[Span]]:
    """Request traces (their spans) whose request started in [start_ns, end_ns], newest
    first; only `request_id`'s (exact) when given. For TraceQL (telemetry/traceql/search.py)."""
    if not _has_tables(conn):
        return
    where = "q.start_ns >= ? AND q.start_ns <= ?"
    params: list[Any] = [start_ns, end_ns]
    if request_id is not None:
        where += " AND q.request_id = ?"
        params.append(request_id)
    rows = conn.execute(
        f"SELECT DISTINCT q.trace_hi, q.trace_lo FROM requests q WHERE {where} "
        "ORDER BY q.start_ns DESC LIMIT ?",
        (*params, limit),
    ).fetchall()
    for hi, lo in rows:
        built = build_trace(conn, requests_of_trace(conn, (hi % 2**64) << 64 | (lo % 2**64)))
        if built is not None:
            yield built.spans
