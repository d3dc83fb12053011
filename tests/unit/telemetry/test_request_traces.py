"""Request membership from the worker to the request trace: wire, validation, store, spans,
links, TraceQL and the query API's trace-by-id route.

The engine's step objects come from tests/support/request_sim.py (no vLLM runs in unit tests);
the processor, membership, streamer batches, validation, store, trace builder, TraceQL search
and the Tempo-API route are the real ones. The simulator keeps the truth each test checks.
"""

from __future__ import annotations

import json
from array import array
from types import SimpleNamespace

import pytest
from opentelemetry.proto.trace.v1 import trace_pb2

from guard.wave import request_membership
from guard.wave.request_membership import RequestMembership
from telemetry.ingest.validation import validate_batch
from telemetry.metrics import requests as request_metrics
from telemetry.spans import requests as request_spans
from telemetry.spans.query import load_trace
from telemetry.store import connect
from telemetry.store import requests as request_store
from telemetry.tempo_api.server import PROTOBUF, Request, route
from telemetry.traceql.search import search as traceql_search
from telemetry.wire import schema
from telemetry.wire.proto import guard_pb2
from telemetry.wire.request_columns import entries
from telemetry.wire.schema import InvalidBatch
from telemetry.wire.trace_ids import format_trace_id, request_trace_id, wave_trace_id
from tests.support.metrics import samples, value
from tests.support.request_sim import Sim, SimRequest, drive, guarded, store_batches


def _requests() -> list[SimRequest]:
    # a long prompt (chunked over the 64-token budget), staggered arrivals, one preemption
    return [
        SimRequest(f"cmpl-{i}-0", prompt=10 + 37 * i, max_tokens=4 + 3 * i, arrive_wave=1 + 2 * i)
        for i in range(5)
    ]


# the runner's order: as requests joined; vLLM's persistent batch (slots reused, condensed);
# the same with a reorder every 5 waves (the membership then maps every id)
LAYOUTS = {
    "list": {},
    "slots": {"layout": "slots"},
    "reordered": {"layout": "slots", "swap_every": 5},
}


@pytest.fixture(params=sorted(LAYOUTS))
def simulated(tmp_path, request):
    reqs = _requests()
    sim = Sim(reqs, budget=64, preempt={9: "cmpl-1-0"}, **LAYOUTS[request.param])
    processor = guarded()
    batches = drive(processor, sim)
    assert processor.errors.total == 0
    store, path = store_batches(tmp_path, batches)
    yield reqs, store, path, batches
    store.close()


def test_each_request_trace_holds_exactly_the_waves_and_tokens_it_ran(simulated) -> None:
    reqs, _, path, _ = simulated
    conn = connect(path, readonly=True)
    assert sum(r.preemptions for r in reqs) == 1
    for req in reqs:
        (trace,) = request_spans.request_traces(conn, req.req_id)
        got = {w.wave: (w.scheduled, w.sampled) for w in trace.waves}
        assert got == req.waves, req.req_id
        assert trace.sampled_tokens() == req.max_tokens
        assert sum(w.preempted for w in trace.waves) == req.preemptions
        root = trace.spans[0]
        assert root.name == "request" and root.parent_id is None
        assert root.attributes[schema.attr("request.sampled_tokens")] == req.max_tokens
        assert trace.trace_id == request_trace_id("run-sim", "sim", 0, req.req_id)
        kinds = [s.name for s in trace.spans[1:]]
        assert kinds[0] == "prefill" and kinds.count("prefill") >= 1
        assert len(kinds) == len(req.waves)


def test_prefill_waves_are_the_chunks_up_to_the_first_token_and_again_after_a_preemption(
    simulated,
) -> None:
    reqs, _, path, _ = simulated
    conn = connect(path, readonly=True)
    long_one = reqs[4]  # 158-token prompt over a 64-token budget: three prefill chunks
    (trace,) = request_spans.request_traces(conn, long_one.req_id)
    truth_prefill = []
    for wave in sorted(long_one.waves):
        truth_prefill.append(wave)
        if long_one.waves[wave][1]:
            break
    assert [w.wave for w in trace.waves if w.kind == "prefill"] == truth_prefill
    assert len(truth_prefill) >= 3
    (preempted,) = request_spans.request_traces(conn, reqs[1].req_id)
    after = [w for w in preempted.waves if w.preempted]
    assert len(after) == 1 and after[0].kind == "prefill" and after[0].recompute


