"""What a TraceQL field names on our spans: intrinsics, span attributes and resource attributes.

Span attribute keys are read off telemetry/spans/builders.py itself (the builder is run once on a sample
rank, wave, collective and incident), so a field it starts to emit is queryable without a change
here. A query may name a key in full (`span.ascend_guard.tp`) or by its short name (`.tp`): the
key without the `ascend_guard.` prefix, and collective stats without `collective.` too.
"""

from __future__ import annotations

import functools

from telemetry.spans.builders import (
    SLOW_CALL_PREFIX,
    Span,
    collective_spans,
    incident_span,
    slow_call_spans,
    wave_spans,
)
from telemetry.store import RankRow
from telemetry.wire import schema
from telemetry.wire.proto import guard_pb2

# the OTLP exporter's resource (telemetry/export/resource.py): what `resource.` fields see.
# `service.name` is the span's engine (schema.service_name), as the export and the query API's
# traces name it, so a query means the same here and in a cluster's Tempo.
RESOURCE_SERVICE = "service.name"
RESOURCE_NAMESPACE = "service.namespace"
RESOURCE_HOST = "host.name"
# the instrumentation scope the query API's OTLP answers name (telemetry/tempo_api/otlp.py)
INSTRUMENTATION_NAME = schema.SCOPE_NAME
# incidents carry their request id in the span event; the field reads it from there (and from the
# request traces' own attribute, once they exist)
ATTR_REQUEST = schema.attr("request_id")
# names a query may use besides the keys' own short names
ALIASES = {
    "run": schema.ATTR_RUN,
    "request": ATTR_REQUEST,
    "ascend_guard.request": ATTR_REQUEST,  # request traces' spans (telemetry/store/requests.py)
    "incident": schema.attr("incident_type"),
}
SPAN_STATUS = "unset"  # every span but incidents and the rank / wave spans that raised one
SPAN_KIND = "internal"  # ... and SPAN_KIND_INTERNAL on every span
# span kinds as the planner tells them apart (by name, or by name prefix)
COLLECTIVE_PREFIX = "collective:"
INCIDENT_PREFIX = "incident:"


def _sample_spans() -> dict[str, list[Span]]:
    """One of each span the builder makes, keyed by kind."""
    rank = RankRow(1, "sample-run", "eng", 0, 0, 0, "node", 1)
    cols = guard_pb2.WaveColumns()
    for name in schema.WAVE_FIELDS:
        getattr(cols, name).append(1)
    cw = guard_pb2.CollectiveWave(wave=1, first_arrival_unix_nano=1)
    cw.stats.add(op="all_reduce", group="tp")
    cw.slow_calls.add(op="all_reduce", group="tp", start_unix_nano=1, host_ns=1)
    row = {
        "id": "i",
        "run_id": "sample-run",
        "wave": 1,
        "dp": 0,
        "tp": 0,
        "pp": 0,
        "engine": "eng",
        "type": "sample",
        "severity": "error",
        "request_id": "r",
        "summary": "",
        "evidence": "",
        "actions": "[]",
        "occurrence": 1,
        "time_ns": 1,
    }
    out: dict[str, list[Span]] = {}
    for span in wave_spans(rank, cols, 0):
        out.setdefault(span.name, []).append(span)
    out["collective"] = collective_spans(rank, cw)
    out["slow_call"] = slow_call_spans(rank, cw)
    out["incident"] = [incident_span(row)]
    return out


@functools.lru_cache(maxsize=1)
def kind_keys() -> dict[str, frozenset[str]]:
    """Span kind -> the attribute keys its spans carry (incidents: with the request id)."""
    keys = {kind: frozenset(spans[0].attributes) for kind, spans in _sample_spans().items()}
    keys["incident"] = keys["incident"] | {ATTR_REQUEST}
    from telemetry.spans.requests import REQUEST_ATTRIBUTE_KEYS  # request traces' spans

    keys["request"] = frozenset(REQUEST_ATTRIBUTE_KEYS)
    return keys


@functools.lru_cache(maxsize=1)
def short_names() -> dict[str, str]:
    """Short name -> full attribute key, for every key the builder emits."""
    out: dict[str, str] = {}
    for keys in kind_keys().values():
        for key in keys:
            short = key.removeprefix(schema.PREFIX)
            out[short] = key
            out.setdefault(short.removeprefix("collective."), key)
    out.update(ALIASES)
    return out


def attribute_key(name: str) -> str:
    """The span attribute key a query's attribute name stands for."""
    return short_names().get(name, name)


def kind_of(name: str) -> str:
    if name.startswith(COLLECTIVE_PREFIX):
        return "collective"
    if name.startswith(INCIDENT_PREFIX):
        return "incident"
    if name.startswith(SLOW_CALL_PREFIX):
        return "slow_call"
    return name


def span_attributes(span: Span) -> dict:
    """The span's attributes as queries see them (incidents: plus their request id)."""
    if span.events and span.name.startswith(INCIDENT_PREFIX):
        request = span.events[0]["attributes"].get("incident.request_id")
        if request:
            return {**span.attributes, ATTR_REQUEST: request}
    return span.attributes


def resource_attributes(engine: str | None, node: str | None) -> dict:
    """The resource of a span of this engine on this node (node None: unknown here)."""
    out = {
        RESOURCE_SERVICE: schema.service_name(engine),
        RESOURCE_NAMESPACE: schema.SERVICE_NAMESPACE,
    }
    if node:
        out[RESOURCE_HOST] = node
    return out


def service_name(span: Span) -> str:
    """The span's `service.name` (and, on a trace's root, its `rootServiceName`)."""
    return schema.service_name(span.engine)


def all_tag_names() -> dict[str, list[str]]:
    """Scope -> queryable attribute names (for the tags API): short names and resource keys."""
    return {
        "span": sorted(short_names()),
        "resource": [RESOURCE_HOST, RESOURCE_SERVICE, RESOURCE_NAMESPACE],
    }
