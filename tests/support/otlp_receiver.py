"""A real OTLP/gRPC trace receiver process that keeps every span it is sent.

It is the OpenTelemetry protocol package's TraceService server, standing in for an OpenTelemetry
Collector (whose binary is not installable here): what it stores is what any OTel backend would
be handed. It runs as its own process (`python -m tests.support.otlp_receiver`), as a Collector
would, and appends each export request it accepts to a file, length-prefixed; the test's
`Receiver` reads that file back and decodes it with opentelemetry-proto.
"""

from __future__ import annotations

import argparse
import os
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from tests.support.ports import free_port

REPO = Path(__file__).resolve().parents[2]
FRAME = struct.Struct("<I")  # each export request: its length, then its bytes
READY = "otlp receiver ready"


class Receiver:
    """What the receiver process was sent so far: spans, and each span's resource, in arrival
    order. Reads the process's file anew on each access."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = threading.Lock()  # held by callers that read spans and resources together
        self._offset = 0
        self._spans: list = []
        self._resources: list = []
        self._read = threading.Lock()

    def _load(self) -> None:
        with self._read:
            try:
                with open(self.path, "rb") as f:
                    f.seek(self._offset)
                    data = f.read()
            except FileNotFoundError:
                return
            at = 0
            while at + FRAME.size <= len(data):
                (size,) = FRAME.unpack_from(data, at)
                if at + FRAME.size + size > len(data):
                    break  # a frame still being written
                request = trace_service_pb2.ExportTraceServiceRequest.FromString(
                    data[at + FRAME.size : at + FRAME.size + size]
                )
                for resource_spans in request.resource_spans:
                    for scope_spans in resource_spans.scope_spans:
                        self._spans.extend(scope_spans.spans)
                        self._resources.extend([resource_spans.resource] * len(scope_spans.spans))
                at += FRAME.size + size
            self._offset += at

    @property
    def spans(self) -> list:
        self._load()
        return self._spans

    @property
    def resources(self) -> list:
        self._load()
        return self._resources

    def snapshot(self) -> list:
        return list(self.spans)


@contextmanager
def otlp_receiver() -> Iterator[tuple[Receiver, int]]:
    """A receiver process listening on a free loopback port: (its reader, the port)."""
    import tempfile

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="otlp-receiver-") as tmp:
        out = Path(tmp) / "requests.bin"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join((str(REPO), os.environ.get("PYTHONPATH", ""))),
        }
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.otlp_receiver", "--port", str(port), "--out", str(out)],
            stdout=subprocess.PIPE, text=True, env=env, cwd=REPO,
        )  # fmt: skip
        try:
            line = proc.stdout.readline() if proc.stdout else ""
            if READY not in line:
                proc.kill()
                raise RuntimeError(
                    f"the OTLP receiver did not start (exit {proc.wait()}): {line!r}"
                )
            receiver = Receiver(out)
            yield receiver, port
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if READY in line:
            receiver._load()  # everything it was sent, read before its file goes


def serve(port: int, out: Path) -> None:
    """The receiver process: accept trace exports on `port`, append each to `out`."""
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    lock = threading.Lock()
    sink = open(out, "ab")  # noqa: SIM115 - open as long as the process

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802 - gRPC method name
            data = request.SerializeToString()
            with lock:
                sink.write(FRAME.pack(len(data)) + data)
                sink.flush()
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print(READY, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    import signal

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    serve(args.port, args.out)
