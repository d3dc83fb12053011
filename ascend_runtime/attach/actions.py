"""What the guard does at each kind of attach point: one wrapper factory per action.

Every wrapper passes the call through untouched when the guard is off in this process, returns
the wrapped method's own result, lets its exceptions through, and catches its own errors
(counted by the processor, logged at a bounded rate). Probes needing a device clock or a
device graph class do nothing on CPU.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import structlog

from ascend_runtime.attach.detect import platform
from ascend_runtime.attach.points import ACTIONS, AttachPoint
from ascend_runtime.probes import device_time, speculators
from guard import decorators
from guard.config.reload import guard_schedule
from guard.decorators import (
    WRAPPED_ATTR,
    runtime_guard_batch_logits,
    runtime_guard_batch_verify_logits,
    runtime_guard_dummy_step,
    runtime_guard_logits,
    runtime_guard_sample_tokens,
    runtime_guard_step,
    runtime_guard_verify_logits,
)

log = structlog.get_logger("ascend_guard.actions")

Wrapper = Callable[[Callable[..., Any], AttachPoint], Callable[..., Any]]

_state: dict[str, Any] = {}
_UNSET = object()
_local = threading.local()


def _record_error(where: str) -> None:
    processor = decorators.active_processor()
    if processor is not None:
        processor.errors.record(where)
    else:
        log.warning("probe_error", where=where, exc_info=True)


def _mark(wrapper: Callable[..., Any], fn: Callable[..., Any]) -> Callable[..., Any]:
    setattr(wrapper, WRAPPED_ATTR, fn)
    return wrapper


def _after(probe: Callable[..., None], *, outermost: bool = True) -> Wrapper:
    """Run `probe(self, args, kwargs, result)` after the call (only the outermost of nested
    calls, e.g. a subclass method calling its wrapped base)."""

    def factory(fn: Callable[..., Any], point: AttachPoint) -> Callable[..., Any]:
        key = f"depth:{point.action}"

        @functools.wraps(fn)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            if decorators.active_processor() is None:
                return fn(self, *args, **kwargs)
            depth = getattr(_local, key, 0)
            setattr(_local, key, depth + 1)
            try:
                result = fn(self, *args, **kwargs)
            finally:
                setattr(_local, key, depth)
            if depth == 0 or not outermost:
                try:
                    probe(self, args, kwargs, result)
                except Exception:  # noqa: BLE001
                    _record_error(point.action)
            return result

        return _mark(wrapper, fn)

    return factory


# -- device time per phase ------------------------------------------------------------------
def _timer() -> Any:
    if "timer" not in _state:
        factory = device_time.event_factory(platform())
        _state["timer"] = device_time.PhaseTimer(factory) if factory is not None else None
    return _state["timer"]


def _device_time(fn: Callable[..., Any], point: AttachPoint) -> Callable[..., Any]:
    phase = point.method
    state = _state
    tried_aside = False  # once: a wrapper that is not where it was bound stays

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal tried_aside
        if decorators._processor is None:  # the guard is off: one global read
            return fn(self, *args, **kwargs)
        timer = state.get("timer", _UNSET)
        if timer is _UNSET:
            try:
                timer = _timer()
            except Exception:  # noqa: BLE001 - no device time in this process, the step goes on
                _record_error("device_time")
                timer = state["timer"] = None
        if timer is None:  # no device clock here (CPU), ever: the bare method from now on
            if not tried_aside:
                tried_aside = True
                try:
                    if decorators.step_aside(type(self), phase, wrapper):
                        log.info("device_time_stepped_aside", method=point.target)
                except Exception:  # noqa: BLE001
                    _record_error("device_time")
            return fn(self, *args, **kwargs)
        try:
            started = timer.start(phase)
        except Exception:  # noqa: BLE001
            _record_error("device_time")
            return fn(self, *args, **kwargs)
        try:
            return fn(self, *args, **kwargs)
        finally:
            try:
                timer.end(started)
            except Exception:  # noqa: BLE001
                _record_error("device_time")

    return _mark(wrapper, fn)


# -- KV cache ---------------------------------------------------------------------------------
def _kv_init(runner: Any, args: tuple, kwargs: dict, _result: Any) -> None:
    if kwargs.get("is_profiling") or (len(args) > 1 and args[1] is True):
        return  # the minimal cache of a profiling run is freed right after
    kv_cache_config = args[0] if args else kwargs.get("kv_cache_config")
    from ascend_runtime.probes.kv_probe import probe_kv_cache

    probe_kv_cache(runner, kv_cache_config, platform())


def _rotary(runner: Any, _args: tuple, _kwargs: dict, _result: Any) -> None:
    from ascend_runtime.probes.rotary import probe_runner

    probe_runner(runner)


# -- graph capture ----------------------------------------------------------------------------
def _graph_capture(fn: Callable[..., Any], point: AttachPoint) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if decorators.active_processor() is None or getattr(_local, "capturing", False):
            return fn(self, *args, **kwargs)
        try:
            session = _capture_session(point)
            session.__enter__()
        except Exception:  # noqa: BLE001
            _record_error("graph_capture")
            return fn(self, *args, **kwargs)
        _local.capturing = True
        try:
            return fn(self, *args, **kwargs)
        finally:
            _local.capturing = False
            try:
                session.__exit__(None, None, None)
            except Exception:  # noqa: BLE001
                _record_error("graph_capture")

    return _mark(wrapper, fn)


def _capture_session(point: AttachPoint) -> Any:
    from ascend_runtime.probes import graphs

    where = platform()
    return graphs.CaptureSession(
        graphs.graph_class(where),
        memory_allocated=graphs.memory_reader(where),
        describe=graphs.forward_context_label,
        workspace_params=graphs.ascend_workspace_params if where == "ascend" else tuple,
        source=point.target,
    )


# -- speculators ------------------------------------------------------------------------------
def _speculator(obj: Any, args: tuple, kwargs: dict, result: Any) -> None:
    stats = speculators.STATS
    if kwargs.get("dummy_run") or kwargs.get("is_profile"):
        return
    drafter = getattr(obj, "drafter", None)  # V1 runner: propose_draft_token_ids
    speculative = getattr(obj, "speculative_config", None) or getattr(
        getattr(obj, "vllm_config", None), "speculative_config", None
    )
    method = str(getattr(speculative, "method", "") or "unknown")
    if drafter is not None:
        stats.on_propose(
            method, type(drafter).__name__, result, sampled_token_ids=_host_sampled(args, kwargs)
        )
        return
    num_sampled = kwargs.get("num_sampled", args[5] if len(args) > 5 else None)
    stats.on_propose(
        method,
        type(obj).__name__,
        result,
        num_sampled=num_sampled,
        new_event=device_time.event_factory(platform()),
    )


def _host_sampled(args: tuple, kwargs: dict) -> list | None:
    """This step's sampled tokens per request as host lists, from a V1 runner's
    `propose_draft_token_ids` (upstream: 2nd argument `sampled_token_ids`; vllm-ascend: 1st,
    `valid_sampled_token_ids`). None when they are a device tensor: not read, no sync."""
    for key in ("sampled_token_ids", "valid_sampled_token_ids"):
        if key in kwargs:
            value = kwargs[key]
            return value if isinstance(value, list) else None
    return next((a for a in args[:2] if isinstance(a, list)), None)


# -- device communicator ------------------------------------------------------------------------
def _communicator(comm: Any, _args: tuple, _kwargs: dict, _result: Any) -> None:
    from ascend_runtime.probes import hccl, report

    name = type(comm).__name__
    backend = {"NPUCommunicator": "hccl", "CudaCommunicator": "nccl"}.get(name, "cpu")
    group = str(getattr(comm, "unique_name", "") or "")
    report.probe("device_communicator_info", 1, communicator=name, backend=backend, group=group)
    if backend == "hccl":
        hccl.report_settings(name)


def _guard_decorator(decorator: Callable) -> Wrapper:
    """A guard decorator applied as a runner carries it in source: beneath the method's
    `@torch.inference_mode()` when it has one (vLLM's runners decorate `execute_model` and
    `sample_tokens` so), so that the guard's own work runs in inference mode too. The result
    is a new inference-mode wrapper around the guarded body; `unwrap` gives vLLM's method."""

    def factory(fn: Callable[..., Any], point: AttachPoint) -> Callable[..., Any]:
        layer = _inference_mode_layer(fn)
        if layer is None:
            return decorator(fn)
        mode, body = layer
        return _mark(mode.clone()(decorator(body)), fn)

    return factory


