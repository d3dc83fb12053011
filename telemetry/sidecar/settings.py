"""Every sidecar setting in one table: its field, its default, its command-line flag and its help.

`ascend-guard sidecar` builds its flags from these fields and turns the parsed flags back into
a `SidecarSettings` (telemetry/cli/commands/sidecar.py), so a setting is declared once. A default
that belongs to one part of the sidecar is that part's own constant (`HangSettings`,
`ExportSettings`, the store's caps, ...), read here, never typed twice. Where the command line's
default comes from the environment (`--listen`, `--store`, `--health-port`), the field names the
function that reads it (`cli_default`); the dataclass default is what an embedded sidecar (tests,
benches) gets.

Kinds of value, as the command line writes them: `duration` ("2s", "15m"; the field holds
seconds), `size` ("16GiB"; the field holds bytes), `octal` ("0660"), `int`, `port` (1-65535,
or 0: that listener is off; the same for every port flag), `str`, `flag` (a switch). A field
with no flag is set only by code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from telemetry.crossrank.rank_state import HangSettings
from telemetry.crossrank.ranksync import DEFAULT_STRAGGLER_S
from telemetry.crossrank.roster import DEFAULT_LINGER_S
from telemetry.export.otlp import ExportSettings
from telemetry.ingest.ring_drain import DEFAULT_POLL_S as RING_POLL_S
from telemetry.ingest.service import DEFAULT_MAX_MESSAGE_BYTES
from telemetry.pipeline.writer import DEFAULT_QUEUE_BYTES
from telemetry.store import DEFAULT_MAX_BYTES, DEFAULT_RETENTION_S
from telemetry.wire import paths
from telemetry.wire.transport import ServerSecurity

KINDS = ("duration", "size", "octal", "int", "port", "str", "flag")


def setting(
    default: Any = dataclasses.MISSING,
    *,
    flag: str | None = None,
    help: str = "",
    kind: str = "str",
    cli_default: Callable[[], Any] | None = None,
    positive: bool = False,
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A `SidecarSettings` field. `positive`: the command line refuses 0 and below."""
    assert kind in KINDS, kind
    metadata = {
        "flag": flag,
        "help": help,
        "kind": kind,
        "cli_default": cli_default,
        "positive": positive,
    }
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


