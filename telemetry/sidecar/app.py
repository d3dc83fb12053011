"""The node sidecar: gRPC ingest, Prometheus `/metrics`, the record store, OTLP export.

    ingest (gRPC handlers) -> BoundedQueue -> Writer -> [metrics, store, OTLP exporter]

See telemetry/pipeline/writer.py for the split, telemetry/store/ for the tables and
telemetry/export/otlp.py for the sampling policy."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import structlog
from prometheus_client import start_http_server

from telemetry.crossrank.bundle import BundleSettings, BundleWriter
from telemetry.crossrank.hangs import HangSettings
from telemetry.crossrank.liveness import LivenessServer
from telemetry.crossrank.rank_gauges import RankGauges
from telemetry.crossrank.roster import EngineRoster
from telemetry.crossrank.view import CrossRankView
from telemetry.export.otlp import ExportSettings, OtlpExporter
from telemetry.ingest.ring_drain import RingDrainer
from telemetry.ingest.service import IngestService
from telemetry.metrics.auth import auth_refused_counter
from telemetry.metrics.bundles import BundleMetrics
from telemetry.metrics.requests import RequestMetrics
from telemetry.metrics.sink import MetricsSink
from telemetry.metrics.store import StoreMetrics
from telemetry.metrics.waves import SidecarMetrics
from telemetry.metrics.workload import WorkloadInfo
from telemetry.pipeline.writer import (
    BoundedQueue,
    Drops,
    Writer,
)
from telemetry.sidecar.errors import SidecarStartError
from telemetry.sidecar.settings import SidecarSettings
from telemetry.sidecar.sockets import claim_socket, secure_socket, socket_gid
from telemetry.store import Store, prepare_store
from telemetry.store.budget import budget_problem
from telemetry.store.incidents import IncidentLedger
from telemetry.tempo_api import TempoApiServer
from telemetry.wire import build_info, paths
from telemetry.wire.addresses import address_problem, unix_socket_path
from telemetry.wire.liveness_record import RecordReader
from telemetry.wire.transport import (
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


def _stream_checks(settings: SidecarSettings) -> list[tuple[str, int]]:
    """gRPC server options: how often it pings a worker's connection, and how long a ping (or
    a settings change) may go unacknowledged before it closes the connection."""
    ping_ms = max(1, int(settings.stream_ping_timeout_s * 1000))
    return [
        ("grpc.keepalive_time_ms", max(1, int(settings.stream_keepalive_s * 1000))),
        ("grpc.keepalive_timeout_ms", ping_ms),
        ("grpc.http2.ping_timeout_ms", ping_ms),
        ("grpc.http2.settings_timeout", ping_ms),
    ]


class Sidecar:
    def __init__(self, settings: SidecarSettings) -> None:
        self.settings = settings
        self.metrics = SidecarMetrics()
        self.drops = Drops(self.metrics.registry)
        # a store file SQLite cannot use is moved aside before anything opens it: the sidecar
        # starts on a fresh store rather than not at all (telemetry/store/files.py)
        self.store_moved_to = prepare_store(settings.store) if settings.store else None
        # a budget the store's file system cannot hold would fill it before the cap rolls
        # anything out (telemetry/store/budget.py): refused, naming both sizes
        problem = settings.store and budget_problem(settings.store, settings.max_store_bytes)
        if problem:
            raise SidecarStartError(problem)
        self.store_metrics = StoreMetrics(self.metrics.registry)
        self.store_metrics.moved_aside = int(self.store_moved_to is not None)
        self.incidents = IncidentLedger(
            settings.store,
            counter=self.metrics.incidents,
            retention_s=max(settings.retention_s, 7 * 24 * 3600),
        )
        self.cross_rank = CrossRankView(
            self.metrics.registry,
            hang_settings=HangSettings(
                stale_s=settings.hang_stale_s,
                wait_s=settings.hang_wait_s,
                frozen_s=settings.hang_frozen_s,
                lost_linger_s=settings.engine_linger_s,
            ),
            straggler_threshold_s=settings.straggler_threshold_s,
            incident_sink=self.incidents.add,
            records=RecordReader(settings.liveness_dir),
        )
        self.bundles = self._bundle_writer()
        self.rank_gauges = RankGauges(self.cross_rank.hangs.rank_facts)
        self.metrics.registry.register(self.rank_gauges)
        self.queue = BoundedQueue(settings.queue_bytes, self.drops, self.metrics.registry)
        self.store, self.exporter, sinks = self._build_sinks()
        self.store_metrics.store = self.store
        self.writer = Writer(self.queue, sinks, self.drops)
        self.ingest = IngestService(
            self.metrics,
            self.queue,
            self.drops,
            max_message_bytes=settings.max_message_bytes,
            incidents=self.incidents,
            cross_rank=self.cross_rank,
        )
        self.rings = RingDrainer(self.ingest, settings.liveness_dir, settings.ring_poll_s)
        self.ingest.rings = self.rings
        self.roster = EngineRoster(
            self.metrics.registry,
            self.ingest.connected,
            linger_s=settings.engine_linger_s,
            connected_gauge=self.metrics.ranks_connected,
            held=self.cross_rank.hangs.holds,
        )
        # the workload's pod per rank; its entries linger as long as the engine's series
        self.ingest.workloads.linger_s = settings.engine_linger_s
        self.metrics.registry.register(WorkloadInfo(self.ingest.workloads))
        # hang verdicts and exits name each rank's pod, device and model from the same book
        self.cross_rank.hangs.workload_of = self.ingest.workloads.get
        self.ingest.on_engine_joined = self.roster.joined
        self.ingest.on_engine_idle = self.roster.idle
        self.ingest.check_engine = self.roster.check
        self.build_labels = build_info.build_labels("sidecar")
        self.metrics.probes["build_info"].labels("", "", "", "", *self.build_labels.values()).set(1)
        self.auth_refused = auth_refused_counter(self.metrics.registry)
        self.liveness: LivenessServer | None = None
        self.query_api: TempoApiServer | None = None
        self._server: grpc.Server | None = None
        self._http = None
        self._token: str | None = None
        self._stopped = threading.Event()

    def _bundle_writer(self) -> BundleWriter | None:
        """The evidence bundle writer, hooked into the hang checker (None: --bundle-dir off)."""
        directory = self.settings.bundle_dir or paths.bundle_dir()
        if directory == "off":
            return None
        writer = BundleWriter(
            BundleSettings(os.path.abspath(directory), liveness_dir=self.settings.liveness_dir),
            BundleMetrics(self.metrics.registry),
        )
        self.cross_rank.hangs.bundles = writer
        return writer

    def _build_sinks(self) -> tuple[Store, OtlpExporter | None, list]:
        """The writer's sinks, in order: metrics, store, OTLP exporter (when configured)."""
        settings = self.settings
        store = Store(
            settings.store, retention_s=settings.retention_s, max_bytes=settings.max_store_bytes
        )
        self.metrics.registry.register(RequestMetrics(store.requests))  # request membership
        sinks: list = [
            MetricsSink(self.metrics, self.cross_rank, self.drops, self.rank_gauges),
            store,
        ]
        exporter = None
        if settings.otlp_endpoint:
            if settings.otlp_requests not in ("all", "off"):
                raise SidecarStartError(f"--otlp-requests {settings.otlp_requests!r}: all or off")
            exporter = OtlpExporter(
                ExportSettings(
                    settings.otlp_endpoint,
                    slow_wave_s=settings.otlp_slow_wave_s,
                    keep_one_in=settings.otlp_keep_one_in,
                    requests=settings.otlp_requests == "all",
                ),
                self.drops,
                self.metrics.registry,
                socket.gethostname(),
                store_path=settings.store,
                workload_of=lambda *rank: self.ingest.workloads.get(rank),  # made below
            )
            self.incidents.listeners.append(exporter.on_incident)
            if exporter.settings.requests:
                store.requests.finished_listeners.append(exporter.on_requests_finished)
            sinks.append(exporter)
        return store, exporter, sinks

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
            claim_socket(unix_path)
            if settings.socket_group:
                socket_gid(settings.socket_group)  # refuse an unknown group before binding
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
                *_stream_checks(settings),
            ],
        )
        # no moment in which the socket is open to everyone: bind under a tight umask, then
        # set the asked mode and group
        old_umask = os.umask(0o177) if unix_path else None
        try:
            if credentials is not None:
                bound = server.add_secure_port(settings.listen, credentials)
            else:
                bound = server.add_insecure_port(settings.listen)
        except RuntimeError as exc:
            raise SidecarStartError(f"cannot listen on {settings.listen}: {exc}") from exc
        finally:
            if old_umask is not None:
                os.umask(old_umask)
        if not bound and not unix_path:
            raise SidecarStartError(
                f"cannot listen on {settings.listen}: address in use or invalid"
            )
        try:
            if settings.metrics_port == paths.PORT_OFF:
                pass  # --metrics-port 0: no /metrics, as 0 means off for every port flag
            elif security.tls or (token and not security.metrics_open):
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
            self._start_query_api()
        except SidecarStartError:
            server.stop(0)
            if self.liveness is not None:
                self.liveness.stop()
            raise
        self.writer.start()
        self.rings.start()
        if self.exporter is not None:
            self.exporter.start()
        old_umask = os.umask(0o177) if unix_path else None
        try:
            server.start()
        finally:
            if old_umask is not None:
                os.umask(old_umask)
        self._server = server
        if unix_path:
            try:
                secure_socket(unix_path, settings.socket_mode, settings.socket_group)
            except SidecarStartError:
                self.stop(0)
                raise
        if self.bundles is not None:
            self.bundles.start()
        self.cross_rank.start()
        if settings.publish:
            self._publish()
        log.info(
            "sidecar_ready",
            listen=settings.listen,
            metrics=f"http://{settings.metrics_host}:{settings.metrics_port}/metrics"
            if settings.metrics_port != paths.PORT_OFF
            else "off",
            store=settings.store,
            otlp=settings.otlp_endpoint or "off",
        )

    def stop(self, grace_s: float = 2.0) -> None:
        """Stop every part in order; the log line says how long each step took."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        log.info("sidecar_stopping")
        steps = _StopSteps()
        if self._server is not None:
            with steps("grpc"):
                self._server.stop(grace_s).wait(grace_s + 1)
        with steps("rings"):
            self.rings.stop()  # after the streams: their last waves are drained
        with steps("cross_rank"):
            self.cross_rank.stop()
            if self.bundles is not None:
                self.bundles.stop()
        with steps("roster"):
            self.roster.stop()
        if self.settings.publish:
            paths.remove_discovery(os.getpid())
        if self.liveness is not None:
            with steps("liveness"):
                self.liveness.stop()
        if self.query_api is not None:
            with steps("query_api"):
                self.query_api.stop()
        with steps("writer"):
            self.writer.stop()  # writes what is queued, then closes the sinks (store, exporter)
        with steps("incidents"):
            self.incidents.close()
        if self._http is not None:
            with steps("metrics_http"):
                self._http.shutdown()
        unix_path = unix_socket_path(self.settings.listen)
        if unix_path and os.path.exists(unix_path):
            os.unlink(unix_path)
        log.info(
            "sidecar_stopped",
            waves_received=self.ingest.received_records,
            waves_stored=self.store.stored_waves,
            dropped=dict(self.drops.totals),
            stop_ms=steps.ms,
        )

    def _start_liveness(self) -> None:
        settings = self.settings
        port = settings.health_port
        if port == 0:
            return
        try:
            self.liveness = LivenessServer(
                self.cross_rank,
                settings.health_host,
                port,
                routes={
                    "/coverage": lambda _rest: (
                        200,
                        self.roster.coverage(self.cross_rank.hangs.snapshot()),
                    )
                },
                security=settings.security,
                token=self._token,
                on_refused=self.auth_refused.labels("http").inc,
            )
        except OSError as exc:
            if self._http is not None:
                self._http.shutdown()
            raise SidecarStartError(
                f"cannot serve /live on {settings.health_host}:{port}: {exc.strerror} "
                "(--health-port: pick a free port, or 0 for none)"
            ) from exc
        self.liveness.start()
        log.info(
            "liveness_ready",
            url=f"http://{settings.health_host}:{self.liveness.port}/live/<engine>",
        )

    def _start_query_api(self) -> None:
        settings = self.settings
        port = paths.query_port(settings.metrics_port, settings.query_port)
        if port == 0:
            return
        try:
            self.query_api = TempoApiServer(
                settings.store,
                settings.query_host,
                port,
                self.metrics.registry,
                security=settings.security,
                token=self._token,
                on_auth_refused=self.auth_refused.labels("query").inc,
            )
        except OSError as exc:
            if self._http is not None:
                self._http.shutdown()
            raise SidecarStartError(
                f"cannot serve the query API on {settings.query_host}:{port}: {exc.strerror} "
                "(--query-port: pick a free port, or 0 for none)"
            ) from exc
        self.query_api.start()
        log.info("query_api_ready", url=f"http://{settings.query_host}:{self.query_api.port}/api")

    def _publish(self) -> None:
        """sidecar.json: how the CLI and probes on this host find this sidecar's files."""
        settings = self.settings
        local = (
            settings.health_host
            if settings.health_host not in ("0.0.0.0", "::", "")
            else "127.0.0.1"
        )
        query = (
            settings.query_host if settings.query_host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        )
        scheme = "https" if settings.security.tls else "http"  # both listeners share the TLS
        # a table: one row per line, columns aligned (fmt: skip)
        facts = {
            "pid": os.getpid(), "listen": settings.listen, "store": os.path.abspath(settings.store),
            "metrics_url": f"http://127.0.0.1:{settings.metrics_port}/metrics"
                           if settings.metrics_port != paths.PORT_OFF else "",
            "health_url": f"{scheme}://{local}:{self.liveness.port}" if self.liveness else "",
            "query_url": f"{scheme}://{query}:{self.query_api.port}" if self.query_api else "",
            "version": self.build_labels["version"], "wire": self.build_labels["wire"],
            "bundle_dir": self.bundles.settings.directory if self.bundles else "",
        }  # fmt: skip
        try:
            where = paths.write_discovery(facts)
        except OSError as exc:  # the CLI then needs flags; serving goes on
            log.warning("discovery_not_written", error=exc.strerror, dir=paths.runtime_dir())
            return
        log.info("discovery_written", path=where)

    def serve_forever(self) -> None:
        """Run until SIGINT or SIGTERM, then stop cleanly. SIGUSR1 writes every thread's stack
        to stderr, for a sidecar that seems stuck (docs/operations.md)."""
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        done = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: done.set())
        self.start()
        done.wait()
        self.stop()


class _StopSteps:
    """Times the steps of a shutdown, so that a slow stop names its slow step (a warning as
    each slow step ends, all of them on `sidecar_stopped`)."""

    SLOW_S = 1.0

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, step: str) -> Iterator[None]:
        began = time.monotonic()
        try:
            yield
        finally:
            took = time.monotonic() - began
            self.ms[step] = round(took * 1e3, 1)
            if took > self.SLOW_S:
                log.warning("sidecar_stop_step_slow", step=step, ms=self.ms[step])
