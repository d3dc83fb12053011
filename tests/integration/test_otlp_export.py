"""`--otlp-endpoint`: the sidecar exports the wave spans over OTLP/gRPC.

The receiver is a real OTLP/gRPC TraceService server from the OpenTelemetry protocol package,
standing in for an OpenTelemetry Collector (whose binary is not installable here). It checks
what any OTel backend would see: one trace per wave whose id is the deterministic wave id.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from telemetry.traces import format_trace_id, wave_trace_id
from tests.support.feed import send_waves
from tests.support.ports import free_port
from tests.support.sidecar import SidecarProcess

pytestmark = pytest.mark.timeout(120)


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans = []
        self.lock = threading.Lock()

    def Export(self, request, context):  # noqa: N802 - gRPC method name
        with self.lock:
            for resource_spans in request.resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend(scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def receiver():
    port = free_port()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    servicer = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    yield servicer, port
    server.stop(0)


def test_wave_spans_reach_an_otlp_receiver(receiver, tmp_path: Path) -> None:
    servicer, port = receiver
    sidecar = SidecarProcess.start(
        tmp_path, extra_args=("--otlp-endpoint", f"http://127.0.0.1:{port}")
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
