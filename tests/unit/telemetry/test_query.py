"""Query parsing, the record store written by the real writer sink, spans built from it on
demand, and the query/trace CLI."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from telemetry import store as store_mod
from telemetry.cli import main as cli
from telemetry.cli.args import parse_duration_ns, parse_rank, parse_time_ns
from telemetry.cli.render import span_tree
from telemetry.pipeline.writer import Item, RankSource
from telemetry.spans.query import QueryError, load_trace
from telemetry.store import Store
from telemetry.wire.proto import guard_pb2
from telemetry.wire.trace_ids import (
    format_trace_id,
    rank_span_id,
    wave_span_id,
    wave_trace_id,
)
from tests.support.span_search import SpanQuery

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
        query.validate()
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


def item(rank: guard_pb2.RankInfo, *waves: guard_pb2.WaveRecord) -> Item:
    """One batch of `waves` from `rank`, as ingest hands it to the writer (wire v2 columns)."""
    batch = guard_pb2.Batch(rank=rank)
    batch.waves.extend(waves)
    from telemetry.ingest.validation import validate_batch
    from telemetry.wire.wave_columns import to_columns

    to_columns(batch)
    records = validate_batch(batch)
    labels = ("eng", str(rank.dp_rank), str(rank.tp_rank), str(rank.pp_rank))
    source = RankSource(rank, "eng", labels, (rank.run_id, "eng", 0, rank.tp_rank, 0, rank.pid))
    return Item(source, batch, batch.ByteSize(), records)


def build_store(path: Path, waves, **store_kwargs) -> Store:
    """waves: (rank, WaveRecord) pairs, one batch each, written by the store sink."""
    sink = Store(path, **store_kwargs)
    sink.write([item(rank, wave) for rank, wave in waves])
    sink.close()
    return sink


def _spans(path) -> list:
    """Every span the store can build (all ranks, all blocks)."""
    from telemetry.spans.builders import wave_spans

    conn = store_mod.connect(path, readonly=True)
    try:
        ranks = {r.id: r for r in store_mod.ranks(conn)}
        out = []
        for rank_id, cols in store_mod.wave_blocks(conn, list(ranks)):
            for i in range(len(cols.wave)):
                out += wave_spans(ranks[rank_id], cols, i)
        return out
    finally:
        conn.close()


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
    rows = _spans(store)
    # per wave: 1 wave span (from tp0) + 2 rank spans + 2 execute + 2 sample
    assert len(rows) == 3 * 7
    assert len({r.trace_id for r in rows}) == 3
    for n in (1, 2, 3):
        trace = [r for r in rows if r.wave == n]
        assert {r.trace_hex for r in trace} == {format_trace_id(wave_trace_id("run-q", n, 0))}
        ranks = [r for r in trace if r.name == "rank"]
        assert sorted(r.tp for r in ranks) == [0, 1]
        (root,) = [r for r in trace if r.name == "wave"]
        assert root.span_id == wave_span_id("run-q", n, 0)
        for r in ranks:
            assert r.parent_id == root.span_id
            assert r.span_id == rank_span_id("run-q", n, 0, r.tp, 0)
    # the trace id alone finds the wave again: all 7 spans, built from the stored rows
    conn = store_mod.connect(store, readonly=True)
    spans = load_trace(conn, format_trace_id(wave_trace_id("run-q", 2, 0)))
    assert sorted(s.name for s in spans) == sorted(
        ["wave", "rank", "rank", "execute_model", "execute_model", "sample_tokens", "sample_tokens"]
    )
    tp1 = next(s for s in spans if s.name == "execute_model" and s.tp == 1)
    assert tp1.duration_ns == 80 * MS


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
    # waves 1..10, one second apart, ending at NOW; tp0 only: one block (batch) per wave
    waves = [(rank_info(0), wave_record(n, NOW - (10 - n) * 10**9, 1)) for n in range(1, 11)]
    path = tmp_path / "prune.db"
    # prune_every_s huge: only the explicit prune() below deletes anything
    build_store(path, waves, prune_every_s=10**12, **kwargs)
    return path


def _stored_waves(path) -> list[int]:
    return sorted({s.wave for s in _spans(path)})


def test_prune_by_age(tmp_path):
    path = _prune_store(tmp_path, retention_s=4.5)
    assert len(_stored_waves(path)) == 10
    sink = Store(path, retention_s=4.5, prune_every_s=10**12)
    removed = sink.prune(now_ns=NOW)
    sink.close()
    # waves 6..10 start within 4.5 s of NOW; waves 1..5 go
    assert removed == 5
    assert _stored_waves(path) == [6, 7, 8, 9, 10]
    assert min(s.start_ns for s in _spans(path)) >= NOW - 4_500_000_000


def test_prune_by_size_deletes_the_oldest_minutes_first(tmp_path):
    """20 minutes of 4 blocks of 256 waves each; a cap of about half the data's pages."""
    import random

    rng = random.Random(7)
    path = tmp_path / "size.db"
    sink = Store(path, retention_s=10**9, prune_every_s=10**12)
    empty = sink.used_bytes()  # the schema's own pages
    begin = NOW - 20 * 60 * 10**9
    for minute in range(20):
        for part in range(4):
            first = minute * 1024 + part * 256 + 1
            waves = []
            for k in range(256):
                wave = wave_record(first + k, begin + minute * 60 * 10**9 + k * 10**7, 1)
                wave.execute_ns, wave.sample_ns = rng.randrange(10**7), rng.randrange(10**6)
                waves.append(wave)
            sink.write([item(rank_info(0), *waves)])
    full = sink.used_bytes()
    assert full - empty > 10 * sink_page(sink)  # enough pages for the cap to bite
    cap = empty + (full - empty) // 2
    sink.max_bytes = cap
    removed = sink.prune(now_ns=NOW)
    assert removed > 0
    assert sink.used_bytes() <= cap
    kept = _stored_waves(path)
    assert kept[-1] == 20 * 1024  # the newest minute stays
    assert kept[0] > 1024  # the oldest minute went first
    # whole minutes went: the oldest kept wave starts a minute, and about half are left
    assert (kept[0] - 1) % 1024 == 0
    assert 5 * 1024 <= len(kept) <= 15 * 1024
    assert sink.prune(now_ns=NOW) == 0
    sink.close()


