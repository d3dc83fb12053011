"""`ascend-guard sidecar`: the node sidecar (gRPC ingest, /metrics, trace store, query API)."""

from __future__ import annotations

import argparse
import re
import sys

from telemetry.spans.query import QueryError, parse_duration_ns
from telemetry.wire import logs, paths


def _octal_mode(text: str) -> int:
    try:
        mode = int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an octal mode such as 0600") from None
    if not 0 <= mode <= 0o777:
        raise argparse.ArgumentTypeError(f"{text!r} is outside 0000-0777")
    return mode


def add_parser(sub: argparse._SubParsersAction) -> None:
    from telemetry.sidecar.app import setting_default as d

    side = sub.add_parser(
        "sidecar", help="run the node sidecar (gRPC ingest, /metrics, trace store)"
    )
    side.add_argument(
        "--listen",
        default=paths.sidecar_address(),
        help=f"gRPC address: unix:///path.sock or HOST:PORT (env ${paths.SIDECAR_ENV})",
    )
    side.add_argument(
        "--socket-mode",
        type=_octal_mode,
        default=None,
        help=f"permissions of the unix socket (default {paths.DEFAULT_SOCKET_MODE:04o}, "
        f"{paths.GROUP_SOCKET_MODE:04o} with --socket-group)",
    )
    side.add_argument(
        "--socket-group", default="", help="group that may connect to the unix socket (name or gid)"
    )
    side.add_argument(
        "--metrics-port",
        type=int,
        default=paths.DEFAULT_METRICS_PORT,
        help="port of the Prometheus /metrics endpoint",
    )
    side.add_argument("--metrics-host", default="0.0.0.0", help="interface for /metrics")
    side.add_argument(
        "--store",
        default=paths.default_store(),
        help=f"SQLite trace store path (env ${paths.STORE_ENV})",
    )
    side.add_argument(
        "--otlp-endpoint", default=None, help="also export spans over OTLP/gRPC to this URL"
    )
    side.add_argument(
        "--otlp-slow-wave",
        default=_seconds_text(d("otlp_slow_wave_s")),
        help="OTLP export keeps every wave with a step at least this long",
    )
    side.add_argument(
        "--otlp-keep-one-in",
        type=int,
        default=d("otlp_keep_one_in"),
        help="... and 1 in N of the other waves (1: every wave); waves with an incident or "
        "verdict are always kept",
    )
    side.add_argument(
        "--retention",
        default=_seconds_text(d("retention_s")),
        help="keep records this long (e.g. 6h, 7d)",
    )
    side.add_argument(
        "--max-store-bytes",
        default=f"{d('max_store_bytes') // 2**30}GiB",
        help="the store's size cap; the oldest minutes go first",
    )
    side.add_argument(
        "--queue-bytes",
        default=f"{d('queue_bytes') // 2**20}MiB",
        help="validated batches waiting for the writer, at most (beyond: dropped, counted)",
    )
    side.add_argument(
        "--max-message-bytes",
        type=int,
        default=d("max_message_bytes"),
        help="largest accepted batch",
    )
    side.add_argument("--log-json", action="store_true", help="log JSON lines instead of key=value")
    side.add_argument(
        "--health-port",
        type=int,
        default=paths.health_port(),
        help="port of /live, /ready, /hangs, /coverage; a busy port stops start-up; 0: off "
        f"(env ${paths.HEALTH_PORT_ENV})",
    )
    side.add_argument("--health-host", default="0.0.0.0", help="interface for /live")
    side.add_argument(
        "--query-port",
        type=int,
        default=d("query_port"),
        help="port of the Tempo-compatible trace query API for Grafana; default: the metrics "
        f"port + {paths.QUERY_PORT_OFFSET}; 0: off",
    )
    side.add_argument("--query-host", default=d("query_host"), help="interface for the query API")
    side.add_argument(
        "--engine-linger",
        default="15m",
        help="keep the series of an engine whose streams broke this long (one that closed its "
        "streams is forgotten at once)",
    )
    side.add_argument(
        "--hang-after", default="2s", help="a rank silent this long is declared stopped"
    )
    side.add_argument(
        "--hang-wait",
        default="3s",
        help="peers inside one collective this long while a rank is not: verdict",
    )
    side.add_argument(
        "--hang-frozen-after",
        default="1s",
        help="a rank on this node whose process is stopped (state T) and silent this long is "
        "declared frozen (default 1s)",
    )
    side.add_argument(
        "--stream-ping-timeout",
        default="1h",
        help="close a worker's connection when a ping on it goes unanswered this long (gRPC's "
        "own default, 1m, drops the stream of a rank that is merely stopped)",
    )
    side.add_argument(
        "--stream-keepalive",
        default="2h",
        help="ping each worker's connection this often (gRPC's default)",
    )
    side.add_argument(
        "--liveness-dir",
        default="",
        help="where the workers on this node keep their liveness records (default "
        f"{paths.DEFAULT_LIVENESS_DIR}; the guard's liveness_dir)",
    )
    side.add_argument("--tls-cert", default="", help="PEM certificate: TLS on gRPC and HTTP")
    side.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    side.add_argument(
        "--tls-client-ca",
        default="",
        help="PEM CA bundle: clients must present a certificate it signed (mTLS)",
    )
    side.add_argument(
        "--token-file",
        default="",
        help="file holding a bearer token every gRPC call and HTTP request must carry",
    )
    side.add_argument(
        "--metrics-open",
        action="store_true",
        help="serve /metrics without the token (for a Prometheus that cannot send one)",
    )
    side.add_argument(
        "--straggler-threshold",
        default="50ms",
        help="wave skew from which the slowest rank is counted as a straggler",
    )