@dataclasses.dataclass
class SidecarSettings:
    """Every sidecar setting and its one default."""

    listen: str = setting(
        flag="--listen",
        cli_default=paths.sidecar_address,
        help=f"gRPC address: unix:///path.sock or HOST:PORT (env ${paths.SIDECAR_ENV})",
    )
    # unix socket permissions: owner only, or owner and --socket-group (the command line's
    # default follows --socket-group: telemetry/cli/commands/sidecar.py)
    socket_mode: int = setting(
        paths.DEFAULT_SOCKET_MODE,
        flag="--socket-mode",
        kind="octal",
        cli_default=lambda: None,
        help=f"permissions of the unix socket (default {paths.DEFAULT_SOCKET_MODE:04o}, "
        f"{paths.GROUP_SOCKET_MODE:04o} with --socket-group)",
    )
    socket_group: str = setting(
        "", flag="--socket-group", help="group that may connect to the unix socket (name or gid)"
    )
    metrics_port: int = setting(
        paths.DEFAULT_METRICS_PORT,
        flag="--metrics-port",
        kind="port",
        help="port of the Prometheus /metrics endpoint; 0: off",
    )
    metrics_host: str = setting("0.0.0.0", flag="--metrics-host", help="interface for /metrics")
    store: str = setting(
        "",
        flag="--store",
        cli_default=paths.default_store,
        help=f"SQLite trace store path (env ${paths.STORE_ENV})",
    )
    otlp_endpoint: str | None = setting(
        None, flag="--otlp-endpoint", help="also export spans over OTLP/gRPC to this URL"
    )
    # OTLP tail sampling (telemetry/export/otlp.py)
    otlp_slow_wave_s: float = setting(
        ExportSettings.slow_wave_s,
        flag="--otlp-slow-wave",
        kind="duration",
        help="OTLP export keeps every wave with a step at least this long",
    )
    otlp_keep_one_in: int = setting(
        ExportSettings.keep_one_in,
        flag="--otlp-keep-one-in",
        kind="int",
        positive=True,
        help="... and 1 in N of the other waves (1: every wave); waves with an incident or "
        "verdict are always kept",
    )
    otlp_requests: str = setting(
        "all",
        flag="--otlp-requests",
        help="request traces over OTLP: all (each finished request's trace, linked with its "
        "waves) or off",
    )
    retention_s: float = setting(
        DEFAULT_RETENTION_S,
        flag="--retention",
        kind="duration",
        help="keep records this long (e.g. 6h, 7d)",
    )
    max_store_bytes: int = setting(
        DEFAULT_MAX_BYTES,
        flag="--max-store-bytes",
        kind="size",
        help="the store's size cap; the oldest minutes go first",
    )
    # validated batches waiting for the writer
    queue_bytes: int = setting(
        DEFAULT_QUEUE_BYTES,
        flag="--queue-bytes",
        kind="size",
        help="validated batches waiting for the writer, at most (beyond: dropped, counted)",
    )
    max_message_bytes: int = setting(
        DEFAULT_MAX_MESSAGE_BYTES,
        flag="--max-message-bytes",
        kind="int",
        help="largest accepted batch",
    )
    max_streams: int = setting(256)
    # liveness/API endpoint (/live, /ready, /hangs, /coverage); 0 = off. A busy port is an
    # error, never silently another port: probes and the CLI must find it where it was asked.
    health_port: int = setting(
        paths.DEFAULT_HEALTH_PORT,
        flag="--health-port",
        kind="port",
        cli_default=paths.health_port,
        help="port of /live, /ready, /hangs, /coverage; a busy port stops start-up; 0: off "
        f"(env ${paths.HEALTH_PORT_ENV})",
    )
    health_host: str = setting("0.0.0.0", flag="--health-host", help="interface for /live")
    # Tempo-compatible trace query API (telemetry/tempo_api/) for Grafana; None: the
    # metrics port + 2, or its own default while /metrics is off (paths.query_port), 0: off.
    # Same TLS and token as the other listeners.
    query_port: int | None = setting(
        None,
        flag="--query-port",
        kind="port",
        help="port of the Tempo-compatible trace query API for Grafana; default: the metrics "
        f"port + {paths.QUERY_PORT_OFFSET} ({paths.DEFAULT_QUERY_PORT} while --metrics-port is "
        "0); 0: off",
    )
    query_host: str = setting("0.0.0.0", flag="--query-host", help="interface for the query API")
    # series of an engine whose streams broke stay this long (ranks_connected at 0)
    engine_linger_s: float = setting(
        DEFAULT_LINGER_S,
        flag="--engine-linger",
        kind="duration",
        help="keep the series of an engine whose streams broke this long (one that closed its "
        "streams is forgotten at once)",
    )
    hang_stale_s: float = setting(
        HangSettings.stale_s,
        flag="--hang-after",
        kind="duration",
        positive=True,
        help="a rank silent this long is declared stopped",
    )
    hang_wait_s: float = setting(
        HangSettings.wait_s,
        flag="--hang-wait",
        kind="duration",
        positive=True,
        help="peers inside one collective this long while a rank is not: verdict",
    )
    hang_frozen_s: float = setting(
        HangSettings.frozen_s,
        flag="--hang-frozen-after",
        kind="duration",
        positive=True,
        help="a rank on this node whose process is stopped (state T) and silent this long is "
        "declared frozen",
    )
    # gRPC's own checks on a worker's connection. gRPC closes a connection whose ping (a
    # keepalive, or the flow-control probe it sends after reading data) goes unacknowledged for
    # its ping timeout, one minute by default: the stream of a rank that is merely stopped
    # (SIGSTOP, a debugger, a starved host) then ends, as if the worker had closed it. A stopped
    # rank is a hang to report, not a connection to drop, and a process that exits closes its
    # socket itself; so pings may go unanswered for an hour, and keepalives are gRPC's default
    # (every 2 hours). Both are settings so that tests can make gRPC drop a stopped rank's
    # stream within seconds (and show that the verdict does not depend on it).
    stream_ping_timeout_s: float = setting(
        3600.0,
        flag="--stream-ping-timeout",
        kind="duration",
        positive=True,
        help="close a worker's connection when a ping on it goes unanswered this long (gRPC's "
        "own default, 1m, drops the stream of a rank that is merely stopped)",
    )
    stream_keepalive_s: float = setting(
        7200.0,
        flag="--stream-keepalive",
        kind="duration",
        positive=True,
        help="ping each worker's connection this often (gRPC's default)",
    )
    # liveness records of ranks on this node (telemetry/wire/liveness_record.py); "" = its default
    liveness_dir: str = setting(
        "",
        flag="--liveness-dir",
        help="where the workers on this node keep their liveness records (default "
        f"{paths.DEFAULT_LIVENESS_DIR}; the guard's liveness_dir)",
    )
    # wave rings of ranks on this node, beside their liveness records
    # (telemetry/ingest/ring_drain.py)
    ring_poll_s: float = setting(
        RING_POLL_S,
        flag="--ring-poll",
        kind="duration",
        positive=True,
        help="drain the wave rings of ranks on this node (workers with wave_ring on) this often",
    )
    # hang evidence bundles (telemetry/crossrank/bundle.py; bounds in BundleSettings)
    bundle_dir: str = setting(
        "",
        flag="--bundle-dir",
        help="where hang evidence bundles go (default $ASCEND_GUARD_STATE_DIR/bundles); off: none",
    )
    straggler_threshold_s: float = setting(
        DEFAULT_STRAGGLER_S,
        flag="--straggler-threshold",
        kind="duration",
        help="wave skew from which the slowest rank is counted as a straggler",
    )
    # TLS / mTLS / bearer token of the gRPC and HTTP listeners (telemetry/wire/transport.py);
    # its flags are SECURITY_FLAGS below
    security: ServerSecurity = setting(default_factory=ServerSecurity)
    # write sidecar.json (store, endpoints) for the CLI; off for tests that run many sidecars
    publish: bool = setting(True)


# The listeners' security, one flag per `ServerSecurity` field: (field, flag, kind, help).
SECURITY_FLAGS = (
    ("tls_cert", "--tls-cert", "str", "PEM certificate: TLS on gRPC and HTTP"),
    ("tls_key", "--tls-key", "str", "PEM private key of --tls-cert"),
    (
        "tls_client_ca",
        "--tls-client-ca",
        "str",
        "PEM CA bundle: clients must present a certificate it signed (mTLS)",
    ),
    (
        "token_file",
        "--token-file",
        "str",
        "file holding a bearer token every gRPC call and HTTP request must carry",
    ),
    (
        "metrics_open",
        "--metrics-open",
        "flag",
        "serve /metrics without the token (for a Prometheus that cannot send one)",
    ),
)


def setting_default(name: str) -> Any:
    """The default of one `SidecarSettings` field."""
    field = SidecarSettings.__dataclass_fields__[name]
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default
