"""The exact pass of a TraceQL query over one trace's built spans: spansets, the pipeline's stages,
structural operators and aggregates, and whether (and how) the trace matches.

Both the wave search (telemetry/traceql/search.py) and the request-trace search
(telemetry/traceql/requests.py) end here, so a query means the same on both kinds of trace.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np

from telemetry.spans.builders import Span
from telemetry.traceql import ast, fields
from telemetry.traceql.columns import mask_of, scalar_cmp, value_of
from telemetry.traceql.parser import TraceQLError
from telemetry.traceql.source import (
    SpanTable,
)


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
    root_service: str | None = None  # the root span's service.name (None: no root here)

    @property
    def spans(self) -> list[Span]:
        return [s for ss in self.spansets for s in ss.spans]

    def span_attributes(self, span: Span) -> dict[str, object]:
        """The attributes the query fetched, keyed by their attribute key."""
        attrs = fields.span_attributes(span)
        out = {}
        for field in self.fetched:
            key = fields.attribute_key(field.name)
            if key in attrs and field.scope in (None, "span"):
                out[key] = attrs[key]
        return out


# -- the exact pass: one trace ------------------------------------------------------------------
class TraceView:
    """One trace's spans with their tree, for evaluating a query on it."""

    def __init__(self, spans: list[Span], nodes: dict | None = None) -> None:
        self.spans = spans
        self.nodes = nodes
        index = {s.span_id: i for i, s in enumerate(spans)}
        self.parent = [index.get(s.parent_id) if s.parent_id is not None else None for s in spans]
        self.children: dict[int, list[int]] = {}
        for i, p in enumerate(self.parent):
            if p is not None:
                self.children.setdefault(p, []).append(i)
        roots = [s for s in spans if s.parent_id is None]
        self.root_name = roots[0].name if roots else None
        self.root_service = fields.service_name(roots[0]) if roots else None
        self.start_ns = min(s.start_ns for s in spans)
        self.duration_ns = max(s.end_ns for s in spans) - self.start_ns
        self.context = {
            "rootName": self.root_name,
            "traceDuration": self.duration_ns,
            "rootServiceName": self.root_service,
        }
        self._tree: dict[str, list] | None = None
        self.table = SpanTable(spans, self.context, nodes, lambda: self.per_span)

    @property
    def per_span(self) -> dict[str, list]:
        """The tree's intrinsics, one value per span (made when a query first reads one)."""
        if self._tree is None:
            self._tree = self._tree_columns()
        return self._tree

    def _tree_columns(self) -> dict[str, list]:
        """Tempo's nested set numbers (a depth-first walk from each root: left on the way down,
        right on the way up, parent = the parent's left, -1 for a root; 0 for a span whose root
        is not in the trace) and each span's child count."""
        n = len(self.spans)
        left, right, parent = [0] * n, [0] * n, [0] * n
        bound = 1
        for root in (i for i, s in enumerate(self.spans) if s.parent_id is None):
            left[root], parent[root] = bound, -1
            bound += 1
            stack = [(root, iter(self.children.get(root, ())))]
            while stack:
                node, pending = stack[-1]
                child = next(pending, None)
                if child is None:
                    right[node] = bound
                    bound += 1
                    stack.pop()
                elif not left[child]:  # (a span seen twice, in a broken tree, is walked once)
                    left[child], parent[child] = bound, left[node]
                    bound += 1
                    stack.append((child, iter(self.children.get(child, ()))))
        return {
            "nestedSetLeft": left,
            "nestedSetRight": right,
            "nestedSetParent": parent,
            "span:childCount": [len(self.children.get(i, ())) for i in range(n)],
        }

    def sub_table(self, rows: list[int]) -> SpanTable:
        def per_span() -> dict[str, list]:
            return {name: [values[i] for i in rows] for name, values in self.per_span.items()}

        return SpanTable([self.spans[i] for i in rows], self.context, self.nodes, per_span)

    def ancestors(self, i: int) -> Iterable[int]:
        seen = set()
        parent = self.parent[i]
        while parent is not None and parent not in seen:
            seen.add(parent)
            yield parent
            parent = self.parent[parent]


MULTIPLE_SPANSETS = (
    "spanset operators are not supported for multiple spansets per trace; consider coalesce()"
)


def _operand(expr: ast.SpansetExpr, view: TraceView, rows: list[int] | None) -> list[set[int]]:
    """The spansets a spanset operand gives: one, or a pipeline's several."""
    if isinstance(expr, ast.SubPipeline):
        first = sorted(_spanset(expr.spanset, view, rows))
        sets, _ = run_stages([(first, {})] if first else [], expr.stages, view)
        return [set(r) for r, _ in sets]
    found = _spanset(expr, view, rows)
    return [found] if found else []


