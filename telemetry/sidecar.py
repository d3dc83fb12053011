"""The node sidecar: gRPC ingest, Prometheus `/metrics`, traces into the store (and OTLP)."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import threading
from concurrent import futures
from pathlib import Path

import grpc
import structlog
from prometheus_client import Counter, start_http_server

from guard.liveness_record import RecordReader
from telemetry.addresses import address_problem, unix_socket_path
from telemetry.crossrank import CrossRankView
from telemetry.hangs import HangSettings
from telemetry.incidents import IncidentLedger
from telemetry.ingest import DEFAULT_MAX_MESSAGE_BYTES, IngestService
from telemetry.liveness import LivenessServer
from telemetry.metrics import SidecarMetrics
from telemetry.store import SqliteSpanExporter
from telemetry.traces import WaveTracer, build_provider
from telemetry.transport import (
    ServerSecurity,
    TokenInterceptor,
    TransportConfigError,
    exposure_problem,
    grpc_server_credentials,
    start_metrics_server,
    tcp_host,
)

log = structlog.get_logger("ascend_guard.sidecar")

# Memory guard: gRPC buffers a whole message before the sidecar sees it.
GRPC_HARD_CAP_BYTES = 64 * 1024 * 1024


@dataclasses.dataclass
class SidecarSettings:
    listen: str
    metrics_host: str = "0.0.0.0"
    metrics_port: int = 9464
    store: str = ""
    otlp_endpoint: str | None = None
    retention_s: float = 24 * 3600
    max_spans: int = 5_000_000
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_streams: int = 256
    # liveness endpoint /live/<engine>: -1 = metrics port + 1 if free, 0 = off
    health_host: str = "0.0.0.0"
    health_port: int = -1
    hang_stale_s: float = 2.0
    hang_wait_s: float = 3.0
    hang_frozen_s: float = 1.0
    # liveness records of ranks on this node (guard/liveness_record.py); "" = its default
    liveness_dir: str = ""
    # TLS / mTLS / bearer token of the gRPC and HTTP listeners (telemetry/transport.py)
    security: ServerSecurity = dataclasses.field(default_factory=ServerSecurity)
    straggler_threshold_s: float = 0.05


class SidecarStartError(RuntimeError):
    """The sidecar cannot start; the message says what is in the way."""


def _claim_socket(path: str) -> None:
    """Remove a stale socket file, but refuse to take over a live sidecar's socket."""
    if not os.path.exists(path):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # nobody listens: a leftover from a sidecar that died
        return
    finally:
        probe.close()
    raise SidecarStartError(
        f"another process is already listening on {path}; stop it or pick another --listen"
    )


