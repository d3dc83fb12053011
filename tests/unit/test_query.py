"""Query parsing, the SQLite span store built by the real tracer, and the query/trace CLI."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from telemetry import cli
from telemetry.proto import guard_pb2
from telemetry.query import (
    QueryError,
    SpanQuery,
    parse_duration_ns,
    parse_rank,
    parse_time_ns,
    span_tree,
)
from telemetry.store import SqliteSpanExporter
from telemetry.traces import (
    WaveTracer,
    build_provider,
    format_trace_id,
    lockstep_links,
    rank_span_id,
    wave_span_id,
    wave_trace_id,
)

MS = 1_000_000
NOW = 1_750_000_000 * 10**9

# -- argument parsing -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "ns"),
    [
        ("250ns", 250),
        ("250us", 250_000),
        ("250µs", 250_000),
        ("5ms", 5 * MS),
        (" 7 ms ", 7 * MS),
        ("1.5s", 1_500_000_000),
        ("0.25s", 250 * MS),
        ("10m", 600 * 10**9),
        ("2h", 7200 * 10**9),
        ("1d", 86400 * 10**9),
        ("0ms", 0),
    ],
)
def test_parse_duration_good(text, ns):
    assert parse_duration_ns(text, "--min-duration") == ns


@pytest.mark.parametrize("text", ["5", "ms", "-5ms", "5 sec", "", "1e3ms", "5ms5", "five ms"])
def test_parse_duration_bad_names_argument_and_value(text):
    with pytest.raises(QueryError) as info:
        parse_duration_ns(text, "--min-duration")
    assert str(info.value).startswith("--min-duration: ")
    assert repr(text) in str(info.value)


def test_parse_duration_decimal_is_exact():
    assert parse_duration_ns("1.005s", "--min-duration") == 1_005_000_000


@pytest.mark.parametrize(
    ("text", "ns"),
    [
        ("now", NOW),
        (" now ", NOW),
        ("15m", NOW - 15 * 60 * 10**9),
        ("30s", NOW - 30 * 10**9),
        ("1700000000", 1_700_000_000 * 10**9),
        ("2024-01-01T00:00:00", 1_704_067_200 * 10**9),  # naive = UTC
        ("2024-01-01T01:00:00+01:00", 1_704_067_200 * 10**9),
        ("2024-01-01", 1_704_067_200 * 10**9),
    ],
)
def test_parse_time_good(text, ns):
    assert parse_time_ns(text, "--since", now_ns=NOW) == ns


def test_parse_time_fractional_unix_seconds():
    assert parse_time_ns("1700000000.5", "--until", now_ns=NOW) == pytest.approx(
        1_700_000_000_500_000_000, abs=1000
    )


def test_parse_time_relative_to_the_clock_by_default():
    before = time.time_ns()
    value = parse_time_ns("1h", "--since")
    after = time.time_ns()
    assert before - 3600 * 10**9 <= value <= after - 3600 * 10**9


@pytest.mark.parametrize("text", ["yesterday", "2024-13-01", "15 minutes", "nan", ""])
def test_parse_time_bad_names_argument_and_value(text):
    with pytest.raises(QueryError) as info:
        parse_time_ns(text, "--since", now_ns=NOW)
    assert str(info.value).startswith("--since: ")
    assert repr(text.strip()) in str(info.value)


@pytest.mark.parametrize("text", ["inf", "1e400"])
def test_parse_time_infinite_is_a_query_error(text):
    with pytest.raises(QueryError, match=r"--since: "):
        parse_time_ns(text, "--since", now_ns=NOW)


@pytest.mark.parametrize(
    ("text", "rank"),
    [
        ("tp=1", {"tp": 1}),
        ("dp=0,tp=1,pp=0", {"dp": 0, "tp": 1, "pp": 0}),
        (" TP = 3 , pp=2", {"tp": 3, "pp": 2}),
        ("0/1/0", {"dp": 0, "tp": 1, "pp": 0}),
        ("12/34/5", {"dp": 12, "tp": 34, "pp": 5}),
    ],
)
def test_parse_rank_good(text, rank):
    assert parse_rank(text) == rank


@pytest.mark.parametrize(
    ("text", "part"),
    [
        ("tp1", "tp1"),
        ("ep=1", "ep=1"),
        ("tp=-1", "tp=-1"),
        ("tp=x", "tp=x"),
        ("tp=1,pp", "pp"),
        ("0/1", "0/1"),
        ("", ""),
    ],
)
def test_parse_rank_bad_names_argument_and_part(text, part):
    with pytest.raises(QueryError) as info:
        parse_rank(text)
    assert str(info.value).startswith("--rank: ")
    assert repr(part) in str(info.value)


# -- SpanQuery.sql --------------------------------------------------------------------------


def test_span_query_without_filters():
    sql, params = SpanQuery().sql()
    assert "WHERE" not in sql
    assert sql.endswith("ORDER BY duration_ns DESC LIMIT ?")
    assert params == [20]


def test_span_query_all_filters_in_order():
    query = SpanQuery(
        since_ns=1, until_ns=2, min_duration_ns=3, rank={"dp": 0, "tp": 1}, name="rank",
        run_id="r", engine="e", wave=4, sort="start", limit=5,
    )  # fmt: skip
    sql, params = query.sql()
    where = sql.split(" WHERE ", 1)[1].split(" ORDER BY ")[0]
    assert where.split(" AND ") == [
        "start_ns >= ?", "start_ns <= ?", "duration_ns >= ?", "dp = ?", "tp = ?", "name = ?",
        "run_id = ?", "engine = ?", "wave = ?",
    ]  # fmt: skip
    assert params == [1, 2, 3, 0, 1, "rank", "r", "e", 4, 5]
    assert sql.endswith("ORDER BY start_ns DESC LIMIT ?")


@pytest.mark.parametrize(
    ("query", "fragment"),
    [
        (SpanQuery(name="span"), "--name: 'span'"),
        (SpanQuery(sort="slowest"), "--sort: 'slowest'"),
        (SpanQuery(limit=0), "--limit: 0"),
        (SpanQuery(since_ns=5, until_ns=4), "--since is later than --until"),
    ],
)
def test_span_query_validation(query, fragment):
    with pytest.raises(QueryError) as info:
        query.sql()
    assert fragment in str(info.value)


def _row(span_id, parent, start, name="rank", dp=None, tp=None, pp=None):
    return {"span_id": span_id, "parent_id": parent, "start_ns": start, "name": name, "dp": dp,
            "tp": tp, "pp": pp}  # fmt: skip


def test_span_tree_depth_first_by_start_then_rank():
    rows = [
        _row("c2", "r1", 15, "sample_tokens"),
        _row("r1", "w", 10, tp=1),
        _row("c1", "r1", 10, "execute_model"),
        _row("r0", "w", 10, tp=0),
        _row("orphan", "gone", 5),
        _row("w", None, 10, "wave"),
        _row("c0", "r0", 10, "execute_model"),
    ]
    order = [(depth, row["span_id"]) for depth, row in span_tree(rows)]
    assert order == [
        (0, "orphan"),  # its parent is not stored: a root, and it starts first
        (0, "w"),
        (1, "r0"),
        (2, "c0"),
        (1, "r1"),
        (2, "c1"),
        (2, "c2"),
    ]


# -- a store produced by the real exporter and tracer ---------------------------------------


def rank_info(tp: int, run_id: str = "run-q", pp: int = 0) -> guard_pb2.RankInfo:
    return guard_pb2.RankInfo(
        run_id=run_id, engine="eng", dp_rank=0, tp_rank=tp, pp_rank=pp, dp_size=1, tp_size=2,
        pp_size=1, node="n1", pid=100 + tp,
    )  # fmt: skip


def wave_record(wave, start, execute_ms, sample_ms=1, sampled=True, reqs=2):
    return guard_pb2.WaveRecord(
        wave=wave, start_unix_nano=start, execute_ns=execute_ms * MS, sample_ns=sample_ms * MS,
        sample_offset_ns=execute_ms * MS + 100_000, num_reqs=reqs, decode_reqs=reqs, decode_tokens=reqs,
        sampled_tokens=reqs, sampled=sampled,
    )  # fmt: skip


def build_store(path: Path, waves, **exporter_kwargs) -> SqliteSpanExporter:
    """waves: (rank, WaveRecord) pairs, written through a provider that is then shut down."""
    exporter = SqliteSpanExporter(path, **exporter_kwargs)
    provider, ids = build_provider([exporter], "node")
    tracer = WaveTracer(provider, ids)
    for rank, wave in waves:
        tracer.record(rank, "eng", wave)
    provider.shutdown()
    return exporter


@pytest.fixture
def store(tmp_path):
    """3 waves from tp0 and tp1; tp1 is slow in wave 2."""
    start = time.time_ns() - 60 * 10**9
    waves = []
    for n in (1, 2, 3):
        t = start + n * 10**9
        waves.append((rank_info(0), wave_record(n, t, 5)))
        waves.append((rank_info(1), wave_record(n, t, 80 if n == 2 else 6)))
    path = tmp_path / "store.db"
    build_store(path, waves)
    return path


def _rows(path, sql="SELECT * FROM spans", params=()):
    conn = sqlite3.connect(path)
    conn.row_factory = sqlite3.Row
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def _table_rows(out: str) -> list[str]:
    lines = out.splitlines()
    dash = next(i for i, line in enumerate(lines) if line.startswith("---"))
    rows = []
    for line in lines[dash + 1 :]:
        if not line.strip():
            break
        rows.append(line)
    return rows


def test_store_holds_one_trace_per_wave_with_rank_spans(store):
    rows = _rows(store)
    # per wave: 1 wave span (from tp0) + 2 rank spans + 2 execute + 2 sample
    assert len(rows) == 3 * 7
    assert len({r["trace_id"] for r in rows}) == 3
    for n in (1, 2, 3):
        trace = [r for r in rows if r["wave"] == n]
        assert {r["trace_id"] for r in trace} == {format_trace_id(wave_trace_id("run-q", n, 0))}
        ranks = [r for r in trace if r["name"] == "rank"]
        assert sorted(r["tp"] for r in ranks) == [0, 1]
        (root,) = [r for r in trace if r["name"] == "wave"]
        assert root["span_id"] == format(wave_span_id("run-q", n, 0), "016x")
        for r in ranks:
            assert r["parent_id"] == root["span_id"]
            assert r["span_id"] == format(rank_span_id("run-q", n, 0, r["tp"], 0), "016x")


def test_cli_query_slowest_first(store, capsys):
    assert cli.main(["query", "--store", str(store), "--since", "1h"]) == 0
    out = capsys.readouterr().out
    rows = _table_rows(out)
    assert len(rows) == 20  # default --limit
    assert "dp0 tp1 pp0" in rows[0] and " rank " in rows[0]
    assert "81.100 ms" in rows[0]  # execute 80 ms, sample 1 ms starting 0.1 ms after it
    assert "execute_model" in rows[1] and "80.000 ms" in rows[1]
    trace = format_trace_id(wave_trace_id("run-q", 2, 0))
    assert rows[0].endswith(trace)
    assert f"ascend-guard trace {trace} --store {store}" in out


def test_cli_query_rank_filter(store, capsys):
    assert cli.main(["query", "--store", str(store), "--rank", "tp=1", "--limit", "100"]) == 0
    rows = _table_rows(capsys.readouterr().out)
    assert len(rows) == 9  # 3 waves x (rank, execute_model, sample_tokens)
    assert all("dp0 tp1 pp0" in row for row in rows)
    assert cli.main(["query", "--store", str(store), "--rank", "0/0/0", "--name", "rank"]) == 0
    rows = _table_rows(capsys.readouterr().out)
    assert len(rows) == 3 and all("dp0 tp0 pp0" in row for row in rows)


def test_cli_query_other_filters(store, capsys):
    assert cli.main(["query", "--store", str(store), "--min-duration", "50ms"]) == 0
    rows = _table_rows(capsys.readouterr().out)
    assert len(rows) == 2 and all("tp1" in r for r in rows)
    assert cli.main(["query", "--store", str(store), "--wave", "3", "--name", "wave"]) == 0
    rows = _table_rows(capsys.readouterr().out)
    assert len(rows) == 1 and " wave " in rows[0]
    assert cli.main(["query", "--store", str(store), "--since", "5s"]) == 0
    assert "no spans match" in capsys.readouterr().out
    assert cli.main(["query", "--store", str(store), "--run", "other"]) == 0
    assert "no spans match" in capsys.readouterr().out


def test_cli_trace_prints_the_tree(store, capsys):
    trace = format_trace_id(wave_trace_id("run-q", 2, 0))
    assert cli.main(["trace", trace.upper(), "--store", str(store)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert (
        lines[0].startswith(f"trace {trace}") and "run run-q" in lines[0] and "wave 2" in lines[0]
    )
    rows = [line.split("  +")[0].rstrip() for line in _table_rows(out)]
    assert rows == [
        "wave",
        "  └─ rank dp0 tp0 pp0",
        "    └─ execute_model",
        "    └─ sample_tokens",
        "  └─ rank dp0 tp1 pp0",
        "    └─ execute_model",
        "    └─ sample_tokens",
    ]
    assert "sampled_tokens=2" in out


@pytest.mark.parametrize("bad", ["xyz", "12345", "g" * 32])
def test_cli_trace_bad_id(store, capsys, bad):
    assert cli.main(["trace", bad, "--store", str(store)]) == 2
    err = capsys.readouterr().err
    assert "trace id" in err and repr(bad) in err


def test_cli_trace_unknown_id(store, capsys):
    assert cli.main(["trace", "0" * 31 + "1", "--store", str(store)]) == 1
    assert "is not in" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--since", "yesterday"], "--since: 'yesterday'"),
        (["--until", "later"], "--until: 'later'"),
        (["--min-duration", "5"], "--min-duration: '5'"),
        (["--rank", "tp1"], "--rank: 'tp1'"),
        (["--name", "step"], "--name: 'step'"),
        (["--sort", "fast"], "--sort: 'fast'"),
        (["--limit", "0"], "--limit: 0"),
    ],
)
def test_cli_query_bad_arguments_exit_2(store, capsys, args, fragment):
    assert cli.main(["query", "--store", str(store), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ascend-guard query: ")
    assert fragment in err


def test_cli_query_infinite_since_exits_2(store, capsys):
    assert cli.main(["query", "--store", str(store), "--since", "inf"]) == 2
    assert "--since: 'inf'" in capsys.readouterr().err


def test_cli_missing_store_exits_2(tmp_path, capsys):
    missing = tmp_path / "none.db"
    assert cli.main(["query", "--store", str(missing)]) == 2
    assert f"no trace store at {missing}" in capsys.readouterr().err
    assert cli.main(["trace", "0" * 32, "--store", str(missing)]) == 2
    assert not missing.exists()


# -- retention ------------------------------------------------------------------------------


def _prune_store(tmp_path, **kwargs):
    # waves 1..10, one second apart, ending at NOW; tp0 only: 4 spans per wave
    waves = [(rank_info(0), wave_record(n, NOW - (10 - n) * 10**9, 1)) for n in range(1, 11)]
    path = tmp_path / "prune.db"
    # prune_every_s huge: only the explicit prune() below deletes anything
    build_store(path, waves, prune_every_s=10**12, **kwargs)
    return path


def test_prune_by_age(tmp_path):
    path = _prune_store(tmp_path, retention_s=4.5)
    assert len(_rows(path)) == 40
    exporter = SqliteSpanExporter(path, retention_s=4.5, prune_every_s=10**12)
    removed = exporter.prune(now_ns=NOW)
    exporter.shutdown()
    rows = _rows(path)
    # waves 6..10 start within 4.5 s of NOW; waves 1..5 go
    assert removed == 20
    assert sorted({r["wave"] for r in rows}) == [6, 7, 8, 9, 10]
    assert min(r["start_ns"] for r in rows) >= NOW - 4_500_000_000


def test_prune_caps_max_spans_keeping_the_newest(tmp_path):
    path = _prune_store(tmp_path)
    exporter = SqliteSpanExporter(path, retention_s=10**9, max_spans=10, prune_every_s=10**12)
    removed = exporter.prune(now_ns=NOW)
    rows = _rows(path)
    assert removed == 30
    assert len(rows) == 10
    assert min(r["wave"] for r in rows) >= 8  # the oldest went first
    assert exporter.prune(now_ns=NOW) == 0
    exporter.shutdown()


def test_prune_nothing_to_do(tmp_path):
    path = _prune_store(tmp_path)
    exporter = SqliteSpanExporter(path, prune_every_s=10**12)
    assert exporter.prune(now_ns=NOW) == 0
    exporter.shutdown()
    assert len(_rows(path)) == 40


def test_export_prunes_by_itself(tmp_path):
    """With the default prune interval, exporting enforces retention against the real clock."""
    old = time.time_ns() - 3600 * 10**9
    waves = [
        (rank_info(0), wave_record(1, old, 1)),
        (rank_info(0), wave_record(2, time.time_ns(), 1)),
    ]
    path = tmp_path / "auto.db"
    build_store(path, waves, retention_s=60)
    assert {r["wave"] for r in _rows(path)} == {2}


def test_same_span_exported_twice_is_stored_once(tmp_path):
    wave = wave_record(1, NOW, 1)
    path = tmp_path / "dup.db"
    build_store(path, [(rank_info(0), wave)], prune_every_s=10**12)
    build_store(path, [(rank_info(0), wave)], prune_every_s=10**12)
    names = [r["name"] for r in _rows(path, "SELECT * FROM spans WHERE name IN ('wave', 'rank')")]
    assert sorted(names) == ["rank", "wave"]


# -- deterministic ids ----------------------------------------------------------------------


def test_wave_trace_id_is_deterministic_across_calls_and_processes():
    def ids() -> list[int]:
        return [
            wave_trace_id("run-a", 7, 1),
            wave_span_id("run-a", 7, 1),
            rank_span_id("run-a", 7, 1, 1, 0),
        ]

    here = ids()
    assert here == ids()
    code = (
        "from telemetry.traces import wave_trace_id, wave_span_id, rank_span_id\n"
        "print(wave_trace_id('run-a', 7, 1), wave_span_id('run-a', 7, 1),"
        " rank_span_id('run-a', 7, 1, 1, 0))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
        env={"PYTHONHASHSEED": "123", "PATH": ""},
    )
    assert proc.returncode == 0, proc.stderr
    assert [int(x) for x in proc.stdout.split()] == here


def test_ids_differ_between_waves_runs_replicas_and_ranks():
    assert wave_trace_id("run-a", 1, 0) != wave_trace_id("run-a", 2, 0)
    assert wave_trace_id("run-a", 1, 0) != wave_trace_id("run-b", 1, 0)
    # wave N of two DP engines (replicas) is two traces, with two root spans
    assert wave_trace_id("run-a", 1, 0) != wave_trace_id("run-a", 1, 1)
    assert wave_span_id("run-a", 1, 0) != wave_span_id("run-a", 1, 1)
    traces = {wave_trace_id("run-a", n, dp) for n in range(1, 1001) for dp in range(4)}
    assert len(traces) == 4000
    assert 0 < wave_trace_id("run-a", 1, 0) < 2**128
    assert 0 < wave_span_id("run-a", 1, 0) < 2**64
    spans = {
        rank_span_id("run-a", 1, dp, tp, pp)
        for dp in range(2)
        for tp in range(4)
        for pp in range(2)
    }
    assert len(spans) == 16
    assert not spans & {wave_span_id("run-a", 1, dp) for dp in range(2)}


def test_lockstep_links_name_the_other_dp_ranks_waves():
    links = lockstep_links("run-a", 5, 1, 3)
    assert links == [
        (wave_trace_id("run-a", 5, 0), wave_span_id("run-a", 5, 0), 0),
        (wave_trace_id("run-a", 5, 2), wave_span_id("run-a", 5, 2), 2),
    ]
    assert lockstep_links("run-a", 5, 0, 1) == []


def test_spans_from_two_sidecars_join_into_one_trace(tmp_path):
    """tp0 and tp1 on different nodes: each node's store holds its part; ids line up."""
    start = time.time_ns()
    build_store(tmp_path / "a.db", [(rank_info(0), wave_record(4, start, 2))])
    build_store(tmp_path / "b.db", [(rank_info(1), wave_record(4, start, 3))])
    a, b = _rows(tmp_path / "a.db"), _rows(tmp_path / "b.db")
    assert {r["trace_id"] for r in a} == {r["trace_id"] for r in b}
    (root,) = [r for r in a if r["name"] == "wave"]
    assert not [r for r in b if r["name"] == "wave"]  # only the dp0 tp0 pp0 node emits the root
    (remote_rank,) = [r for r in b if r["name"] == "rank"]
    assert remote_rank["parent_id"] == root["span_id"]
