"""Where the collective wrappers attach: methods of vLLM's `GroupCoordinator`.

The out-of-place all-reduce/all-gather/reduce-scatter methods are what both call paths reach:
the direct one (`GroupCoordinator.all_reduce` -> `_all_reduce_out_place`) and the torch custom
op one (`torch.ops.vllm.all_reduce` -> module-level `all_reduce` -> `_all_reduce_out_place`),
so every call is seen once whichever path the platform takes. The other collectives are
wrapped where they are defined. Which methods are wrapped is listed with every other attach
point in `ascend_runtime/attach/points.py` (action "collective") and bound by the same binder
when `vllm.distributed.parallel_state` is imported; this module says how each one's op and
payload are read, and turns recording on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog

from guard.collectives.install import wrap_collective
from guard.collectives.payload import Payload, arg_or_result, first_arg, no_payload, result_only
from guard.collectives.records import GroupMeta
from guard.config.runtime_guard import GuardConfig

log = structlog.get_logger("ascend_guard.collective_binding")

MODULE = "vllm.distributed.parallel_state"
CLASS = "GroupCoordinator"

# (method, op name reported, how to read its payload)
COLLECTIVE_METHODS: tuple[tuple[str, str, Payload], ...] = (
    ("_all_reduce_out_place", "all_reduce", first_arg),
    ("_all_gather_out_place", "all_gather", first_arg),
    ("_reduce_scatter_out_place", "reduce_scatter", first_arg),
    ("all_gatherv", "all_gatherv", first_arg),
    ("reduce_scatterv", "reduce_scatterv", first_arg),
    ("gather", "gather", first_arg),
    ("broadcast", "broadcast", first_arg),
    ("broadcast_object", "broadcast_object", no_payload),
    ("broadcast_object_list", "broadcast_object_list", no_payload),
    ("broadcast_tensor_dict", "broadcast_tensor_dict", arg_or_result),
    ("send_object", "send_object", no_payload),
    ("recv_object", "recv_object", no_payload),
    ("send_tensor_dict", "send_tensor_dict", first_arg),
    ("recv_tensor_dict", "recv_tensor_dict", result_only),
    ("send", "send", first_arg),
    ("recv", "recv", result_only),
    ("barrier", "barrier", no_payload),
    ("dispatch", "all_to_all_dispatch", first_arg),
    ("combine", "all_to_all_combine", first_arg),
)


def _is_compiling() -> Callable[[], bool]:
    try:
        import torch

        return torch.compiler.is_compiling
    except Exception:  # noqa: BLE001 - an old torch: nothing compiles through the wrapper
        return lambda: False


_HOW = {method: (op, payload) for method, op, payload in COLLECTIVE_METHODS}


def collective_wrapper(method_name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """The wrapper of one GroupCoordinator method (the binder's "collective" action)."""
    op, payload = _HOW[method_name]
    return wrap_collective(op, method, payload, _is_compiling())


def bind_group_coordinator(cls: type) -> list[str]:
    """Wrap the collective methods `cls` defines; returns the names now wrapped."""
    compiling = _is_compiling()
    bound = []
    for method_name, op, payload in COLLECTIVE_METHODS:
        method = cls.__dict__.get(method_name)
        if method is None or not callable(method):
            continue
        setattr(cls, method_name, wrap_collective(op, method, payload, compiling))
        bound.append(method_name)
    return bound


def describe_group(group: Any) -> GroupMeta:
    """Label, backend and position of a `GroupCoordinator` (cached on it by the tracker)."""
    name = str(getattr(group, "unique_name", "") or "unknown")
    return GroupMeta(
        name.split(":", 1)[0],
        group_backend(group),
        int(getattr(group, "rank_in_group", 0) or 0),
        int(getattr(group, "world_size", 1) or 1),
    )


def group_backend(group: Any) -> str:
    """shm (vLLM's CPU shared-memory path), else the device group's torch backend: hccl,
    nccl, gloo, ..."""
    communicator = getattr(group, "device_communicator", None)
    dist_module = getattr(communicator, "dist_module", None)
    if dist_module is not None and "SHM" in type(dist_module).__name__:
        return "shm"
    try:
        import torch.distributed as dist

        return str(dist.get_backend(group.device_group)).lower()
    except Exception:  # noqa: BLE001
        return str(getattr(group, "torch_distributed_backend", "") or "unknown").lower()


def current_rank() -> tuple[int, int, int]:
    """(dp, tp, pp) of this process inside its groups; zeros where a group is absent."""
    from vllm.distributed import parallel_state as ps

    coords = []
    for getter in (ps.get_dp_group, ps.get_tp_group, ps.get_pp_group):
        try:
            coords.append(int(getter().rank_in_group))
        except Exception:  # noqa: BLE001 - group not initialised
            coords.append(0)
    return coords[0], coords[1], coords[2]


def widest_group() -> int:
    """The most ranks any of this process's groups spans (1: vLLM short-cuts every collective
    here, so none communicates; 0: not known, no group answered)."""
    from vllm.distributed import parallel_state as ps

    sizes = []
    for name in ("get_world_group", "get_tp_group", "get_pp_group", "get_dp_group", "get_ep_group"):
        try:
            sizes.append(int(getattr(ps, name)().world_size))
        except Exception:  # noqa: BLE001 - a group this vLLM lacks, or not initialised
            continue
    return max(sizes, default=0)


def _replay_events() -> Callable[[], Any] | None:
    """Device timing events for graph replays (None on CPU, where nothing is captured)."""
    try:
        from ascend_runtime.attach.detect import platform
        from ascend_runtime.probes.device_time import event_factory

        return event_factory(platform())
    except Exception:  # noqa: BLE001
        return None


def install_collective_guard(config: GuardConfig, processor: Any) -> None:
    """Turn on collective recording, the watchdog and (if configured) the fire drill for the
    guard `processor` of this process."""
    from guard.collectives.install import install_tracker
    from guard.collectives.observer import CollectiveGuard

    collectives, fault = config.collectives, config.fault_injection
    if not collectives.enabled and not fault.enabled:
        return
    guard = CollectiveGuard(
        collectives,
        fault,
        wave_source=lambda: processor.wave,
        rank_source=current_rank,
        describe_group=describe_group,
        new_event=_replay_events(),
        world_size=widest_group,
    )
    processor.add_observer(guard)
    if collectives.enabled:
        install_tracker(guard.tracker)  # the GroupCoordinator rows of the attach-point table
    elif fault.where == "collective":
        log.warning("fault_injection_needs_collectives", where=fault.where)