def test_wave_spans_link_to_their_requests_and_back(simulated) -> None:
    reqs, _, path, _ = simulated
    conn = connect(path, readonly=True)
    req = reqs[2]
    (trace,) = request_spans.request_traces(conn, req.req_id)
    for child in trace.spans[1:]:
        (link,) = child.links
        assert link["trace_id"] == wave_trace_id("run-sim", child.wave, 0)
        wave_spans = load_trace(conn, format_trace_id(link["trace_id"]))
        request_spans.link_wave_spans(conn, wave_spans)  # as the query API serves it
        (root,) = [s for s in wave_spans if s.name == "wave"]
        assert root.span_id == link["span_id"]
        linked = {entry["trace_id"] for entry in root.links}
        assert trace.trace_id in linked
        # every request the wave ran, and no other
        running = {r.req_id for r in reqs if child.wave in r.waves}
        names = {entry["attributes"][request_spans.ATTR_REQUEST] for entry in root.links}
        assert names == running


def test_api_id_prefix_finds_the_engine_request_and_two_replicas_do_not_share_a_trace() -> None:
    a = request_trace_id("run", "eng", 0, "cmpl-x-0")
    assert a != request_trace_id("run", "eng", 1, "cmpl-x-0")
    assert a != request_trace_id("run", "other", 0, "cmpl-x-0")
    assert a != request_trace_id("run2", "eng", 0, "cmpl-x-0")


def test_find_by_prefix_and_trace_by_id_through_the_query_api(simulated) -> None:
    reqs, _, path, _ = simulated
    conn = connect(path, readonly=True)
    (row,) = request_store.find_requests(conn, "cmpl-3")  # the API's id, without "-0"
    assert row.request_id == "cmpl-3-0"
    endpoint, reply = route(path, Request(f"/api/v2/traces/{row.trace_hex}", {}, {}))
    assert endpoint == "trace" and reply.code == 200, reply.body
    body = json.loads(reply.body)
    spans = [s for rs in body["trace"]["resourceSpans"] for ss in rs["scopeSpans"]
             for s in ss["spans"]]  # fmt: skip
    assert {s["traceId"] for s in spans} == {row.trace_hex}
    assert sum(1 for s in spans if s["name"] in ("prefill", "decode")) == len(reqs[3].waves)
    assert all(s["links"][0]["traceId"] for s in spans if s["name"] in ("prefill", "decode"))
    _, v1 = route(path, Request(f"/api/traces/{row.trace_hex}", {}, {}))
    assert v1.code == 200 and json.loads(v1.body)["batches"]
    _, proto = route(path, Request(f"/api/traces/{row.trace_hex}", {}, {"Accept": PROTOBUF}))
    assert proto.code == 200 and proto.content_type == PROTOBUF
    data = trace_pb2.TracesData.FromString(proto.body)
    decoded = [s for rs in data.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert {s.links[0].trace_id.hex() for s in decoded if s.name == "decode"} <= {
        format_trace_id(wave_trace_id("run-sim", w, 0)) for w in reqs[3].waves
    }


def test_traceql_finds_request_spans_and_only_the_named_request(simulated) -> None:
    reqs, _, path, _ = simulated
    conn = connect(path, readonly=True)
    start, end = 0, 2**62
    for text in (
        '{ name = "request" && span.ascend_guard.request = "cmpl-2-0" }',
        '{ name = "request" && .request = "cmpl-2-0" }',
    ):
        (match,) = traceql_search(conn, text, start, end)
        assert match.root_name == "request"
        assert match.trace_id == format_trace_id(request_trace_id("run-sim", "sim", 0, "cmpl-2-0"))
    everyone = traceql_search(conn, '{ name = "request" }', start, end, limit=50)
    assert len(everyone) == len(reqs)
    long = traceql_search(conn, "{ .request.sampled_tokens >= 13 }", start, end, limit=50)
    assert {m.spans[0].attributes[request_spans.ATTR_REQUEST] for m in long} == {
        r.req_id for r in reqs if r.max_tokens >= 13
    }
    # a query about waves still returns wave traces only
    waves = traceql_search(conn, '{ name = "wave" }', start, end, limit=5)
    assert waves and all(m.root_name == "wave" for m in waves)


def test_steady_decode_rows_are_a_few_bytes_each(simulated) -> None:
    _, _, _, batches = simulated
    cols = batches[0].request_columns
    same = sum(cols.same_members)
    assert same > 0  # the decode waves with an unchanged batch reuse the row before
    expanded = entries(cols)
    assert len(expanded.wave) == sum(cols.members)


def test_bad_membership_is_dropped_alone_with_the_column_named() -> None:
    batch = guard_pb2.Batch(rank=guard_pb2.RankInfo(run_id="r"))
    cols = batch.request_columns
    cols.wave.extend([1, 2])
    cols.members.extend([2, 3])
    cols.same_members.extend([False, True])
    for name in ("scheduled_each", "sampled_each", "scheduled_count", "sampled_count",
                 "finished_count", "preempted_count"):  # fmt: skip
        getattr(cols, name).extend([1, 1] if "each" in name else [0, 0])
    cols.sampled.extend([True, True])
    cols.req_index.extend([0, 1])
    with pytest.raises(InvalidBatch, match=r"request_columns\.members\[1\]: 3, but same_members"):
        validate_batch(batch)
    dropped: list = []
    validate_batch(batch, dropped=dropped)
    assert not batch.HasField("request_columns")
    assert dropped[0][0] == "requests"
    bad = guard_pb2.Batch(rank=guard_pb2.RankInfo(run_id="r"))
    bad.request_columns.name_index.append(1)
    with pytest.raises(InvalidBatch, match="name_request_id: 0 ids for 1 name_index"):
        validate_batch(bad)


def _sched(ids, tokens, new=(), finished=()):
    return SimpleNamespace(
        num_scheduled_tokens={i.encode().decode(): t for i, t in zip(ids, tokens, strict=True)},
        total_num_scheduled_tokens=sum(tokens),
        scheduled_new_reqs=[SimpleNamespace(req_id=i) for i in new],
        finished_req_ids=set(finished),
        scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set()),
    )


