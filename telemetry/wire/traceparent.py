"""W3C Trace Context `traceparent` headers, parsed strictly (https://www.w3.org/TR/trace-context/).

A request that reaches vLLM with a `traceparent` (a gateway's, a client's) carries it to the
guard's request membership (guard/trace_context.py); the sidecar parses it here and the
request's trace links to that trace and span (telemetry/spans/requests.py).

The header is `version-traceid-parentid-flags`: two, 32, 16 and two lowercase hex digits.
Refused, as the specification and OpenTelemetry's propagator (the one vLLM's own span uses)
refuse them: a version `ff` or not hex, a trace id or parent id of all zeros, any field of the
wrong length or with characters other than lowercase hex, and a version `00` header with
anything after its flags. A later version may append fields after a `-`; its first four are
read the same way. Spaces or tabs around the header, which OpenTelemetry's propagator
tolerates, are refused: an HTTP server strips them from a header's value before vLLM sees it.
"""

from __future__ import annotations

import re
from typing import NamedTuple

# as OpenTelemetry's propagator: a longer header is refused (the worker passes on at most one
# character more, guard/trace_context.py, so that it is)
MAX_LENGTH = 512

_HEADER = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


class TraceParent(NamedTuple):
    trace_id: int
    span_id: int
    flags: int  # W3C trace flags (bit 0: sampled)

    @property
    def sampled(self) -> bool:
        return bool(self.flags & 1)


def parse_traceparent(value: str) -> TraceParent | None:
    """The header's trace id, parent span id and flags; None when it is malformed."""
    if not isinstance(value, str) or len(value) < 55 or len(value) > MAX_LENGTH:
        return None
    match = _HEADER.match(value)
    if match is None:
        return None
    version, trace_hex, span_hex, flags_hex = match.groups()
    if version == "ff":
        return None
    if len(value) > 55 and (version == "00" or value[55] != "-"):
        return None
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if not trace_id or not span_id:
        return None
    return TraceParent(trace_id, span_id, int(flags_hex, 16))
