"""`ascend-guard incidents`: stored incidents, newest first."""

from __future__ import annotations

import argparse
import json

from telemetry.cli.args import parse_time_ns
from telemetry.cli.common import add_store_argument, clock
from telemetry.cli.render import rank_label
from telemetry.cli.table import render_table
from telemetry.ingest.validation import SEVERITIES
from telemetry.spans.query import QueryError
from telemetry.store import connect
from telemetry.store.incidents import IncidentFilter, list_incidents

# the engine column: a DaemonSet sidecar serves several engines, whose ranks share coordinates
HEADER = (
    "time (UTC)", "type", "severity", "engine", "wave", "rank", "request", "hit", "actions",
    "summary",
)  # fmt: skip


def add_parser(sub: argparse._SubParsersAction) -> None:
    incidents = sub.add_parser("incidents", help="list incidents, newest first")
    add_store_argument(incidents)
    incidents.add_argument("--since", default="24h", help="age (15m), unix seconds or ISO time")
    incidents.add_argument("--type", default=None, help="incident type, e.g. logits_finite")
    incidents.add_argument("--request", default=None, help="request id (a prefix matches)")
    incidents.add_argument("--severity", default=None, choices=SEVERITIES)
    incidents.add_argument("--run", dest="run_id", default=None, help="run id")
    incidents.add_argument("--engine", default=None, help="engine label")
    incidents.add_argument("--limit", type=int, default=50)
    incidents.add_argument("--json", action="store_true", help="one JSON object per line")


def _row(r) -> tuple:
    hit = f"{r['occurrence']}" + (f" (+{r['suppressed']})" if r["suppressed"] else "")
    return (
        clock(r["time_ns"]),
        r["type"],
        r["severity"],
        r["engine"] or "-",
        r["wave"] or "",
        rank_label(r) if r["tp"] is not None else "-",
        r["request_id"] or "-",
        hit,
        ",".join(json.loads(r["actions"] or "[]")),
        r["summary"],
    )


def run(args: argparse.Namespace) -> int:
    if args.limit < 1:
        raise QueryError(f"--limit: {args.limit} must be 1 or more")
    flt = IncidentFilter(
        since_ns=parse_time_ns(args.since, "--since"),
        type=args.type,
        request_id=args.request,
        run_id=args.run_id,
        engine=args.engine,
        severity=args.severity,
        limit=args.limit,
    )
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
    print(render_table(HEADER, [_row(r) for r in rows], right=(4,)))
    traced = next((r for r in rows if r["trace_id"]), None)
    hint = (
        f"see its wave with: ascend-guard trace {traced['trace_id']} --store {args.store}"
        if traced
        else "filter with --type, --request or --since"
    )
    print(f"\n{len(rows)} incident(s); {hint}")
    return 0
