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

from telemetry.export.otlp import sampled
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
