"""The spans one TraceQL filter matches, best first: what `ascend-guard query` lists for its
filter flags (and `--spans`), over the same plan and column evaluator as the trace search.

A trace search answers traces, newest first; an on-call engineer asking for "the slowest
spans of the last 15 minutes" wants spans ranked across traces instead. `top_spans` evaluates
one `{ }` filter over every block the plan allows (telemetry/traceql/plan.py: ranks, span kinds,
a `duration >= X` bound on a block's slowest step), keeps the best `limit` rows by the sort key
without building a span, and builds only those with telemetry/spans/builders.py.
"""

from __future__ import annotations

import heapq
import sqlite3

import numpy as np

from telemetry import store
from telemetry.spans import requests as request_spans
from telemetry.spans.builders import Span, collective_spans
from telemetry.traceql import ast
from telemetry.traceql import requests as request_traceql
from telemetry.traceql.columns import mask_of
from telemetry.traceql.parser import TraceQLError, parse
from telemetry.traceql.plan import plan_leaf, uses_trace_level
from telemetry.traceql.source import (
    WAVE_KINDS,
    BlockTable,
    CollectiveTable,
    SpanTable,
    block_template,
    collective_waves_in_range,
    incident_spans,
    node_map,
    slow_call_spans_in,
)
from telemetry.wire import schema

_GROUP = schema.attr("collective.group")
SORT_KEYS = ("duration", "start", "wave")  # each descending: slowest, newest, latest wave first


def _one_filter(query: str | ast.Query) -> ast.SpansetFilter:
    parsed = parse(query) if isinstance(query, str) else query
    if parsed.metrics is not None:
        raise TraceQLError(f"{parsed.metrics.fn}() is a metrics query; a span list takes a filter")
    if parsed.stages or not isinstance(parsed.spanset, ast.SpansetFilter):
        raise TraceQLError(
            "a span list takes one { } filter, with no pipeline or spanset operator; "
            "search traces for those"
        )
    if uses_trace_level(parsed.spanset.expr):
        raise TraceQLError(
            "rootName, traceDuration, span ids and the nested set are read from whole traces; "
            "search traces for those"
        )
    return parsed.spanset