def _related(op: str, left: set[int], right: set[int], view: TraceView) -> set[int]:
    """`left op right` for a structural operator: the right side's spans that relate to a left
    one (`>` child, `<` parent, `>>` descendant, `<<` ancestor, `~` sibling); `!op` those that
    do not; `&op` the spans of both sides that relate."""
    base = op.lstrip("!&")
    parent = view.parent
    if base == ">":
        hits = {r for r in right if parent[r] in left}
        back = {parent[r] for r in hits}
    elif base == "<":
        parents = {parent[i] for i in left}
        hits = right & parents
        back = {i for i in left if parent[i] in hits}
    elif base == ">>":
        hits, back = set(), set()
        for r in right:
            above = [a for a in view.ancestors(r) if a in left]
            if above:
                hits.add(r)
                back.update(above)
    elif base == "<<":
        hits, back = set(), set()
        for i in left:
            above = [a for a in view.ancestors(i) if a in right]
            if above:
                back.add(i)
                hits.update(above)
    else:  # "~": another child of the same parent
        by_parent: dict[int, set[int]] = {}
        for i in left:
            if parent[i] is not None:
                by_parent.setdefault(parent[i], set()).add(i)
        hits, back = set(), set()
        for r in right:
            others = by_parent.get(parent[r], set()) - {r} if parent[r] is not None else set()
            if others:
                hits.add(r)
                back.update(others)
    if op.startswith("!"):
        return right - hits
    if op.startswith("&"):
        return hits | back
    return hits


def _spanset(expr: ast.SpansetExpr, view: TraceView, rows: list[int] | None = None) -> set[int]:
    """Indices (into view.spans) of the spans the spanset expression returns, among `rows`."""
    if isinstance(expr, ast.SpansetFilter):
        if rows is None:
            return set(np.flatnonzero(mask_of(expr.expr, view.table)).tolist())
        hits = np.flatnonzero(mask_of(expr.expr, view.sub_table(rows)))
        return {rows[i] for i in hits}
    if isinstance(expr, ast.SubPipeline):
        return set().union(*_operand(expr, view, rows))
    lefts, rights = _operand(expr.left, view, rows), _operand(expr.right, view, rows)
    left, right = set().union(*lefts), set().union(*rights)
    op = expr.op
    if op == "&&":
        return left | right if left and right else set()
    if op == "||":
        return left | right
    if op in ast.ALL_STRUCTURAL_OPS:
        if len(lefts) > 1 or len(rights) > 1:
            raise TraceQLError(f"TraceQL: {MULTIPLE_SPANSETS}")
        return _related(op, left, right, view)
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
    return run_stages([(first, {})] if first else [], query.stages, view)


def run_stages(sets: list, stages, view: TraceView) -> tuple[list[tuple[list[int], dict]], list]:
    """Spansets (span indices, attributes) through pipeline stages."""
    selected: list = []
    for stage in stages:
        if isinstance(stage, (ast.SpansetFilter, ast.SpansetOp, ast.SubPipeline)):
            sets = [(sorted(_spanset(stage, view, rows)), attrs) for rows, attrs in sets]
        elif isinstance(stage, ast.ScalarFilter):
            kept = []
            for rows, attrs in sets:
                value = aggregate_value(stage.aggregate, view, rows)
                if value is not None and scalar_cmp(stage.op, value, stage.value.value, None):
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


def fields_of(node) -> list:
    if isinstance(node, ast.Attribute):
        return [node]
    out = []
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            items = value if isinstance(value, tuple) else (value,)
            for item in items:
                if dataclasses.is_dataclass(item):
                    out += fields_of(item)
    return out


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
    fetched = tuple(dict.fromkeys(fields_of(query.spanset) + fields_of_stages(query)))
    fetched += tuple(f for f in selected if isinstance(f, ast.Attribute) and f not in fetched)
    spansets = []
    for rows, attrs in sets:
        chosen = rows if spans_per_spanset is None else rows[:spans_per_spanset]
        spansets.append(SpanSet([spans[i] for i in chosen], len(rows), attrs))
    return TraceMatch(
        trace_id,
        view.root_name,
        view.start_ns,
        view.duration_ns,
        spansets,
        fetched,
        view.root_service,
    )


def fields_of_stages(query: ast.Query) -> list:
    out = []
    for stage in query.stages:
        out += fields_of(stage)
    return out
