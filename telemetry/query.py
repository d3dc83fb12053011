"""Searches of the trace store: the filters on-call engineers type, parsed with clear errors."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import re
import sqlite3
import time
from decimal import Decimal, InvalidOperation
from typing import Any

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ns|us|µs|ms|s|m|h|d)\s*$")
_UNIT_NS = {"ns": 1, "us": 10**3, "µs": 10**3, "ms": 10**6, "s": 10**9, "m": 60 * 10**9, "h": 3600 * 10**9,
            "d": 86400 * 10**9}  # fmt: skip
SPAN_NAMES = ("wave", "rank", "execute_model", "sample_tokens")
SORT_KEYS = {"duration": "duration_ns DESC", "start": "start_ns DESC", "wave": "wave DESC"}


class QueryError(ValueError):
    """A query argument that cannot be used; the message names the argument and the value."""


def parse_duration_ns(text: str, what: str) -> int:
    """'250us', '5ms', '1.5s', '10m' → nanoseconds."""
    match = _DURATION.match(text)
    if not match:
        raise QueryError(
            f"{what}: {text!r} is not a duration; use a number and a unit, e.g. 5ms, 1.5s, 10m"
        )
    return int(Decimal(match.group(1)) * _UNIT_NS[match.group(2)])  # exact: 1.005s → 1005000000


def parse_time_ns(text: str, what: str, now_ns: int | None = None) -> int:
    """A relative age ('15m' = 15 minutes ago), 'now', a unix time in seconds, or ISO 8601."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    text = text.strip()
    if text == "now":
        return now_ns
    if _DURATION.match(text):
        return now_ns - parse_duration_ns(text, what)
    try:
        seconds = Decimal(text)
    except InvalidOperation:
        pass
    else:
        if not seconds.is_finite() or not 0 <= seconds < 10**11:
            raise QueryError(f"{what}: {text!r} is not a unix time in seconds")
        return int(seconds * 10**9)
    try:
        parsed = dt.datetime.fromisoformat(text)
    except ValueError:
        raise QueryError(
            f"{what}: {text!r} is not a time; use an age like 15m, 'now', unix seconds or ISO 8601"
        ) from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=dt.timezone.utc)
    return int(parsed.timestamp() * 1e9)


def parse_rank(text: str) -> dict[str, int]:
    """'tp=1', 'dp=0,tp=1,pp=0' or 'DP/TP/PP' such as '0/1/0' → {coordinate: rank}."""
    text = text.strip()
    if re.fullmatch(r"\d+/\d+/\d+", text):
        dp, tp, pp = (int(x) for x in text.split("/"))
        return {"dp": dp, "tp": tp, "pp": pp}
    out: dict[str, int] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in ("dp", "tp", "pp") or not value.strip().isdigit():
            raise QueryError(
                f"--rank: {part.strip()!r} is not a rank filter; use tp=1, dp=0,tp=1 or 0/1/0 (dp/tp/pp)"
            )
        out[key] = int(value)
    return out


@dataclasses.dataclass
class SpanQuery:
    since_ns: int | None = None
    until_ns: int | None = None
    min_duration_ns: int | None = None
    rank: dict[str, int] = dataclasses.field(default_factory=dict)
    name: str | None = None
    run_id: str | None = None
    engine: str | None = None
    wave: int | None = None
    sort: str = "duration"
    limit: int = 20

    def validate(self) -> None:
        if self.name is not None and self.name not in SPAN_NAMES:
            raise QueryError(
                f"--name: {self.name!r} is not a span name; one of {', '.join(SPAN_NAMES)}"
            )
        if self.sort not in SORT_KEYS:
            raise QueryError(f"--sort: {self.sort!r}; one of {', '.join(SORT_KEYS)}")
        if self.limit < 1:
            raise QueryError(f"--limit: {self.limit} must be 1 or more")
        if (
            self.since_ns is not None
            and self.until_ns is not None
            and self.since_ns > self.until_ns
        ):
            raise QueryError("--since is later than --until")

    def sql(self) -> tuple[str, list[Any]]:
        self.validate()
        where, params = [], []
        if self.since_ns is not None:
            where.append("start_ns >= ?")
            params.append(self.since_ns)
        if self.until_ns is not None:
            where.append("start_ns <= ?")
            params.append(self.until_ns)
        if self.min_duration_ns is not None:
            where.append("duration_ns >= ?")
            params.append(self.min_duration_ns)
        for coord, value in self.rank.items():
            where.append(f"{coord} = ?")
            params.append(value)
        for column in ("name", "run_id", "engine", "wave"):
            value = getattr(self, column)
            if value is not None:
                where.append(f"{column} = ?")
                params.append(value)
        clause = f" WHERE {' AND '.join(where)}" if where else ""
        return f"SELECT * FROM spans{clause} ORDER BY {SORT_KEYS[self.sort]} LIMIT ?", [
            *params,
            self.limit,
        ]


def search(conn: sqlite3.Connection, query: SpanQuery) -> list[sqlite3.Row]:
    sql, params = query.sql()
    return conn.execute(sql, params).fetchall()


def load_trace(conn: sqlite3.Connection, trace_id: str) -> list[sqlite3.Row]:
    trace_id = trace_id.strip().lower()
    if not re.fullmatch(r"[0-9a-f]{32}", trace_id):
        raise QueryError(f"trace id: {trace_id!r} is not 32 hex digits")
    return conn.execute(
        "SELECT * FROM spans WHERE trace_id = ? ORDER BY start_ns, name", (trace_id,)
    ).fetchall()


def span_tree(rows: list[sqlite3.Row]) -> list[tuple[int, sqlite3.Row]]:
    """Depth-first (depth, span) order; spans whose parent is not stored are roots."""
    by_id = {row["span_id"]: row for row in rows}
    children: dict[str | None, list[sqlite3.Row]] = {}
    for row in rows:
        parent = row["parent_id"] if row["parent_id"] in by_id else None
        children.setdefault(parent, []).append(row)
    for items in children.values():
        items.sort(
            key=lambda r: (r["start_ns"], r["dp"] or 0, r["tp"] or 0, r["pp"] or 0, r["name"])
        )
    out: list[tuple[int, sqlite3.Row]] = []

    def walk(parent: str | None, depth: int) -> None:
        for row in children.get(parent, []):
            out.append((depth, row))
            walk(row["span_id"], depth + 1)

    walk(None, 0)
    return out


def rank_label(row: sqlite3.Row) -> str:
    """'dp0 tp1 pp0' for a span that belongs to a rank, '-' for the wave root."""
    if row["dp"] is None:
        return "-"
    return f"dp{row['dp']} tp{row['tp']} pp{row['pp']}"


def attributes(row: sqlite3.Row) -> dict[str, Any]:
    return json.loads(row["attributes"] or "{}")