_SIZE = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str, what: str) -> int:
    """'8GiB', '500MB', '1048576' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _SIZE or float(match.group(1)) <= 0:
        raise QueryError(f"{what}: {text!r} is not a size; use e.g. 8GiB, 500MB or bytes")
    return int(float(match.group(1)) * _SIZE[unit])


def _seconds_text(seconds: float) -> str:
    return f"{seconds:g}s" if seconds < 3600 else f"{seconds / 3600:g}h"


def run(args: argparse.Namespace) -> int:
    from telemetry.sidecar.app import Sidecar, SidecarSettings, SidecarStartError
    from telemetry.wire.transport import ServerSecurity

    logs.configure(json_output=args.log_json)
    try:
        max_store_bytes = parse_size(args.max_store_bytes, "--max-store-bytes")
        queue_bytes = parse_size(args.queue_bytes, "--queue-bytes")
        slow_wave_s = parse_duration_ns(args.otlp_slow_wave, "--otlp-slow-wave") / 1e9
        if args.otlp_keep_one_in < 1:
            raise QueryError(f"--otlp-keep-one-in: {args.otlp_keep_one_in} must be 1 or more")
        retention_s = parse_duration_ns(args.retention, "--retention") / 1e9
        hang_stale_s = parse_duration_ns(args.hang_after, "--hang-after") / 1e9
        hang_wait_s = parse_duration_ns(args.hang_wait, "--hang-wait") / 1e9
        frozen_s = parse_duration_ns(args.hang_frozen_after, "--hang-frozen-after") / 1e9
        straggler_s = parse_duration_ns(args.straggler_threshold, "--straggler-threshold") / 1e9
        linger_s = parse_duration_ns(args.engine_linger, "--engine-linger") / 1e9
        ping_timeout_s = parse_duration_ns(args.stream_ping_timeout, "--stream-ping-timeout") / 1e9
        keepalive_s = parse_duration_ns(args.stream_keepalive, "--stream-keepalive") / 1e9
        for flag, seconds in (
            ("--hang-after", hang_stale_s),
            ("--hang-wait", hang_wait_s),
            ("--hang-frozen-after", frozen_s),
            ("--stream-ping-timeout", ping_timeout_s),
            ("--stream-keepalive", keepalive_s),
        ):
            if seconds <= 0:
                raise QueryError(f"{flag}: must be above 0, got {seconds:g}s")
    except QueryError as exc:
        print(f"ascend-guard sidecar: {exc}", file=sys.stderr)
        return 2
    settings = SidecarSettings(
        listen=args.listen,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        store=args.store,
        otlp_endpoint=args.otlp_endpoint,
        retention_s=retention_s,
        max_store_bytes=max_store_bytes,
        queue_bytes=queue_bytes,
        otlp_slow_wave_s=slow_wave_s,
        otlp_keep_one_in=args.otlp_keep_one_in,
        max_message_bytes=args.max_message_bytes,
        health_host=args.health_host,
        health_port=args.health_port,
        query_host=args.query_host,
        query_port=args.query_port,
        hang_stale_s=hang_stale_s,
        hang_wait_s=hang_wait_s,
        straggler_threshold_s=straggler_s,
        socket_group=args.socket_group,
        engine_linger_s=linger_s,
        stream_ping_timeout_s=ping_timeout_s,
        stream_keepalive_s=keepalive_s,
        socket_mode=args.socket_mode
        if args.socket_mode is not None
        else (paths.GROUP_SOCKET_MODE if args.socket_group else paths.DEFAULT_SOCKET_MODE),
        hang_frozen_s=frozen_s,
        liveness_dir=args.liveness_dir,
        security=ServerSecurity(
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            tls_client_ca=args.tls_client_ca,
            token_file=args.token_file,
            metrics_open=args.metrics_open,
        ),
    )
    try:
        Sidecar(settings).serve_forever()
    except SidecarStartError as exc:
        print(f"ascend-guard sidecar: {exc}", file=sys.stderr)
        return 1
    return 0
