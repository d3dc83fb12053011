"""`ascend-guard`: the sidecar and the on-call commands (query, trace)."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
import time
from collections.abc import Sequence

import telemetry.request_cli as request_cli
from telemetry import build_info, hangs_cli, logs, paths, ready_cli, schema, timeline_cli
from telemetry.incidents import IncidentFilter, list_incidents
from telemetry.query import (
    QueryError,
    SpanQuery,
    load_trace,
    parse_duration_ns,
    parse_rank,
    parse_time_ns,
    rank_label,
    search,
    span_tree,
)
from telemetry.store import connect
from telemetry.table import format_duration_ns, render_table
from telemetry.validation import SEVERITIES


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to every option that has a default worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, "", False) or action.default is argparse.SUPPRESS:
            return action.help or ""
        return super()._get_help_string(action) or ""


class _Parser(argparse.ArgumentParser):
    """Every subcommand's --help shows its defaults."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(*args, **kwargs)


def _octal_mode(text: str) -> int:
    try:
        mode = int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an octal mode such as 0600") from None
    if not 0 <= mode <= 0o777:
        raise argparse.ArgumentTypeError(f"{text!r} is outside 0000-0777")
    return mode


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="ascend-guard",
        description="Runtime guard and observability for vLLM: node sidecar and on-call queries. "
        f"Paths: socket under ${paths.RUNTIME_DIR_ENV} ({paths.DEFAULT_RUNTIME_DIR}), store, spool "
        f"and dumps under ${paths.STATE_DIR_ENV} ({paths.DEFAULT_STATE_DIR}).",
    )
    parser.add_argument("--version", action="version", version=build_info.version_line())
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=_Parser
    )

    side = sub.add_parser(
        "sidecar", help="run the node sidecar (gRPC ingest, /metrics, trace store)"
    )
    from telemetry.sidecar import setting_default as d

    side.add_argument(
        "--listen",
        default=paths.sidecar_address(),
        help=f"gRPC address: unix:///path.sock or HOST:PORT (env ${paths.SIDECAR_ENV})",
    )
    side.add_argument(
        "--socket-mode", type=_octal_mode, default=None,
        help=f"permissions of the unix socket (default {paths.DEFAULT_SOCKET_MODE:04o}, "
        f"{paths.GROUP_SOCKET_MODE:04o} with --socket-group)",
    )  # fmt: skip
    side.add_argument(
        "--socket-group", default="", help="group that may connect to the unix socket (name or gid)"
    )
    side.add_argument(
        "--metrics-port", type=int, default=paths.DEFAULT_METRICS_PORT,
        help="port of the Prometheus /metrics endpoint",
    )  # fmt: skip
    side.add_argument("--metrics-host", default="0.0.0.0", help="interface for /metrics")
    side.add_argument(
        "--store", default=paths.default_store(),
        help=f"SQLite trace store path (env ${paths.STORE_ENV})",
    )  # fmt: skip
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
        "--health-port", type=int, default=paths.health_port(),
        help="port of /live, /ready, /hangs, /coverage; a busy port stops start-up; 0: off "
        f"(env ${paths.HEALTH_PORT_ENV})",
    )  # fmt: skip
    side.add_argument("--health-host", default="0.0.0.0", help="interface for /live")
    side.add_argument(
        "--query-port", type=int, default=d("query_port"),
        help="port of the Tempo-compatible trace query API for Grafana; default: the metrics "
        f"port + {paths.QUERY_PORT_OFFSET}; 0: off",
    )  # fmt: skip
    side.add_argument("--query-host", default=d("query_host"), help="interface for the query API")
    side.add_argument(
        "--engine-linger", default="15m",
        help="keep the series of an engine whose streams broke this long (one that closed its "
        "streams is forgotten at once)",
    )  # fmt: skip
    side.add_argument(
        "--hang-after", default="2s", help="a rank silent this long is declared stopped"
    )
    side.add_argument(
        "--hang-wait", default="3s",
        help="peers inside one collective this long while a rank is not: verdict",
    )  # fmt: skip
    side.add_argument(
        "--hang-frozen-after",
        default="1s",
        help="a rank on this node whose process is stopped (state T) and silent this long is "
        "declared frozen (default 1s)",
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
        "--straggler-threshold", default="50ms",
        help="wave skew from which the slowest rank is counted as a straggler",
    )  # fmt: skip

    query = sub.add_parser(
        "query", help="search stored traces with TraceQL, or spans with the filter flags"
    )
    query.add_argument(
        "traceql", nargs="?", default=None, metavar="TRACEQL",
        help="a TraceQL search over --since/--until, e.g. "
        "'{ span.tp = 1 && name = \"execute_model\" && duration > 50ms }' (docs/traceql.md)",
    )  # fmt: skip
    query.add_argument("--store", default=paths.cli_store(), help=paths.CLI_STORE_HELP)
    query.add_argument("--since", default="1h", help="age (15m), unix seconds, ISO time or 'now'")
    query.add_argument("--until", default=None, help="same forms as --since (default now)")
    query.add_argument(
        "--min-duration", default=None, help="only spans at least this long, e.g. 5ms"
    )
    query.add_argument("--rank", default=None, help="tp=1, dp=0,tp=1 or DP/TP/PP such as 0/1/0")
    query.add_argument(
        "--name", default=None, help="span name: wave, rank, execute_model, sample_tokens"
    )
    query.add_argument("--run", dest="run_id", default=None, help="run id")
    query.add_argument("--engine", default=None, help="engine label")
    query.add_argument("--wave", type=int, default=None, help="one wave number")
    query.add_argument("--sort", default="duration", help="duration, start or wave")
    query.add_argument("--limit", type=int, default=20)

    incidents = sub.add_parser("incidents", help="list incidents, newest first")
    incidents.add_argument("--store", default=paths.cli_store(), help=paths.CLI_STORE_HELP)
    incidents.add_argument("--since", default="24h", help="age (15m), unix seconds or ISO time")
    incidents.add_argument("--type", default=None, help="incident type, e.g. logits_finite")
    incidents.add_argument("--request", default=None, help="request id (a prefix matches)")
    incidents.add_argument("--severity", default=None, choices=SEVERITIES)
    incidents.add_argument("--run", dest="run_id", default=None, help="run id")
    incidents.add_argument("--engine", default=None, help="engine label")
    incidents.add_argument("--limit", type=int, default=50)
    incidents.add_argument("--json", action="store_true", help="one JSON object per line")
    doctor = sub.add_parser(
        "doctor",
        help="where the guard attaches to vLLM / vllm-ascend, bound or missing (--help for more)",
        add_help=False,
    )
    doctor.add_argument("doctor_args", nargs=argparse.REMAINDER)

    config = sub.add_parser("config", help="work with runtime_guard config files")
    config_sub = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    check = config_sub.add_parser("check", help="validate a config file offline")
    check.add_argument("file", help='JSON file: {"runtime_guard": {...}} or the bare object')
    check.add_argument(
        "--show", action="store_true", help="print every resolved key, not only changes"
    )

    trace = sub.add_parser("trace", help="print one trace as a tree")
    trace.add_argument("trace_id", help="32 hex digits, as `ascend-guard query` prints")
    trace.add_argument("--store", default=paths.cli_store(), help=paths.CLI_STORE_HELP)
    hangs_cli.add_parser(sub)
    ready_cli.add_parser(sub)
    timeline_cli.add_parser(sub)
    request_cli.add_parser(sub)
    return parser


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


