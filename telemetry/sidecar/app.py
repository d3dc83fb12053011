"""The node sidecar: gRPC ingest, Prometheus `/metrics`, the record store, OTLP export.

    ingest (gRPC handlers) -> BoundedQueue -> Writer -> [metrics, store, OTLP exporter]

See telemetry/pipeline/writer.py for the split, telemetry/store/records.py for the tables and
telemetry/export/otlp.py for the sampling policy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import grp
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import structlog
from prometheus_client import Counter, start_http_server

from telemetry.crossrank.hangs import HangSettings
from telemetry.crossrank.liveness import LivenessServer
from telemetry.crossrank.roster import DEFAULT_LINGER_S, EngineRoster
from telemetry.crossrank.view import CrossRankView
from telemetry.export.otlp import ExportSettings, OtlpExporter
from telemetry.ingest.service import DEFAULT_MAX_MESSAGE_BYTES, IngestService
from telemetry.metrics.rank_gauges import RankGauges
from telemetry.metrics.waves import SidecarMetrics
from telemetry.pipeline.writer import (
    DEFAULT_QUEUE_BYTES,
    STAGE_WORKER,
    BoundedQueue,
    Drops,
    Writer,
)
from telemetry.store.incidents import IncidentLedger
from telemetry.store.records import (
    DEFAULT_MAX_BYTES,
    DEFAULT_RETENTION_S,
    Store,
    StoreMetrics,
    prepare_store,
)
from telemetry.store.requests import RequestMetrics
from telemetry.tempo_api import TempoApiServer
from telemetry.wire import build_info, paths
from telemetry.wire.addresses import address_problem, unix_socket_path
from telemetry.wire.liveness_record import RecordReader
from telemetry.wire.transport import (
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
    """Every sidecar setting and its one default (the CLI reads its defaults from here)."""

    listen: str
    metrics_host: str = "0.0.0.0"
    metrics_port: int = paths.DEFAULT_METRICS_PORT
    store: str = ""
    otlp_endpoint: str | None = None
    retention_s: float = DEFAULT_RETENTION_S
    max_store_bytes: int = DEFAULT_MAX_BYTES
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_streams: int = 256
    queue_bytes: int = DEFAULT_QUEUE_BYTES  # validated batches waiting for the writer
    # liveness/API endpoint (/live, /ready, /hangs, /coverage); 0 = off. A busy port is an
    # error, never silently another port: probes and the CLI must find it where it was asked.
    health_host: str = "0.0.0.0"
    health_port: int = paths.DEFAULT_HEALTH_PORT
    # Tempo-compatible trace query API (telemetry/tempo_api/) for Grafana; None: the
    # metrics port + 2 (paths.query_port), 0: off. Same TLS and token as the other listeners.
    query_host: str = "0.0.0.0"
    query_port: int | None = None
    # unix socket permissions: owner only, or owner and --socket-group
    socket_mode: int = paths.DEFAULT_SOCKET_MODE
    socket_group: str = ""
    # series of an engine whose streams broke stay this long (ranks_connected at 0)
    engine_linger_s: float = DEFAULT_LINGER_S
    # write sidecar.json (store, endpoints) for the CLI; off for tests that run many sidecars
    publish: bool = True
    hang_stale_s: float = 2.0
    hang_wait_s: float = 3.0
    hang_frozen_s: float = 1.0
    # gRPC's own checks on a worker's connection. gRPC closes a connection whose ping (a
    # keepalive, or the flow-control probe it sends after reading data) goes unacknowledged for
    # its ping timeout, one minute by default: the stream of a rank that is merely stopped
    # (SIGSTOP, a debugger, a starved host) then ends, as if the worker had closed it. A stopped
    # rank is a hang to report, not a connection to drop, and a process that exits closes its
    # socket itself; so pings may go unanswered for an hour, and keepalives are gRPC's default
    # (every 2 hours). Both are settings so that tests can make gRPC drop a stopped rank's
    # stream within seconds (and show that the verdict does not depend on it).
    stream_ping_timeout_s: float = 3600.0
    stream_keepalive_s: float = 7200.0
    # liveness records of ranks on this node (telemetry/wire/liveness_record.py); "" = its default
    liveness_dir: str = ""
    # TLS / mTLS / bearer token of the gRPC and HTTP listeners (telemetry/wire/transport.py)
    security: ServerSecurity = dataclasses.field(default_factory=ServerSecurity)
    straggler_threshold_s: float = 0.05
    # OTLP tail sampling (telemetry/export/otlp.py)
    otlp_slow_wave_s: float = ExportSettings.slow_wave_s
    otlp_keep_one_in: int = ExportSettings.keep_one_in


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


def setting_default(name: str):
    """The default of one `SidecarSettings` field."""
    return SidecarSettings.__dataclass_fields__[name].default


class _MetricsSink:
    """Per-batch aggregates into the metrics (the writer's first sink)."""

    stage = "metrics"

    def __init__(
        self,
        metrics: SidecarMetrics,
        cross_rank: CrossRankView,
        drops: Drops,
        rank_gauges: RankGauges | None = None,
    ) -> None:
        self._metrics = metrics
        self._cross_rank = cross_rank
        self._drops = drops
        self._rank_gauges = rank_gauges

    def write(self, items) -> None:
        for item in items:
            source = item.source
            dropped = self._metrics.observe_batch(source.labels, item.batch, source.process)
            if dropped:
                self._drops.add(STAGE_WORKER, "buffer_full_or_lost_in_flight", dropped)
            self._cross_rank.count(source.engine, item.batch)
            if self._rank_gauges is not None:
                self._rank_gauges.count(source.engine, item.batch)

    def close(self) -> None:
        pass


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


def _socket_gid(group: str) -> int:
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise SidecarStartError(
            f"--socket-group {group!r}: no such group on this host (create it, or pass a gid)"
        ) from None


def _secure_socket(path: str, mode: int, group: str) -> None:
    """Give the socket file its group and mode (workers of that group may then connect)."""
    try:
        if group:
            os.chown(path, -1, _socket_gid(group))
        os.chmod(path, mode)
    except OSError as exc:
        raise SidecarStartError(
            f"cannot set mode {mode:o} / group {group or '-'} on {path}: {exc.strerror}"
        ) from exc


class Sidecar:
    def __init__(self, settings: SidecarSettings) -> None:
        self.settings = settings
        self.metrics = SidecarMetrics()
        self.drops = Drops(self.metrics.registry)
        # a store file SQLite cannot use is moved aside before anything opens it: the sidecar
        # starts on a fresh store rather than not at all (telemetry/store/records.py)
        self.store_moved_to = prepare_store(settings.store) if settings.store else None
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
        self.roster = EngineRoster(
            self.metrics.registry,
            self.ingest.connected,
            linger_s=settings.engine_linger_s,
            connected_gauge=self.metrics.ranks_connected,
            held=self.cross_rank.hangs.holds,
        )
        self.ingest.on_engine_joined = self.roster.joined
        self.ingest.on_engine_idle = self.roster.idle
        self.ingest.check_engine = self.roster.check
        self.build_labels = build_info.build_labels("sidecar")
        self.metrics.probes["build_info"].labels("", "", "", "", *self.build_labels.values()).set(1)
        self.auth_refused = Counter(
            "ascend_guard_auth_refused",
            "Calls and requests refused for a missing or wrong bearer token, per listener",
            ["listener"],
            registry=self.metrics.registry,
        )
        self.liveness: LivenessServer | None = None
        self.query_api: TempoApiServer | None = None
        self._server: grpc.Server | None = None
        self._http = None
        self._token: str | None = None
        self._stopped = threading.Event()

    def _build_sinks(self) -> tuple[Store, OtlpExporter | None, list]:
        """The writer's sinks, in order: metrics, store, OTLP exporter (when configured)."""
        settings = self.settings
        store = Store(
            settings.store, retention_s=settings.retention_s, max_bytes=settings.max_store_bytes
        )
        self.metrics.registry.register(RequestMetrics(store.requests))  # request membership
        sinks: list = [
            _MetricsSink(self.metrics, self.cross_rank, self.drops, self.rank_gauges),
            store,
        ]
        exporter = None
        if settings.otlp_endpoint:
            exporter = OtlpExporter(
                ExportSettings(
                    settings.otlp_endpoint,
                    slow_wave_s=settings.otlp_slow_wave_s,
                    keep_one_in=settings.otlp_keep_one_in,
                ),
                self.drops,
                self.metrics.registry,
                socket.gethostname(),
            )
            self.incidents.listeners.append(exporter.on_incident)
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
            _claim_socket(unix_path)
            if settings.socket_group:
                _socket_gid(settings.socket_group)  # refuse an unknown group before binding
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
            self._start_query_api()
        except SidecarStartError:
            server.stop(0)
            if self.liveness is not None:
                self.liveness.stop()
            raise
        self.writer.start()
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
                _secure_socket(unix_path, settings.socket_mode, settings.socket_group)
            except SidecarStartError:
                self.stop(0)
                raise
        self.cross_rank.start()
        if settings.publish:
            self._publish()
        log.info(
            "sidecar_ready", listen=settings.listen, metrics=f"http://{settings.metrics_host}:{settings.metrics_port}/metrics",
            store=settings.store, otlp=settings.otlp_endpoint or "off",
        )  # fmt: skip

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
        with steps("cross_rank"):
            self.cross_rank.stop()
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
        facts = {
            "pid": os.getpid(), "listen": settings.listen, "store": os.path.abspath(settings.store),
            "metrics_url": f"http://127.0.0.1:{settings.metrics_port}/metrics",
            "health_url": f"{scheme}://{local}:{self.liveness.port}" if self.liveness else "",
            "query_url": f"{scheme}://{query}:{self.query_api.port}" if self.query_api else "",
            "version": self.build_labels["version"], "wire": self.build_labels["wire"],
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
