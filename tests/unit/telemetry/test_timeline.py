"""The timeline export (telemetry/spans/timeline.py, `ascend-guard timeline`) on a store written by the
real writer sink: the JSON checked against the Trace Event Format's rules, its slices against
the spans `ascend-guard trace` builds for the same waves, and its wait arrows against a store
with one late rank.

No trace viewer runs here: Perfetto's Python package downloads its `trace_processor_shell`
binary at run time (the wheel ships none, and no Debian or npm package has it), which this
machine cannot do. `check_trace_events` below encodes the rules the viewers rely on instead.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import Path

import pytest

from telemetry.cli import main as cli
from telemetry.ingest.validation import validate_batch
from telemetry.pipeline.writer import Item, RankSource
from telemetry.spans.builders import incident_span
from telemetry.spans.query import QueryError, load_trace
from telemetry.spans.timeline import build_timeline
from telemetry.spans.timeline_select import TimelineQuery, parse_wave_range
from telemetry.store import Store, connect
from telemetry.store.incidents import IncidentLedger
from telemetry.wire.proto import guard_pb2
from telemetry.wire.trace_ids import format_trace_id, wave_trace_id
from telemetry.wire.wave_columns import to_columns

MS = 1_000_000
ENGINE = "eng"
RUN = "run-t"
TP = 3
SLOW_TP, SLOW_WAVE, LATE_MS = 1, 2, 80
WAVES = (1, 2, 3, 4)

# -- the documented rules ------------------------------------------------------------------

_REQUIRED = {
    "X": ("name", "ph", "ts", "dur", "pid", "tid"),
    "i": ("name", "ph", "ts", "pid", "tid", "s"),
    "s": ("name", "cat", "ph", "ts", "pid", "tid", "id"),
    "f": ("name", "cat", "ph", "ts", "pid", "tid", "id"),
    "M": ("name", "ph", "pid", "args"),
}
_METADATA = {
    "process_name": "name",
    "process_labels": "labels",
    "process_sort_index": "sort_index",
    "thread_name": "name",
    "thread_sort_index": "sort_index",
}


def _ns(us: float) -> int:
    return round(us * 1000)


def check_trace_events(trace: dict) -> dict[tuple[int, int], list[tuple[int, int, dict]]]:
    """Assert the Trace Event Format rules the viewers rely on; return the X slices per
    (pid, tid) as (start ns, end ns, event).

    - the JSON object form: `traceEvents` a list, `displayTimeUnit` "ms" or "ns";
    - each event has the keys its phase needs; ts/dur are numbers of microseconds (>= 0);
    - metadata events are the known kinds, with their argument;
    - X slices on one thread nest (no partial overlaps);
    - flows: one "s" and one "f" per (id, cat, name), the "f" bound to its enclosing slice
      (`bp: "e"`), no earlier than the "s", and each inside a slice of its own thread.
    """
    assert set(trace) >= {"traceEvents", "displayTimeUnit"}
    assert trace["displayTimeUnit"] in ("ms", "ns")
    events = trace["traceEvents"]
    assert isinstance(events, list) and events
    slices: dict[tuple[int, int], list] = defaultdict(list)
    flows: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for event in events:
        ph = event["ph"]
        assert ph in _REQUIRED, f"unexpected phase {ph!r}: {event}"
        missing = [key for key in _REQUIRED[ph] if key not in event]
        assert not missing, f"{ph} event lacks {missing}: {event}"
        assert isinstance(event["pid"], int) and event["pid"] > 0
        assert isinstance(event["tid"], int) and event["tid"] >= 0
        if ph == "M":
            assert event["name"] in _METADATA, event
            assert _METADATA[event["name"]] in event["args"], event
            continue
        assert isinstance(event["ts"], (int, float)) and event["ts"] >= 0, event
        assert isinstance(event["name"], str) and event["name"], event
        if ph == "X":
            assert isinstance(event["dur"], (int, float)) and event["dur"] >= 0, event
            start = _ns(event["ts"])
            slices[(event["pid"], event["tid"])].append((start, start + _ns(event["dur"]), event))
        elif ph == "i":
            assert event["s"] in ("g", "p", "t"), event
        else:
            key = (event["id"], event["cat"], event["name"])
            assert ph not in flows[key], f"two {ph!r} events for flow {key}"
            flows[key][ph] = event
    for track, items in slices.items():
        stack: list[int] = []
        for start, end, event in sorted(items, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1] <= start:
                stack.pop()
            assert not stack or end <= stack[-1], f"{event} overlaps its parent on {track}"
            stack.append(end)
    for key, pair in flows.items():
        assert set(pair) == {"s", "f"}, f"flow {key} has {sorted(pair)}"
        assert pair["f"].get("bp") == "e", pair["f"]
        assert pair["f"]["ts"] >= pair["s"]["ts"]
        for event in pair.values():
            at = _ns(event["ts"])
            inside = [s for s in slices[(event["pid"], event["tid"])] if s[0] < at < s[1]]
            assert inside, f"flow {key}: its {event['ph']!r} is inside no slice of its thread"
    return slices


def _flows(trace: dict) -> list[tuple[dict, dict]]:
    by_id: dict = defaultdict(dict)
    for event in trace["traceEvents"]:
        if event["ph"] in ("s", "f"):
            by_id[event["id"]][event["ph"]] = event
    return [(pair["s"], pair["f"]) for _, pair in sorted(by_id.items())]


# -- a store with one late rank, written by the real writer ---------------------------------


def _rank(tp: int, run_id: str = RUN) -> guard_pb2.RankInfo:
    return guard_pb2.RankInfo(
        run_id=run_id, engine=ENGINE, dp_rank=0, tp_rank=tp, pp_rank=0, dp_size=1, tp_size=TP,
        pp_size=1, node="node-a", pid=4000 + tp,
    )  # fmt: skip


def _item(rank: guard_pb2.RankInfo, batch: guard_pb2.Batch) -> Item:
    to_columns(batch)
    records = validate_batch(batch)
    labels = (ENGINE, str(rank.dp_rank), str(rank.tp_rank), str(rank.pp_rank))
    source = RankSource(rank, ENGINE, labels, (rank.run_id, ENGINE, 0, rank.tp_rank, 0, rank.pid))
    return Item(source, batch, batch.ByteSize(), records)


def _wave_batch(rank: guard_pb2.RankInfo, wave: int, t: int, *, overlap: bool = False):
    """One wave of one rank: in SLOW_WAVE, SLOW_TP enters the collectives LATE_MS late and
    its peers wait that long inside all_reduce (one slow call each)."""
    tp = rank.tp_rank
    slow = wave == SLOW_WAVE
    late = slow and tp == SLOW_TP
    waiting = slow and not late
    execute = (86 if slow else 6) * MS + tp * 10_000
    batch = guard_pb2.Batch(rank=rank)
    batch.waves.add(
        wave=wave, start_unix_nano=t, execute_ns=execute, sample_ns=MS,
        sample_offset_ns=execute - MS // 2 if overlap else execute + 100_000, num_reqs=2,
        decode_reqs=2, decode_tokens=2, sampled_tokens=2, sampled=True,
    )  # fmt: skip
    arrival = t + (2 + (LATE_MS if late else 0)) * MS
    reduce_ns = (LATE_MS + 1) * MS if waiting else MS + tp * 50_000  # < 1 ms apart normally
    cw = batch.collective_waves.add(
        wave=wave, first_arrival_unix_nano=arrival, wait_ns=reduce_ns + 100_000,
        injected_delay_ns=LATE_MS * MS if late else 0,
    )  # fmt: skip
    cw.stats.add(op="all_reduce", group="tp", backend="hccl", dtype="bfloat16", calls=5,
                 bytes=5 * 4096, host_ns=reduce_ns, max_host_ns=reduce_ns - 10_000,
                 first_seq=6 * wave - 5, last_seq=6 * wave - 1)  # fmt: skip
    cw.stats.add(op="all_gather", group="tp", backend="hccl", dtype="bfloat16", calls=1,
                 bytes=1024, host_ns=100_000, max_host_ns=100_000, first_seq=6 * wave,
                 last_seq=6 * wave)  # fmt: skip
    if waiting:
        cw.slow_calls.add(op="all_reduce", group="tp", backend="hccl", dtype="bfloat16",
                          seq=6 * wave - 5, bytes=4096, start_unix_nano=arrival,
                          host_ns=LATE_MS * MS)  # fmt: skip
    return batch


def build_store(path: Path, start_ns: int, *, run_id: str = RUN, overlap_wave: int = 0) -> None:
    sink = Store(path)
    items = []
    for wave in WAVES:
        t = start_ns + wave * 200 * MS
        for tp in range(TP):
            rank = _rank(tp, run_id)
            items.append(_item(rank, _wave_batch(rank, wave, t, overlap=wave == overlap_wave)))
    sink.write(items)
    sink.close()
    ledger = IncidentLedger(str(path))
    t2 = start_ns + SLOW_WAVE * 200 * MS
    ledger.add(ENGINE, _rank(SLOW_TP, run_id), guard_pb2.Incident(
        schema_version=1, id=f"{run_id}-straggler", type="straggler", severity="warning",
        wave=SLOW_WAVE, time_unix_nano=t2 + 90 * MS, summary="tp1 late by 80 ms",
    ))  # fmt: skip
    ledger.add(ENGINE, None, guard_pb2.Incident(
        schema_version=1, id=f"{run_id}-sidecar", type="hang_verdict", severity="critical",
        time_unix_nano=t2 + 95 * MS, summary="a sidecar verdict",
    ))  # fmt: skip
    ledger.close()


@pytest.fixture
def store_path(tmp_path) -> Path:
    path = tmp_path / "store.db"
    build_store(path, time.time_ns() - 60 * 10**9)
    return path


def _timeline(path: Path, **fields):
    conn = connect(path, readonly=True)
    try:
        return build_timeline(conn, TimelineQuery(**fields))
    finally:
        conn.close()


# -- the tests ------------------------------------------------------------------------------


def test_the_file_follows_the_trace_event_rules(store_path):
    timeline = _timeline(store_path, first_wave=1, last_wave=4)
    slices = check_trace_events(timeline.trace)
    assert (timeline.ranks, timeline.waves, timeline.rank_waves) == (TP, 4, TP * 4)
    assert timeline.events == len(timeline.trace["traceEvents"])
    # per rank-wave: wave + execute_model + sample_tokens + 2 collectives; + 1 slow call on
    # each of the two waiting ranks
    assert sum(len(items) for items in slices.values()) == TP * 4 * 5 + 2
    json.loads(json.dumps(timeline.trace))  # plain JSON, nothing a viewer cannot read


def test_one_process_per_rank_named_with_its_coordinates(store_path):
    trace = _timeline(store_path, first_wave=1, last_wave=4).trace
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    names = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert names == {
        tp + 1: f"{ENGINE} dp0 tp{tp} pp0 · node-a pid {4000 + tp}" for tp in range(TP)
    } | {TP + 1: "incidents (no rank)"}
    order = {e["pid"]: e["args"]["sort_index"] for e in meta if e["name"] == "process_sort_index"}
    assert sorted(order, key=order.get) == [1, 2, 3, 4]
    labels = {e["pid"]: e["args"]["labels"] for e in meta if e["name"] == "process_labels"}
    assert set(labels.values()) == {f"run {RUN}"}
    threads = {(e["pid"], e["args"]["name"]) for e in meta if e["name"] == "thread_name"}
    for pid in range(1, TP + 1):
        assert {(pid, "waves"), (pid, "collective all_reduce tp"),
                (pid, "collective all_gather tp")} <= threads  # fmt: skip
    slow_threads = {pid for pid, name in threads if name == "slow calls"}
    assert slow_threads == {1, 3}  # the two ranks that waited
    # every tid belongs to one process only
    owners = defaultdict(set)
    for e in trace["traceEvents"]:
        owners[e["tid"]].add(e["pid"])
    assert all(len(pids) == 1 for tid, pids in owners.items() if tid)


def test_slices_have_the_times_and_ids_of_the_trace_spans(store_path):
    """Every span `ascend-guard trace` builds for these waves is a slice (the wave root is
    the tp0 rank span's twin), with the same ids, start and duration to the nanosecond."""
    timeline = _timeline(store_path, first_wave=1, last_wave=4)
    base = timeline.trace["otherData"]["base_unix_ns"]
    by_span = {}
    for event in timeline.trace["traceEvents"]:
        if event["ph"] in ("X", "i") and "span_id" in event["args"]:
            assert event["args"]["span_id"] not in by_span
            by_span[event["args"]["span_id"]] = event
    conn = connect(store_path, readonly=True)
    compared = 0
    for trace_id in (format_trace_id(wave_trace_id(RUN, wave, 0)) for wave in WAVES):
        for span in load_trace(conn, trace_id):
            if span.name == "wave":
                spans = load_trace(conn, trace_id)
                twin = next(s for s in spans if s.name == "rank" and s.tp == 0)
                assert (span.start_ns, span.end_ns) == (twin.start_ns, twin.end_ns)
                continue
            event = by_span.pop(span.span_hex)
            assert event["args"]["trace_id"] == trace_id
            assert _ns(event["ts"]) + base == span.start_ns, span.name
            if event["ph"] == "X":
                assert _ns(event["dur"]) == span.duration_ns, span.name
            compared += 1
    # 5 spans per rank-wave, the straggler incident, a slow call on each of the 3 ranks that
    # waited
    assert compared == 4 * TP * 5 + 1 + (TP - 1)
    # left: the sidecar's incident, in no wave trace; its span as `incidents` rows build it
    (row,) = [r for r in conn.execute("SELECT * FROM incidents") if not r["wave"]]
    conn.close()
    span = incident_span(row)
    event = by_span.pop(span.span_hex)
    assert _ns(event["ts"]) + base == span.start_ns and event["name"] == "incident:hang_verdict"
    assert not by_span, f"slices with no span in `trace`: {sorted(by_span)}"


def test_wait_arrows_go_from_the_late_rank_to_the_ones_that_waited(store_path):
    timeline = _timeline(store_path, first_wave=1, last_wave=4)
    slices = check_trace_events(timeline.trace)
    flows = _flows(timeline.trace)
    late_pid = SLOW_TP + 1
    assert len(flows) == TP - 1 == timeline.flows  # the other waves are < 1 ms apart
    assert {f["pid"] for _, f in flows} == {tp + 1 for tp in range(TP) if tp != SLOW_TP}
    for start, end in flows:
        assert start["pid"] == late_pid
        assert start["args"]["wave"] == SLOW_WAVE
        assert start["args"]["last_rank"] == f"dp0 tp{SLOW_TP} pp0"
        # the peers' 81 ms inside all_reduce less the late rank's own 1.05 ms
        assert start["args"]["waited_ns"] == LATE_MS * MS - SLOW_TP * 50_000
        for event in (start, end):
            at = _ns(event["ts"])
            (enclosing,) = [s for s in slices[(event["pid"], event["tid"])] if s[0] < at < s[1]]
            assert enclosing[2]["name"] == "collective:all_reduce"
            assert enclosing[2]["args"]["wave"] == SLOW_WAVE
    # a looser threshold finds nothing more, a strict one draws arrows in every wave
    assert _timeline(store_path, first_wave=1, last_wave=4, min_wait_ns=90 * MS).flows == 0
    assert _timeline(store_path, first_wave=1, last_wave=4, min_wait_ns=0).flows == 4 * (TP - 1)


def test_incidents_are_instants_on_their_rank(store_path):
    trace = _timeline(store_path, first_wave=1, last_wave=4).trace
    instants = {e["args"]["type"]: e for e in trace["traceEvents"] if e["ph"] == "i"}
    assert set(instants) == {"straggler", "hang_verdict"}
    assert instants["straggler"]["pid"] == SLOW_TP + 1 and instants["straggler"]["s"] == "p"
    assert instants["straggler"]["args"]["summary"] == "tp1 late by 80 ms"
    assert instants["hang_verdict"]["pid"] == TP + 1  # the "incidents (no rank)" process


def test_partial_overlaps_move_to_an_overlap_thread(tmp_path):
    """sample_tokens starting inside execute_model and ending after it cannot nest: it goes to
    a thread of its own, times unchanged."""
    path = tmp_path / "store.db"
    build_store(path, time.time_ns() - 60 * 10**9, overlap_wave=3)
    timeline = _timeline(path, first_wave=3, last_wave=3)
    check_trace_events(timeline.trace)
    names = [e["args"]["name"] for e in timeline.trace["traceEvents"] if e["name"] == "thread_name"]
    assert names.count("waves (overlap 1)") == TP
    # nothing overlaps in the other waves
    plain = _timeline(path, first_wave=1, last_wave=2).trace["traceEvents"]
    assert not [e for e in plain if e["name"] == "thread_name" and "overlap" in e["args"]["name"]]


def test_since_window_and_the_cap_keep_the_newest(tmp_path):
    start = time.time_ns() - 60 * 10**9
    path = tmp_path / "store.db"
    build_store(path, start)
    assert _timeline(path, since_ns=start).rank_waves == 4 * TP
    within = _timeline(path, since_ns=start + 250 * MS, until_ns=start + 650 * MS)
    assert within.rank_waves == 2 * TP  # waves 2 and 3 start at +400 and +600 ms
    capped = _timeline(path, since_ns=start, max_rank_waves=TP)
    assert (capped.rank_waves, capped.matched_rank_waves) == (TP, 4 * TP)
    waves = {e["args"]["wave"] for e in capped.trace["traceEvents"] if e.get("cat") == "wave"}
    assert waves == {4}
    assert _timeline(path, since_ns=start, engine="other").rank_waves == 0


@pytest.mark.parametrize(("text", "pair"), [("1..4", (1, 4)), (" 7 ", (7, 7)), ("0..0", (0, 0))])
def test_parse_wave_range(text, pair):
    assert parse_wave_range(text) == pair


@pytest.mark.parametrize("text", ["", "a..b", "4..1", "1..", "-3..2", "1...3"])
def test_parse_wave_range_bad(text):
    with pytest.raises(QueryError, match=r"^--waves: "):
        parse_wave_range(text)


# -- the CLI --------------------------------------------------------------------------------


def test_cli_writes_the_file_and_says_how_to_open_it(store_path, tmp_path, capsys):
    out = tmp_path / "wave.json"
    argv = ["timeline", "--waves", "1..4", "-o", str(out), "--store", str(store_path)]
    assert cli.main(argv) == 0
    line = capsys.readouterr().out.strip()
    assert "\n" not in line
    assert line.startswith(f"timeline: {TP} rank(s), 4 wave(s), {4 * TP} rank-waves")
    assert f"-> {out};" in line and "ui.perfetto.dev" in line and "chrome://tracing" in line
    assert "MindStudio Insight" in line
    trace = json.loads(out.read_text())
    check_trace_events(trace)
    events = len(trace["traceEvents"])
    assert f"{events} events" in line
    assert not list(tmp_path.glob(".wave.json.*"))  # the temporary file was renamed
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask  # as any file the user writes


def test_cli_since_engine_and_stdout(store_path, capsys):
    argv = ["timeline", "--since", "1h", "--engine", ENGINE, "-o", "-", "--store", str(store_path)]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    check_trace_events(json.loads(captured.out))
    assert captured.err.startswith("timeline: ") and "-> stdout" in captured.err


def test_cli_request_that_is_not_stored(store_path, tmp_path, capsys):
    """A request the store has no trace of: exit 1, no file (the request's own waves are
    tested in tests/unit/telemetry/test_request_traces.py)."""
    out = tmp_path / "r.json"
    argv = ["timeline", "--request", "cmpl-1", "-o", str(out), "--store", str(store_path)]
    assert cli.main(argv) == 1
    assert "no request 'cmpl-1' with stored waves" in capsys.readouterr().out
    assert not out.exists()


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--waves", "9..1"], "--waves: '9..1'"),
        (["--since", "yesterday"], "--since: 'yesterday'"),
        (["--waves", "1..2", "--until", "now"], "--until goes with --since"),
        (["--waves", "1..2", "--min-wait", "5"], "--min-wait: '5'"),
        (["--waves", "1..2", "--max-waves", "0"], "--max-waves: 0"),
    ],
)
def test_cli_bad_arguments_exit_2(store_path, tmp_path, capsys, args, fragment):
    argv = ["timeline", *args, "-o", str(tmp_path / "x.json"), "--store", str(store_path)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ascend-guard timeline: ") and fragment in err


def test_cli_nothing_matches_exits_1(store_path, tmp_path, capsys):
    out = tmp_path / "x.json"
    argv = ["timeline", "--waves", "50..60", "-o", str(out), "--store", str(store_path)]
    assert cli.main(argv) == 1
    assert "no waves match" in capsys.readouterr().out
    assert not out.exists()


def test_cli_waves_of_two_runs_need_run(tmp_path, capsys):
    path = tmp_path / "store.db"
    build_store(path, time.time_ns() - 120 * 10**9, run_id="run-a")
    build_store(path, time.time_ns() - 60 * 10**9, run_id="run-b")
    out = tmp_path / "x.json"
    argv = ["timeline", "--waves", "1..2", "-o", str(out), "--store", str(path)]
    assert cli.main(argv) == 2
    assert "exist in 2 runs (run-a, run-b); pick one with --run" in capsys.readouterr().err
    assert cli.main([*argv, "--run", "run-b"]) == 0
    labels = {e["args"]["labels"] for e in json.loads(out.read_text())["traceEvents"]
              if e["name"] == "process_labels"}  # fmt: skip
    assert labels == {"run run-b"}


def test_slice_arguments_carry_the_wave_counts_not_the_coordinates(store_path):
    trace = _timeline(store_path, first_wave=2, last_wave=2).trace
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    wave = next(e for e in slices if e["cat"] == "wave" and e["pid"] == SLOW_TP + 1)
    assert wave["name"] == f"wave {SLOW_WAVE}" and wave["args"]["span"] == "rank"
    assert (wave["args"]["num_reqs"], wave["args"]["decode_tokens"]) == (2, 2)
    assert not {"run_id", "engine", "tp", "node", "pid"} & set(wave["args"])
    reduce = next(e for e in slices if e["name"] == "collective:all_reduce" and e["pid"] == 1)
    assert (reduce["args"]["calls"], reduce["args"]["bytes"]) == (5, 5 * 4096)
    assert reduce["args"]["backend"] == "hccl" and "op" not in reduce["args"]
    late = next(e for e in slices if e["name"] == "collective:all_reduce" and e["pid"] == 2)
    assert late["args"]["injected_delay_ns"] == LATE_MS * MS
    slow = [e for e in slices if e["cat"] == "slow_call"]
    assert sorted(e["pid"] for e in slow) == [1, 3]
    assert all(_ns(e["dur"]) == LATE_MS * MS and e["name"] == "slow all_reduce tp #7" for e in slow)
