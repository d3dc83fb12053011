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


def stored_incidents(path: Path, type_: str, since_ns: int = 0) -> list[dict]:
    """The store's incidents of `type_` raised since `since_ns`, oldest first (none while the
    store has no incidents table yet)."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
    conn.row_factory = sqlite3.Row
    try:
        rows = conn.execute(
            "SELECT * FROM incidents WHERE type = ? AND time_ns >= ? ORDER BY time_ns",
            (type_, since_ns),
        ).fetchall()
    except sqlite3.OperationalError:
        return []
    finally:
        conn.close()
    return [dict(r) for r in rows]


def request_owner(incident: dict, api_ids: list[str]) -> str | None:
    """The API's request id an incident's engine request id belongs to (the API's id of prompt
    i is "<response id>-<i>"; the engine may append a suffix)."""
    for api_id in api_ids:
        if incident["request_id"] == api_id or incident["request_id"].startswith(api_id + "-"):
            return api_id
    return None