def test_membership_reuses_the_row_while_the_batch_is_unchanged_and_bounds_its_buffer() -> None:
    ids = [f"r{i}" for i in range(8)]
    m = RequestMembership(capacity=4)
    m.note_schedule(1, _sched(ids, [3] * 8, new=ids))
    out = SimpleNamespace(req_ids=list(ids), sampled_token_ids=[[1]] * 8)
    m.note_wave(1, out, 8)
    for wave in range(2, 8):
        m.note_schedule(wave, _sched(ids, [1] * 8))
        m.note_wave(wave, SimpleNamespace(req_ids=out.req_ids, sampled_token_ids=[[1]] * 8), 8)
    assert len(m) == 14 and not m.dropped_rows  # queued steps: worked out by the streamer
    m.drain()
    assert len(m) == 4 and m.dropped_rows == 3
    batch = guard_pb2.Batch(rank=guard_pb2.RankInfo(run_id="r"))
    m.fill_batch(batch)
    cols = batch.request_columns
    assert list(cols.wave) == [4, 5, 6, 7]
    assert list(cols.same_members) == [False, True, True, True]
    assert len(cols.req_index) == 8 and not cols.scheduled_tokens and not cols.sampled_tokens
    assert list(cols.scheduled_each) == [1, 1, 1, 1] and list(cols.sampled_each) == [1, 1, 1, 1]
    assert cols.dropped_rows_total == 3
    assert list(cols.name_request_id) == ids  # named once, in the stream's first batch