def sink_page(sink: Store) -> int:
    return store_mod.PAGE_SIZE


def test_prune_nothing_to_do(tmp_path):
    path = _prune_store(tmp_path)
    sink = Store(path, prune_every_s=10**12)
    assert sink.prune(now_ns=NOW) == 0
    sink.close()
    assert len(_stored_waves(path)) == 10


def test_write_prunes_by_itself(tmp_path):
    """With the default prune interval, writing enforces retention against the real clock."""
    path = tmp_path / "auto.db"
    sink = Store(path, retention_s=60, prune_every_s=0)
    sink.write([item(rank_info(0), wave_record(1, time.time_ns() - 3600 * 10**9, 1))])
    sink.write([item(rank_info(0), wave_record(2, time.time_ns(), 1))])
    sink.close()
    assert _stored_waves(path) == [2]


def test_same_batch_written_twice_is_stored_once(tmp_path):
    wave = wave_record(1, NOW, 1)
    path = tmp_path / "dup.db"
    first = build_store(path, [(rank_info(0), wave)], prune_every_s=10**12)
    second = build_store(path, [(rank_info(0), wave)], prune_every_s=10**12)
    assert (first.stored_waves, second.stored_waves, second.ignored_waves) == (1, 0, 1)
    names = [s.name for s in _spans(path) if s.name in ("wave", "rank")]
    assert sorted(names) == ["rank", "wave"]


# -- deterministic ids ----------------------------------------------------------------------


