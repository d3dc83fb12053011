"""Span status, slow-call spans, wave-less incidents, block histograms and the block schema of
older stores, over a store written by the real writer sink and incident ledger."""

from __future__ import annotations

import sqlite3

import numpy as np
import pytest
from opentelemetry.proto.trace.v1 import trace_pb2

from telemetry import store
from telemetry.export.otlp import to_otlp
from telemetry.spans.query import load_trace
from telemetry.store import block_summary
from telemetry.store.incidents import IncidentLedger
from telemetry.traceql import metrics_range, search, trace_spans
from telemetry.wire.proto import guard_pb2
from telemetry.wire.trace_ids import format_span_id, format_trace_id, phase_span_id, wave_trace_id
from tests.support.trace_store import (
    MS,
    add_incident,
    batch_item,
    collective_wave,
    rank_info,
    wave_record,
    write_store,
)

WAVES = 48
PER_BATCH = 4
STEP_NS = 10 * MS
BASE = 1_796_000_000 * 10**9
START, END = BASE, BASE + (WAVES + 2) * STEP_NS
SLOW_CALL_WAVE = 3  # tp1's all_reduce has one slow call of 55 ms
INCIDENT_WAVE = 5  # tp1 raises an incident


def _start(wave: int) -> int:
    return BASE + wave * STEP_NS


def _execute_ns(tp: int, wave: int) -> int:
    return 2 * MS + (wave * 7919 + tp * 104_729) % (3 * MS)  # spread over 2..5 ms


def _tid(wave: int, run: str = "run-t") -> str:
    return format_trace_id(wave_trace_id(run, wave, 0))


def _sidecar_incident(path) -> None:
    """An incident the sidecar raised itself, tied to no wave and no rank."""
    ledger = IncidentLedger(str(path), retention_s=10**9)
    ledger.add(
        "eng",
        None,
        guard_pb2.Incident(schema_version=1, id="inc-sidecar", type="hang_verdict",
                           severity="critical", wave=0, time_unix_nano=_start(7),
                           summary="a sidecar verdict", evidence_json="{}"),
    )  # fmt: skip
    ledger.close()


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    path = tmp_path_factory.mktemp("status") / "store.db"
    items = []
    for tp in (0, 1):
        for first in range(1, WAVES + 1, PER_BATCH):
            numbers = range(first, first + PER_BATCH)
            waves = [wave_record(n, _start(n), _execute_ns(tp, n)) for n in numbers]
            colls = []
            for n in numbers:
                cw = collective_wave(n, _start(n) + MS, 1 * MS)
                if tp == 1 and n == SLOW_CALL_WAVE:
                    cw.stats[0].host_ns = 60 * MS
                    cw.slow_calls.add(op="all_reduce", group="tp", backend="gloo",
                                      dtype="float32", seq=4 * n - 2, bytes=1024,
                                      start_unix_nano=_start(n) + 2 * MS, host_ns=55 * MS)  # fmt: skip
                colls.append(cw)
            items.append(batch_item(rank_info(tp), waves, colls))
    write_store(path, items)
    add_incident(path, rank_info(1), wave=INCIDENT_WAVE, at=_start(INCIDENT_WAVE) + MS,
                 request_id="req-1", kind="nan_logits")  # fmt: skip
    _sidecar_incident(path)
    return path


@pytest.fixture
def conn(path):
    conn = store.connect(path, readonly=True)
    yield conn
    conn.close()


def _names(match) -> list[tuple[str, int | None]]:
    return sorted((s.name, s.tp) for s in match.spans)


def test_status_error_is_on_the_incident_its_rank_and_its_wave(conn):
    found = search(conn, "{ status = error }", START, END, spans_per_spanset=None)
    by_trace = {m.trace_id: _names(m) for m in found}
    assert by_trace == {
        _tid(INCIDENT_WAVE): [("incident:nan_logits", 1), ("rank", 1), ("wave", None)],
        _tid(0, run=""): [("incident:hang_verdict", None)],
    }
    # found from the block columns too, when the filter names a rank span
    (rank,) = search(conn, '{ status = error && name = "rank" }', START, END)
    assert rank.trace_id == _tid(INCIDENT_WAVE) and _names(rank) == [("rank", 1)]
    assert search(conn, '{ status = error && name = "execute_model" }', START, END) == []
    unset = search(conn, '{ status = unset && name = "rank" && .tp = 1 }', START, END, limit=99)
    assert len(unset) == WAVES - 1
    # the same status on the spans a trace loads, and over OTLP
    spans = load_trace(conn, _tid(INCIDENT_WAVE))
    assert spans == trace_spans(conn, _tid(INCIDENT_WAVE))
    errors = {(s.name, s.tp) for s in spans if s.status == "error"}
    assert errors == {("incident:nan_logits", 1), ("rank", 1), ("wave", None)}
    codes = {s.name: to_otlp(s).status.code for s in spans if s.tp in (1, None)}
    assert codes["rank"] == codes["wave"] == trace_pb2.Status.STATUS_CODE_ERROR
    assert codes["execute_model"] == trace_pb2.Status.STATUS_CODE_UNSET


