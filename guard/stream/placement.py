"""Where a rank runs, as its worker alone can tell once the rank has opened its device: which
accelerator (the node's id of it) and which model it serves (the name vLLM's own metrics carry).

Read once, on the engine thread, when streaming starts (guard/processor.py): the current device
is per thread in both torch_npu and CUDA, and the engine thread is the one that opened it. The
streamer sends both with the stream's metadata (telemetry/wire/workload.py); the sidecar puts
them on `ascend_guard_rank_workload_info` and on hang verdicts.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from telemetry.wire.workload import physical_device, served_model_name

ACCELERATORS = ("npu", "cuda")


def _current_index(kind: str, torch_module: Any) -> int | None:
    """The current device of this thread from torch_npu (`torch.npu`) or CUDA, if imported."""
    runtime = getattr(torch_module, kind, None)
    try:
        return int(runtime.current_device()) if runtime is not None else None
    except Exception:  # noqa: BLE001 - no device set up on this thread: no id
        return None


def device_of(
    runner: Any, environ: Mapping[str, str] | None = None, torch_module: Any = None
) -> str:
    """The node's id of the accelerator `runner` opened (vLLM's model runners keep it as
    `runner.device`, a torch.device): its index, or the thread's current device where the
    runner names none, mapped through the visible-devices lists. "" on CPU or when unknown."""
    device = getattr(runner, "device", None)
    if device is None:
        return ""
    kind = getattr(device, "type", None) or str(device).partition(":")[0]
    if kind not in ACCELERATORS:
        return ""
    index = getattr(device, "index", None)
    if index is None:
        torch_module = torch_module if torch_module is not None else sys.modules.get("torch")
        index = _current_index(kind, torch_module)
    return physical_device(kind, index, environ) if index is not None else ""


def model_name_of(runner: Any) -> str:
    """The served model name vLLM labels its metrics with (`model_name`)."""
    vllm_config = getattr(runner, "vllm_config", None)
    return served_model_name(getattr(vllm_config, "model_config", None))
