"""`/ascend-guard/api/spans`: the spans one TraceQL filter matches, best first
(telemetry/traceql/span_list.py), for `ascend-guard query`'s filter flags and `--spans`.

Tempo has no such endpoint (its search answers traces, newest first), so it lives outside
Tempo's `/api/` paths and Grafana never calls it. Parameters: `q` (one `{ }` filter), `start`
and `end` (unix seconds, as `/api/search`), `sort` (duration, start or wave; descending) and
`limit`. The answer is `{"spans": [...]}`, each span whole (ids, times, attributes, events), so
the CLI rebuilds the very `Span`s the store source gives.
"""

from __future__ import annotations

import sqlite3
import time
from typing import Any

from telemetry.spans.builders import STATUS_UNSET, Span
from telemetry.tempo_api import params
from telemetry.tempo_api.params import BadParameter

ROUTE = "/ascend-guard/api/spans"
DEFAULT_LIMIT = 20
_PARAMS = {"q", "start", "end", "sort", "limit"}


def top_spans(
    conn: sqlite3.Connection, q: str, start_ns: int, end_ns: int, sort: str, limit: int
) -> list[Span]:
    """telemetry.traceql's span list; a query it refuses is a bad `q`."""
    from telemetry.traceql import TraceQLError
    from telemetry.traceql.span_list import SORT_KEYS
    from telemetry.traceql.span_list import top_spans as evaluate

    if sort not in SORT_KEYS:
        raise BadParameter("sort", f"{sort!r}; one of {', '.join(SORT_KEYS)}")
    try:
        return evaluate(conn, q, start_ns, end_ns, sort, limit)
    except TraceQLError as exc:
        raise BadParameter("q", str(exc)) from None


def answer(conn: sqlite3.Connection, get) -> dict[str, Any]:
    """The JSON body for the request parameters `get(name)` (BadParameter: a 400)."""
    q = get("q")
    if not q:
        raise BadParameter("q", "missing: one TraceQL filter, e.g. { .tp = 1 && duration > 5ms }")
    start_ns, end_ns = params.search_window(get("start"), get("end"))
    limit = params.positive_int("limit", get("limit") or str(DEFAULT_LIMIT))
    spans = top_spans(
        conn,
        q,
        start_ns or 0,
        end_ns if end_ns is not None else time.time_ns(),
        get("sort") or "duration",
        limit,
    )
    return {"spans": [span_json(s) for s in spans]}


def unknown_parameter(names) -> str | None:
    extra = sorted(set(names) - _PARAMS)
    return extra[0] if extra else None


def _hex(value: int | None, digits: int) -> str | None:
    return None if value is None else f"{value:0{digits}x}"


def span_json(span: Span) -> dict[str, Any]:
    return {
        "traceID": _hex(span.trace_id, 32),
        "spanID": _hex(span.span_id, 16),
        "parentSpanID": _hex(span.parent_id, 16),
        "name": span.name,
        "startTimeUnixNano": str(span.start_ns),
        "endTimeUnixNano": str(span.end_ns),
        "run": span.run_id,
        "engine": span.engine,
        "wave": span.wave,
        "dp": span.dp,
        "tp": span.tp,
        "pp": span.pp,
        "attributes": span.attributes,
        "events": span.events,
        "links": [
            {
                "traceID": _hex(link["trace_id"], 32),
                "spanID": _hex(link["span_id"], 16),
                "attributes": link.get("attributes", {}),
                **({"flags": link["flags"]} if "flags" in link else {}),
            }
            for link in span.links
        ],
        "status": span.status,
    }


def span_from_json(d: dict[str, Any]) -> Span:
    return Span(
        trace_id=int(d["traceID"], 16),
        span_id=int(d["spanID"], 16),
        parent_id=int(d["parentSpanID"], 16) if d.get("parentSpanID") else None,
        name=d["name"],
        start_ns=int(d["startTimeUnixNano"]),
        end_ns=int(d["endTimeUnixNano"]),
        run_id=d["run"],
        engine=d["engine"],
        wave=d["wave"],
        dp=d["dp"],
        tp=d["tp"],
        pp=d["pp"],
        attributes=d["attributes"],
        events=d["events"],
        links=[
            {
                "trace_id": int(link["traceID"], 16),
                "span_id": int(link["spanID"], 16),
                "attributes": link.get("attributes", {}),
                **({"flags": int(link["flags"])} if "flags" in link else {}),
            }
            for link in d.get("links", [])
        ],
        status=d.get("status", STATUS_UNSET),
    )
