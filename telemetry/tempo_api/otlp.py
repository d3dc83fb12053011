"""A stored trace as OTLP: resource spans per rank, encoded as protobuf or OTLP/JSON.

Grafana's trace view takes a span's service from its resource (`service.name`, and
`service.namespace`), and shows the resource attributes as "process" tags. Every span here
belongs to one rank (or, for the wave root and sidecar-raised incidents, to one replica), so
each rank gets its own resource, named as the OTLP export names it (telemetry/export/resource.py,
OTel's conventions): the engine as `service.name`, `ascend-guard` as `service.namespace`, the
rank as `service.instance.id`, the node as `host.name`. The spans are the ones `ascend-guard trace` shows (telemetry/spans/query.py
`load_trace`), converted with the exporter's `to_otlp`.
"""

from __future__ import annotations

import base64
from typing import Any

from google.protobuf import json_format
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from telemetry.export.otlp import to_otlp
from telemetry.export.resource import attributes as _attributes
from telemetry.spans.builders import Span
from telemetry.wire import schema
from telemetry.wire.protobuf_fields import length_delimited

SCOPE_NAME = schema.SCOPE_NAME
RESOURCE_KEYS = ("service.name", "service.namespace", "service.instance.id", "host.name")
_ID_KEYS = ("traceId", "spanId", "parentSpanId")


def rank_key(span: Span) -> tuple:
    """(engine, dp, tp, pp); tp and pp are None for spans of the whole replica."""
    dp = span.dp if span.dp is not None else span.attributes.get(schema.ATTR_DP, 0)
    return (span.engine, dp, span.tp, span.pp)


def instance_id(key: tuple) -> str:
    _, dp, tp, pp = key
    return f"dp{dp}" if tp is None else f"dp{dp} tp{tp} pp{pp}"


def resources(spans: list[Span]) -> dict[tuple, dict[str, Any]]:
    """Rank key -> its resource attributes, in rank order (the replica's own first)."""
    nodes = {
        rank_key(s): s.attributes[schema.ATTR_NODE]
        for s in spans
        if schema.ATTR_NODE in s.attributes
    }
    keys = sorted({rank_key(s) for s in spans}, key=_order)
    out = {}
    for key in keys:
        engine, dp, tp, pp = key
        node = nodes.get(key) or nodes.get((engine, dp, 0, 0)) or ""
        attrs = {
            "service.name": schema.service_name(engine),
            "service.namespace": schema.SERVICE_NAMESPACE,
            "service.instance.id": instance_id(key),
        }
        if node:
            attrs["host.name"] = node
        out[key] = attrs
    return out


def _order(key: tuple) -> tuple:
    engine, dp, tp, pp = key
    return (engine, dp, -1 if tp is None else tp, -1 if pp is None else pp)


def traces_data(spans: list[Span]) -> trace_pb2.TracesData:
    """The spans grouped into one ResourceSpans per rank (Tempo's `Trace` message has the
    same field 1, so these bytes are a valid `tempopb.Trace`)."""
    groups: dict[tuple, list[Span]] = {}
    for span in spans:
        groups.setdefault(rank_key(span), []).append(span)
    data = trace_pb2.TracesData()
    for key, attrs in resources(spans).items():
        rs = data.resource_spans.add()
        rs.resource.attributes.extend(_attributes(attrs))
        ss = rs.scope_spans.add()
        ss.scope.name = SCOPE_NAME
        ss.spans.extend(to_otlp(s) for s in groups[key])
    return data


def trace_by_id_v2(data: trace_pb2.TracesData) -> bytes:
    """`TraceByIDResponse{trace = 1}` (status COMPLETE = 0 is the default, so not written)."""
    body = data.SerializeToString()
    return length_delimited(1, body)


def otlp_json(message) -> dict[str, Any]:
    """OTLP/JSON as the spec encodes it: lowerCamel names, trace and span ids as lowercase hex
    (not protobuf JSON's base64), 64-bit integers as strings, enums as integers, zero values
    left out."""
    out = json_format.MessageToDict(message, use_integers_for_enums=True)
    _hex_ids(out)
    return out


def _hex_ids(value: Any) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            if key in _ID_KEYS and isinstance(item, str):
                value[key] = base64.b64decode(item).hex()
            else:
                _hex_ids(item)
    elif isinstance(value, list):
        for item in value:
            _hex_ids(item)


def key_values_json(attrs: dict[str, Any]) -> list[dict[str, Any]]:
    """Attributes as OTLP/JSON KeyValues (search spans and spansets, metrics labels)."""
    return [
        json_format.MessageToDict(kv)
        for kv in _attributes(attrs)
        if isinstance(kv, common_pb2.KeyValue)
    ]