def _cmd_sidecar(args: argparse.Namespace) -> int:
    from telemetry.sidecar import Sidecar, SidecarSettings, SidecarStartError
    from telemetry.transport import ServerSecurity

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
        for flag, seconds in (
            ("--hang-after", hang_stale_s),
            ("--hang-wait", hang_wait_s),
            ("--hang-frozen-after", frozen_s),
        ):
            if seconds <= 0:
                raise QueryError(f"{flag}: must be above 0, got {seconds:g}s")
    except QueryError as exc:
        print(f"ascend-guard sidecar: {exc}", file=sys.stderr)
        return 2
    settings = SidecarSettings(
        listen=args.listen, metrics_host=args.metrics_host, metrics_port=args.metrics_port, store=args.store,
        otlp_endpoint=args.otlp_endpoint, retention_s=retention_s, max_store_bytes=max_store_bytes,
        queue_bytes=queue_bytes, otlp_slow_wave_s=slow_wave_s, otlp_keep_one_in=args.otlp_keep_one_in,
        max_message_bytes=args.max_message_bytes, health_host=args.health_host,
        health_port=args.health_port, query_host=args.query_host, query_port=args.query_port,
        hang_stale_s=hang_stale_s, hang_wait_s=hang_wait_s,
        straggler_threshold_s=straggler_s, socket_group=args.socket_group, engine_linger_s=linger_s,
        socket_mode=args.socket_mode if args.socket_mode is not None else (
            paths.GROUP_SOCKET_MODE if args.socket_group else paths.DEFAULT_SOCKET_MODE),
        hang_frozen_s=frozen_s, liveness_dir=args.liveness_dir,
        security=ServerSecurity(
            tls_cert=args.tls_cert, tls_key=args.tls_key, tls_client_ca=args.tls_client_ca,
            token_file=args.token_file, metrics_open=args.metrics_open,
        ),
    )  # fmt: skip
    try:
        Sidecar(settings).serve_forever()
    except SidecarStartError as exc:
        print(f"ascend-guard sidecar: {exc}", file=sys.stderr)
        return 1
    return 0


