"""A request's W3C `traceparent`, from vLLM's scheduler to the guard's request membership.

vLLM keeps a request's trace headers (`traceparent`, `tracestate`) only when its own tracing is
on (`--otlp-traces-endpoint`; the API server drops them otherwise), on the engine core's
`Request.trace_headers`. The scheduler output that reaches the workers does not carry them. So
the engine core's `schedule()` hook (guard/config/reload.py `guard_schedule`) copies the
header of each newly scheduled request onto that request's `NewRequestData` (`stamp_new`),
which reaches every worker with the scheduler output, the way the hot-reload stamp does. The
rank that reports membership reads it when the request joins (`of_new`) and sends it once with
the request's name; the sidecar parses it (telemetry/wire/traceparent.py) and links the
request's trace to that trace and span.

Cost: nothing unless vLLM's tracing is on; then a dictionary look-up per new request in the
engine core, and on the worker an attribute read per new request, only on waves where a
request joins. The value is passed on as received (a value past the sidecar's `MAX_LENGTH`
cut one character past it, still refused there); a malformed one is the sidecar's to count,
never an error here.
"""

from __future__ import annotations

from typing import Any

from telemetry.wire.traceparent import MAX_LENGTH

ATTR = "ascend_guard_traceparent"  # on a scheduler output's NewRequestData
HEADER = "traceparent"


def tracing_enabled(scheduler: Any) -> bool:
    """vLLM keeps requests' trace headers in this engine (an OTLP traces endpoint is set)."""
    config = getattr(getattr(scheduler, "vllm_config", None), "observability_config", None)
    return getattr(config, "otlp_traces_endpoint", None) is not None


def stamp_new(scheduler: Any, scheduler_output: Any) -> int:
    """Engine core: put each newly scheduled request's `traceparent` on its NewRequestData;
    returns how many were stamped."""
    new = getattr(scheduler_output, "scheduled_new_reqs", None)
    if not new:
        return 0
    requests = getattr(scheduler, "requests", None)
    if not isinstance(requests, dict):
        return 0
    stamped = 0
    for data in new:
        request = requests.get(data.req_id)
        headers = getattr(request, "trace_headers", None)
        if not headers:
            continue
        value = headers.get(HEADER)
        if isinstance(value, str) and value:
            setattr(data, ATTR, value[: MAX_LENGTH + 1])
            stamped += 1
    return stamped


def of_new(new_reqs: Any) -> dict[str, str] | None:
    """Worker: request id -> traceparent of the new requests that carry one (None: none do)."""
    found = None
    for data in new_reqs:
        value = getattr(data, ATTR, None)
        if value is not None:
            if found is None:
                found = {}
            found[data.req_id] = value
    return found
