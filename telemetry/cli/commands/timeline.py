"""`ascend-guard timeline`: stored waves as a Perfetto / chrome://tracing JSON file
(telemetry/spans/timeline.py)."""

from __future__ import annotations

import argparse
import sys

from telemetry.cli.args import parse_duration_ns, parse_time_ns
from telemetry.cli.common import add_store_argument
from telemetry.spans.query import QueryError
from telemetry.spans.requests import request_traces
from telemetry.spans.timeline import build_timeline, write_timeline
from telemetry.spans.timeline_select import DEFAULT_MAX_RANK_WAVES, TimelineQuery, parse_wave_range
from telemetry.store import connect

OPEN_HINT = (
    "open it in https://ui.perfetto.dev (Open trace file), chrome://tracing (Load) "
    "or MindStudio Insight (Import Data)"
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    timeline = sub.add_parser(
        "timeline", help="write stored waves as a Perfetto / chrome://tracing JSON timeline"
    )
    which = timeline.add_mutually_exclusive_group(required=True)
    which.add_argument("--since", help="waves since: age (15m), unix seconds, ISO time")
    which.add_argument("--waves", help="wave range A..B (both included), or one wave")
    which.add_argument("--request", metavar="ID", help="the waves of one request")
    timeline.add_argument("--until", default=None, help="with --since: same forms (default now)")
    timeline.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="FILE.json",
        help="where to write the JSON ('-' for stdout)",
    )
    timeline.add_argument("--engine", default=None, help="engine label")
    timeline.add_argument("--run", dest="run_id", default=None, help="run id")
    timeline.add_argument(
        "--min-wait", default="1ms", help="draw a wait arrow when a rank waited at least this long"
    )
    timeline.add_argument(
        "--max-waves",
        type=int,
        default=DEFAULT_MAX_RANK_WAVES,
        help="at most this many rank-waves (the newest are kept)",
    )
    add_store_argument(timeline)


def _request_waves(args: argparse.Namespace, query: TimelineQuery) -> bool:
    """Point the query at the waves request `args.request` ran in (telemetry/store/requests.py)."""
    conn = connect(args.store, readonly=True)
    try:
        traces = request_traces(conn, args.request, run_id=args.run_id, engine=args.engine)
    finally:
        conn.close()
    traces = [t for t in traces if t.waves]
    if not traces:
        print(f"no request {args.request!r} with stored waves in {args.store}")
        return False
    if len(traces) > 1:
        names = ", ".join(t.request_id for t in traces[:8])
        print(f"--request {args.request}: {len(traces)} requests match ({names}); give one")
        return False
    (trace,) = traces
    head = trace.requests[0]
    waves = [w.wave for w in trace.waves]
    query.run_id, query.engine, query.dp = head.run_id, head.engine, head.dp
    query.first_wave, query.last_wave = min(waves), max(waves)
    query.waves = frozenset(waves)
    return True


def run(args: argparse.Namespace) -> int:
    query = TimelineQuery(
        engine=args.engine,
        run_id=args.run_id,
        max_rank_waves=args.max_waves,
        min_wait_ns=parse_duration_ns(args.min_wait, "--min-wait"),
    )
    if args.request is not None:
        if args.until:
            raise QueryError("--until goes with --since")
        if not _request_waves(args, query):
            return 1
    elif args.since is not None:
        query.since_ns = parse_time_ns(args.since, "--since")
        query.until_ns = parse_time_ns(args.until, "--until") if args.until else None
    else:
        if args.until:
            raise QueryError("--until goes with --since")
        query.first_wave, query.last_wave = parse_wave_range(args.waves)
    timeline = build_timeline(connect(args.store, readonly=True), query)
    if not timeline.rank_waves:
        print("no waves match; widen --since, check --waves, or drop --engine/--run")
        return 1
    if args.output == "-":
        import json

        json.dump(timeline.trace, sys.stdout, separators=(",", ":"))
        sys.stdout.write("\n")
        where, out = "stdout", sys.stderr
    else:
        write_timeline(timeline, args.output)
        where, out = args.output, sys.stdout
    kept = (
        f" (the newest {timeline.rank_waves} of {timeline.matched_rank_waves}; raise --max-waves)"
        if timeline.matched_rank_waves > timeline.rank_waves
        else ""
    )
    print(
        f"timeline: {timeline.ranks} rank(s), {timeline.waves} wave(s), {timeline.rank_waves} "
        f"rank-waves{kept}, {timeline.flows} wait arrow(s), {timeline.incidents} incident(s), "
        f"{timeline.events} events -> {where}; {OPEN_HINT}",
        file=out,
    )
    return 0
