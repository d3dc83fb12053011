"""`ascend-guard trace ID`: one trace as a tree, through the sidecar's query API or from the
store file (telemetry/cli/source.py)."""

from __future__ import annotations

import argparse
import re

from telemetry.cli.render import tree_rows
from telemetry.cli.source import add_source_arguments, ask, open_source
from telemetry.cli.table import render_table
from telemetry.spans.query import QueryError


def add_parser(sub: argparse._SubParsersAction) -> None:
    trace = sub.add_parser("trace", help="print one trace as a tree")
    trace.add_argument("trace_id", help="32 hex digits, as `ascend-guard query` prints")
    add_source_arguments(trace)


def run(args: argparse.Namespace) -> int:
    trace_id = args.trace_id.strip().lower()
    if not re.fullmatch(r"[0-9a-f]{32}", trace_id):
        raise QueryError(f"trace id: {trace_id!r} is not 32 hex digits")
    source = open_source(args, "trace")
    source, spans = ask(args, "trace", source, lambda s: s.trace(trace_id))
    if not spans:
        print(
            f"trace {trace_id} is not in {source.describe()} (expired, or not written yet); "
            "find current ones with `ascend-guard query`"
        )
        return 1
    first = spans[0]
    print(f"trace {first.trace_hex}  run {first.run_id}  engine {first.engine}  wave {first.wave}")
    rows = [row for _, row in tree_rows(spans)]
    print(render_table(("span", "start", "duration", "detail"), rows, right=(1, 2)))
    return 0