def _inference_mode_layer(fn: Any) -> tuple[Any, Callable[..., Any]] | None:
    """(the `torch.inference_mode` object, the function it wraps) when `fn` is a function
    decorated with `@torch.inference_mode()`, else None. torch's decorator is a closure over
    `ctx_factory` (the mode object's bound `clone`) and `func`."""
    import sys

    torch = sys.modules.get("torch")
    code = getattr(fn, "__code__", None)
    closure = getattr(fn, "__closure__", None)
    if torch is None or code is None or not closure:
        return None
    cells = dict(zip(code.co_freevars, (cell.cell_contents for cell in closure), strict=True))
    mode = getattr(cells.get("ctx_factory"), "__self__", None)
    body = cells.get("func")
    if not isinstance(mode, torch.inference_mode) or not callable(body):
        return None
    return mode, body


def _collective(method: Callable[..., Any], point: AttachPoint) -> Callable[..., Any]:
    from ascend_runtime.attach.collectives import collective_wrapper

    return collective_wrapper(point.method, method)


def _compiled_graph(method: Callable[..., Any], point: AttachPoint) -> Callable[..., Any]:
    from ascend_runtime.attach.compiled_collectives import compiled_graph_wrapper

    return compiled_graph_wrapper(point.method, method)


def _graph_collectives(method: Callable[..., Any], point: AttachPoint) -> Callable[..., Any]:
    from ascend_runtime.attach.graph_collectives import graph_wrapper

    return graph_wrapper(point.method, method)


WRAPPERS: dict[str, Wrapper] = {
    "step": _guard_decorator(runtime_guard_step),
    "sample": _guard_decorator(runtime_guard_sample_tokens),
    "dummy_step": _guard_decorator(runtime_guard_dummy_step),
    "device_time": _device_time,
    "kv_init": _after(_kv_init),
    "graph_capture": _graph_capture,
    "rotary_capacity": _after(_rotary),
    "speculator_propose": _after(_speculator),
    "communicator_init": _after(_communicator),
    "logits": _guard_decorator(runtime_guard_logits),
    "batch_logits": _guard_decorator(runtime_guard_batch_logits),
    "verify_logits": _guard_decorator(runtime_guard_verify_logits),
    "batch_verify_logits": _guard_decorator(runtime_guard_batch_verify_logits),
    "schedule": _guard_decorator(guard_schedule),
    "collective": _collective,
    "compiled_graph": _compiled_graph,
    "graph_collectives": _graph_collectives,
}
assert set(WRAPPERS) == set(ACTIONS), "every action needs a wrapper"