def _clock(ns: int) -> str:
    return dt.datetime.fromtimestamp(ns / 1e9, tz=dt.timezone.utc).strftime("%H:%M:%S.%f")[:-3]


_FILTER_FLAGS = ("min_duration", "rank", "name", "run_id", "engine", "wave")


def _cmd_traceql(args: argparse.Namespace) -> int:
    from telemetry import traceql

    flags = [f"--{f.replace('_', '-')}" for f in _FILTER_FLAGS if getattr(args, f) is not None]
    if flags:
        raise QueryError(f"give a TraceQL query or {', '.join(flags)}, not both")
    if args.limit < 1:
        raise QueryError(f"--limit: {args.limit} must be 1 or more")
    start = parse_time_ns(args.since, "--since")
    end = parse_time_ns(args.until, "--until") if args.until else time.time_ns()
    try:
        matches = traceql.search(connect(args.store, readonly=True), args.traceql, start, end,
                                 limit=args.limit)  # fmt: skip
    except traceql.TraceQLError as exc:
        raise QueryError(f"TRACEQL: {exc}") from None
    if not matches:
        print("no trace matches; widen --since or loosen the query")
        return 0
    rows = []
    for m in matches:
        spans = m.spans
        shown = ", ".join(f"{s.name} {rank_label(s)} {format_duration_ns(s.duration_ns)}"
                          for s in spans[:3])  # fmt: skip
        more = f" (+{len(spans) - 3})" if len(spans) > 3 else ""
        rows.append((_clock(m.start_ns), m.root_name or "?", format_duration_ns(m.duration_ns),
                     len(spans), shown + more, m.trace_id))  # fmt: skip
    header = ("start (UTC)", "root", "duration", "spans", "matched", "trace id")
    print(render_table(header, rows, right=(2, 3)))
    print(f"\n{len(matches)} trace(s); show one with: ascend-guard trace {matches[0].trace_id}"
          f" --store {args.store}")  # fmt: skip
    return 0


def _cmd_query(args: argparse.Namespace) -> int:
    if args.traceql is not None:
        return _cmd_traceql(args)
    query = SpanQuery(
        since_ns=parse_time_ns(args.since, "--since"),
        until_ns=parse_time_ns(args.until, "--until") if args.until else None,
        min_duration_ns=parse_duration_ns(args.min_duration, "--min-duration") if args.min_duration else None,
        rank=parse_rank(args.rank) if args.rank else {},
        name=args.name, run_id=args.run_id, engine=args.engine, wave=args.wave, sort=args.sort, limit=args.limit,
    )  # fmt: skip
    rows = search(connect(args.store, readonly=True), query)
    if not rows:
        print("no spans match; widen --since or drop a filter")
        return 0
    table = [
        (_clock(r.start_ns), r.wave, rank_label(r), r.name, format_duration_ns(r.duration_ns),
         r.attributes.get(schema.attr("num_reqs"), ""), r.trace_hex)
        for r in rows
    ]  # fmt: skip
    print(
        render_table(
            ("start (UTC)", "wave", "rank", "span", "duration", "reqs", "trace id"),
            table,
            right=(1, 4, 5),
        )
    )
    print(
        f"\n{len(rows)} span(s); show one with: ascend-guard trace {rows[0].trace_hex} --store {args.store}"
    )
    return 0


