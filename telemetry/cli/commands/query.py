"""`ascend-guard query`: TraceQL over the stored traces, or the filter flags, which are mapped
onto one TraceQL filter (the same engine answers both).

- `query 'TRACEQL'`: the matching traces (spansets), newest first: a table, `--tree` (each
  trace's spans with the matched ones marked) or `--json` (one Tempo `TraceSearchMetadata`
  object per line, as `/api/search` writes it).
- `query --rank tp=1 --min-duration 5ms ...` (or `query --spans 'FILTER'`): the matching spans
  ranked across traces by `--sort` (slowest first by default), from
  telemetry/traceql/span_list.py.
- `--follow`: keep polling and print what matches as it is stored, until Ctrl-C.

Reads through the sidecar's query API when one answers, else the store file
(telemetry/cli/source.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from telemetry.cli.args import SORT_KEYS, parse_duration_ns, parse_rank, parse_time_ns
from telemetry.cli.common import clock
from telemetry.cli.follow import follow
from telemetry.cli.render import (
    COORDINATES,
    SEARCH_HEADER,
    SEARCH_RIGHT,
    SPAN_HEADER,
    SPAN_RIGHT,
    json_of,
    print_trees,
    search_row,
    span_row,
)
from telemetry.cli.source import add_source_arguments, ask, open_source
from telemetry.cli.table import render_table
from telemetry.spans.query import QueryError
from telemetry.wire.schema import WAVE_SPAN_NAMES

FILTER_FLAGS = ("min_duration", "rank", "name", "run_id", "engine", "wave")
TREE_SPSS = 10_000  # --tree marks every matched span of a trace


def add_parser(sub: argparse._SubParsersAction) -> None:
    query = sub.add_parser(
        "query", help="search stored traces with TraceQL, or spans with the filter flags"
    )
    query.add_argument(
        "traceql",
        nargs="?",
        default=None,
        metavar="TRACEQL",
        help="a TraceQL search over --since/--until, e.g. "
        "'{ span.tp = 1 && name = \"execute_model\" && duration > 50ms }' (docs/traceql.md)",
    )
    query.add_argument("--since", default="1h", help="age (15m), unix seconds, ISO time or 'now'")
    query.add_argument("--until", default=None, help="same forms as --since (default now)")
    flags = query.add_argument_group(
        "filter flags", "list spans, mapped onto one TraceQL filter (the footer shows it)"
    )
    flags.add_argument(
        "--min-duration", default=None, help="only spans at least this long, e.g. 5ms"
    )
    flags.add_argument("--rank", default=None, help="tp=1, dp=0,tp=1 or DP/TP/PP such as 0/1/0")
    flags.add_argument(
        "--name", default=None, help="span name: wave, rank, execute_model, sample_tokens"
    )
    flags.add_argument("--run", dest="run_id", default=None, help="run id")
    flags.add_argument("--engine", default=None, help="engine label")
    flags.add_argument("--wave", type=int, default=None, help="one wave number")
    query.add_argument(
        "--spans",
        action="store_true",
        help="list the spans TRACEQL (one { } filter) matches, best first by --sort, "
        "as the filter flags do",
    )
    query.add_argument("--sort", default="duration", help="spans: duration, start or wave")
    query.add_argument("--limit", type=int, default=20, help="traces (spans with --spans)")
    query.add_argument(
        "--spss", type=int, default=3, help="matched spans shown per trace (TraceQL searches)"
    )
    shape = query.add_mutually_exclusive_group()
    shape.add_argument(
        "--tree", action="store_true", help="each trace as a tree, matched spans marked *"
    )
    shape.add_argument("--json", action="store_true", help="one JSON object per line")
    query.add_argument(
        "--follow",
        action="store_true",
        help="keep printing what matches as it is stored, until Ctrl-C",
    )
    query.add_argument("--interval", default="1s", help="with --follow: time between polls")
    add_source_arguments(query)


# -- the flag form as TraceQL -------------------------------------------------------------
def _string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _duration(ns: int) -> str:
    for unit, size in (("s", 10**9), ("ms", 10**6), ("us", 10**3)):
        if ns and ns % size == 0:
            return f"{ns // size}{unit}"
    return f"{ns}ns"


def flags_to_traceql(args: argparse.Namespace) -> str:
    """The one TraceQL filter the filter flags stand for."""
    if args.name is not None and args.name not in WAVE_SPAN_NAMES:
        raise QueryError(
            f"--name: {args.name!r} is not a span name; one of {', '.join(WAVE_SPAN_NAMES)}"
        )
    terms = []
    if args.name is not None:
        terms.append(f"name = {_string(args.name)}")
    else:
        terms.append("(" + " || ".join(f"name = {_string(n)}" for n in WAVE_SPAN_NAMES) + ")")
    if args.rank:
        terms += [f".{coord} = {value}" for coord, value in parse_rank(args.rank).items()]
    if args.run_id is not None:
        terms.append(f".run = {_string(args.run_id)}")
    if args.engine is not None:
        terms.append(f".engine = {_string(args.engine)}")
    if args.wave is not None:
        terms.append(f".wave = {args.wave}")
    if args.min_duration:
        terms.append(
            f"duration >= {_duration(parse_duration_ns(args.min_duration, '--min-duration'))}"
        )
    return "{ " + " && ".join(terms) + " }"


# -- what one run asks ----------------------------------------------------------------------
@dataclasses.dataclass
class Plan:
    spans: bool  # a span list (flags, --spans), else a trace search
    q: str  # what the source is asked
    shown: str  # the query as the footer names it
    start_s: int
    end_s: int


def _window(args: argparse.Namespace) -> tuple[int, int]:
    """--since/--until as whole unix seconds, as the API's search takes them (both sources get
    the same window, so both give the same rows)."""
    start_ns = parse_time_ns(args.since, "--since")
    end_ns = parse_time_ns(args.until, "--until") if args.until else time.time_ns()
    if start_ns > end_ns:
        raise QueryError("--since is later than --until")
    start_s = start_ns // 10**9
    return start_s, max(end_ns // 10**9, start_s + 1)


def _with_coordinates(parsed) -> str:
    """The search, selecting the engine and rank coordinates too, so each matched span names
    its engine and rank."""
    from telemetry.traceql import ast

    fields = tuple(ast.Attribute(c, "span") for c in ("engine", *COORDINATES))
    return str(dataclasses.replace(parsed, stages=(*parsed.stages, ast.Select(fields))))


def plan(args: argparse.Namespace) -> Plan:
    """Validates every argument before any source is opened."""
    from telemetry import traceql

    if args.limit < 1:
        raise QueryError(f"--limit: {args.limit} must be 1 or more")
    if args.spss < 1:
        raise QueryError(f"--spss: {args.spss} must be 1 or more")
    given = [f"--{f.replace('_', '-')}" for f in FILTER_FLAGS if getattr(args, f) is not None]
    if args.traceql is not None and given:
        raise QueryError(f"give a TraceQL query or {', '.join(given)}, not both")
    spans = args.traceql is None or args.spans
    if spans and args.sort not in SORT_KEYS:
        raise QueryError(f"--sort: {args.sort!r}; one of {', '.join(SORT_KEYS)}")
    text = flags_to_traceql(args) if args.traceql is None else args.traceql
    start_s, end_s = _window(args)
    parse_duration_ns(args.interval, "--interval")
    try:
        parsed = traceql.parse(text)
    except traceql.TraceQLError as exc:
        raise QueryError(f"TRACEQL: {exc}") from None
    if parsed.metrics is not None:
        raise QueryError(
            f"TRACEQL: {parsed.metrics.fn}() is a metrics query; this command lists traces and "
            "spans (Grafana's Tempo datasource draws metrics from the sidecar's query_range)"
        )
    if spans:
        from telemetry.traceql.span_list import _one_filter

        try:
            _one_filter(parsed)
        except traceql.TraceQLError as exc:
            raise QueryError(f"TRACEQL: {exc}") from None
        return Plan(True, text, text, start_s, end_s)
    return Plan(False, _with_coordinates(parsed), text, start_s, end_s)


# -- one-shot ---------------------------------------------------------------------------------
def _fetch(
    source, p: Plan, args: argparse.Namespace, start_s: int, end_s: int, limit: int, sort: str
) -> list:
    if p.spans:
        return source.spans(p.q, start_s, end_s, sort, limit)
    spss = TREE_SPSS if args.tree else args.spss
    return source.search(p.q, start_s, end_s, limit, spss)


def run(args: argparse.Namespace) -> int:
    p = plan(args)
    source = open_source(args, "query")
    if args.follow:
        return follow(
            source,
            p.spans,
            args,
            lambda lo, hi, n: _fetch(source, p, args, lo, hi, n, "start"),
            p.start_s,
        )
    source, found = ask(
        args,
        "query",
        source,
        lambda s: _fetch(s, p, args, p.start_s, p.end_s, args.limit, args.sort),
    )
    if args.json:
        for item in found:
            print(json.dumps(json_of(item, p.spans), sort_keys=True))
        return 0
    capped = not p.spans and getattr(source, "capped", False)
    if not found:
        print(_nothing(p, source))
        if capped:
            print(_capped())
        return 0
    if args.tree:
        print_trees(source, p.spans, found)
    elif p.spans:
        print(render_table(SPAN_HEADER, [span_row(s) for s in found], right=SPAN_RIGHT))
    else:
        print(render_table(SEARCH_HEADER, [search_row(h) for h in found], right=SEARCH_RIGHT))
    if capped:
        print(f"\n{_capped()}")
    first = found[0].trace_hex if p.spans else found[0]["traceID"]
    what = "span(s)" if p.spans else "trace(s)"
    print(f"\n{len(found)} {what}; show one with: ascend-guard trace {first}{source.trace_hint()}")
    if args.traceql is None:
        print(f"as TraceQL: ascend-guard query --spans '{p.shown}'")
    return 0


def _capped() -> str:
    """What to do about a trace search that stopped at the traces it may check."""
    from telemetry.traceql.search import MAX_TRACES_INSPECTED

    return (
        f"the search stopped after checking {MAX_TRACES_INSPECTED:,} traces: there may be more "
        "matches, older than those listed. Narrow it: an engine, rank, span name or duration "
        '(.engine = "...", .tp = N, name = "...", duration > X), or a shorter --since/--until'
    )


def _nothing(p: Plan, source) -> str:
    window = f"{clock(p.start_s * 10**9)[:8]}-{clock(p.end_s * 10**9)[:8]} UTC"
    if p.spans:
        return f"no spans match in {window} ({source.describe()}); widen --since or drop a filter"
    return f"no trace matches in {window} ({source.describe()}); widen --since or loosen the query"