def test_a_finished_request_stays_known_for_a_late_output_the_newest_retired_kept(
    monkeypatch,
) -> None:
    """An async output can name a request a wave after it finished: the newest RETIRED_KEPT
    finished ones still map to their index; older ones are forgotten, oldest first (the
    bound is an ordered dict, so dropping the oldest stays O(1) however long the server runs)."""
    monkeypatch.setattr(request_membership, "RETIRED_KEPT", 3)
    ids = [f"r{i}" for i in range(6)]
    m = RequestMembership(capacity=100)
    m.note_schedule(1, _sched(ids, [1] * 6, new=ids))
    m.note_wave(1, SimpleNamespace(req_ids=list(ids), sampled_token_ids=[[1]] * 6), 6)
    first = guard_pb2.Batch(rank=guard_pb2.RankInfo(run_id="r"))
    m.fill_batch(first)
    cols = first.request_columns
    index = dict(zip(cols.name_request_id, cols.name_index, strict=True))
    for wave, req_id in enumerate(ids, 2):  # one finishes per wave, r0 first
        live = ids[ids.index(req_id) + 1 :]
        m.note_schedule(wave, _sched(live, [1] * len(live), finished=[req_id]))
        out = SimpleNamespace(req_ids=list(live), sampled_token_ids=[[1]] * len(live))
        m.note_wave(wave, out, len(live))
    m.note_schedule(8, _sched(["r2", "r3", "r5"], [1, 1, 1]))  # outputs a wave late
    m.note_wave(8, SimpleNamespace(req_ids=["r2", "r3", "r5"], sampled_token_ids=[[1]] * 3), 3)
    later = guard_pb2.Batch()
    m.fill_batch(later)
    cols = later.request_columns
    assert list(cols.name_request_id) == ["r2"]  # forgotten: named again
    renamed = cols.name_index[0]
    assert renamed not in index.values()
    assert list(cols.req_index)[-3:] == [renamed, index["r3"], index["r5"]]


def test_the_engine_thread_only_queues_and_uses_its_own_counts_after_a_list_is_cut() -> None:
    """The engine thread's calls queue the objects; the streamer works them out later. By
    then vLLM's scheduler may have cut a token list where its request stopped (in place): the
    row keeps the counts the engine thread made (`kept`)."""
    ids = ["a", "b", "c"]
    m = RequestMembership(capacity=100)
    m.note_schedule(1, _sched(ids, [4] * 3, new=ids))
    out = SimpleNamespace(req_ids=list(ids), sampled_token_ids=[[1, 2, 3], [1], [1, 2]])
    kept = array("I", [3, 1, 2])
    m.note_wave(1, out, 6, kept)
    assert len(m) == 2 and not m._rows  # two steps queued, nothing worked out yet
    del out.sampled_token_ids[0][1:]  # the scheduler: request "a" stopped at its first token
    batch = guard_pb2.Batch(rank=guard_pb2.RankInfo(run_id="r"))
    m.fill_batch(batch)
    validate_batch(batch)
    got = entries(batch.request_columns)
    assert got.sampled.tolist() == [3, 1, 2] and got.scheduled.tolist() == [4, 4, 4]
    assert not len(m)


class _Held(SimpleNamespace):
    """A step object that can be weakly referenced (a subclass gets the slot SimpleNamespace
    lacks)."""


def test_queued_steps_hold_no_vllm_object_and_one_each_rows_match_counted_rows() -> None:
    """Queued steps keep only the fields they read: the scheduler and runner outputs and the
    new requests' data (which would live until the streamer's next batch and bring the
    garbage collector's young collections on sooner) are freed as soon as the engine drops
    them. A wave whose counts
    are `ONE_EACH` (the processor's usual wave) gives the same rows as the same wave with its
    counts made from the token lists."""
    import gc
    import weakref

    from guard.wave.schedule import ONE_EACH, read_sampled

    ids = ["a", "b", "c"]
    rows = []
    for counts_from_processor in (True, False):
        m = RequestMembership(capacity=100)
        so = _Held(**vars(_sched(ids, [2, 2, 2])))
        so.scheduled_new_reqs = [_Held(req_id=i, prompt_token_ids=[1, 2]) for i in ids]
        new_req = weakref.ref(so.scheduled_new_reqs[0])
        out = _Held(req_ids=list(ids), sampled_token_ids=[[7], [8], [9]])
        tokens, kept, _ = read_sampled(out)
        assert (tokens, kept) == (3, ONE_EACH)
        m.note_schedule(1, so)
        if counts_from_processor:
            m.note_wave(1, out, tokens, kept)
        else:
            m.note_wave(1, out, tokens)  # no counts given: made from the lists
        held = weakref.ref(so), weakref.ref(out), new_req
        del so, out
        gc.collect()
        assert [r() for r in held] == [None, None, None]
        batch = guard_pb2.Batch(rank=guard_pb2.RankInfo(run_id="r"))
        m.fill_batch(batch)
        got = entries(batch.request_columns)
        rows.append((got.sampled.tolist(), got.scheduled.tolist()))
    assert rows[0] == rows[1] == ([1, 1, 1], [2, 2, 2])


