"""Where the guard attaches in each runtime, listed in one place, and how it is applied.

Each attach point is a runner class that defines `execute_model` and/or `sample_tokens` itself.
The guard decorates the methods a class defines in its own body (inherited ones are already
covered by the base class's attach point), when the class's module is imported. A module that
is not installed is never imported, so its attach point simply never fires; a class or method
that is missing in the installed version is skipped with one log line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import ModuleType
from typing import Any

import structlog

from ascend_runtime.import_hooks import when_imported
from guard.decorators import (
    is_guarded,
    runtime_guard_logits,
    runtime_guard_sample_tokens,
    runtime_guard_step,
    runtime_guard_verify_logits,
)
from guard.reload import guard_schedule

log = structlog.get_logger("ascend_guard.bindings")

STEP_METHOD = "execute_model"
SAMPLE_METHOD = "sample_tokens"


@dataclasses.dataclass(frozen=True)
class AttachPoint:
    name: str
    module: str
    cls: str
    note: str = ""


RUNNER_ATTACH_POINTS: tuple[AttachPoint, ...] = (
    AttachPoint(
        "v1-gpu-runner", "vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "upstream V1 runner"
    ),
    AttachPoint(
        "v1-cpu-runner",
        "vllm.v1.worker.cpu_model_runner",
        "CPUModelRunner",
        "V1 runner on CPU hosts",
    ),
    AttachPoint(
        "mrv2-gpu-runner",
        "vllm.v1.worker.gpu.model_runner",
        "GPUModelRunner",
        "upstream Model Runner V2",
    ),
    AttachPoint(
        "mrv2-cpu-runner",
        "vllm.v1.worker.cpu.model_runner",
        "CPUModelRunner",
        "MRV2 on CPU (needs triton-cpu)",
    ),
    AttachPoint(
        "ascend-v1-runner",
        "vllm_ascend.worker.model_runner_v1",
        "NPUModelRunner",
        "vllm-ascend V1 runner",
    ),
    AttachPoint(
        "ascend-mrv2-runner",
        "vllm_ascend.worker.v2.model_runner",
        "NPUModelRunner",
        "vllm-ascend MRV2",
    ),
)


def bind_runner_class(cls: type) -> list[str]:
    """Decorate the step/sample methods `cls` defines itself; returns the names now guarded."""
    bound = []
    for name, decorator in (
        (STEP_METHOD, runtime_guard_step),
        (SAMPLE_METHOD, runtime_guard_sample_tokens),
    ):
        method = cls.__dict__.get(name)
        if method is None or not callable(method):
            continue
        if not is_guarded(method):
            setattr(cls, name, decorator(method))
        bound.append(name)
    return bound


def _bind_module(point: AttachPoint, module: ModuleType) -> None:
    cls = getattr(module, point.cls, None)
    if not isinstance(cls, type):
        log.warning(
            "attach_point_missing", attach_point=point.name, module=point.module, cls=point.cls
        )
        return
    bound = bind_runner_class(cls)
    log.info(
        "attach_point_bound",
        attach_point=point.name,
        cls=f"{point.module}.{point.cls}",
        methods=bound,
    )


def bind_all(points: tuple[AttachPoint, ...] = RUNNER_ATTACH_POINTS) -> None:
    """Arrange for every attach point to be bound when (or if) its module is imported."""
    for point in points:
        when_imported(point.module, lambda module, point=point: _bind_module(point, module))


@dataclasses.dataclass(frozen=True)
class MethodAttachPoint:
    """A method the guard decorates in place, outside the runner (samplers, the scheduler)."""

    name: str
    module: str
    cls: str
    method: str
    decorator: Callable[[Any], Any]
    note: str = ""


SAMPLING_ATTACH_POINTS: tuple[MethodAttachPoint, ...] = (
    MethodAttachPoint(
        "v1-sampler", "vllm.v1.sample.sampler", "Sampler", "forward", runtime_guard_logits,
        "logits before sampling: logits_finite, logits_stats",
    ),
    MethodAttachPoint(
        "v1-rejection-sampler", "vllm.v1.sample.rejection_sampler", "RejectionSampler", "forward",
        runtime_guard_verify_logits, "spec-decode verify logits",
    ),
    MethodAttachPoint(
        "v1-scheduler", "vllm.v1.core.sched.scheduler", "Scheduler", "schedule", guard_schedule,
        "engine core: stamps hot-reloaded config onto scheduler outputs",
    ),
)  # fmt: skip


def _bind_method(point: MethodAttachPoint, module: ModuleType) -> None:
    cls = getattr(module, point.cls, None)
    method = getattr(cls, point.method, None) if isinstance(cls, type) else None
    if method is None:
        log.warning(
            "attach_point_missing", attach_point=point.name, module=point.module,
            cls=point.cls, method=point.method,
        )  # fmt: skip
        return
    if not is_guarded(method):
        setattr(cls, point.method, point.decorator(method))
    log.info("attach_point_bound", attach_point=point.name, cls=f"{point.module}.{point.cls}",
             methods=[point.method])  # fmt: skip


def bind_sampling(points: tuple[MethodAttachPoint, ...] = SAMPLING_ATTACH_POINTS) -> None:
    for point in points:
        when_imported(point.module, lambda module, point=point: _bind_method(point, module))
