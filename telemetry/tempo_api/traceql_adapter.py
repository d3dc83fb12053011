"""The one place the API meets the TraceQL evaluator (package `telemetry.traceql`).

When that package is not installed in this tree, `available()` is False and the handlers
answer TraceQL requests (`/api/search?q=`, `/api/metrics/query_range`) with 501.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from telemetry.tempo_api.params import BadParameter
from telemetry.tempo_api.store_search import Hit

try:
    from telemetry import traceql
except ImportError:  # the evaluator is not part of this build
    traceql = None  # type: ignore[assignment]


def available() -> bool:
    return traceql is not None


def _rejected(exc: Exception, name: str) -> BadParameter:
    return BadParameter(name, str(exc))


def search(
    conn: sqlite3.Connection, q: str, start_ns: int, end_ns: int, limit: int, spss: int
) -> tuple[list[Hit], Any]:
    """TraceQL search: (hits, its `traceql.SearchStats`); a query the evaluator refuses is a
    bad `q`."""
    assert traceql is not None
    stats = traceql.SearchStats()
    try:
        matches = traceql.search(conn, q, start_ns, end_ns, limit, spss, stats)
    except traceql.TraceQLError as exc:
        raise _rejected(exc, "q") from None
    hits = []
    for m in matches:
        sets = [
            ([(span, m.span_attributes(span)) for span in ss.spans], ss.matched, ss.attributes)
            for ss in m.spansets
        ]
        hits.append(Hit(m.trace_id, m.root_name, m.start_ns, m.duration_ns, sets, m.root_service))
    return hits, stats


def metrics_range(
    conn: sqlite3.Connection, q: str, start_ns: int, end_ns: int, step_ns: int
) -> list[tuple[dict[str, Any], list[tuple[int, float]]]]:
    """(labels, [(unix ns, value)]) per series."""
    assert traceql is not None
    try:
        series = traceql.metrics_range(conn, q, start_ns, end_ns, step_ns)
    except traceql.TraceQLError as exc:
        raise _rejected(exc, "q") from None
    return [(s.labels, s.samples) for s in series]
