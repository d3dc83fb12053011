"""End to end: a gateway's W3C `traceparent` joins vLLM's request span and the guard's request
trace, both exported to one OTLP receiver.

A real `vllm serve` at TP=2 on CPU with its own tracing on (`--otlp-traces-endpoint`), the
guard on, and a real sidecar exporting over OTLP (`--otlp-endpoint`), both to the same real
OTLP/gRPC receiver (tests/support/otlp_receiver.py: the OpenTelemetry protocol package's
TraceService server; spans decoded with opentelemetry-proto), standing in for a Collector.

Three requests go through the OpenAI API: one with a traceparent (a gateway's trace and span),
one without, one with a malformed traceparent. Checked against what vLLM itself exports:
vLLM's `llm_request` span of the first request is in the gateway's trace, a child of the
gateway's span; the guard's request trace of that request links to exactly that trace and
span, and its wave spans link to wave traces the receiver also holds. The request without a
header has no such link, and the malformed one is counted, not linked.

The scheduler output crosses a process boundary at TP=2 (the engine core pickles it to both
workers), which is the path the traceparent rides.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from tests.support.metrics import value
from tests.support.otlp_receiver import otlp_receiver
from tests.support.ready import wait_until
from tests.support.sidecar import SidecarProcess
from tests.support.vllm_server import VllmServer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ENGINE = "traced"


def _attrs(kvs) -> dict:
    out = {}
    for kv in kvs:
        v = kv.value
        kind = v.WhichOneof("value")
        out[kv.key] = getattr(v, kind) if kind else None
    return out


def test_a_requests_traceparent_joins_vllms_span_and_the_guards_request_trace(
    tiny_model, tmp_path: Path
) -> None:
    gateway_trace, gateway_span = secrets.token_hex(16), secrets.token_hex(8)
    header = f"00-{gateway_trace}-{gateway_span}-01"
    malformed = f"00-{'0' * 32}-{gateway_span}-01"  # an all-zero trace id
    with otlp_receiver() as (receiver, port):
        endpoint = f"http://127.0.0.1:{port}"
        sock = tmp_path / "guard.sock"
        sidecar = SidecarProcess.start(
            tmp_path,
            address=f"unix://{sock}",
            extra_args=("--otlp-endpoint", endpoint, "--otlp-keep-one-in", "1"),
        )
        server = None
        try:
            server = VllmServer.start(
                tiny_model,
                tmp_path,
                tp=2,
                guard={"sidecar": f"unix://{sock}", "engine": ENGINE, "flush_interval_ms": 20},
                extra_args=("--otlp-traces-endpoint", endpoint),
            )
            traced = server.complete(
                "A gateway sent this request", 8, headers={"traceparent": header}
            )
            plain = server.complete("This one came without a trace", 8)
            broken = server.complete("And this one with a broken one", 8,
                                     headers={"traceparent": malformed})  # fmt: skip
            ids = {"traced": traced["id"], "plain": plain["id"], "broken": broken["id"]}

            def ours():
                roots = {}
                for span in receiver.snapshot():
                    if span.name != "request":
                        continue
                    request_id = _attrs(span.attributes).get("ascend_guard.request_id", "")
                    for name, api_id in ids.items():
                        if request_id.startswith(api_id):
                            roots[name] = span
                return roots if len(roots) == len(ids) else None

            def vllms():
                found = [s for s in receiver.snapshot() if s.name == "llm_request"]
                return found if len(found) >= len(ids) else None

            roots = wait_until(
                ours, 60, "request traces of all three requests from the sidecar", 0.2
            )
            llm_spans = wait_until(vllms, 60, "llm_request spans from vLLM", 0.2)
            metrics = sidecar.metrics_text()
        finally:
            if server is not None:
                server.stop()
            sidecar.stop()
        spans = receiver.snapshot()

    # vLLM's own request span joined the gateway's trace, as a child of the gateway's span
    by_request = {_attrs(s.attributes).get("gen_ai.request.id", ""): s for s in llm_spans}
    (vllm_traced,) = [s for rid, s in by_request.items() if rid.startswith(ids["traced"])]
    assert vllm_traced.trace_id.hex() == gateway_trace
    assert vllm_traced.parent_span_id.hex() == gateway_span
    for name in ("plain", "broken"):  # no (valid) traceparent: vLLM starts a trace of its own
        (span,) = [s for rid, s in by_request.items() if rid.startswith(ids[name])]
        assert span.trace_id.hex() != gateway_trace

    # ours links to exactly that trace and span: the one vLLM's span hangs off
    (link,) = roots["traced"].links
    assert link.trace_id.hex() == vllm_traced.trace_id.hex() == gateway_trace
    assert link.span_id.hex() == vllm_traced.parent_span_id.hex() == gateway_span
    assert link.flags & 0xFF == 0x01 and link.flags & 0x300 == 0x300  # sampled, remote
    assert _attrs(link.attributes) == {"ascend_guard.link": "traceparent"}
    assert not roots["plain"].links and not roots["broken"].links
    # no other span of ours links to the gateway's trace
    gateway, root_id = bytes.fromhex(gateway_trace), roots["traced"].span_id
    linked = [s.name for s in spans for x in s.links if x.trace_id == gateway]
    assert linked == ["request"] and sum(s.span_id == root_id for s in spans) == 1

    # and on to the waves: each of its wave spans links to a wave trace the receiver holds
    trace_id = roots["traced"].trace_id
    steps = [s for s in spans if s.trace_id == trace_id and s.name in ("prefill", "decode")]
    assert steps, "the traced request ran in no wave"
    wave_roots = {s.trace_id for s in spans if s.name == "wave"}
    for step in steps:
        (wave_link,) = step.links
        assert wave_link.trace_id in wave_roots

    # the sidecar counted one linked and one malformed traceparent
    name = "ascend_guard_request_traceparents_total"
    assert value(metrics, name, engine=ENGINE, outcome="linked") == 1, metrics
    assert value(metrics, name, engine=ENGINE, outcome="malformed") == 1, metrics
