"""Collectives that torch.compile traces into its graph, kept visible at run time.

Where a platform calls its collectives directly rather than through vLLM's custom ops
(`GroupCoordinator.use_custom_op_call` is False: vLLM's CPU platform), Dynamo inlines
`GroupCoordinator._all_reduce_out_place` -> `CpuCommunicator.all_reduce` down to the backend's
kernel (`torch.ops._C.shm_allreduce`, `c10d` all_reduce). The compiled graph then calls that
kernel with no Python around it, and the per-call wrappers never see the per-layer TP
all-reduces of a compiled model.

The wrappers here sit on the device communicator's methods (rows of action "collective_op" in
`ascend_runtime/attach_points.py`). Outside torch.compile they are the bare call: in eager mode
the `GroupCoordinator` wrapper above them already counts the call. While Dynamo traces, they
emit one opaque guard op instead (`torch.ops.ascend_guard.all_reduce_`, `...all_gather`) with
the same semantics as the method (in place for all_reduce, a new tensor for all_gather), so the
graph holds one node where it held the backend's one, with no graph break. At run time the op's
kernel calls the communicator's own method inside the tracker: each call is numbered, timed
and aggregated exactly as in eager mode.

Platforms whose collectives already are vLLM's opaque custom ops (CUDA, ROCm, XPU, Ascend) need
none of this: the custom op's implementation calls `GroupCoordinator._all_reduce_out_place` at
run time, where the `GroupCoordinator` wrappers see it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog

from guard import collectives

log = structlog.get_logger("ascend_guard.collective_ops")

LIBRARY = "ascend_guard"
# communicator method -> (op name reported, guard op name)
COMPILED_METHODS = {
    "all_reduce": ("all_reduce", "all_reduce_"),
    "all_gather": ("all_gather", "all_gather"),
}
GUARD_OPS = tuple(f"{LIBRARY}::{name}" for _, name in COMPILED_METHODS.values())

# the library, and each wrapped communicator method's bare function (one communicator class
# per platform carries these rows)
_state: dict[str, Any] = {"library": None, "bare": {}}
# (method, group name) -> (GroupCoordinator, its communicator's bare method): resolved once
_targets: dict[tuple[str, str], tuple[Any, Callable[..., Any]]] = {}


def _target(method: str, group_name: str) -> tuple[Any, Callable[..., Any]]:
    from vllm.distributed import parallel_state

    ref = parallel_state._groups.get(group_name)
    group = ref() if ref is not None else None
    if group is None:
        raise ValueError(f"ascend_guard::{method}: no live group {group_name!r}")
    bare = _state["bare"][method]

    def call(coordinator: Any, *args: Any) -> Any:
        return bare(coordinator.device_communicator, *args)

    found = _targets[(method, group_name)] = (group, call)
    return found


# The kernels run once per collective of a compiled graph, after a dispatcher crossing that
# already costs about as much as the eager wrapper: one dict lookup, then the tracker's flat
# single-tensor path (`run_tensor`).
def _all_reduce_kernel(tensor: Any, group_name: str) -> None:
    group, call = _targets.get(("all_reduce", group_name)) or _target("all_reduce", group_name)
    tracker = collectives._tracker
    if tracker is None:
        call(group, tensor)
    else:
        tracker.run_tensor("all_reduce", call, group, tensor)


def _all_gather_kernel(tensor: Any, dim: int, group_name: str) -> Any:
    group, call = _targets.get(("all_gather", group_name)) or _target("all_gather", group_name)
    tracker = collectives._tracker
    if tracker is None:
        return call(group, tensor, dim)
    return tracker.run_tensor("all_gather", call, group, tensor, dim)


def define_ops() -> bool:
    """Define the guard ops once per process (True when they exist). Cheap; safe to repeat."""
    if _state["library"] is not None:
        return True
    try:
        import torch

        lib = torch.library.Library(LIBRARY, "FRAGMENT")
        lib.define("all_reduce_(Tensor(a!) tensor, str group_name) -> ()")
        lib.define("all_gather(Tensor tensor, int dim, str group_name) -> Tensor")
        lib.impl("all_reduce_", _all_reduce_kernel, "CompositeExplicitAutograd")
        lib.impl("all_gather", _all_gather_kernel, "CompositeExplicitAutograd")

        def all_gather_fake(tensor: Any, dim: int, group_name: str) -> Any:
            world = _world_size(group_name)
            shape = list(tensor.shape)
            shape[dim] = shape[dim] * world
            return tensor.new_empty(shape)

        lib._register_fake("all_reduce_", lambda tensor, group_name: None)
        lib._register_fake("all_gather", all_gather_fake)
        _state["library"] = lib
        return True
    except Exception as exc:  # noqa: BLE001 - an old torch: compiled collectives stay unseen
        log.warning("guard_ops_unavailable", error=f"{type(exc).__name__}: {exc}")
        return False


def _world_size(group_name: str) -> int:
    from vllm.distributed import parallel_state

    ref = parallel_state._groups.get(group_name)
    group = ref() if ref is not None else None
    return int(getattr(group, "world_size", 1) or 1)


def _is_compiling() -> Callable[[], bool]:
    try:
        import torch

        return torch.compiler.is_compiling
    except Exception:  # noqa: BLE001
        return lambda: False


def compiled_collective_wrapper(method_name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """The wrapper of one device communicator method (the binder's "collective_op" action)."""
    if method_name not in COMPILED_METHODS or not define_ops():
        return method
    import torch

    _state["bare"][method_name] = method
    is_compiling = _is_compiling()
    if method_name == "all_reduce":
        guard_op = torch.ops.ascend_guard.all_reduce_.default

        def all_reduce(self: Any, input_: Any) -> Any:
            if not is_compiling():
                return method(self, input_)  # eager: the GroupCoordinator wrapper counts it
            guard_op(input_, self.unique_name)
            return input_

        wrapper = all_reduce
    else:
        gather_op = torch.ops.ascend_guard.all_gather.default

        def all_gather(self: Any, input_: Any, dim: int = -1) -> Any:
            if not is_compiling():
                return method(self, input_, dim)
            if dim < 0:
                dim += input_.dim()
            return gather_op(input_, dim, self.unique_name)

        wrapper = all_gather
    wrapper.__name__ = method_name
    wrapper.__qualname__ = getattr(method, "__qualname__", method_name)
    wrapper.__doc__ = getattr(method, "__doc__", None)
    wrapper.__wrapped__ = method  # type: ignore[attr-defined]
    setattr(wrapper, collectives.WRAPPED_ATTR, method)
    setattr(wrapper, collectives.GUARD_WRAPPED_ATTR, method)
    return wrapper