def test_an_output_with_no_token_lists_leaves_its_rows_sampled_unknown() -> None:
    """A pooling runner's output has request ids and an empty `sampled_token_ids`: the
    processor counts 0 tokens, one each of no list, and the row says the sampled tokens are
    not known rather than one each."""
    from guard.wave.schedule import read_sampled

    ids = ["a", "b"]
    m = RequestMembership(capacity=100)
    m.note_schedule(1, _sched(ids, [3, 3], new=ids))
    out = SimpleNamespace(req_ids=list(ids), req_id_to_index={"a": 0, "b": 1}, sampled_token_ids=[])
    tokens, kept, _ = read_sampled(out)
    m.note_wave(1, out, tokens, kept)
    m.drain()
    (row,) = m._rows
    assert row[3] is None  # sampled: unknown
    assert set(m._prefilling) == {"a", "b"}  # neither taken for a finished prefill


def test_queued_steps_are_bounded_by_the_engine_thread_catching_up(monkeypatch) -> None:
    """With no streamer draining (no stream), the engine thread works the oldest steps out
    itself past STEPS_KEPT waves, so nothing is lost; while the streamer holds the lock it
    does not wait for it (the queue may then grow past the bound, briefly)."""
    monkeypatch.setattr(request_membership, "STEPS_KEPT", 2)
    ids = ["a", "b"]
    m = RequestMembership(capacity=100)
    m.note_schedule(1, _sched(ids, [3, 3], new=ids))
    m.note_wave(1, SimpleNamespace(req_ids=list(ids), sampled_token_ids=[[1], [1]]), 2)
    for wave in range(2, 9):
        m.note_schedule(wave, _sched(ids, [1, 1]))
        m.note_wave(wave, SimpleNamespace(req_ids=list(ids), sampled_token_ids=[[1], [1]]), 2)
        assert len(m._steps) <= 4
    assert len(m._rows) == 6  # the engine thread's own catching up
    with m._lock:  # the streamer is packing: the engine thread queues and goes on
        for wave in range(9, 12):
            m.note_schedule(wave, _sched(ids, [1, 1]))
            m.note_wave(wave, SimpleNamespace(req_ids=list(ids), sampled_token_ids=[[1], [1]]), 2)
    assert len(m._steps) == 10
    batch = guard_pb2.Batch(rank=guard_pb2.RankInfo(run_id="r"))
    m.fill_batch(batch)
    assert list(batch.request_columns.wave) == list(range(1, 12))
    assert not m.dropped_rows and not len(m)


def test_only_tp0_records_membership() -> None:
    sim = Sim(_requests()[:2])
    assert drive(guarded(tp=0), sim)[0].HasField("request_columns")
    sim = Sim(_requests()[:2])
    processor = guarded(tp=1)
    assert not any(b.HasField("request_columns") for b in drive(processor, sim))
    assert processor.membership is None
    sim = Sim(_requests()[:2])
    off = guarded(request_traces=False)
    assert not any(b.HasField("request_columns") for b in drive(off, sim))


