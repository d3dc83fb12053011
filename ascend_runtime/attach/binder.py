"""Applies the guard at every attach point of `ascend_runtime.attach.points`, as modules load.

For each attach point the binder waits for its module to be imported (a module that is never
imported costs nothing), then wraps the method the class defines in its own body with the
action's wrapper (`ascend_runtime.attach.actions`). A class that only inherits the method is covered by
the base class's attach point and never wrapped twice. A class or method missing in the
installed version is skipped with one log line: version skew never stops start-up; one the
installed release cannot hold (the table's spans) is "not in this version", logged at debug
only. The outcome of every attach point is kept in `BINDINGS`, which `ascend-guard doctor`
reports.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Iterable
from types import ModuleType

import structlog

from ascend_runtime.attach.import_hooks import when_imported
from ascend_runtime.attach.points import ATTACH_POINTS, NOT_IN_VERSION, AttachPoint
from guard.decorators import (
    WRAPPED_ATTR,
    is_guarded,
    runtime_guard_sample_tokens,
    runtime_guard_step,
)

log = structlog.get_logger("ascend_guard.bindings")

STEP_METHOD = "execute_model"
SAMPLE_METHOD = "sample_tokens"

BOUND = "bound"
MISSING = "missing"
NOT_LOADED = "not loaded"
FAILED = "failed"


@dataclasses.dataclass(frozen=True)
class Binding:
    status: str  # bound | missing | not loaded | failed | not in this version
    reason: str = ""


BINDINGS: dict[AttachPoint, Binding] = {}
_lock = threading.Lock()


def resolve(point: AttachPoint, module: ModuleType) -> tuple[type | None, str]:
    """The class of `point` in `module`, or None and why not."""
    obj: object = module
    for part in point.qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None, f"no class {point.qualname} in {point.module}"
    if not isinstance(obj, type):
        return None, f"{point.module}.{point.qualname} is not a class"
    return obj, ""


def bind_point(point: AttachPoint, module: ModuleType) -> Binding:
    """Wrap `point`'s method in the loaded `module`; record and return the outcome."""
    from ascend_runtime.attach.actions import WRAPPERS

    cls, why = resolve(point, module)
    if cls is None:
        binding = Binding(MISSING, why)
    elif point.inherited:
        method = getattr(cls, point.method, None)
        if method is None:
            binding = Binding(MISSING, f"{point.qualname} has no method {point.method}")
        elif is_guarded(method):
            owner = next(k for k in cls.__mro__ if point.method in k.__dict__)
            binding = Binding(BOUND, f"inherited from {owner.__module__}.{owner.__qualname__}")
        else:
            binding = Binding(MISSING, f"{point.method} is inherited from an unbound class")
    else:
        method = cls.__dict__.get(point.method)
        if method is None or not callable(method):
            binding = Binding(MISSING, f"{point.qualname} defines no {point.method}")
        elif is_guarded(method):
            binding = Binding(BOUND, "already bound")
        else:
            try:
                setattr(cls, point.method, WRAPPERS[point.action](method, point))
                binding = Binding(BOUND, "wrapped")
            except Exception as exc:  # noqa: BLE001 - never stop start-up
                binding = Binding(FAILED, f"{type(exc).__name__}: {exc}")
    if binding.status == MISSING:
        from ascend_runtime.attach.detect import installed_versions

        why_not = point.absent_from(installed_versions())
        if why_not is not None:
            binding = Binding(NOT_IN_VERSION, why_not)
    with _lock:
        BINDINGS[point] = binding
    if binding.status == NOT_IN_VERSION:
        log.debug("attach_point_not_in_version", target=point.target, reason=binding.reason)
    elif binding.status == BOUND:
        log.debug("attach_point_bound", target=point.target, action=point.action)
    else:
        log.warning(
            "attach_point_skipped",
            target=point.target,
            status=binding.status,
            reason=binding.reason,
        )
    return binding


def binding_of(point: AttachPoint) -> Binding:
    """What happened at `point` in this process (an inherited point is re-checked now)."""
    module = sys.modules.get(point.module)
    if module is not None and point.inherited:
        return bind_point(point, module)
    with _lock:
        found = BINDINGS.get(point)
    if found is not None:
        return found
    return Binding(NOT_LOADED, f"{point.module} is not imported in this process")


def attach_point_readings() -> list[tuple[str, float, dict[str, str]]]:
    """`attach_points{status}` of this process: points bound, and points skipped (missing in
    this version, or wrapping failed). Points whose module never loaded here are not counted."""
    with _lock:
        outcomes = [b.status for b in BINDINGS.values()]
    bound = sum(status == BOUND for status in outcomes)
    skipped = sum(status in (MISSING, FAILED) for status in outcomes)
    return [
        ("attach_points", float(bound), {"status": "bound"}),
        ("attach_points", float(skipped), {"status": "skipped"}),
    ]


def bind_all(points: Iterable[AttachPoint] = ATTACH_POINTS) -> None:
    """Bind every attach point when (or if) its module is imported. Owned methods first, so an
    inherited point of the same module sees its base already bound."""
    ordered = sorted(points, key=lambda p: p.inherited)
    for point in ordered:
        when_imported(point.module, lambda module, point=point: bind_point(point, module))


def bind_sampling() -> None:
    """The sampler and scheduler rows. `bind_all()` already covers them; kept because
    `plugin.activate` calls it, and binding twice is a no-op."""
    bind_all(p for p in ATTACH_POINTS if p.component in ("sampler", "scheduler"))


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
        if getattr(method, WRAPPED_ATTR, None) is None:
            setattr(cls, name, decorator(method))
        bound.append(name)
    return bound
