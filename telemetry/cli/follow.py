"""`ascend-guard query --follow`: poll a source and print each new match once, as it is
stored, until Ctrl-C.

Each poll after the first looks FOLLOW_LAG_S back (records reach the store a moment after
their wave ran) and drops what it printed before. The table has fixed column widths, so rows
line up as they come.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

from telemetry.cli.args import parse_duration_ns
from telemetry.cli.render import (
    SEARCH_HEADER,
    SEARCH_RIGHT,
    SPAN_HEADER,
    SPAN_RIGHT,
    json_of,
    print_tree,
    print_trees,
    rank_label,
    search_row,
    span_row,
)
from telemetry.cli.source import SourceError

FOLLOW_BATCH = 500  # traces (or spans) one poll takes at most
# each poll looks this far back: a trace stored later than this after its start (a rank's
# spool replayed after a sidecar restart) is not shown; search for it instead
FOLLOW_LAG_S = 10
# the last column is left free
SEARCH_WIDTHS = (12, 6, 12, 9, 5, 32)
SPAN_WIDTHS = (12, 7, 12, 11, 24, 11, 4)


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

    def __init__(self, source, spans: bool, args: argparse.Namespace) -> None:
        self.source, self.spans, self.args = source, spans, args
        self.header_done = False

    def header(self) -> None:
        if self.args.json or self.args.tree or self.header_done:
            return
        header, widths = (
            (SPAN_HEADER, SPAN_WIDTHS) if self.spans else (SEARCH_HEADER, SEARCH_WIDTHS)
        )
        right = SPAN_RIGHT if self.spans else SEARCH_RIGHT
        print(_fixed(header, widths, right))
        free = 32 if self.spans else 10  # the trace id, or the start of the matched spans
        print(_fixed(tuple("-" * w for w in widths) + ("-" * free,), widths, ()))
        self.header_done = True

    def item(self, item) -> None:
        args = self.args
        if args.json:
            print(json.dumps(json_of(item, self.spans), sort_keys=True))
        elif args.tree:
            if self.spans:
                print_tree(
                    self.source,
                    item.trace_hex,
                    {item.span_hex},
                    f"span {item.name} {rank_label(item)} in trace {item.trace_hex}",
                )
            else:
                print_trees(self.source, False, [item])
        elif self.spans:
            print(_fixed(span_row(item), SPAN_WIDTHS, SPAN_RIGHT))
        else:
            print(_fixed(search_row(item), SEARCH_WIDTHS, SEARCH_RIGHT))


def _key_and_start(item, spans: bool) -> tuple[str, int]:
    if spans:
        return f"{item.trace_hex}/{item.span_hex}", item.start_ns
    return item["traceID"], int(item["startTimeUnixNano"])


def follow(
    source,
    spans: bool,
    args: argparse.Namespace,
    fetch: Callable[[int, int, int], list],
    start_s: int,
    *,
    polls: int | None = None,
    now_s: Callable[[], int] = lambda: int(time.time()),
) -> int:
    """Poll until Ctrl-C (or `polls` polls): the newest --limit matches since `start_s` first,
    then each match as it is stored, oldest first within a poll. `fetch(start_s, end_s, limit)`
    asks the source (span lists sorted by start: a tail wants the newest)."""
    interval_s = parse_duration_ns(args.interval, "--interval") / 1e9
    printer = _Printer(source, spans, args)
    printer.header()
    seen: dict[str, int] = {}
    first, lost, done = True, False, 0
    if args.until:
        print("ascend-guard query: --follow ignores --until", file=sys.stderr)
    try:
        while polls is None or done < polls:
            end_s = now_s()
            lo = start_s if first else max(start_s, end_s - FOLLOW_LAG_S)
            limit = args.limit if first else FOLLOW_BATCH
            try:
                found = fetch(lo, end_s, limit)
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
                    key, start = _key_and_start(item, spans)
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
    except KeyboardInterrupt:  # the way out of a follow: quiet, with the shell's SIGINT status
        return INTERRUPTED
    except BrokenPipeError:  # piped into head and the like
        pass
    return 0


INTERRUPTED = 128 + 2