def _cmd_incidents(args: argparse.Namespace) -> int:
    if args.limit < 1:
        raise QueryError(f"--limit: {args.limit} must be 1 or more")
    flt = IncidentFilter(
        since_ns=parse_time_ns(args.since, "--since"), type=args.type, request_id=args.request,
        run_id=args.run_id, engine=args.engine, severity=args.severity, limit=args.limit,
    )  # fmt: skip
    rows = list_incidents(connect(args.store, readonly=True), flt)
    if args.json:
        for row in rows:
            record = dict(row)
            record["evidence"] = json.loads(record["evidence"] or "{}")
            record["actions"] = json.loads(record["actions"] or "[]")
            print(json.dumps(record, sort_keys=True))
        return 0
    if not rows:
        print("no incidents match; widen --since or drop a filter")
        return 0
    table = [
        (_clock(r["time_ns"]), r["type"], r["severity"], r["wave"] or "", rank_label(r) if r["tp"] is not None else "-",
         r["request_id"] or "-", f"{r['occurrence']}" + (f" (+{r['suppressed']})" if r["suppressed"] else ""),
         ",".join(json.loads(r["actions"] or "[]")), r["summary"])
        for r in rows
    ]  # fmt: skip
    print(
        render_table(
            (
                "time (UTC)",
                "type",
                "severity",
                "wave",
                "rank",
                "request",
                "hit",
                "actions",
                "summary",
            ),
            table,
            right=(3,),
        )
    )
    traced = next((r for r in rows if r["trace_id"]), None)
    hint = (
        f"see its wave with: ascend-guard trace {traced['trace_id']} --store {args.store}"
        if traced
        else "filter with --type, --request or --since"
    )
    print(f"\n{len(rows)} incident(s); {hint}")
    return 0


def _flatten(prefix: str, value: object) -> list[tuple[str, object]]:
    if isinstance(value, dict):
        out = []
        for key in sorted(value):
            out += _flatten(f"{prefix}.{key}" if prefix else key, value[key])
        return out
    return [(prefix, value)]


def _cmd_config(args: argparse.Namespace) -> int:
    from guard.config import GuardConfig, GuardConfigError, _load_file, parse_config

    try:
        config = parse_config(_load_file(args.file))
    except GuardConfigError as exc:
        print(f"{args.file}: invalid\n  {exc}", file=sys.stderr)
        print("fix that key and run `ascend-guard config check` again", file=sys.stderr)
        return 1
    defaults = dict(_flatten("", json.loads(GuardConfig().to_json())))
    rows = [
        (key, json.dumps(val), json.dumps(defaults.get(key)))
        for key, val in _flatten("", json.loads(config.to_json()))
        if args.show or defaults.get(key) != val
    ]
    print(f"{args.file}: valid")
    if rows:
        print(render_table(("key", "value", "default"), rows))
    else:
        print("(every key at its default)")
    return 0


def _cmd_trace(args: argparse.Namespace) -> int:
    spans = load_trace(connect(args.store, readonly=True), args.trace_id)
    if not spans:
        print(f"trace {args.trace_id} is not in {args.store} (expired, or not written yet)")
        return 1
    origin = min(s.start_ns for s in spans)
    first = spans[0]
    print(f"trace {first.trace_hex}  run {first.run_id}  engine {first.engine}  wave {first.wave}")
    table = []
    for depth, span in span_tree(spans):
        attrs = span.attributes
        detail = []
        for key in schema.RANK_SPAN_FIELDS:
            value = attrs.get(schema.attr(key))
            if key == "dummy":
                if value:
                    detail.append("dummy")
            elif value is not None:
                detail.append(f"{key}={value}")
        if span.name.startswith("collective:"):
            calls = attrs.get(schema.attr("collective.calls"))
            group = attrs.get(schema.attr("collective.group"))
            detail.append(f"group={group} calls={calls}")
        label = span.name if span.name != "rank" else f"rank {rank_label(span)}"
        table.append(
            ("  " * depth + ("└─ " if depth else "") + label, f"+{format_duration_ns(span.start_ns - origin)}",
             format_duration_ns(span.duration_ns), " ".join(detail))
        )  # fmt: skip
    print(render_table(("span", "start", "duration", "detail"), table, right=(1, 2)))
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from ascend_runtime.doctor import main as doctor_main  # imports torch/vLLM only when run

    return doctor_main(args.doctor_args)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["doctor"] and "--live" in argv:  # asks the sidecar; imports no vLLM
        from telemetry import doctor_live

        return doctor_live.main(argv[1:])
    if argv[:1] == ["doctor"]:  # its own parser: options such as --source pass through as-is
        return _cmd_doctor(argparse.Namespace(doctor_args=argv[1:]))
    args = _parser().parse_args(argv)
    handlers = {
        "sidecar": _cmd_sidecar,
        "query": _cmd_query,
        "trace": _cmd_trace,
        "incidents": _cmd_incidents,
        "config": _cmd_config,
        "doctor": _cmd_doctor,
        "hangs": hangs_cli.run,
        "ready": ready_cli.run,
        "timeline": timeline_cli.run,
        "request": request_cli.run,
    }
    try:
        return handlers[args.command](args)
    except (QueryError, FileNotFoundError) as exc:
        print(f"ascend-guard {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
