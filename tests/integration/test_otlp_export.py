"""`--otlp-endpoint`: the sidecar exports the wave spans over OTLP/gRPC, tail-sampled.

The receiver is a real OTLP/gRPC TraceService server from the OpenTelemetry protocol package
(tests/support/otlp_receiver.py), standing in for an OpenTelemetry Collector (whose binary is
not installable here). It checks what any OTel backend would see: one trace per wave whose id is the deterministic wave id, the
same spans `ascend-guard trace` builds from the store, and the sampling policy's choice.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from opentelemetry.proto.trace.v1 import trace_pb2

from telemetry.export.otlp import sampled
from telemetry.store import connect
from telemetry.wire.trace_ids import format_trace_id, wave_trace_id
from tests.support.feed import attach_reporter, make_streamer, send_waves, wave_tuple
from tests.support.otlp_receiver import otlp_receiver
from tests.support.sidecar import SidecarProcess
from tests.support.store import trace_spans

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def receiver():
    with otlp_receiver() as (servicer, port):
        yield servicer, port


def test_wave_spans_reach_an_otlp_receiver(receiver, tmp_path: Path) -> None:
    servicer, port = receiver
    sidecar = SidecarProcess.start(
        tmp_path,
        extra_args=("--otlp-endpoint", f"http://127.0.0.1:{port}", "--otlp-keep-one-in", "1"),
    )
    try:
        send_waves(sidecar.address, ranks=((0, 0, 0), (0, 1, 0)), waves=10, run_id="run-otlp")
    finally:
        sidecar.stop()  # flushes the batch span processors
    deadline = time.monotonic() + 10
    while len(servicer.spans) < 70 and time.monotonic() < deadline:
        time.sleep(0.1)
    spans = list(servicer.spans)
    # per wave: 1 wave root + 2 rank spans + 2 x (execute_model, sample_tokens)
    assert len(spans) == 10 * 7
    by_trace: dict[str, list] = {}
    for span in spans:
        by_trace.setdefault(span.trace_id.hex(), []).append(span)
    assert set(by_trace) == {format_trace_id(wave_trace_id("run-otlp", w, 0)) for w in range(1, 11)}
    for members in by_trace.values():
        names = sorted(s.name for s in members)
        assert names == sorted(["wave", "rank", "rank"] + ["execute_model", "sample_tokens"] * 2)
        root = next(s for s in members if s.name == "wave")
        ranks = [s for s in members if s.name == "rank"]
        assert all(s.parent_span_id == root.span_id for s in ranks)
    # the same spans, with the same ids, as the store builds for `ascend-guard trace`
    trace = format_trace_id(wave_trace_id("run-otlp", 3, 0))
    stored = {
        (s.name, s.span_id.to_bytes(8, "big"), s.start_ns, s.end_ns)
        for s in trace_spans(sidecar.store_path, trace)
    }
    exported = {
        (s.name, s.span_id, s.start_time_unix_nano, s.end_time_unix_nano) for s in by_trace[trace]
    }
    assert stored == exported


def test_tail_sampling_keeps_slow_waves_incident_waves_and_one_in_n(receiver, tmp_path):
    servicer, port = receiver
    keep_one_in = 7
    sidecar = SidecarProcess.start(
        tmp_path,
        extra_args=(
            "--otlp-endpoint",
            f"http://127.0.0.1:{port}",
            "--otlp-keep-one-in",
            str(keep_one_in),
            "--otlp-slow-wave",
            "40ms",
        ),
    )
    slow = {5, 17}
    streamer = make_streamer(sidecar.address, run_id="run-tail")
    reporter = attach_reporter(streamer, "run-tail", wave=23)
    try:
        for n in range(1, 41):
            streamer.offer(wave_tuple(n, execute_ns=50_000_000 if n in slow else 2_000_000))
        reporter.report("logits_finite", "error", "nan", request_id="r1")
        streamer.start()
        deadline = time.monotonic() + 10
        while (
            streamer.sent_waves < 40 or streamer.incidents_sent < 1
        ) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)
    finally:
        streamer.stop()
        sidecar.stop()
    deadline = time.monotonic() + 10
    expected = {n for n in range(1, 41) if sampled(n, keep_one_in)} | slow | {23}
    while time.monotonic() < deadline:
        waves = {int.from_bytes(s.trace_id[8:], "big") for s in servicer.spans if s.name == "rank"}
        if waves >= expected:
            break
        time.sleep(0.1)
    assert waves == expected, (sorted(waves), sorted(expected))
    assert 0 < len(expected - slow - {23}) < 40  # the 1-in-N rule kept some and left others
    names = {s.name for s in servicer.spans}
    assert "incident:logits_finite" in names
    # the wave roots say why each was kept, so a Collector downstream can keep what is marked
    kept_for = {
        int.from_bytes(s.trace_id[8:], "big"): _attrs(s.attributes)["ascend_guard.kept_for"]
        for s in servicer.spans
        if s.name == "wave"
    }
    assert kept_for[23] == "incident" and kept_for[5] == kept_for[17] == "slow"
    assert {kept_for[w] for w in expected - slow - {23}} == {"sampled"}
    (incident,) = [s for s in servicer.spans if s.name == "incident:logits_finite"]
    assert incident.status.code == trace_pb2.Status.STATUS_CODE_ERROR


def _attrs(kvs) -> dict:
    out = {}
    for kv in kvs:
        v = kv.value
        out[kv.key] = getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None
    return out


def test_request_traces_reach_the_receiver_linked_both_ways_under_their_workload(
    receiver, tmp_path, monkeypatch
) -> None:
    """Two ranks of a TP group run simulated vLLM steps (tests/support/request_sim.py: no vLLM
    here) through the real processor and streamer; the sidecar exports over OTLP. Every finished
    request's trace arrives whole, its wave spans link to the wave traces and the wave roots
    link back; each span's resource names the engine, the workload's pod and the rank. The
    request that came with a W3C traceparent (a gateway's trace) has its root link to exactly
    that trace and span; the others have no root link."""
    from telemetry.wire.trace_ids import request_trace_id
    from tests.support.request_sim import RANK, Sim, SimRequest, drive, guarded

    servicer, port = receiver
    monkeypatch.setenv("ASCEND_GUARD_POD_NAME", "vllm-qwen-0")
    monkeypatch.setenv("ASCEND_GUARD_POD_NAMESPACE", "serving")
    monkeypatch.setenv("ASCEND_GUARD_NODE_NAME", "node-7")
    sidecar = SidecarProcess.start(
        tmp_path,
        extra_args=("--otlp-endpoint", f"http://127.0.0.1:{port}", "--otlp-keep-one-in", "1"),
    )
    truth = []
    gateway = (0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331)
    traceparent = f"00-{gateway[0]:032x}-{gateway[1]:016x}-01"
    try:
        for tp in (0, 1):
            reqs = [
                SimRequest(
                    f"cmpl-ot{i}-0",
                    prompt=10 + 30 * i,
                    max_tokens=5 + i,
                    arrive_wave=1 + 2 * i,
                    traceparent=traceparent if i == 1 else None,
                )
                for i in range(5)
            ]
            processor = guarded(tp=tp, sidecar=sidecar.address)
            drive(processor, Sim(reqs, budget=64))
            processor.close()
            truth = truth or reqs
        run, engine = RANK["run_id"], RANK["engine"]
        # the requests whose finish the store committed (the simulation ends before the last
        # one's finish is reported: an unfinished request's trace is not exported)
        conn = connect(sidecar.store_path, readonly=True)
        finished = {r for (r,) in conn.execute("SELECT request_id FROM requests WHERE end_ns > 0")}
        conn.close()
        assert len(finished) >= 4, finished
        wanted = {
            request_trace_id(run, engine, 0, r.req_id): r for r in truth if r.req_id in finished
        }
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            roots = {
                int.from_bytes(s.trace_id, "big")
                for s in servicer.snapshot()
                if s.name == "request"
            }
            if roots >= set(wanted):
                break
            time.sleep(0.1)
    finally:
        sidecar.stop()
    with servicer.lock:
        pairs = list(zip(servicer.spans, servicer.resources, strict=True))
    by_trace: dict[int, list] = {}
    for span, res in pairs:
        by_trace.setdefault(int.from_bytes(span.trace_id, "big"), []).append(
            (span, _attrs(res.attributes))
        )
    assert any(r.traceparent for r in wanted.values())  # the traced request finished
    for trace_id, req in wanted.items():
        members = by_trace.get(trace_id, [])
        (root,) = [s for s, _ in members if s.name == "request"]
        assert _attrs(root.attributes)["ascend_guard.request_id"] == req.req_id
        if req.traceparent:  # linked to the gateway's trace and span, sampled, remote
            (link,) = root.links
            linked = (int.from_bytes(link.trace_id, "big"), int.from_bytes(link.span_id, "big"))
            assert linked == gateway and link.flags == 0x301
        else:
            assert not root.links
        steps = {
            _attrs(s.attributes)["ascend_guard.wave"]: s
            for s, _ in members
            if s.name in ("prefill", "decode")
        }
        assert set(steps) == set(req.waves), req.req_id  # one span per wave it ran in
        for wave, span in steps.items():
            (link,) = span.links
            assert int.from_bytes(link.trace_id, "big") == wave_trace_id(run, wave, 0)
        for _, res in members:  # the replica's resource: engine, workload, no one rank
            assert res["service.name"] == engine and res["k8s.pod.name"] == "vllm-qwen-0"
            assert res["k8s.namespace.name"] == "serving" and "ascend_guard.tp" not in res
    # no trace of the unfinished request went out
    unfinished = {request_trace_id(run, engine, 0, r.req_id) for r in truth} - set(wanted)
    assert not unfinished & set(by_trace)
    # wave roots link back to the requests they ran, and say why they were kept
    for wave in (1, 3):
        (root,) = [s for s, _ in by_trace[wave_trace_id(run, wave, 0)] if s.name == "wave"]
        linked = {int.from_bytes(link.trace_id, "big") for link in root.links}
        ran = {request_trace_id(run, engine, 0, r.req_id) for r in truth if wave in r.waves}
        assert ran and linked == ran, (wave, linked, ran)
        assert _attrs(root.attributes)["ascend_guard.kept_for"] == "sampled"
    # a rank's spans carry that rank's resource: its pid, its coordinates, the workload's node
    rank_resources = [_attrs(res.attributes) for span, res in pairs if span.name == "rank"]
    assert {res["ascend_guard.tp"] for res in rank_resources} == {0, 1}
    assert all(
        res["process.pid"] == RANK["pid"] and res["k8s.node.name"] == "node-7"
        for res in rank_resources
    )
    assert all(res["service.instance.id"].startswith(f"{run}/dp0/tp") for res in rank_resources)
