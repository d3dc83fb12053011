"""One trace's spans, loaded for a query: the one trace loader (`ascend-guard trace`, the query
API's trace by id, TraceQL's exact pass), and the error a query that cannot be answered as asked
raises, with the argument and the value in its message.

Spans are not stored: `load_trace` reads the trace's wave blocks and builds its spans with
telemetry/spans/builders.py, the builder the OTLP exporter uses too.
"""

from __future__ import annotations

import re
import sqlite3

from telemetry import store
from telemetry.spans.builders import (
    Span,
    collective_spans,
    incident_span,
    mark_errors,
    slow_call_spans,
    wave_spans,
)
from telemetry.store.incidents import incidents_of_wave
from telemetry.wire.trace_ids import split_trace_id


class QueryError(ValueError):
    """A query argument that cannot be used; the message names the argument and the value."""


def load_trace(conn: sqlite3.Connection, trace_id: str) -> list[Span]:
    """Every span of one wave trace, built from the stored rows, in start order."""
    text = trace_id.strip().lower()
    if not re.fullmatch(r"[0-9a-f]{32}", text):
        raise QueryError(f"trace id: {text!r} is not 32 hex digits")
    key, wave = split_trace_id(int(text, 16))
    spans: list[Span] = []
    runs = set()
    for rank in store.ranks_of_trace_key(conn, key):
        runs.add(rank.run_id)
        for _, cols in store.wave_blocks(conn, [rank.id], wave=wave):
            for i, number in enumerate(cols.wave):
                if number == wave:
                    spans += wave_spans(rank, cols, i)
        for cw in store.collective_waves(conn, rank.id, wave):
            spans += collective_spans(rank, cw)
            spans += slow_call_spans(rank, cw)
    return finish_wave_trace(conn, spans, runs, wave, text)


def finish_wave_trace(
    conn: sqlite3.Connection, spans: list[Span], runs: set[str], wave: int, trace_hex: str
) -> list[Span]:
    """A wave trace's last steps, whoever read its blocks: add the incidents of `wave` in
    `runs` (run "" when no rank was found: the sidecar's own), keep the spans of `trace_hex`,
    sort by start, and mark error status."""
    seen = set()
    for run_id in runs or {""}:
        for row in incidents_of_wave(conn, run_id, wave):
            if row["id"] not in seen:
                seen.add(row["id"])
                spans.append(incident_span(row))
    trace_id = int(trace_hex, 16)
    spans = [s for s in spans if s.trace_id == trace_id]
    spans.sort(key=lambda s: (s.start_ns, s.name))
    return mark_errors(spans)
