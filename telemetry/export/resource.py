"""The OTel resource of the spans a rank's waves make: who served them, where, and which rank.

Attribute names follow OpenTelemetry's semantic conventions, so that a trace backend groups and
filters by workload without knowing this project:

    service.name          the engine label (the model server, as the worker names it)
    service.namespace     "ascend-guard"
    service.instance.id   <run id>/dp<D>/tp<T>/pp<P> (the replica's, /dp<D>, for a wave root)
    service.version       this sidecar's version
    host.name             the rank's node
    process.pid           the worker's pid
    k8s.namespace.name    the workload's namespace \
    k8s.pod.name          the workload's pod        > where the worker sent them (Kubernetes)
    k8s.node.name         the workload's node      /
    ascend_guard.run_id, .dp, .tp, .pp             the rank's coordinates
    ascend_guard.model_name                        the model name vLLM labels its metrics with
    ascend_guard.device                            the accelerator the rank opened (NPU id)

A wave root belongs to its replica, not to one rank: its resource is the replica's (no tp, pp
or pid), with the workload of the replica's tp0 rank.
"""

from __future__ import annotations

from typing import Any

from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.resource.v1 import resource_pb2

from telemetry.wire import schema
from telemetry.wire.build_info import version
from telemetry.wire.workload import NO_WORKLOAD, Workload

SERVICE_NAMESPACE = schema.SERVICE_NAMESPACE

# (run id, engine, dp, tp, pp); tp and pp None: the replica (a wave root)
ResourceKey = tuple[str, str, int, int | None, int | None]


def any_value(value: Any) -> common_pb2.AnyValue:
    if isinstance(value, bool):
        return common_pb2.AnyValue(bool_value=value)
    if isinstance(value, int):
        if -(2**63) <= value < 2**63:
            return common_pb2.AnyValue(int_value=value)
        return common_pb2.AnyValue(string_value=str(value))  # OTLP integers are int64
    if isinstance(value, float):
        return common_pb2.AnyValue(double_value=value)
    if isinstance(value, (list, tuple)):
        return common_pb2.AnyValue(
            array_value=common_pb2.ArrayValue(values=[any_value(v) for v in value])
        )
    return common_pb2.AnyValue(string_value=str(value))


def attributes(attrs: dict[str, Any]) -> list[common_pb2.KeyValue]:
    return [common_pb2.KeyValue(key=k, value=any_value(v)) for k, v in attrs.items()]


def resource_attributes(
    key: ResourceKey, node: str, pid: int = 0, workload: Workload = NO_WORKLOAD
) -> dict[str, Any]:
    run_id, engine, dp, tp, pp = key
    instance = f"{run_id}/dp{dp}" + (f"/tp{tp}/pp{pp}" if tp is not None else "")
    attrs: dict[str, Any] = {
        "service.name": schema.service_name(engine),
        "service.namespace": SERVICE_NAMESPACE,
        "service.instance.id": instance,
        "service.version": version(),
        "host.name": node,
        schema.ATTR_RUN: run_id,
        schema.ATTR_DP: dp,
    }
    if tp is not None:
        attrs[schema.ATTR_TP] = tp
        attrs[schema.ATTR_PP] = pp
        if pid:
            attrs["process.pid"] = pid
    for name, value in (
        ("k8s.namespace.name", workload.namespace),
        ("k8s.pod.name", workload.pod),
        ("k8s.node.name", workload.node),
        (schema.attr("model_name"), workload.model_name),
        (schema.attr("device"), workload.device if tp is not None else ""),
    ):
        if value:
            attrs[name] = value
    return attrs


def resource(attrs: dict[str, Any]) -> resource_pb2.Resource:
    return resource_pb2.Resource(attributes=attributes(attrs))
