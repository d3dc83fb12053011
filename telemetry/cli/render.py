"""How `ascend-guard query` prints what a source answers: table rows of trace-search hits
(Tempo's `TraceSearchMetadata` dicts) and of spans, trees with matched spans marked, JSON."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from typing import Any

from telemetry.cli.common import clock
from telemetry.cli.table import format_duration_ns, render_table
from telemetry.spans.builders import (
    Span,
)
from telemetry.wire import schema

COORDINATES = ("dp", "tp", "pp")
# the engine column: a DaemonSet sidecar serves several engines, whose ranks share coordinates
SEARCH_HEADER = ("start (UTC)", "root", "engine", "duration", "spans", "trace id", "matched")
SEARCH_RIGHT = (3, 4)
SPAN_HEADER = ("start (UTC)", "wave", "engine", "rank", "span", "duration", "reqs", "trace id")
SPAN_RIGHT = (1, 5, 6)


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
    engines: dict[str, None] = {}
    for spanset in sets:
        for span in spanset.get("spans", []):
            engine = _attributes(span.get("attributes", [])).get(schema.ATTR_ENGINE)
            if engine:
                engines[str(engine)] = None
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
        ",".join(engines) or "-",
        f"{ms} ms" if ms else "<1 ms",
        matched,
        hit["traceID"],
        "; ".join(parts) + (f" (+{hidden})" if hidden > 0 else ""),
    )


def span_row(span: Span) -> tuple:
    return (
        clock(span.start_ns),
        span.wave,
        span.engine or "-",
        rank_label(span),
        span.name,
        format_duration_ns(span.duration_ns),
        span.attributes.get(schema.attr("num_reqs"), ""),
        span.trace_hex,
    )


def marked_spans(hit: dict) -> set[str]:
    return {s["spanID"] for ss in _spansets(hit) for s in ss.get("spans", [])}


def print_tree(source, trace_id: str, marked: set[str], title: str) -> None:
    spans = source.trace(trace_id)
    print(title)
    if not spans:
        print("  (no span of it is stored any more)")
        return
    rows = [("*" if s.span_hex in marked else "", *row) for s, row in tree_rows(spans)]
    print(render_table(("", "span", "start", "duration", "detail"), rows, right=(2, 3)))


def json_of(item, spans: bool) -> dict:
    """A span list's span as one JSON object, or a search hit as it is."""
    if spans:
        from telemetry.tempo_api.span_list_api import span_json

        return span_json(item)
    return item


def print_trees(source, spans: bool, found: list) -> None:
    """Each trace of `found` as a tree: a span list's spans, or a hit's matched spans, marked."""
    if spans:
        groups: dict[str, set[str]] = {}
        for span in found:
            groups.setdefault(span.trace_hex, set()).add(span.span_hex)
        for trace_id, marked in groups.items():
            print_tree(source, trace_id, marked, f"trace {trace_id}  {len(marked)} listed span(s)")
            print()
        return
    for hit in found:
        row = search_row(hit)
        title = (
            f"trace {hit['traceID']}  root {row[1]}  engine {row[2]}  start {row[0]}  {row[3]}  "
            f"{row[4]} matched"
        )
        print_tree(source, hit["traceID"], marked_spans(hit), title)
        print()


def _detail(span: Span) -> str:
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
    return " ".join(detail)


def tree_rows(spans: list[Span]) -> list[tuple[Span, tuple]]:
    """(span, (tree label, start offset, duration, detail)) in depth-first order."""
    origin = min(s.start_ns for s in spans)
    out = []
    for depth, span in span_tree(spans):
        label = span.name if span.name != "rank" else f"rank {rank_label(span)}"
        out.append(
            (
                span,
                (
                    "  " * depth + ("└─ " if depth else "") + label,
                    f"+{format_duration_ns(span.start_ns - origin)}",
                    format_duration_ns(span.duration_ns),
                    _detail(span),
                ),
            )
        )
    return out


def span_tree(spans: list) -> list[tuple[int, Span]]:
    """Depth-first (depth, span) order; spans whose parent is not there are roots."""
    by_id = {_get(s, "span_id"): s for s in spans}
    children: dict = {}
    for span in spans:
        parent = _get(span, "parent_id")
        children.setdefault(parent if parent in by_id else None, []).append(span)
    for items in children.values():
        items.sort(
            key=lambda s: (
                _get(s, "start_ns"),
                _get(s, "dp") or 0,
                _get(s, "tp") or 0,
                _get(s, "pp") or 0,
                _get(s, "name"),
            )
        )
    out: list[tuple[int, Span]] = []

    def walk(parent, depth: int) -> None:
        for span in children.get(parent, []):
            out.append((depth, span))
            walk(_get(span, "span_id"), depth + 1)

    walk(None, 0)
    return out


def _get(span, name: str):
    return span[name] if isinstance(span, (dict, sqlite3.Row)) else getattr(span, name)


def rank_label(span) -> str:
    """'dp0 tp1 pp0' for a span that belongs to a rank, '-' for the wave root."""
    if _get(span, "dp") is None:
        return "-"
    return f"dp{_get(span, 'dp')} tp{_get(span, 'tp')} pp{_get(span, 'pp')}"