def test_a_request_joining_lists_only_its_own_tokens_and_drafts_list_every_member() -> None:
    """Churn: one request leaves, one joins with a 32-token prefill; only the newcomer is listed.
    Drafts (4 tokens scheduled each, 1-4 kept): every member is listed, with what it kept."""
    ids = [f"r{i}" for i in range(6)]
    m = RequestMembership(capacity=100)
    m.note_schedule(1, _sched(ids, [5] * 6, new=ids))
    m.note_wave(1, SimpleNamespace(req_ids=list(ids), sampled_token_ids=[[1]] * 6), 6)
    live = ids[1:] + ["r6"]
    m.note_schedule(2, _sched(live, [1] * 5 + [32], new=["r6"], finished=["r0"]))
    m.note_wave(2, SimpleNamespace(req_ids=list(live), sampled_token_ids=[[1]] * 6), 6)
    spec = SimpleNamespace(
        req_ids=list(live), sampled_token_ids=[[1] * (1 + i % 4) for i in range(6)]
    )
    m.note_schedule(3, _sched(live, [4] * 6))
    m.note_wave(3, spec, sum(1 + i % 4 for i in range(6)))
    batch = guard_pb2.Batch(rank=guard_pb2.RankInfo(run_id="r"))
    m.fill_batch(batch)
    cols = batch.request_columns
    validate_batch(batch)
    assert list(cols.scheduled_each) == [1, 1, 0]  # wave 1: six newcomers listed; 3: drafts
    assert list(cols.scheduled_count) == [6, 1, 6]
    assert list(cols.scheduled_tokens)[6:7] == [32]  # wave 2: the newcomer alone
    assert list(cols.sampled_each) == [1, 1, 0]
    got = entries(cols)
    assert got.scheduled[got.wave == 1].tolist() == [5] * 6
    wave3 = got.wave == 3
    assert got.sampled[wave3].tolist() == [1 + i % 4 for i in range(6)]
    assert got.scheduled[got.wave == 2].tolist() == [1] * 5 + [32]
    assert list(cols.finished_index) == [0]


