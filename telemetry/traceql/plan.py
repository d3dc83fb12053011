"""Which ranks, span kinds and blocks can hold a match, decided before any block is decoded.

Each `{ }` filter of a query is planned on its own. For every rank and span kind the filter is
evaluated with what is known without reading a block: the rank's coordinates, run, engine and
node, the span kind's name and attribute keys (telemetry/traceql/fields.py). A rank or kind
where the filter cannot be true is skipped, so `{ .tp = 1 }` reads tp1's blocks only and
`{ .op = "all_reduce" }` reads collective blocks only. A `duration > X` conjunct skips wave
blocks whose slowest step is shorter (wave_blocks.max_step_ns).
"""

from __future__ import annotations

import dataclasses

from telemetry import store
from telemetry.spans.builders import SLOW_CALL_PREFIX, STATUS_ERROR, is_root_rank
from telemetry.traceql import ast, fields
from telemetry.traceql.columns import ABSENT, UNKNOWN, Prefixed, lower_bounds, maybe
from telemetry.traceql.source import ALL_KINDS, WAVE_KINDS
from telemetry.wire import schema

_DURATION = ast.Intrinsic("duration")
_PREFIXES = {
    "collective": fields.COLLECTIVE_PREFIX,
    "slow_call": SLOW_CALL_PREFIX,
    "incident": fields.INCIDENT_PREFIX,
}


def relax(expr: ast.FieldExpr | None, positive: bool = True):
    """The filter with every condition only a built trace decides (rootName, traceDuration, the
    tree's nested set, ids, events, links: `uses_trace_level`) replaced by what keeps every
    possible match: true, or false under a `!`."""
    if expr is None:
        return None
    if isinstance(expr, ast.Logical):
        return ast.Logical(expr.op, relax(expr.left, positive), relax(expr.right, positive))
    if isinstance(expr, ast.Not):
        return ast.Not(relax(expr.operand, not positive))
    if uses_trace_level(expr):
        return ast.Static(positive, "bool", "true" if positive else "false")
    return expr


def uses_trace_level(expr) -> bool:
    """Whether the expression reads a field that only a built trace answers."""
    if isinstance(expr, ast.Intrinsic | ast.Attribute):
        return expr.trace_level
    if isinstance(expr, ast.Comparison | ast.Logical | ast.Arithmetic):
        return uses_trace_level(expr.left) or uses_trace_level(expr.right)
    if isinstance(expr, ast.Not | ast.Negate):
        return uses_trace_level(expr.operand)
    return False


def _rank_values(rank: store.RankRow) -> dict:
    return {
        schema.ATTR_RUN: rank.run_id,
        schema.ATTR_ENGINE: rank.engine,
        schema.ATTR_DP: rank.dp,
        schema.ATTR_TP: rank.tp,
        schema.ATTR_PP: rank.pp,
        schema.ATTR_NODE: rank.node,
        schema.ATTR_PID: rank.pid,
    }


def _known(kind: str, rank: store.RankRow | None):
    keys = fields.kind_keys()[kind]
    values = _rank_values(rank) if rank is not None else {}
    resource = fields.resource_attributes(rank.engine, rank.node) if rank is not None else {}

    def known(field):
        if isinstance(field, ast.Intrinsic):
            if field.name == "name":
                if kind in WAVE_KINDS:
                    return kind
                return Prefixed(_PREFIXES[kind])
            if field.name == "status":
                if kind == "incident":
                    return STATUS_ERROR
                # a rank span (and its wave root) has status error where it raised an incident
                return UNKNOWN if kind in ("wave", "rank") else fields.SPAN_STATUS
            if field.name == "kind":
                return fields.SPAN_KIND
            if field.name == "rootServiceName":  # the replica's engine, which its ranks share
                return schema.service_name(rank.engine) if rank is not None else UNKNOWN
            if field.name == "instrumentation:name":
                return fields.INSTRUMENTATION_NAME
            if field.name.startswith("event:"):  # incidents carry the one event a span has
                return UNKNOWN if kind == "incident" else ABSENT
            if field.name.startswith(("link:", "instrumentation:")):
                return ABSENT  # no span a search reads has a link or a scope version
            return UNKNOWN
        if field.scope == "event":
            return UNKNOWN if kind == "incident" else ABSENT
        if field.scope in ("link", "instrumentation"):
            return ABSENT
        key = fields.attribute_key(field.name)
        if field.scope in (None, "span") and key in keys:
            return values.get(key, UNKNOWN)
        if field.scope in (None, "resource"):
            if rank is None and field.name in fields.resource_attributes("", "node"):
                return UNKNOWN  # a span of no one rank (an incident): its own engine and node
            if field.name == fields.RESOURCE_HOST:
                return resource.get(field.name, UNKNOWN)
            if field.name in resource:
                return resource[field.name]
        return ABSENT

    return known


def known_values(kind: str, rank: store.RankRow | None):
    """`known(field)` for one span kind on one rank: the value every such span has, ABSENT, or
    UNKNOWN (the field differs span by span)."""
    return _known(kind, rank)


@dataclasses.dataclass
class LeafPlan:
    """Where one `{ }` filter can match."""

    leaf: ast.SpansetFilter
    expr: ast.FieldExpr | None  # relaxed: what blocks are filtered with
    kinds: dict[int, set[str]]  # rank id -> span kinds (wave kinds and "collective")
    incidents: bool
    min_step_ns: int | None
    # wave-kind spans match only where they have status error (raised an incident)
    error_only: bool = False


def plan_leaf(leaf: ast.SpansetFilter, ranks: list[store.RankRow]) -> LeafPlan:
    expr = relax(leaf.expr)
    kinds: dict[int, set[str]] = {}
    for rank in ranks:
        possible = {
            kind
            for kind in ALL_KINDS
            if kind != "incident"
            and (kind != "wave" or is_root_rank(rank))  # the root comes from tp0 pp0's row
            and (expr is None or maybe(expr, _known(kind, rank)) is not False)
        }
        if possible:
            kinds[rank.id] = possible
    incidents = expr is None or maybe(expr, _known("incident", None)) is not False
    # every wave kind that can match at all can only with status error
    possible = [k for k in WAVE_KINDS if expr is None or maybe(expr, _known(k, None)) is not False]
    error_only = (
        expr is not None
        and bool(possible)
        and all(maybe(expr, _unset(_known(k, None))) is False for k in possible)
    )
    return LeafPlan(leaf, expr, kinds, incidents, lower_bounds(expr, _DURATION), error_only)


def _unset(known):
    """`known` with status unset (a span that raised no incident)."""

    def with_status(field):
        if isinstance(field, ast.Intrinsic) and field.name == "status":
            return fields.SPAN_STATUS
        return known(field)

    return with_status


def leaves(expr: ast.SpansetExpr) -> list[ast.SpansetFilter]:
    if isinstance(expr, ast.SpansetFilter):
        return [expr]
    if isinstance(expr, ast.SubPipeline):
        return leaves(expr.spanset)
    return leaves(expr.left) + leaves(expr.right)


def requirements(query: ast.Query) -> list[ast.SpansetExpr]:
    """Spanset expressions a trace must match somewhere for the query to match it: the first
    spanset, and where that is `{ }` (every span: also a pipeline that starts with by(),
    select() or an aggregate) the spanset stages after it instead, since the spans they keep
    must match them."""
    first = query.spanset
    if isinstance(first, ast.SpansetFilter) and first.expr is None:
        later = [
            s
            for s in query.stages
            if isinstance(s, ast.SpansetFilter | ast.SpansetOp | ast.SubPipeline)
        ]
        if later:
            return later
    return [first]
