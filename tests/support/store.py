"""Spans as the CLI sees them, built from a sidecar's store (for tests that check the store)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from telemetry.spans.builders import Span
from telemetry.spans.query import load_trace
from telemetry.store import connect
from tests.support.span_search import SpanQuery, search


def stored_spans(path: Path, **filters) -> list[Span]:
    """Every wave, rank and phase span the store can build that matches `filters`
    (SpanQuery's fields), however old."""
    try:
        conn = connect(path, readonly=True)
    except FileNotFoundError:
        return []
    try:
        return search(conn, SpanQuery(limit=10**9, **filters))
    except sqlite3.OperationalError:  # the sidecar has not created the tables yet
        return []
    finally:
        conn.close()


def trace_spans(path: Path, trace_id: str) -> list[Span]:
    """Every span of one trace (including collectives and incidents)."""
    conn = connect(path, readonly=True)
    try:
        return load_trace(conn, trace_id)
    finally:
        conn.close()
