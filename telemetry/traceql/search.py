"""TraceQL search over the store: matched traces, newest first.

Two passes. The candidate pass finds, for each `{ }` filter, the traces (waves of one replica)
that hold at least one span matching it: it reads only the ranks, span kinds and blocks the
plan allows (telemetry/traceql/plan.py) and evaluates the filter over a block's columns without
building spans. The filters' trace sets are combined the way the spanset expression combines
them (`||` unites, `&&` and structural operators need both sides). The exact pass then builds
each candidate trace with the CLI's own builder (telemetry/spans/query.py `load_trace`) and runs the
whole query on its spans, newest first, until `limit` traces match. The candidate pass walks
back from `end_ns` in windows that grow fourfold, so a broad query stops after the first
window while a narrow one scans the range.
"""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import Iterable

import numpy as np

from telemetry.spans.builders import Span
from telemetry.store import records as store
from telemetry.traceql import ast, fields
from telemetry.traceql import requests as request_traceql
from telemetry.traceql.columns import _scalar_cmp, mask_of, value_of
from telemetry.traceql.parser import TraceQLError, parse
from telemetry.traceql.plan import LeafPlan, leaves, plan_leaf
from telemetry.traceql.source import (
    WAVE_KINDS,
    BlockCache,
    BlockTable,
    CollectiveTable,
    SpanTable,
    block_template,
    error_waves,
    incident_spans,
    load_trace_cached,
    node_map,
    slow_call_spans_in,
)
from telemetry.wire.trace_ids import format_trace_id, wave_trace_key

DEFAULT_LIMIT = 20
DEFAULT_SPSS = 3
FIRST_WINDOW_NS = 2 * 10**9


@dataclasses.dataclass
class SpanSet:
    spans: list[Span]  # at most spans_per_spanset, in start order
    matched: int  # spans in the set before the cap
    attributes: dict[str, object]  # by() groups and aggregates, keyed by their TraceQL text


@dataclasses.dataclass
class TraceMatch:
    trace_id: str  # 32 lowercase hex digits
    root_name: str | None  # None: the root span is not in this store
    start_ns: int
    duration_ns: int
    spansets: list[SpanSet]
    fetched: tuple[ast.Field, ...]  # attribute fields the query named or selected

    @property
    def spans(self) -> list[Span]:
        return [s for ss in self.spansets for s in ss.spans]

    def span_attributes(self, span: Span) -> dict[str, object]:
        """The attributes the query fetched, keyed by their attribute key."""
        attrs = fields.span_attributes(span)
        out = {}
        for field in self.fetched:
            key = fields.attribute_key(field.name)
            if key in attrs and field.scope != "resource":
                out[key] = attrs[key]
        return out


