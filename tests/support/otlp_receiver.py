"""A real OTLP/gRPC trace receiver that keeps every span it is sent.

It is the OpenTelemetry protocol package's TraceService server, standing in for an OpenTelemetry
Collector (whose binary is not installable here): what it stores is what any OTel backend would
be handed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from tests.support.ports import free_port


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans = []
        self.resources = []  # (resource, span) pairs' resources, in arrival order
        self.lock = threading.Lock()

    def Export(self, request, context):  # noqa: N802 - gRPC method name
        with self.lock:
            for resource_spans in request.resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend(scope_spans.spans)
                    self.resources.extend([resource_spans.resource] * len(scope_spans.spans))
        return trace_service_pb2.ExportTraceServiceResponse()

    def snapshot(self) -> list:
        with self.lock:
            return list(self.spans)


@contextmanager
def otlp_receiver() -> Iterator[tuple[Receiver, int]]:
    """A started receiver on a free loopback port: (servicer, port)."""
    port = free_port()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    servicer = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        yield servicer, port
    finally:
        server.stop(0)
