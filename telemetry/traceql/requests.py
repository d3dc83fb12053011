"""TraceQL over request traces: the spans of `telemetry/store/requests.py`, searched by the same
matcher as wave traces (telemetry/traceql/search.py `match_trace`).

Only a query that names request spans looks at request traces: a span name `request`,
`prefill` or `decode`, or an attribute of request spans (`.request`, `.request_id`,
`.request.sampled_tokens`, ...). Every other query searches wave traces only, as before. A
`request = "X"` (or `request_id = "X"`) comparison is used to read that request alone.
"""

from __future__ import annotations

import dataclasses
import sqlite3

from telemetry.spans import requests as request_spans
from telemetry.traceql import ast, fields
from telemetry.traceql.evaluate import match_trace
from telemetry.wire import schema
from telemetry.wire.trace_ids import format_trace_id

REQUEST_SPAN_NAMES = frozenset((request_spans.REQUEST_SPAN, "prefill", "decode"))
MAX_INSPECTED = 2000  # request traces built per search
_REQUEST_KEY = schema.attr("request")


def _nodes(node):
    yield node
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            for item in value if isinstance(value, tuple) else (value,):
                if dataclasses.is_dataclass(item):
                    yield from _nodes(item)


def _is_request_key(field) -> bool:
    return isinstance(field, ast.Attribute) and fields.attribute_key(field.name).startswith(
        _REQUEST_KEY
    )


def names_requests(query: ast.Query) -> bool:
    """Whether the query names request spans or their attributes."""
    for node in _nodes(query):
        if isinstance(node, ast.Comparison):
            sides = (node.left, node.right)
            named = any(isinstance(s, ast.Intrinsic) and s.name == "name" for s in sides)
            value = next((s.value for s in sides if isinstance(s, ast.Static)), None)
            if named and value in REQUEST_SPAN_NAMES:
                return True
        if _is_request_key(node):
            return True
    return False


def wanted_request(expr) -> str | None:
    """The request id an `&&`-chain of the first filter pins (`.request = "X"`), if any."""
    if isinstance(expr, ast.SpansetFilter):
        return wanted_request(expr.expr)
    if isinstance(expr, ast.Logical) and expr.op == "&&":
        return wanted_request(expr.left) or wanted_request(expr.right)
    if isinstance(expr, ast.Comparison) and expr.op == "=":
        for field, other in ((expr.left, expr.right), (expr.right, expr.left)):
            key = fields.attribute_key(field.name) if isinstance(field, ast.Attribute) else None
            if key == request_spans.ATTR_REQUEST and isinstance(other, ast.Static):
                return str(other.value)
    return None


def search(
    conn: sqlite3.Connection,
    query: ast.Query,
    start_ns: int,
    end_ns: int,
    limit: int,
    spans_per_spanset: int | None,
    nodes: dict | None,
) -> list:
    """The request traces in [start_ns, end_ns] that match, newest first, at most `limit`."""
    if not names_requests(query):
        return []
    pinned = wanted_request(query.spanset)
    out = []
    for spans in request_spans.spans_in_range(conn, start_ns, end_ns, pinned, MAX_INSPECTED):
        trace_id = format_trace_id(spans[0].trace_id)
        found = match_trace(query, spans, trace_id, spans_per_spanset, nodes)
        if found is not None:
            out.append(found)
            if len(out) >= limit:
                break
    return out