# -- candidate sets: trace keys (replica key, wave) with the earliest matching start ------------
class Candidates:
    def __init__(self) -> None:
        self._parts: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
        self._final: dict[int, tuple[np.ndarray, np.ndarray]] | None = None

    def add(self, key: int, waves: np.ndarray, starts: np.ndarray) -> None:
        if len(waves):
            self._parts.setdefault(key, []).append((waves, starts))
            self._final = None

    def final(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """key -> (sorted unique waves, earliest start of each)."""
        if self._final is None:
            out = {}
            for key, parts in self._parts.items():
                waves = np.concatenate([p[0] for p in parts])
                starts = np.concatenate([p[1] for p in parts])
                order = np.lexsort((starts, waves))
                waves, starts = waves[order], starts[order]
                unique, first = np.unique(waves, return_index=True)
                out[key] = (unique, starts[first])
            self._final = out
        return self._final


def _combine(a, b, both: bool):
    out = {}
    for key in (set(a) & set(b)) if both else (set(a) | set(b)):
        if key not in a or key not in b:
            out[key] = a.get(key) or b.get(key)
            continue
        (wa, sa), (wb, sb) = a[key], b[key]
        if both:
            waves, ia, ib = np.intersect1d(wa, wb, assume_unique=True, return_indices=True)
            out[key] = (waves, np.minimum(sa[ia], sb[ib]))
        else:
            waves = np.union1d(wa, wb)
            starts = np.full(len(waves), np.iinfo(np.int64).max)
            for w, s in ((wa, sa), (wb, sb)):
                idx = np.searchsorted(waves, w)
                starts[idx] = np.minimum(starts[idx], s)
            out[key] = (waves, starts)
    return out


def _needed(expr: ast.SpansetExpr, sets: dict[int, Candidates]):
    """The traces that can satisfy the spanset expression, from each filter's trace set."""
    if isinstance(expr, ast.SpansetFilter):
        return sets[id(expr)].final()
    left, right = _needed(expr.left, sets), _needed(expr.right, sets)
    return _combine(left, right, both=expr.op != "||")


class CandidatePass:
    """Finds each filter's traces window by window (the windows must not overlap)."""

    def __init__(
        self, conn: sqlite3.Connection, query: ast.Query, cache: BlockCache | None = None
    ) -> None:
        self.conn = conn
        self.cache = cache if cache is not None else BlockCache(conn)  # shared with the exact pass
        self.ranks = {r.id: r for r in store.ranks(conn)}
        self.keys = {r.id: wave_trace_key(r.run_id, r.dp) for r in self.ranks.values()}
        self.nodes = node_map(self.ranks.values())
        self.plans = [plan_leaf(leaf, list(self.ranks.values())) for leaf in leaves(query.spanset)]
        self.sets = {id(p.leaf): Candidates() for p in self.plans}
        self.blocks_read = 0

    def scan(self, lo: int, hi: int) -> None:
        """Add the matches among spans starting in [lo, hi)."""
        self._scan_waves(lo, hi)
        self._scan_collectives(lo, hi)
        self._scan_slow_calls(lo, hi)
        self._scan_incidents(lo, hi)

    def _scan_waves(self, lo: int, hi: int) -> None:
        wanted: dict[int, list[LeafPlan]] = {}
        bounds = []
        for plan in self.plans:
            has = [rid for rid, kinds in plan.kinds.items() if kinds & set(WAVE_KINDS)]
            for rid in has:
                wanted.setdefault(rid, []).append(plan)
            if has:
                bounds.append(plan.min_step_ns)
        if not wanted:
            return
        min_step = None if None in bounds else min(bounds)
        error_only = all(p.error_only for plans in wanted.values() for p in plans)
        blocks = store.blocks_by_time(
            self.conn, store.WAVE_BLOCKS, list(wanted), lo, hi, min_ns=min_step
        )
        if error_only:  # only blocks whose waves raised an incident: one look-up per rank
            blocks = self._with_errors(list(blocks))
        for block in blocks:
            rank_id = block.rank
            rank = self.ranks[rank_id]
            cols = self.cache.wave_columns(block.rowid)
            self.blocks_read += 1
            for kind in WAVE_KINDS:
                plans = [p for p in wanted[rank_id] if kind in p.kinds[rank_id]]
                if not plans:
                    continue
                template = block_template(rank, cols, kind)
                if template is None:
                    continue
                table = BlockTable(rank, cols, kind, template, self.conn)
                in_window = table.exists & (table.start >= lo) & (table.start < hi)
                for plan in plans:
                    rows = np.flatnonzero(mask_of(plan.expr, table) & in_window)
                    if len(rows):
                        waves = table.array("wave")[rows]
                        self.sets[id(plan.leaf)].add(self.keys[rank_id], waves, table.start[rows])

    def _with_errors(self, blocks: list) -> list:
        by_rank: dict[int, list] = {}
        for block in blocks:
            by_rank.setdefault(block.rank, []).append(block)
        out = []
        for rank_id, own in by_rank.items():
            first = min(b.first_wave for b in own)
            last = max(b.last_wave for b in own)
            bad = np.array(sorted(error_waves(self.conn, self.ranks[rank_id], "wave", first, last)))
            if not len(bad):
                continue
            for b in own:  # a wave with an incident in the block's wave range
                i = np.searchsorted(bad, b.first_wave)
                if i < len(bad) and bad[i] <= b.last_wave:
                    out.append(b)
        return out

    def _add_spans(self, spans: list[Span], plans: Iterable[LeafPlan], lo: int, hi: int) -> None:
        spans = [s for s in spans if lo <= s.start_ns < hi]
        if not spans:
            return
        table = SpanTable(spans, nodes=self.nodes)
        for plan in plans:
            rows = np.flatnonzero(mask_of(plan.expr, table))
            by_key: dict[int, list[int]] = {}
            for i in rows:
                span = spans[i]
                by_key.setdefault(span.trace_id >> 64, []).append(i)
            for key, idx in by_key.items():
                waves = np.array([spans[i].wave for i in idx], np.int64)
                starts = np.array([spans[i].start_ns for i in idx], np.int64)
                self.sets[id(plan.leaf)].add(key, waves, starts)

    def _scan_collectives(self, lo: int, hi: int) -> None:
        for rank_id, rank in self.ranks.items():
            plans = [p for p in self.plans if "collective" in p.kinds.get(rank_id, ())]
            if not plans:
                continue
            bounds = [p.min_step_ns for p in plans]
            min_ns = None if None in bounds else min(bounds)
            for block in store.blocks_by_time(
                self.conn, store.COLLECTIVE_BLOCKS, (rank_id,), lo, hi - 1, min_ns=min_ns
            ):
                cols = self.cache.collective_columns(block.rowid)
                self.blocks_read += 1
                table = CollectiveTable(rank, cols=cols)
                in_window = (table.start >= lo) & (table.start < hi)
                for plan in plans:
                    rows = np.flatnonzero(mask_of(plan.expr, table) & in_window)
                    if len(rows):
                        self.sets[id(plan.leaf)].add(
                            self.keys[rank_id], table.waves[rows], table.start[rows]
                        )

    def _scan_slow_calls(self, lo: int, hi: int) -> None:
        plans = [p for p in self.plans if any("slow_call" in k for k in p.kinds.values())]
        if not plans:
            return
        ids = {rid for p in plans for rid, kinds in p.kinds.items() if "slow_call" in kinds}
        ranks = {rid: self.ranks[rid] for rid in ids}
        self._add_spans(slow_call_spans_in(self.conn, ranks, lo, hi - 1), plans, lo, hi)

    def _scan_incidents(self, lo: int, hi: int) -> None:
        plans = [p for p in self.plans if p.incidents]
        if plans:
            self._add_spans(incident_spans(self.conn, lo, hi - 1), plans, lo, hi)

    def candidates(self, query: ast.Query) -> list[tuple[int, int, int]]:
        """(start, replica key, wave) of every trace that may match, newest first."""
        out = []
        for key, (waves, starts) in _needed(query.spanset, self.sets).items():
            out += zip(starts.tolist(), [key] * len(waves), waves.tolist(), strict=False)
        out.sort(reverse=True)
        return out


def windows(start_ns: int, end_ns: int, first_ns: int = FIRST_WINDOW_NS):
    """[lo, hi) windows from end_ns back to start_ns, each four times the one before."""
    hi, width = end_ns + 1, first_ns
    while hi > start_ns:
        lo = max(start_ns, hi - width)
        yield lo, hi
        hi, width = lo, width * 4


# -- the exact pass: one trace ------------------------------------------------------------------
class TraceView:
    """One trace's spans with their tree, for evaluating a query on it."""

    def __init__(self, spans: list[Span], nodes: dict | None = None) -> None:
        self.spans = spans
        self.nodes = nodes
        index = {s.span_id: i for i, s in enumerate(spans)}
        self.parent = [index.get(s.parent_id) if s.parent_id is not None else None for s in spans]
        roots = [s for s in spans if s.parent_id is None]
        self.root_name = roots[0].name if roots else None
        self.start_ns = min(s.start_ns for s in spans)
        self.duration_ns = max(s.end_ns for s in spans) - self.start_ns
        self.context = {
            "rootName": self.root_name,
            "traceDuration": self.duration_ns,
        }
        self.table = SpanTable(spans, self.context, nodes)

    def sub_table(self, rows: list[int]) -> SpanTable:
        return SpanTable([self.spans[i] for i in rows], self.context, self.nodes)

    def ancestors(self, i: int) -> Iterable[int]:
        seen = set()
        parent = self.parent[i]
        while parent is not None and parent not in seen:
            seen.add(parent)
            yield parent
            parent = self.parent[parent]


def _spanset(expr: ast.SpansetExpr, view: TraceView, rows: list[int] | None = None) -> set[int]:
    """Indices (into view.spans) of the spans the spanset expression returns, among `rows`."""
    if isinstance(expr, ast.SpansetFilter):
        if rows is None:
            return set(np.flatnonzero(mask_of(expr.expr, view.table)).tolist())
        hits = np.flatnonzero(mask_of(expr.expr, view.sub_table(rows)))
        return {rows[i] for i in hits}
    left, right = _spanset(expr.left, view, rows), _spanset(expr.right, view, rows)
    op = expr.op
    if op == "&&":
        return left | right if left and right else set()
    if op == "||":
        return left | right
    if op == ">":
        return {r for r in right if view.parent[r] in left}
    if op == ">>":
        return {r for r in right if any(a in left for a in view.ancestors(r))}
    if op == "<":
        parents = {view.parent[i] for i in left}
        return right & parents
    if op == "<<":
        above = {a for i in left for a in view.ancestors(i)}
        return right & above
    if op == "~":
        parents: dict[int, set[int]] = {}
        for i in left:
            if view.parent[i] is not None:
                parents.setdefault(view.parent[i], set()).add(i)
        return {
            r
            for r in right
            if view.parent[r] is not None and parents.get(view.parent[r], set()) - {r}
        }
    raise TraceQLError(f"unsupported spanset operator {op}")


def aggregate_value(agg: ast.Aggregate, view: TraceView, rows: list[int]):
    if agg.fn == "count":
        return len(rows)
    values, present = value_of(agg.field, view.sub_table(rows))
    values = np.broadcast_to(np.asarray(values, dtype=object), (len(rows),))
    present = np.broadcast_to(present, (len(rows),))
    numbers = [
        v
        for v, p in zip(values, present, strict=False)
        if p and isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
    ]
    if not numbers:
        return None
    if agg.fn == "avg":
        return sum(numbers) / len(numbers)
    return {"min": min, "max": max, "sum": sum}[agg.fn](numbers)


def run_pipeline(query: ast.Query, view: TraceView) -> tuple[list[tuple[list[int], dict]], list]:
    """The spansets (span indices, attributes) the query leaves of one trace, and the fields
    select() adds."""
    first = sorted(_spanset(query.spanset, view))
    sets = [(first, {})] if first else []
    selected: list = []
    for stage in query.stages:
        if isinstance(stage, (ast.SpansetFilter, ast.SpansetOp)):
            sets = [(sorted(_spanset(stage, view, rows)), attrs) for rows, attrs in sets]
        elif isinstance(stage, ast.ScalarFilter):
            kept = []
            for rows, attrs in sets:
                value = aggregate_value(stage.aggregate, view, rows)
                if value is not None and _scalar_cmp(stage.op, value, stage.value.value, None):
                    kept.append((rows, {**attrs, str(stage.aggregate): value}))
            sets = kept
        elif isinstance(stage, ast.GroupBy):
            grouped = []
            for rows, attrs in sets:
                table = view.sub_table(rows)
                columns = []
                for field in stage.fields:
                    values, present = value_of(field, table)
                    values = np.broadcast_to(np.asarray(values, dtype=object), (len(rows),))
                    present = np.broadcast_to(present, (len(rows),))
                    columns.append(
                        [v if p else None for v, p in zip(values, present, strict=False)]
                    )
                groups: dict[tuple, list[int]] = {}
                for j, row in enumerate(rows):
                    groups.setdefault(tuple(c[j] for c in columns), []).append(row)
                for key, members in groups.items():
                    labels = {f"by({f})": v for f, v in zip(stage.fields, key, strict=False)}
                    grouped.append((members, {**attrs, **labels}))
            sets = grouped
        elif isinstance(stage, ast.Select):
            selected += list(stage.fields)
        elif isinstance(stage, ast.Coalesce):
            merged = sorted({r for rows, _ in sets for r in rows})
            attrs = {k: v for _, a in sets for k, v in a.items()}
            sets = [(merged, attrs)] if merged else []
        sets = [(rows, attrs) for rows, attrs in sets if rows]
    return sets, selected


def _fields_of(node) -> list:
    if isinstance(node, ast.Attribute):
        return [node]
    out = []
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            items = value if isinstance(value, tuple) else (value,)
            for item in items:
                if dataclasses.is_dataclass(item):
                    out += _fields_of(item)
    return out


def _trace_id(key: int, wave: int) -> str:
    return format_trace_id(key << 64 | wave)


def match_trace(
    query: ast.Query,
    spans: list[Span],
    trace_id: str,
    spans_per_spanset: int | None,
    nodes: dict | None = None,
) -> TraceMatch | None:
    """The query's result on one trace's spans (None: no spanset is left)."""
    if not spans:
        return None
    spans = sorted(spans, key=lambda s: (s.start_ns, s.name))
    view = TraceView(spans, nodes)
    sets, selected = run_pipeline(query, view)
    if not sets:
        return None
    fetched = tuple(dict.fromkeys(_fields_of(query.spanset) + _fields_of_stages(query)))
    fetched += tuple(f for f in selected if isinstance(f, ast.Attribute) and f not in fetched)
    spansets = []
    for rows, attrs in sets:
        chosen = rows if spans_per_spanset is None else rows[:spans_per_spanset]
        spansets.append(SpanSet([spans[i] for i in chosen], len(rows), attrs))
    return TraceMatch(trace_id, view.root_name, view.start_ns, view.duration_ns, spansets, fetched)


def _fields_of_stages(query: ast.Query) -> list:
    out = []
    for stage in query.stages:
        out += _fields_of(stage)
    return out


def search(
    conn: sqlite3.Connection,
    query: str | ast.Query,
    start_ns: int,
    end_ns: int,
    limit: int = DEFAULT_LIMIT,
    spans_per_spanset: int | None = DEFAULT_SPSS,
) -> list[TraceMatch]:
    """The traces in [start_ns, end_ns] that match a TraceQL search, newest first, at most
    `limit`; each spanset keeps `spans_per_spanset` spans (None: all)."""
    parsed = parse(query) if isinstance(query, str) else query
    if parsed.metrics is not None:
        raise TraceQLError(f"{parsed.metrics.fn}() is a metrics query; use metrics_range")
    if end_ns < start_ns:
        raise TraceQLError("end is before start")
    if limit < 1:
        raise TraceQLError(f"limit: {limit} must be 1 or more")
    cache = BlockCache(conn)
    finder = CandidatePass(conn, parsed, cache)
    done: set[tuple[int, int]] = set()
    # request traces (telemetry/traceql/requests.py), when the query names request spans
    out: list[TraceMatch] = request_traceql.search(
        conn, parsed, start_ns, end_ns, limit, spans_per_spanset, finder.nodes
    )
    for lo, hi in windows(start_ns, end_ns):
        finder.scan(lo, hi)
        for _, key, wave in finder.candidates(parsed):
            if (key, wave) in done:
                continue
            done.add((key, wave))
            trace_id = _trace_id(key, wave)
            spans = load_trace_cached(conn, trace_id, cache)
            found = match_trace(parsed, spans, trace_id, spans_per_spanset, finder.nodes)
            if found is not None:
                out.append(found)
                if len(out) >= limit:
                    return _newest_first(out)[:limit]
    return _newest_first(out)[:limit]


def _newest_first(matches: list[TraceMatch]) -> list[TraceMatch]:
    return sorted(matches, key=lambda m: m.start_ns, reverse=True)