class Sidecar:
    def __init__(self, settings: SidecarSettings) -> None:
        self.settings = settings
        self.metrics = SidecarMetrics()
        exporters = [
            SqliteSpanExporter(
                settings.store, retention_s=settings.retention_s, max_spans=settings.max_spans
            )
        ]
        self.store_exporter = exporters[0]
        if settings.otlp_endpoint:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporters.append(OTLPSpanExporter(endpoint=settings.otlp_endpoint, insecure=True))
        self.provider, ids = build_provider(exporters, socket.gethostname())
        tracer = WaveTracer(self.provider, ids)
        self.incidents = IncidentLedger(
            settings.store,
            counter=self.metrics.incidents,
            spanner=tracer.record_incident,
            retention_s=max(settings.retention_s, 7 * 24 * 3600),
        )
        self.ingest = IngestService(
            self.metrics,
            tracer,
            max_message_bytes=settings.max_message_bytes,
            incidents=self.incidents,
        )
        self.cross_rank = CrossRankView(
            self.metrics.registry,
            hang_settings=HangSettings(
                stale_s=settings.hang_stale_s,
                wait_s=settings.hang_wait_s,
                frozen_s=settings.hang_frozen_s,
            ),
            straggler_threshold_s=settings.straggler_threshold_s,
            incident_sink=self.incidents.add,
            records=RecordReader(settings.liveness_dir),
        )
        self.ingest.cross_rank = self.cross_rank
        self.auth_refused = Counter(
            "ascend_guard_auth_refused",
            "Calls and requests refused for a missing or wrong bearer token, per listener",
            ["listener"],
            registry=self.metrics.registry,
        )
        self.liveness: LivenessServer | None = None
        self._server: grpc.Server | None = None
        self._http = None
        self._token: str | None = None
        self._stopped = threading.Event()

    def start(self) -> None:
        settings = self.settings
        problem = address_problem(settings.listen)
        if problem:
            raise SidecarStartError(f"--listen {settings.listen!r} is not an address; {problem}")
        security = settings.security
        problem = security.problem() or exposure_problem(
            "gRPC ingest", tcp_host(settings.listen) or "127.0.0.1", security
        )
        if problem:
            raise SidecarStartError(problem)
        try:
            token = security.token()
            credentials = grpc_server_credentials(security) if security.tls else None
        except TransportConfigError as exc:
            raise SidecarStartError(str(exc)) from exc
        self._token = token
        unix_path = unix_socket_path(settings.listen)
        if unix_path:
            _claim_socket(unix_path)
        refused = self.auth_refused.labels("grpc")
        server = grpc.server(
            futures.ThreadPoolExecutor(
                max_workers=settings.max_streams + 8, thread_name_prefix="ingest"
            ),
            handlers=[self.ingest.handler()],
            interceptors=[TokenInterceptor(token, refused.inc)] if token else None,
            maximum_concurrent_rpcs=settings.max_streams,
            options=[
                # gRPC's own cap sits well above ours so that oversize is answered (and counted)
                # by IngestService; only messages past GRPC_HARD_CAP_BYTES are refused by gRPC.
                (
                    "grpc.max_receive_message_length",
                    max(GRPC_HARD_CAP_BYTES, settings.max_message_bytes * 2),
                ),
                ("grpc.so_reuseport", 0),
            ],
        )
        try:
            if credentials is not None:
                bound = server.add_secure_port(settings.listen, credentials)
            else:
                bound = server.add_insecure_port(settings.listen)
        except RuntimeError as exc:
            raise SidecarStartError(f"cannot listen on {settings.listen}: {exc}") from exc
        if not bound and not unix_path:
            raise SidecarStartError(
                f"cannot listen on {settings.listen}: address in use or invalid"
            )
        try:
            if security.tls or (token and not security.metrics_open):
                self._http = start_metrics_server(
                    self.metrics.registry,
                    settings.metrics_host,
                    settings.metrics_port,
                    security,
                    self.auth_refused.labels("metrics").inc,
                )
            else:
                self._http, _ = start_http_server(
                    settings.metrics_port, settings.metrics_host, registry=self.metrics.registry
                )
        except TransportConfigError as exc:
            server.stop(0)
            raise SidecarStartError(str(exc)) from exc
        except OSError as exc:
            server.stop(0)
            raise SidecarStartError(
                f"cannot serve /metrics on {settings.metrics_host}:{settings.metrics_port}: {exc.strerror}"
            ) from exc
        try:
            self._start_liveness()
        except SidecarStartError:
            server.stop(0)
            raise
        server.start()
        self._server = server
        self.cross_rank.start()
        log.info(
            "sidecar_ready", listen=settings.listen, metrics=f"http://{settings.metrics_host}:{settings.metrics_port}/metrics",
            store=settings.store, otlp=settings.otlp_endpoint or "off",
        )  # fmt: skip

    def stop(self, grace_s: float = 2.0) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._server is not None:
            self._server.stop(grace_s).wait(grace_s + 1)
        self.cross_rank.stop()
        if self.liveness is not None:
            self.liveness.stop()
        self.provider.shutdown()  # flushes pending spans into the store
        self.incidents.close()
        if self._http is not None:
            self._http.shutdown()
        unix_path = unix_socket_path(self.settings.listen)
        if unix_path and os.path.exists(unix_path):
            os.unlink(unix_path)
        log.info("sidecar_stopped", spans_stored=self.store_exporter.exported)

    def _start_liveness(self) -> None:
        settings = self.settings
        port = settings.health_port
        if port == 0:
            return
        try:
            self.liveness = LivenessServer(
                self.cross_rank,
                settings.health_host,
                settings.metrics_port + 1 if port < 0 else port,
                security=settings.security,
                token=self._token,
                on_refused=self.auth_refused.labels("http").inc,
            )
        except OSError as exc:
            if port > 0:
                if self._http is not None:
                    self._http.shutdown()
                raise SidecarStartError(
                    f"cannot serve /live on {settings.health_host}:{port}: {exc.strerror}"
                ) from exc
            log.warning("liveness_port_busy", port=settings.metrics_port + 1, error=exc.strerror)
            return
        self.liveness.start()
        log.info(
            "liveness_ready",
            url=f"http://{settings.health_host}:{self.liveness.port}/live/<engine>",
        )

    def serve_forever(self) -> None:
        """Run until SIGINT or SIGTERM, then stop cleanly."""
        done = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: done.set())
        self.start()
        done.wait()
        self.stop()
