"""Searches of the record store: the filters on-call engineers type, parsed with clear errors.

Spans are not stored: `search` and `load_trace` read wave blocks (pruned by their time range,
wave range and slowest step before any is decoded), and build the spans that match with
telemetry/spans/builders.py, the builder the OTLP exporter uses too.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import heapq
import re
import sqlite3
import time
from decimal import Decimal, InvalidOperation

import numpy as np

from telemetry import store
from telemetry.spans.builders import (
    Span,
    collective_spans,
    incident_span,
    is_root_rank,
    mark_errors,
    slow_call_spans,
    wave_spans,
)
from telemetry.store.incidents import incidents_of_wave
from telemetry.wire.trace_ids import split_trace_id

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ns|us|µs|ms|s|m|h|d)\s*$")
_UNIT_NS = {"ns": 1, "us": 10**3, "µs": 10**3, "ms": 10**6, "s": 10**9, "m": 60 * 10**9, "h": 3600 * 10**9,
            "d": 86400 * 10**9}  # fmt: skip
SPAN_NAMES = ("wave", "rank", "execute_model", "sample_tokens")  # what `query --name` searches
SORT_KEYS = ("duration", "start", "wave")


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


def _rank_filter(query: SpanQuery) -> tuple[str, list]:
    where, params = [], []
    for coord, value in query.rank.items():
        where.append(f"ranks.{coord} = ?")
        params.append(value)
    if query.run_id is not None:
        where.append("runs.run_id = ?")
        params.append(query.run_id)
    if query.engine is not None:
        where.append("ranks.engine = ?")
        params.append(query.engine)
    return " AND ".join(where), params


def _candidates(rank: store.RankRow, cols, names: tuple[str, ...], query: SpanQuery):
    """(sort key, name, index) of the waves in one block whose spans match the query."""
    n = len(cols.wave)
    start = np.array(cols.start_unix_nano, np.int64)
    execute = np.array(cols.execute_ns, np.int64)
    sample = np.array(cols.sample_ns, np.int64)
    offset = np.array(cols.sample_offset_ns, np.int64)
    sampled = np.array(cols.sampled, bool)
    wave = np.array(cols.wave, np.int64)
    end = np.where(sampled, np.maximum(start + execute, start + offset + sample), start + execute)
    for name in names:
        if name in ("rank", "wave"):
            if name == "wave" and (query.rank or not is_root_rank(rank)):
                continue
            span_start, duration, ok = start, end - start, np.ones(n, bool)
        elif name == "execute_model":
            span_start, duration, ok = start, execute, np.ones(n, bool)
        else:
            span_start, duration, ok = start + offset, sample, sampled.copy()
        if query.since_ns is not None:
            ok &= span_start >= query.since_ns
        if query.until_ns is not None:
            ok &= span_start <= query.until_ns
        if query.min_duration_ns is not None:
            ok &= duration >= query.min_duration_ns
        if query.wave is not None:
            ok &= wave == query.wave
        key = {"duration": duration, "start": span_start, "wave": wave}[query.sort]
        for i in np.flatnonzero(ok)[np.argsort(-key[ok], kind="stable")][: query.limit]:
            yield int(key[i]), name, int(i)


def search(conn: sqlite3.Connection, query: SpanQuery) -> list[Span]:
    """The spans that match, best first by `query.sort`, at most `query.limit`."""
    query.validate()
    where, params = _rank_filter(query)
    ranks = {r.id: r for r in store.ranks(conn, where, params)}
    names = (query.name,) if query.name else SPAN_NAMES
    best: list[tuple] = []  # min-heap of (key, tiebreak, rank id, name, index, cols)
    counter = 0
    for rank_id, cols in store.wave_blocks(
        conn,
        list(ranks),
        since_ns=query.since_ns,
        until_ns=query.until_ns,
        min_step_ns=query.min_duration_ns,
        wave=query.wave,
    ):
        for key, name, index in _candidates(ranks[rank_id], cols, names, query):
            counter += 1
            entry = (key, -counter, rank_id, name, index, cols)
            if len(best) < query.limit:
                heapq.heappush(best, entry)
            elif entry[:2] > best[0][:2]:
                heapq.heapreplace(best, entry)
    out = []
    for _, _, rank_id, name, index, cols in sorted(best, key=lambda e: e[:2], reverse=True):
        (span,) = wave_spans(ranks[rank_id], cols, index, frozenset((name,)))
        out.append(span)
    return out


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