def test_an_incident_tied_to_no_wave_is_in_its_runs_wave_zero_trace(conn):
    (row,) = conn.execute("SELECT trace_id FROM incidents WHERE wave = 0").fetchall()
    assert row["trace_id"] == _tid(0, run="")
    (span,) = trace_spans(conn, row["trace_id"])
    assert span.name == "incident:hang_verdict" and span.status == "error"
    assert load_trace(conn, row["trace_id"]) == [span]
    (found,) = search(conn, '{ name = "incident:hang_verdict" }', START, END)
    assert found.trace_id == row["trace_id"]


def test_slow_calls_are_spans_under_their_collective(conn):
    query = '{ name = "slow_call:all_reduce" && duration > 50ms && span.ascend_guard.tp = 1 }'
    (found,) = search(conn, query, START, END)
    assert found.trace_id == _tid(SLOW_CALL_WAVE)
    (call,) = found.spans
    assert call.duration_ns == 55 * MS and call.start_ns == _start(SLOW_CALL_WAVE) + 2 * MS
    assert call.attributes["ascend_guard.collective.seq"] == 4 * SLOW_CALL_WAVE - 2
    spans = load_trace(conn, _tid(SLOW_CALL_WAVE))
    (parent,) = [s for s in spans if s.span_id == call.parent_id]
    assert (parent.name, parent.tp) == ("collective:all_reduce", 1)
    assert parent.span_id == phase_span_id(
        "run-t", SLOW_CALL_WAVE, 0, 1, 0, "collective/all_reduce/tp"
    )
    assert format_span_id(call.span_id) in {s.span_hex for s in spans}
    # no other wave or rank has one; the collective itself is found by its aggregate
    (only,) = search(conn, '{ name =~ "slow_call:.*" }', START, END, limit=99)
    assert only.trace_id == found.trace_id and only.spans == found.spans
    (slow,) = search(conn, '{ name = "collective:all_reduce" && duration > 50ms }', START, END)
    assert slow.trace_id == _tid(SLOW_CALL_WAVE)
    # the collective block's slowest (op, group) time is stored, so other blocks are skipped
    (host,) = conn.execute(
        "SELECT MAX(max_host_ns) FROM collective_blocks WHERE first_wave <= ? AND last_wave >= ?",
        (SLOW_CALL_WAVE, SLOW_CALL_WAVE),
    ).fetchone()
    assert host == 60 * MS


def _exact_durations(conn, tp: int, lo: int, hi: int) -> list[float]:
    out = []
    for wave in range(1, WAVES + 1):
        for s in load_trace(conn, _tid(wave)):
            if s.name == "execute_model" and s.tp == tp and lo <= s.start_ns < hi:
                out.append(s.duration_ns / 1e9)
    return out


