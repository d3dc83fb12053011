"""The typed syntax tree of a TraceQL query (the subset docs/traceql.md lists).

Every node prints back as TraceQL (`str(node)`): the HTTP API keys `by()` groups and metric
series labels by that text, as Tempo does.
"""

from __future__ import annotations

import dataclasses
import re

# -- field expressions (inside `{ }`) -------------------------------------------------------
CMP_OPS = ("=", "!=", ">", ">=", "<", "<=", "=~", "!~")
STATUS_VALUES = ("ok", "error", "unset")
KIND_VALUES = ("unspecified", "internal", "server", "client", "producer", "consumer")
# unscoped intrinsics; `trace:` ones are the same for every span of a trace
SPAN_INTRINSICS = ("name", "duration", "status", "statusMessage", "kind")
TRACE_INTRINSICS = ("rootName", "rootServiceName", "traceDuration")
# where a span sits in its trace's tree (Tempo's nested set numbering)
NESTED_SET_INTRINSICS = ("nestedSetLeft", "nestedSetRight", "nestedSetParent")
INTRINSICS = SPAN_INTRINSICS + TRACE_INTRINSICS + NESTED_SET_INTRINSICS
# scoped intrinsic -> its name in the tree (the unscoped one where there is one)
SCOPED_INTRINSICS = {
    "span:name": "name",
    "span:duration": "duration",
    "span:status": "status",
    "span:statusMessage": "statusMessage",
    "span:kind": "kind",
    "span:id": "span:id",
    "span:parentID": "span:parentID",
    "span:childCount": "span:childCount",
    "trace:rootName": "rootName",
    "trace:rootService": "rootServiceName",
    "trace:duration": "traceDuration",
    "trace:id": "trace:id",
    "event:name": "event:name",
    "event:timeSinceStart": "event:timeSinceStart",
    "link:traceID": "link:traceID",
    "link:spanID": "link:spanID",
    "instrumentation:name": "instrumentation:name",
    "instrumentation:version": "instrumentation:version",
}
# the type of each intrinsic's values, as Tempo's validation types them
INTRINSIC_TYPES = {
    "name": "string",
    "duration": "duration",
    "status": "status",
    "statusMessage": "string",
    "kind": "kind",
    "rootName": "string",
    "rootServiceName": "string",
    "traceDuration": "duration",
    "nestedSetLeft": "int",
    "nestedSetRight": "int",
    "nestedSetParent": "int",
    "span:id": "string",
    "span:parentID": "string",
    "span:childCount": "int",
    "trace:id": "string",
    "event:name": "string",
    "event:timeSinceStart": "duration",
    "link:traceID": "string",
    "link:spanID": "string",
    "instrumentation:name": "string",
    "instrumentation:version": "string",
}
# intrinsics known only once a trace's spans are built (its root, its tree, span ids): the
# planner cannot decide them from block columns
EXACT_INTRINSICS = frozenset(
    (*TRACE_INTRINSICS, *NESTED_SET_INTRINSICS, "span:id", "span:parentID", "span:childCount")
) - {"rootServiceName"}  # fmt: skip
ATTRIBUTE_SCOPES = ("span", "resource", "event", "link", "instrumentation")
STATIC_TYPES = ("string", "int", "float", "duration", "bool", "nil", "status", "kind")
ARITH_OPS = ("+", "-", "*", "/", "%", "^")


@dataclasses.dataclass(frozen=True)
class Static:
    """A literal. Durations are integer nanoseconds; `text` is how the query wrote it."""

    value: object
    type: str
    text: str

    def __str__(self) -> str:
        return self.text


@dataclasses.dataclass(frozen=True)
class Intrinsic:
    name: str  # one of INTRINSIC_TYPES

    @property
    def trace_level(self) -> bool:
        """Whether only a built trace answers it (not a block's columns)."""
        return self.name in EXACT_INTRINSICS

    def __str__(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True)
class Attribute:
    name: str
    scope: str | None = None  # one of ATTRIBUTE_SCOPES, or None (span, else resource)

    @property
    def trace_level(self) -> bool:
        return False  # every table answers an attribute, nil where its spans have none

    def __str__(self) -> str:
        return f"{self.scope}.{self.name}" if self.scope else f".{self.name}"


Field = Intrinsic | Attribute


@dataclasses.dataclass(frozen=True)
class Comparison:
    op: str  # one of CMP_OPS
    left: FieldExpr
    right: FieldExpr
    # compiled once for =~ / !~ (the right side is a string static)
    pattern: re.Pattern | None = dataclasses.field(default=None, compare=False)

    def __str__(self) -> str:
        left, right = (
            f"({s})" if isinstance(s, Comparison) else str(s) for s in (self.left, self.right)
        )
        return f"{left} {self.op} {right}"


@dataclasses.dataclass(frozen=True)
class Logical:
    op: str  # "&&" or "||"
    left: FieldExpr
    right: FieldExpr

    def __str__(self) -> str:
        return f"({self.left} {self.op} {self.right})"


