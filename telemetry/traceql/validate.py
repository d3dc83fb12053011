"""Type checks on a parsed query: what Grafana Tempo's TraceQL refuses after parsing, refused here
with the same kind of message.

Every field expression has a type: a static its own, an intrinsic the one Tempo gives it
(`ast.INTRINSIC_TYPES`), an attribute none known until it is read ("attribute": any type), a
comparison or `&&` / `||` boolean, `!` and `-` their operand's, arithmetic its left operand's
(its right one's when the left is an attribute). Then, as in Tempo:

- the two sides of an operator must have matching types (the same, both numbers, or one an
  attribute or nil) and types the operator takes: `&& ||` booleans; `+ - * / % ^` and the
  orderings numbers (and `> >= < <=` strings too); `=~ !~` strings; status, kind and nil only
  `=` and `!=`;
- `!` takes a boolean, unary `-` a number;
- an intrinsic (and `resource.service.name`) cannot be compared `= nil`: it is never nil;
- a `{ }` filter must be boolean (or an attribute: `{ .a }` holds where `.a` is true);
- an aggregate's field must be a number (or an attribute) and read the span, and `by()` must read
  the span.
"""

from __future__ import annotations

from telemetry.traceql import ast
from telemetry.traceql.errors import TraceQLError

NUMERIC = ("int", "float", "duration")
ATTRIBUTE = "attribute"  # a type known only when the value is read
_ORDERING = (">", ">=", "<", "<=")


class TraceQLValidationError(TraceQLError):
    """A query that parses but that TraceQL refuses (ill-typed, or an aggregate of nothing)."""

    def __init__(self, reason: str, node: object) -> None:
        super().__init__(f"TraceQL: invalid query: {reason}: {node}")
        self.reason = reason
        self.node = str(node)


def implied_type(expr: ast.FieldExpr) -> str:
    if isinstance(expr, ast.Static):
        return expr.type
    if isinstance(expr, ast.Intrinsic):
        return ast.INTRINSIC_TYPES[expr.name]
    if isinstance(expr, ast.Attribute):
        return ATTRIBUTE
    if isinstance(expr, ast.Comparison | ast.Logical):
        return "bool"
    if isinstance(expr, ast.Not | ast.Negate):
        return implied_type(expr.operand)
    if isinstance(expr, ast.Arithmetic):
        left = implied_type(expr.left)
        return left if left != ATTRIBUTE else implied_type(expr.right)
    raise TypeError(f"not a field expression: {expr!r}")


def references_span(expr: ast.FieldExpr) -> bool:
    if isinstance(expr, ast.Intrinsic | ast.Attribute):
        return True
    if isinstance(expr, ast.Not | ast.Negate):
        return references_span(expr.operand)
    if isinstance(expr, ast.Comparison | ast.Logical | ast.Arithmetic):
        return references_span(expr.left) or references_span(expr.right)
    return False


def _matching(a: str, b: str) -> bool:
    if ATTRIBUTE in (a, b) or "nil" in (a, b) or a == b:
        return True
    return a in NUMERIC and b in NUMERIC


def _valid_for(op: str, t: str) -> bool:
    if t == ATTRIBUTE:
        return True
    if t == "bool":
        return op in ("&&", "||", "=", "!=")
    if t in NUMERIC:
        return op in ast.ARITH_OPS or op in ("=", "!=", *_ORDERING)
    if t == "string":
        return op in ("=", "!=", "=~", "!~", *_ORDERING)
    return op in ("=", "!=")  # nil, status, kind


def _binary(node, op: str, left: ast.FieldExpr, right: ast.FieldExpr) -> None:
    check_field(left)
    check_field(right)
    lt, rt = implied_type(left), implied_type(right)
    if not _matching(lt, rt):
        raise TraceQLValidationError("binary operations must operate on the same type", node)
    if not (_valid_for(op, lt) and _valid_for(op, rt)):
        raise TraceQLValidationError("illegal operation for the given types", node)


def _never_nil(field: ast.FieldExpr) -> str | None:
    if isinstance(field, ast.Intrinsic):
        return "intrinsics cannot be nil"
    if field == ast.Attribute("service.name", "resource"):
        return "resource.service.name cannot be nil"
    return None


def check_field(expr: ast.FieldExpr) -> None:
    """Raise TraceQLValidationError where the field expression is ill-typed."""
    if isinstance(expr, ast.Comparison):
        sides = (expr.left, expr.right)
        nils = [s for s in sides if isinstance(s, ast.Static) and s.type == "nil"]
        if nils and expr.op in ("=", "!="):  # (not) exists: any field may be compared with nil
            other = expr.right if expr.left is nils[0] else expr.left
            check_field(other)
            why = _never_nil(other) if expr.op == "=" and len(nils) == 1 else None
            if why:
                raise TraceQLValidationError(f"{other}=nil is not valid because {why}", expr)
            return
        _binary(expr, expr.op, expr.left, expr.right)
    elif isinstance(expr, ast.Logical | ast.Arithmetic):
        _binary(expr, expr.op, expr.left, expr.right)
    elif isinstance(expr, ast.Not):
        check_field(expr.operand)
        if implied_type(expr.operand) not in ("bool", ATTRIBUTE):
            raise TraceQLValidationError("illegal operation for the given type", expr)
    elif isinstance(expr, ast.Negate):
        check_field(expr.operand)
        if implied_type(expr.operand) not in (*NUMERIC, ATTRIBUTE):
            raise TraceQLValidationError("illegal operation for the given type", expr)


def _check_filter(node: ast.SpansetFilter) -> None:
    if node.expr is None:
        return
    check_field(node.expr)
    if implied_type(node.expr) not in ("bool", ATTRIBUTE):
        raise TraceQLValidationError(
            "span filter field expressions must resolve to a boolean", node
        )


def _check_spanset(node: ast.SpansetExpr) -> None:
    if isinstance(node, ast.SpansetFilter):
        _check_filter(node)
    elif isinstance(node, ast.SpansetOp):
        _check_spanset(node.left)
        _check_spanset(node.right)
    elif isinstance(node, ast.SubPipeline):
        _check_spanset(node.spanset)
        _check_stages(node.stages)


def _check_stages(stages) -> None:
    for stage in stages:
        if isinstance(stage, ast.SpansetFilter | ast.SpansetOp | ast.SubPipeline):
            _check_spanset(stage)
        elif isinstance(stage, ast.ScalarFilter):
            agg = stage.aggregate
            kind = "int"
            if agg.field is not None:
                check_field(agg.field)
                kind = implied_type(agg.field)
                if kind not in (*NUMERIC, ATTRIBUTE):
                    raise TraceQLValidationError(
                        "aggregate field expressions must resolve to a number type", agg
                    )
                if not references_span(agg.field):
                    raise TraceQLValidationError(
                        "aggregate field expressions must reference the span", agg
                    )
            if not _matching(kind, stage.value.type):
                raise TraceQLValidationError(
                    "binary operations must operate on the same type", stage
                )
        elif isinstance(stage, ast.GroupBy):
            for field in stage.fields:
                check_field(field)
                if not references_span(field):
                    raise TraceQLValidationError(
                        "grouping field expressions must reference the span", stage
                    )


def validate(query: ast.Query) -> ast.Query:
    """The query, if TraceQL takes it; else TraceQLValidationError naming what is wrong."""
    _check_spanset(query.spanset)
    _check_stages(query.stages)
    return query
