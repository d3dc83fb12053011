"""The embedded trace store: an OpenTelemetry span exporter into SQLite, with retention.

One row per span, keyed by (trace_id, span_id), so a span exported twice is stored once. The
rank coordinates and wave are lifted out of the attributes into indexed columns, which is what
the on-call queries filter on. WAL mode lets `ascend-guard query` read while the sidecar writes.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import structlog
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

log = structlog.get_logger("ascend_guard.store")

SCHEMA = """
CREATE TABLE IF NOT EXISTS spans (
    trace_id    TEXT NOT NULL,
    span_id     TEXT NOT NULL,
    parent_id   TEXT,
    name        TEXT NOT NULL,
    start_ns    INTEGER NOT NULL,
    end_ns      INTEGER NOT NULL,
    duration_ns INTEGER NOT NULL,
    run_id      TEXT,
    engine      TEXT,
    wave        INTEGER,
    dp          INTEGER,
    tp          INTEGER,
    pp          INTEGER,
    status      TEXT,
    attributes  TEXT,
    events      TEXT,
    PRIMARY KEY (trace_id, span_id)
);
CREATE INDEX IF NOT EXISTS spans_start ON spans (start_ns);
CREATE INDEX IF NOT EXISTS spans_duration ON spans (name, duration_ns);
CREATE INDEX IF NOT EXISTS spans_wave ON spans (run_id, wave);
"""

ATTR_RUN = "ascend_guard.run_id"
ATTR_ENGINE = "ascend_guard.engine"
ATTR_WAVE = "ascend_guard.wave"
ATTR_DP = "ascend_guard.dp"
ATTR_TP = "ascend_guard.tp"
ATTR_PP = "ascend_guard.pp"


def default_store_path() -> str:
    from telemetry import paths

    return paths.default_store()


def connect(path: str | os.PathLike, *, readonly: bool = False) -> sqlite3.Connection:
    """Open the store; read-only connections fail clearly when the file does not exist."""
    path = Path(path)
    if readonly:
        if not path.exists():
            raise FileNotFoundError(
                f"no trace store at {path}; is the sidecar running with --store {path}?"
            )
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(path, timeout=5.0, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.executescript(SCHEMA)
    conn.row_factory = sqlite3.Row
    return conn


def _hex(value: int, width: int) -> str:
    return format(value, f"0{width}x")


def _row(span: ReadableSpan) -> tuple:
    attrs = dict(span.attributes or {})
    ctx = span.context
    parent = span.parent
    events = [
        {"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})}
        for e in span.events
    ]
    start = span.start_time or 0
    end = span.end_time or start
    return (
        _hex(ctx.trace_id, 32),
        _hex(ctx.span_id, 16),
        _hex(parent.span_id, 16) if parent is not None else None,
        span.name,
        start,
        end,
        end - start,
        attrs.get(ATTR_RUN),
        attrs.get(ATTR_ENGINE),
        attrs.get(ATTR_WAVE),
        attrs.get(ATTR_DP),
        attrs.get(ATTR_TP),
        attrs.get(ATTR_PP),
        span.status.status_code.name,
        json.dumps(attrs, sort_keys=True, default=str),
        json.dumps(events, default=str) if events else None,
    )


class SqliteSpanExporter(SpanExporter):
    """Writes finished spans to the store and enforces retention by age and by row count."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        retention_s: float = 24 * 3600,
        max_spans: int = 5_000_000,
        prune_every_s: float = 30.0,
    ) -> None:
        self.path = str(path)
        self.retention_s = retention_s
        self.max_spans = max_spans
        self._prune_every_s = prune_every_s
        self._last_prune = 0.0
        self._lock = threading.Lock()
        self._conn = connect(self.path)
        self.exported = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            rows = [_row(span) for span in spans]
            with self._lock, self._conn:
                self._conn.executemany(
                    "INSERT OR REPLACE INTO spans VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", rows
                )
            self.exported += len(rows)
            if time.monotonic() - self._last_prune >= self._prune_every_s:
                self.prune()
            return SpanExportResult.SUCCESS
        except sqlite3.Error:
            log.exception("store_write_failed", path=self.path, spans=len(spans))
            return SpanExportResult.FAILURE

    def prune(self, now_ns: int | None = None) -> int:
        """Delete spans older than the retention and the oldest beyond `max_spans`."""
        self._last_prune = time.monotonic()
        cutoff = (now_ns if now_ns is not None else time.time_ns()) - int(self.retention_s * 1e9)
        with self._lock, self._conn:
            removed = self._conn.execute("DELETE FROM spans WHERE start_ns < ?", (cutoff,)).rowcount
            (count,) = self._conn.execute("SELECT COUNT(*) FROM spans").fetchone()
            if count > self.max_spans:
                removed += self._conn.execute(
                    "DELETE FROM spans WHERE rowid IN (SELECT rowid FROM spans ORDER BY start_ns LIMIT ?)",
                    (count - self.max_spans,),
                ).rowcount
        if removed:
            log.info("store_pruned", removed=removed)
        return removed

    def shutdown(self) -> None:
        with self._lock:
            self._conn.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