def test_request_cli_tree_waves_and_json(simulated, capsys) -> None:
    from telemetry.cli import main as cli

    reqs, _, path, _ = simulated
    req = reqs[1]  # preempted once
    assert cli.main(["request", "cmpl-1", "--store", path]) == 0
    out = capsys.readouterr().out
    assert out.startswith("request cmpl-1-0  trace ")
    assert f"sampled {req.max_tokens}" in out and "preemptions 1" in out
    assert out.count("└─ prefill") + out.count("└─ decode") == len(req.waves)
    assert "after-preemption" in out
    assert cli.main(["request", "cmpl-1-0", "--waves", "--store", path]) == 0
    table = capsys.readouterr().out.splitlines()
    assert len(table) == 3 + len(req.waves) and "prefill (recompute)" in "\n".join(table)
    assert cli.main(["request", "cmpl-1-0", "--json", "--store", path]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    body = json.loads(line)
    assert body["sampled_tokens"] == req.max_tokens
    assert {
        w["wave"]: (w["scheduled_tokens"], w["sampled_tokens"]) for w in body["waves"]
    } == req.waves
    assert cli.main(["request", "nope", "--store", path]) == 1


def test_timeline_of_a_request_holds_exactly_its_waves(simulated, tmp_path, capsys) -> None:
    from telemetry.cli import main as cli

    reqs, _, path, _ = simulated
    req = reqs[3]
    out = tmp_path / "req.json"
    assert cli.main(["timeline", "--request", req.req_id, "-o", str(out), "--store", path]) == 0
    events = json.loads(out.read_text())["traceEvents"]
    waves = {e["args"]["wave"] for e in events
             if e.get("ph") == "X" and "wave" in e.get("args", {})}  # fmt: skip
    assert waves == set(req.waves)
    assert cli.main(["timeline", "--request", "cmpl-", "-o", str(out), "--store", path]) == 1
    assert "5 requests match" in capsys.readouterr().out


def test_a_membership_error_costs_neither_the_wave_record_nor_the_engine() -> None:
    processor = guarded()
    runner = SimpleNamespace(requests={}, max_model_len=4096)
    processor.run_step(lambda r, s: None, runner, (_sched(["r0"], [4], new=["r0"]),), {})
    out = SimpleNamespace(req_ids=[["r0"]], sampled_token_ids=[[1]])  # unhashable: it fails
    assert processor.run_sample(lambda r: out, runner, (), {}) is out
    errors = processor.errors.total  # the detectors trip on that id too
    processor.membership.drain()  # the streamer's work
    assert processor.errors.total == errors + 1
    assert not len(processor.membership)  # that wave's membership is lost, counted
    (record,) = list(processor.streamer._buffer)
    assert record.wave == 1 and record.sampled_tokens == 1


def test_names_go_once_per_stream_and_again_on_a_new_stream() -> None:
    ids = ["a", "b", "c"]
    m = RequestMembership(capacity=100)
    m.note_schedule(1, _sched(ids[:2], [3, 3], new=ids[:2]))
    m.note_wave(1, SimpleNamespace(req_ids=ids[:2], sampled_token_ids=[[1], [1]]), 2)
    first = guard_pb2.Batch(rank=guard_pb2.RankInfo(run_id="r"))  # a stream's first batch
    m.fill_batch(first)
    assert list(first.request_columns.name_request_id) == ["a", "b"]
    m.note_schedule(2, _sched(ids, [1, 1, 3], new=["c"]))
    m.note_wave(2, SimpleNamespace(req_ids=list(ids), sampled_token_ids=[[1]] * 3), 3)
    later = guard_pb2.Batch()
    m.fill_batch(later)
    assert list(later.request_columns.name_request_id) == ["c"]
    again = guard_pb2.Batch(rank=guard_pb2.RankInfo(run_id="r"))  # reconnected
    m.fill_batch(again)
    assert sorted(again.request_columns.name_request_id) == ids
    assert not len(again.request_columns.wave)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_churn_in_vllms_persistent_batch_is_predicted_and_every_request_still_adds_up(
    tmp_path, layout
) -> None:
    """Many short requests, so some finish and others join almost every wave. In vLLM's slot
    layout the membership follows the batch without looking every id up; a reorder or the
    join-order layout falls back to the full map. Either way each request's trace is the truth."""
    reqs = [
        SimRequest(
            f"cmpl-{i}-0", prompt=3 + i % 7, max_tokens=2 + (5 * i) % 9, arrive_wave=1 + i // 3
        )
        for i in range(60)
    ]
    sim = Sim(reqs, budget=256, preempt={13: "cmpl-30-0"}, **LAYOUTS[layout])
    processor = guarded()
    batches = drive(processor, sim)
    assert processor.errors.total == 0
    assert sum(r.preemptions for r in reqs) == 1
    membership = processor.membership
    changed = sum(1 for w in range(1, sim.wave + 1) if _changed(reqs, w))
    if layout == "slots":  # the preemption's return (and the first wave) are mapped in full
        assert membership.full_maps <= 4, (membership.full_maps, changed)
    else:
        assert membership.full_maps >= changed // 2, (membership.full_maps, changed)
    store, path = store_batches(tmp_path, batches)
    conn = connect(path, readonly=True)
    for req in reqs:
        (trace,) = request_spans.request_traces(conn, req.req_id)
        assert {w.wave: (w.scheduled, w.sampled) for w in trace.waves} == req.waves, req.req_id
        assert trace.sampled_tokens() == req.max_tokens
    store.close()


def _changed(reqs: list[SimRequest], wave: int) -> bool:
    """The batch's make-up differs from the wave before's."""
    now = {r.req_id for r in reqs if wave in r.waves}
    before = {r.req_id for r in reqs if wave - 1 in r.waves}
    return now != before


def test_membership_drop_series_go_when_their_engine_leaves() -> None:
    """The roster forgets an engine through each collector; the drop counts are one."""
    from prometheus_client import CollectorRegistry, generate_latest

    from telemetry.crossrank.roster import forget_label

    writer = request_store.RequestWriter()
    registry = CollectorRegistry()
    registry.register(request_metrics.RequestMetrics(writer))
    for engine in ("left", "stays"):
        batch = guard_pb2.Batch()
        batch.request_columns.dropped_rows_total = 3
        rank = guard_pb2.RankInfo(run_id="r", engine=engine, tp_size=1, dp_size=1, pp_size=1, pid=7)
        writer.collect(1, rank, engine, batch)
    name = "ascend_guard_request_membership_dropped_total"
    text = generate_latest(registry).decode()
    assert value(text, name, engine="left", kind="rows") == value(text, name, engine="stays") == 3
    assert forget_label(registry, "engine", "left") == 1
    text = generate_latest(registry).decode()
    assert not samples(text, name, engine="left")
    assert value(text, name, engine="stays", kind="rows") == 3