def test_range_queries_read_block_histograms_for_whole_blocks(conn, monkeypatch):
    decoded = []
    real = store.block_columns
    monkeypatch.setattr(store, "block_columns", lambda c, b: decoded.append(b) or real(c, b))
    step = 16 * STEP_NS  # 4 blocks of 4 waves per step; blocks across a step edge decoded
    q = '{ name = "execute_model" } | quantile_over_time(duration, .5, .9) by (.tp)'
    series = metrics_range(conn, q, START, END, step)
    blocks = conn.execute("SELECT COUNT(*) FROM wave_blocks").fetchone()[0]
    assert 0 < len(decoded) < blocks / 2, (len(decoded), blocks)
    exact = metrics_range(conn, q, START, END, step, summaries=False)
    assert [s.labels for s in series] == [s.labels for s in exact]
    base = START - START % step
    for got, want in zip(series, exact, strict=True):
        assert [t for t, _ in got.samples] == [t for t, _ in want.samples]
        for (t, a), (_, b) in zip(got.samples, want.samples, strict=True):
            assert abs(a - b) <= block_summary.RELATIVE_WIDTH * b, (got.labels, t, a, b)
            values = _exact_durations(conn, got.labels[".tp"], t, t + step)
            assert b == pytest.approx(np.quantile(values, got.labels["p"]))
            assert (t - base) % step == 0
    counts = metrics_range(conn, '{ name = "rank" } | count_over_time() by (.tp)', START, END, step)
    assert [sum(v for _, v in s.samples) for s in counts] == [WAVES, WAVES]
    # a range that starts and ends inside blocks: those are decoded, counts stay exact
    lo, hi = _start(6) + STEP_NS // 2, _start(WAVES - 5) + STEP_NS // 2
    q = '{ name = "execute_model" } | count_over_time() by (.tp)'
    for got, want in zip(metrics_range(conn, q, lo, hi, step),
                         metrics_range(conn, q, lo, hi, step, summaries=False), strict=True):  # fmt: skip
        assert got == want
        assert sum(v for _, v in got.samples) == WAVES - 11


# the columns the writer adds to an earlier version's block tables
OLD_STORE_LACKS = tuple(column for _, column, _ in store.ADDED_COLUMNS)


def test_a_store_written_before_the_block_summaries_is_brought_up_and_read(tmp_path, path):
    """A store whose block tables lack the histogram, drop-count and collective columns (an
    earlier version's): the writer adds them, old rows read as before (decoded, no histogram),
    and a restart gap after an old block is counted whole (the worker's drops before it are not
    known, so none are subtracted)."""
    old = tmp_path / "old.db"
    src = sqlite3.connect(path)
    dst = sqlite3.connect(old)
    for (sql,) in src.execute(
        "SELECT sql FROM sqlite_master WHERE type = 'table' AND name IN "
        "('runs', 'ranks', 'wave_blocks', 'collective_blocks', 'slow_calls')"
    ):
        for column in OLD_STORE_LACKS:
            sql = "\n".join(line for line in sql.split("\n") if column not in line or "NOT NULL" in line)  # fmt: skip
        dst.execute(sql)
    for table, columns in (
        ("runs", "*"), ("ranks", "*"), ("slow_calls", "*"),
        ("wave_blocks", "rank, first_wave, last_wave, start_ns, end_ns, waves, max_step_ns, columns"),
        ("collective_blocks", "rank, first_wave, last_wave, start_ns, waves, columns"),
    ):  # fmt: skip
        rows = src.execute(f"SELECT {columns} FROM {table}").fetchall()
        if rows:
            dst.executemany(f"INSERT INTO {table} VALUES ({','.join('?' * len(rows[0]))})", rows)
    dst.commit()
    dst.close()
    src.close()
    assert "rank_hist" not in {
        r[1] for r in sqlite3.connect(old).execute("PRAGMA table_info(wave_blocks)")
    }
    sink = store.Store(old)  # the sidecar opening it
    resumed = batch_item(rank_info(0), [wave_record(WAVES + 11, _start(WAVES + 11), 2 * MS)])
    resumed.batch.dropped_total = 7
    sink.write_started([resumed])
    assert sink.restart_gap_waves == 10  # waves WAVES+1 .. WAVES+10, nothing subtracted
    sink.close()
    conn = store.connect(old, readonly=True)
    columns = {r[1] for r in conn.execute("PRAGMA table_info(collective_blocks)")}
    assert {"end_ns", "max_host_ns"} <= columns
    assert "dropped_before" in {r[1] for r in conn.execute("PRAGMA table_info(wave_blocks)")}
    new = store.connect(path, readonly=True)
    for wave in (1, SLOW_CALL_WAVE, WAVES):
        assert load_trace(conn, _tid(wave)) == [
            s for s in load_trace(new, _tid(wave)) if not s.name.startswith("incident:")
        ]
    q = '{ name = "execute_model" } | quantile_over_time(duration, .9) by (.tp)'
    assert metrics_range(conn, q, START, END, 16 * STEP_NS) == metrics_range(
        new, q, START, END, 16 * STEP_NS, summaries=False
    )
    (found,) = search(conn, '{ name = "collective:all_reduce" && duration > 50ms }', START, END)
    assert found.trace_id == _tid(SLOW_CALL_WAVE)
    conn.close()
    new.close()
