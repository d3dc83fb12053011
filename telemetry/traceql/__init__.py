"""A TraceQL subset over the record store (docs/traceql.md): parse, search, metrics."""

from telemetry.traceql.evaluate import SpanSet, TraceMatch
from telemetry.traceql.metrics import Series, metrics_range
from telemetry.traceql.parser import TraceQLError, TraceQLParseError, parse
from telemetry.traceql.search import MAX_TRACES_INSPECTED, SearchStats, search
from telemetry.traceql.source import trace_spans
from telemetry.traceql.validate import TraceQLValidationError

__all__ = [
    "MAX_TRACES_INSPECTED",
    "SearchStats",
    "Series",
    "SpanSet",
    "TraceMatch",
    "TraceQLError",
    "TraceQLParseError",
    "TraceQLValidationError",
    "metrics_range",
    "parse",
    "search",
    "trace_spans",
]