def test_wave_trace_id_is_deterministic_across_calls_and_processes():
    here = [
        wave_trace_id("run-a", 7, 0),
        wave_span_id("run-a", 7, 0),
        rank_span_id("run-a", 7, 0, 1, 0),
    ]
    assert here == [wave_trace_id("run-a", 7, 0), wave_span_id("run-a", 7, 0), rank_span_id("run-a", 7, 0, 1, 0)]  # fmt: skip
    code = (
        "from telemetry.wire.trace_ids import wave_trace_id, wave_span_id, rank_span_id\n"
        "print(wave_trace_id('run-a', 7, 0), wave_span_id('run-a', 7, 0), rank_span_id('run-a', 7, 0, 1, 0))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
        cwd=Path(__file__).resolve().parents[3], env={"PYTHONHASHSEED": "123", "PATH": ""},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert [int(x) for x in proc.stdout.split()] == here


def test_ids_differ_between_waves_runs_and_ranks():
    assert wave_trace_id("run-a", 1, 0) != wave_trace_id("run-a", 2, 0)
    assert wave_trace_id("run-a", 1, 0) != wave_trace_id("run-b", 1, 0)
    assert len({wave_trace_id("run-a", n, 0) for n in range(1, 1001)}) == 1000
    assert 0 < wave_trace_id("run-a", 1, 0) < 2**128
    assert 0 < wave_span_id("run-a", 1, 0) < 2**64
    spans = {
        rank_span_id("run-a", 1, dp, tp, pp)
        for dp in range(2)
        for tp in range(4)
        for pp in range(2)
    }
    assert len(spans) == 16
    assert wave_span_id("run-a", 1, 0) not in spans


def test_spans_from_two_sidecars_join_into_one_trace(tmp_path):
    """tp0 and tp1 on different nodes: each node's store holds its part; ids line up."""
    start = time.time_ns()
    build_store(tmp_path / "a.db", [(rank_info(0), wave_record(4, start, 2))])
    build_store(tmp_path / "b.db", [(rank_info(1), wave_record(4, start, 3))])
    a, b = _spans(tmp_path / "a.db"), _spans(tmp_path / "b.db")
    assert {r.trace_id for r in a} == {r.trace_id for r in b}
    (root,) = [r for r in a if r.name == "wave"]
    assert not [r for r in b if r.name == "wave"]  # only the dp0 tp0 pp0 node emits the root
    (remote_rank,) = [r for r in b if r.name == "rank"]
    assert remote_rank.parent_id == root.span_id


def test_each_dp_replica_has_its_own_trace_and_root(tmp_path):
    """Wave 4 of dp0 and wave 4 of dp1 are different traces (each replica numbers its own
    waves); the trace id alone finds the right replica's ranks in the store."""
    start = time.time_ns()
    ranks = [
        guard_pb2.RankInfo(run_id="run-dp", engine="eng", dp_rank=dp, tp_rank=tp, dp_size=2,
                           tp_size=2, pp_size=1, node="n", pid=10 * dp + tp)
        for dp in (0, 1)
        for tp in (0, 1)
    ]  # fmt: skip
    build_store(tmp_path / "dp.db", [(r, wave_record(4, start, 2 + r.dp_rank)) for r in ranks])
    conn = store_mod.connect(tmp_path / "dp.db", readonly=True)
    for dp in (0, 1):
        spans = load_trace(conn, format_trace_id(wave_trace_id("run-dp", 4, dp)))
        assert {s.dp for s in spans if s.name == "rank"} == {dp}
        assert sorted(s.tp for s in spans if s.name == "rank") == [0, 1]
        (root,) = [s for s in spans if s.name == "wave"]
        assert root.span_id == wave_span_id("run-dp", 4, dp)
    assert wave_trace_id("run-dp", 4, 0) != wave_trace_id("run-dp", 4, 1)


def test_lockstep_links_name_the_other_dp_ranks_waves():
    from telemetry.wire.trace_ids import lockstep_links

    links = lockstep_links("run-a", 5, 1, 3)
    assert links == [
        (wave_trace_id("run-a", 5, 0), wave_span_id("run-a", 5, 0), 0),
        (wave_trace_id("run-a", 5, 2), wave_span_id("run-a", 5, 2), 2),
    ]
    assert lockstep_links("run-a", 5, 0, 1) == []
