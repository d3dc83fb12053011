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
INTRINSICS = SPAN_INTRINSICS + TRACE_INTRINSICS
# scoped intrinsic -> its unscoped name
SCOPED_INTRINSICS = {
    "span:name": "name",
    "span:duration": "duration",
    "span:status": "status",
    "span:statusMessage": "statusMessage",
    "span:kind": "kind",
    "trace:rootName": "rootName",
    "trace:rootService": "rootServiceName",
    "trace:duration": "traceDuration",
}
STATIC_TYPES = ("string", "int", "float", "duration", "bool", "nil", "status", "kind")


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
    name: str  # one of INTRINSICS

    @property
    def trace_level(self) -> bool:
        return self.name in TRACE_INTRINSICS

    def __str__(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True)
class Attribute:
    name: str
    scope: str | None = None  # "span", "resource" or None (either)

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
        return f"{self.left} {self.op} {self.right}"


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


FieldExpr = Static | Intrinsic | Attribute | Comparison | Logical | Not


# -- spanset expressions ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SpansetFilter:
    expr: FieldExpr | None  # None: `{}`, every span

    def __str__(self) -> str:
        return f"{{ {self.expr} }}" if self.expr is not None else "{ }"


STRUCTURAL_OPS = (">", ">>", "<", "<<", "~")


@dataclasses.dataclass(frozen=True)
class SpansetOp:
    """`&&` / `||` between spansets, or a structural operator (the right side's spans)."""

    op: str  # "&&", "||" or one of STRUCTURAL_OPS
    left: SpansetExpr
    right: SpansetExpr

    def __str__(self) -> str:
        return f"({self.left} {self.op} {self.right})"


SpansetExpr = SpansetFilter | SpansetOp


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
    field: FieldExpr | None = None  # the value, for quantile_over_time and the *_over_time
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