@dataclasses.dataclass(frozen=True)
class Not:
    operand: FieldExpr

    def __str__(self) -> str:
        return f"!({self.operand})"


@dataclasses.dataclass(frozen=True)
class Arithmetic:
    op: str  # one of ARITH_OPS
    left: FieldExpr
    right: FieldExpr

    def __str__(self) -> str:
        return f"({self.left} {self.op} {self.right})"


@dataclasses.dataclass(frozen=True)
class Negate:
    operand: FieldExpr

    def __str__(self) -> str:
        return f"-({self.operand})"


FieldExpr = Static | Intrinsic | Attribute | Comparison | Logical | Not | Arithmetic | Negate


# -- spanset expressions ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SpansetFilter:
    expr: FieldExpr | None  # None: `{}`, every span

    def __str__(self) -> str:
        return f"{{ {self.expr} }}" if self.expr is not None else "{ }"


# plain (the right side's spans that relate), negated `!` (the right side's spans that do not)
# and union `&` (the spans of both sides that relate)
STRUCTURAL_OPS = (">", ">>", "<", "<<", "~")
NEGATED_OPS = tuple("!" + op for op in STRUCTURAL_OPS)
UNION_OPS = tuple("&" + op for op in STRUCTURAL_OPS)
ALL_STRUCTURAL_OPS = STRUCTURAL_OPS + NEGATED_OPS + UNION_OPS


@dataclasses.dataclass(frozen=True)
class SpansetOp:
    """`&&` / `||` between spansets, or a structural operator."""

    op: str  # "&&", "||" or one of ALL_STRUCTURAL_OPS
    left: SpansetExpr
    right: SpansetExpr

    def __str__(self) -> str:
        return f"({self.left} {self.op} {self.right})"


@dataclasses.dataclass(frozen=True)
class SubPipeline:
    """A parenthesised pipeline used as a spanset operand: `({ } | count() > 1) > { }`."""

    spanset: SpansetExpr
    stages: tuple[Stage, ...]

    def __str__(self) -> str:
        return "(" + " | ".join([str(self.spanset), *map(str, self.stages)]) + ")"


SpansetExpr = SpansetFilter | SpansetOp | SubPipeline


# -- pipeline stages ----------------------------------------------------------------------------
AGGREGATES = ("count", "avg", "min", "max", "sum")


@dataclasses.dataclass(frozen=True)
class Aggregate:
    fn: str  # one of AGGREGATES
    field: FieldExpr | None  # None for count()

    def __str__(self) -> str:
        return f"{self.fn}({self.field if self.field is not None else ''})"


@dataclasses.dataclass(frozen=True)
class ScalarFilter:
    aggregate: Aggregate
    op: str
    value: Static

    def __str__(self) -> str:
        return f"{self.aggregate} {self.op} {self.value}"


@dataclasses.dataclass(frozen=True)
class GroupBy:
    fields: tuple[FieldExpr, ...]

    def __str__(self) -> str:
        return f"by({', '.join(map(str, self.fields))})"


@dataclasses.dataclass(frozen=True)
class Select:
    fields: tuple[Field, ...]

    def __str__(self) -> str:
        return f"select({', '.join(map(str, self.fields))})"


@dataclasses.dataclass(frozen=True)
class Coalesce:
    def __str__(self) -> str:
        return "coalesce()"


Stage = SpansetFilter | SpansetOp | ScalarFilter | GroupBy | Select | Coalesce

# -- metrics --------------------------------------------------------------------------------------
METRICS_FUNCTIONS = (
    "rate",
    "histogram_over_time",
    "count_over_time",
    "quantile_over_time",
    "min_over_time",
    "max_over_time",
    "avg_over_time",
    "sum_over_time",
)


@dataclasses.dataclass(frozen=True)
class MetricsAggregate:
    fn: str  # one of METRICS_FUNCTIONS
    field: Field | None = None  # the value, for quantile_over_time and the *_over_time
    quantiles: tuple[float, ...] = ()
    by: tuple[FieldExpr, ...] = ()

    def __str__(self) -> str:
        args = [str(self.field)] if self.field is not None else []
        args += [repr(q) for q in self.quantiles]
        by = f" by({', '.join(map(str, self.by))})" if self.by else ""
        return f"{self.fn}({', '.join(args)}){by}"


@dataclasses.dataclass(frozen=True)
class Query:
    spanset: SpansetExpr
    stages: tuple[Stage, ...] = ()
    metrics: MetricsAggregate | None = None
    hints: tuple[tuple[str, Static], ...] = ()

    def __str__(self) -> str:
        parts = [str(self.spanset), *map(str, self.stages)]
        if self.metrics is not None:
            parts.append(str(self.metrics))
        text = " | ".join(parts)
        if self.hints:
            text += " with(" + ", ".join(f"{k}={v}" for k, v in self.hints) + ")"
        return text
