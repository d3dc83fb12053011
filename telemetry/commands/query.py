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
(telemetry/commands/source.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

from telemetry import schema
from telemetry.commands.common import clock
from telemetry.commands.source import (
    ApiSource,
    SourceError,
    StoreSource,
    add_source_arguments,
    open_source,
)
from telemetry.commands.trace import tree_rows
from telemetry.query import (
    SORT_KEYS,
    SPAN_NAMES,
    QueryError,
    parse_duration_ns,
    parse_rank,
    parse_time_ns,
    rank_label,
)
from telemetry.spans import Span
from telemetry.table import format_duration_ns, render_table

FILTER_FLAGS = ("min_duration", "rank", "name", "run_id", "engine", "wave")
TREE_SPSS = 10_000  # --tree marks every matched span of a trace
FOLLOW_BATCH = 500  # traces (or spans) one poll of --follow takes at most
# --follow looks this far back on every poll: a trace stored later than this after its start
# (a rank's spool replayed after a sidecar restart) is not shown; search for it instead
FOLLOW_LAG_S = 10
COORDINATES = ("dp", "tp", "pp")

SEARCH_HEADER = ("start (UTC)", "root", "duration", "spans", "trace id", "matched")
SEARCH_RIGHT = (2, 3)
SPAN_HEADER = ("start (UTC)", "wave", "rank", "span", "duration", "reqs", "trace id")
SPAN_RIGHT = (1, 4, 5)
# --follow prints rows as they come, so its columns have fixed widths (the last one is free)
SEARCH_WIDTHS = (12, 6, 9, 5, 32)
SPAN_WIDTHS = (12, 7, 11, 24, 11, 4)


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
    if args.name is not None and args.name not in SPAN_NAMES:
        raise QueryError(
            f"--name: {args.name!r} is not a span name; one of {', '.join(SPAN_NAMES)}"
        )
    terms = []
    if args.name is not None:
        terms.append(f"name = {_string(args.name)}")
    else:
        terms.append("(" + " || ".join(f"name = {_string(n)}" for n in SPAN_NAMES) + ")")
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
    """The search, selecting the rank coordinates too, so each matched span names its rank."""
    from telemetry.traceql import ast

    fields = tuple(ast.Attribute(c, "span") for c in COORDINATES)
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


# -- rows -------------------------------------------------------------------------------------
def _attr_value(value: dict[str, Any]) -> Any:
    """An OTLP/JSON AnyValue's value."""
    for key, item in value.items():
        if key == "intValue":
            return int(item)
        if key == "arrayValue":
            return [_attr_value(v) for v in item.get("values", [])]
        return item
    return None


def _attributes(key_values: Iterable[dict]) -> dict[str, Any]:
    return {kv["key"]: _attr_value(kv.get("value", {})) for kv in key_values}


def _hit_rank(attrs: dict[str, Any]) -> str:
    coords = [attrs.get(schema.attr(c)) for c in COORDINATES]
    if coords[0] is None:
        return "-"
    return " ".join(f"{c}{v}" for c, v in zip(COORDINATES, coords, strict=True))


def _spansets(hit: dict) -> list[dict]:
    return hit.get("spanSets") or ([hit["spanSet"]] if hit.get("spanSet") else [])


def search_row(hit: dict, shown_spans: int = 3) -> tuple:
    """One matched trace as the table shows it: its first matched spans, each spanset's
    `by()` / aggregate values in brackets."""
    sets = _spansets(hit)
    parts, left = [], shown_spans
    for spanset in sets:
        spans = spanset.get("spans", [])[:left]
        left -= len(spans)
        texts = []
        for span in spans:
            attrs = _attributes(span.get("attributes", []))
            duration = format_duration_ns(int(span.get("durationNanos", 0)))
            texts.append(f"{span['name']} {_hit_rank(attrs)} {duration}")
        values = _attributes(spanset.get("attributes", []))
        group = " ".join(f"{k}={v}" for k, v in values.items())
        if group:
            parts.append(f"[{group}] " + ", ".join(texts) if texts else f"[{group}]")
        elif texts:
            parts.append(", ".join(texts))
    matched = sum(int(s.get("matched", 0)) for s in sets)
    hidden = matched - (shown_spans - left)
    ms = int(hit.get("durationMs", 0))
    root = hit.get("rootTraceName", "?")
    return (
        clock(int(hit["startTimeUnixNano"])),
        "?" if root.startswith("<") else root,
        f"{ms} ms" if ms else "<1 ms",
        matched,
        hit["traceID"],
        "; ".join(parts) + (f" (+{hidden})" if hidden > 0 else ""),
    )


def span_row(span: Span) -> tuple:
    return (
        clock(span.start_ns),
        span.wave,
        rank_label(span),
        span.name,
        format_duration_ns(span.duration_ns),
        span.attributes.get(schema.attr("num_reqs"), ""),
        span.trace_hex,
    )


def _marked_spans(hit: dict) -> set[str]:
    return {s["spanID"] for ss in _spansets(hit) for s in ss.get("spans", [])}


def print_tree(source, trace_id: str, marked: set[str], title: str) -> None:
    spans = source.trace(trace_id)
    print(title)
    if not spans:
        print("  (no span of it is stored any more)")
        return
    rows = [("*" if s.span_hex in marked else "", *row) for s, row in tree_rows(spans)]
    print(render_table(("", "span", "start", "duration", "detail"), rows, right=(2, 3)))


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
        return follow(source, p, args)
    found = _fetch(source, p, args, p.start_s, p.end_s, args.limit, args.sort)
    if args.json:
        for item in found:
            print(json.dumps(_json_of(item, p), sort_keys=True))
        return 0
    if not found:
        print(_nothing(p, source))
        return 0
    if args.tree:
        _print_trees(source, p, found)
    elif p.spans:
        print(render_table(SPAN_HEADER, [span_row(s) for s in found], right=SPAN_RIGHT))
    else:
        print(render_table(SEARCH_HEADER, [search_row(h) for h in found], right=SEARCH_RIGHT))
    first = found[0].trace_hex if p.spans else found[0]["traceID"]
    what = "span(s)" if p.spans else "trace(s)"
    print(f"\n{len(found)} {what}; show one with: ascend-guard trace {first}{source.trace_hint()}")
    if args.traceql is None:
        print(f"as TraceQL: ascend-guard query --spans '{p.shown}'")
    return 0


def _json_of(item, p: Plan) -> dict:
    if p.spans:
        from telemetry.tempo_api.span_list_api import span_json

        return span_json(item)
    return item


def _nothing(p: Plan, source) -> str:
    window = f"{clock(p.start_s * 10**9)[:8]}-{clock(p.end_s * 10**9)[:8]} UTC"
    if p.spans:
        return f"no spans match in {window} ({source.describe()}); widen --since or drop a filter"
    return f"no trace matches in {window} ({source.describe()}); widen --since or loosen the query"


def _print_trees(source, p: Plan, found: list) -> None:
    if p.spans:
        groups: dict[str, set[str]] = {}
        for span in found:
            groups.setdefault(span.trace_hex, set()).add(span.span_hex)
        for trace_id, marked in groups.items():
            print_tree(source, trace_id, marked, f"trace {trace_id}  {len(marked)} listed span(s)")
            print()
        return
    for hit in found:
        row = search_row(hit)
        title = f"trace {hit['traceID']}  root {row[1]}  start {row[0]}  {row[2]}  {row[3]} matched"
        print_tree(source, hit["traceID"], _marked_spans(hit), title)
        print()


# -- --follow ---------------------------------------------------------------------------------
def _fixed(cells: tuple, widths: tuple[int, ...], right: tuple[int, ...]) -> str:
    parts = []
    for i, cell in enumerate(cells):
        text = str(cell)
        if i < len(widths):
            text = text.rjust(widths[i]) if i in right else text.ljust(widths[i])
        parts.append(text)
    return "  ".join(parts).rstrip()


class _Printer:
    """Prints each new match the moment a poll finds it."""

    def __init__(self, source, p: Plan, args: argparse.Namespace) -> None:
        self.source, self.p, self.args = source, p, args
        self.header_done = False

    def header(self) -> None:
        if self.args.json or self.args.tree or self.header_done:
            return
        header, widths = (
            (SPAN_HEADER, SPAN_WIDTHS) if self.p.spans else (SEARCH_HEADER, SEARCH_WIDTHS)
        )
        right = SPAN_RIGHT if self.p.spans else SEARCH_RIGHT
        print(_fixed(header, widths, right))
        print(_fixed(tuple("-" * w for w in widths) + ("-" * 10,), widths, ()))
        self.header_done = True

    def item(self, item) -> None:
        p, args = self.p, self.args
        if args.json:
            print(json.dumps(_json_of(item, p), sort_keys=True))
        elif args.tree:
            if p.spans:
                print_tree(
                    self.source,
                    item.trace_hex,
                    {item.span_hex},
                    f"span {item.name} {rank_label(item)} in trace {item.trace_hex}",
                )
            else:
                _print_trees(self.source, p, [item])
        elif p.spans:
            print(_fixed(span_row(item), SPAN_WIDTHS, SPAN_RIGHT))
        else:
            print(_fixed(search_row(item), SEARCH_WIDTHS, SEARCH_RIGHT))


def _key_and_start(item, p: Plan) -> tuple[str, int]:
    if p.spans:
        return f"{item.trace_hex}/{item.span_hex}", item.start_ns
    return item["traceID"], int(item["startTimeUnixNano"])


def follow(
    source: StoreSource | ApiSource,
    p: Plan,
    args: argparse.Namespace,
    *,
    polls: int | None = None,
    now_s: Callable[[], int] = lambda: int(time.time()),
) -> int:
    """Poll until Ctrl-C (or `polls` polls, for tests): the newest --limit matches since
    --since first, then each match as it is stored, oldest first within a poll."""
    interval_s = parse_duration_ns(args.interval, "--interval") / 1e9
    printer = _Printer(source, p, args)
    printer.header()
    seen: dict[str, int] = {}
    first, lost, done = True, False, 0
    if args.until:
        print("ascend-guard query: --follow ignores --until", file=sys.stderr)
    try:
        while polls is None or done < polls:
            end_s = now_s()
            lo = p.start_s if first else max(p.start_s, end_s - FOLLOW_LAG_S)
            limit = args.limit if first else FOLLOW_BATCH
            try:  # a tail wants the newest spans: sorted by start
                found = _fetch(source, p, args, lo, end_s, limit, "start")
            except SourceError as exc:
                if not lost:
                    print(
                        f"ascend-guard query: {exc}; retrying every {args.interval}",
                        file=sys.stderr,
                    )
                lost = True
                found = None
            if found is not None:
                if lost:
                    print(f"ascend-guard query: reading {source.describe()} again", file=sys.stderr)
                    lost = False
                fresh = []
                for item in found:
                    key, start = _key_and_start(item, p)
                    if key not in seen:
                        seen[key] = start
                        fresh.append((start, item))
                if not first and len(found) >= limit:
                    print(
                        f"ascend-guard query: over {limit} matches in one poll; some are not shown "
                        "(narrow the query)",
                        file=sys.stderr,
                    )
                for _, item in sorted(fresh, key=lambda f: f[0]):
                    printer.item(item)
                sys.stdout.flush()
                horizon = (lo - FOLLOW_LAG_S) * 10**9
                seen = {k: s for k, s in seen.items() if s >= horizon}
                first = False
            done += 1
            if polls is None or done < polls:
                time.sleep(interval_s)
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:  # piped into head and the like
        pass
    return 0