class _Best:
    """The `limit` best rows seen, by (sort key, start, source order); a row carries what
    builds its span later."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.heap: list[tuple] = []
        self.seen = 0

    def floor(self) -> int | None:
        return self.heap[0][0] if len(self.heap) >= self.limit else None

    def offer(self, keys: np.ndarray, starts: np.ndarray, rows: np.ndarray, build) -> None:
        if not len(rows):
            return
        order = np.lexsort((-starts[rows], -keys[rows]))[: self.limit]
        for i in rows[order]:
            self.seen += 1
            entry = (int(keys[i]), int(starts[i]), -self.seen, build, int(i))
            if len(self.heap) < self.limit:
                heapq.heappush(self.heap, entry)
            elif entry[:3] > self.heap[0][:3]:
                heapq.heapreplace(self.heap, entry)
            else:
                break  # rows come best first: no later one of this batch gets in

    def spans(self) -> list[Span]:
        ranked = sorted(self.heap, key=lambda e: e[:3], reverse=True)
        return [build(i) for _, _, _, build, i in ranked]


def _sort_key(sort: str, duration: np.ndarray, start: np.ndarray, wave) -> np.ndarray:
    value = {"duration": duration, "start": start, "wave": wave}[sort]
    return np.broadcast_to(np.asarray(value, np.int64), start.shape)


def top_spans(
    conn: sqlite3.Connection,
    query: str | ast.Query,
    start_ns: int,
    end_ns: int,
    sort: str = "duration",
    limit: int = 20,
) -> list[Span]:
    """The spans starting in [start_ns, end_ns] that one `{ }` filter matches, best first by
    `sort` (descending; ties: the later start first), at most `limit`."""
    parsed = parse(query) if isinstance(query, str) else query
    leaf = _one_filter(parsed)
    if sort not in SORT_KEYS:
        raise TraceQLError(f"sort: {sort!r}; one of {', '.join(SORT_KEYS)}")
    if limit < 1:
        raise TraceQLError(f"limit: {limit} must be 1 or more")
    if end_ns < start_ns:
        raise TraceQLError("end is before start")
    ranks = {r.id: r for r in store.ranks(conn)}
    plan = plan_leaf(leaf, list(ranks.values()))
    expr = leaf.expr
    best = _Best(limit)

    wave_ranks = [rid for rid, kinds in plan.kinds.items() if kinds & set(WAVE_KINDS)]
    min_step = plan.min_step_ns
    for rank_id, cols in store.wave_blocks(
        conn, wave_ranks, since_ns=start_ns, until_ns=end_ns, min_step_ns=min_step
    ):
        rank = ranks[rank_id]
        for kind in WAVE_KINDS:
            if kind not in plan.kinds[rank_id]:
                continue
            template = block_template(rank, cols, kind)
            if template is None:
                continue
            table = BlockTable(rank, cols, kind, template, conn)
            ok = table.exists & (table.start >= start_ns) & (table.start <= end_ns)
            rows = np.flatnonzero(mask_of(expr, table) & ok)
            keys = _sort_key(sort, table.end - table.start, table.start, table.array("wave"))
            best.offer(keys, table.start, rows, lambda i, t=table: t.spans(np.array([i]))[0])

    for rank_id, kinds in plan.kinds.items():
        if "collective" not in kinds:
            continue
        waves = store.wave_range(conn, rank_id, start_ns, end_ns)
        if waves is None:
            continue
        rank = ranks[rank_id]
        for records in collective_waves_in_range(conn, rank_id, *waves):
            table = CollectiveTable(rank, records)
            ok = (table.start >= start_ns) & (table.start <= end_ns)
            rows = np.flatnonzero(mask_of(expr, table) & ok)
            duration = np.asarray(table.column(ast.Intrinsic("duration"))[0], np.int64)
            keys = _sort_key(sort, duration, table.start, table.waves)
            best.offer(keys, table.start, rows, lambda i, t=table: _collective_span(t, i))

    # spans the store keeps as rows, built before the filter: slow calls, incidents and (where
    # the filter names them, as the trace search reads them) request traces' spans
    built: list[Span] = []
    slow = {rid: ranks[rid] for rid, kinds in plan.kinds.items() if "slow_call" in kinds}
    if slow:
        built += slow_call_spans_in(conn, slow, start_ns, end_ns)
    if plan.incidents:
        built += incident_spans(conn, start_ns, end_ns)
    if request_traceql.names_requests(parsed):
        pinned = request_traceql.wanted_request(leaf)
        for spans in request_spans.spans_in_range(
            conn, start_ns, end_ns, pinned, request_traceql.MAX_INSPECTED
        ):
            built += spans
    spans = [s for s in built if start_ns <= s.start_ns <= end_ns]
    if spans:
        table = SpanTable(spans, nodes=node_map(ranks.values()))
        rows = np.flatnonzero(mask_of(expr, table))
        start = np.array([s.start_ns for s in spans], np.int64)
        duration = np.array([s.duration_ns for s in spans], np.int64)
        wave = np.array([s.wave for s in spans], np.int64)
        keys = _sort_key(sort, duration, start, wave)
        best.offer(keys, start, rows, lambda i, s=spans: s[i])
    return best.spans()


def _collective_span(table: CollectiveTable, i: int) -> Span:
    cw, stat = table.rows[i]
    for span in collective_spans(table.rank, cw):
        if span.name.endswith(f":{stat.op}") and span.attributes.get(_GROUP) == stat.group:
            return span
    raise AssertionError(f"no collective span for {stat.op}/{stat.group} in wave {cw.wave}")
