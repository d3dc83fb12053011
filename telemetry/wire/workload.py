"""The Kubernetes workload a worker runs in, carried from the worker to the sidecar.

A DaemonSet sidecar serves every vLLM pod of its node from another pod, so its scrape target's
`namespace` and `pod` are its own. The worker knows its own: deploy/'s vllm-guard component sets
`ASCEND_GUARD_POD_NAME`, `ASCEND_GUARD_POD_NAMESPACE` and `ASCEND_GUARD_NODE_NAME` from the
Downward API. The worker sends them as gRPC metadata when it opens its stream (no wire-schema
change: a sidecar that does not read them ignores them), and the sidecar publishes them on
`ascend_guard_rank_workload_info` (telemetry/metrics/workload.py), which the alert rules join so
that alerts carry the workload's namespace, pod and node.

With them go the rank's accelerator and its model, which the worker learns once the rank has
opened its device (guard/stream/placement.py):

- `device`: the id of the NPU (or GPU) the rank opened, as the node numbers it (the N of
  /dev/davinciN, which `npu-smi info -m` maps to NPU and chip ids; for CUDA the host's GPU
  index, DCGM's `gpu`): the runtime's device index mapped through
  `ASCEND_RT_VISIBLE_DEVICES`, then the container's `ASCEND_VISIBLE_DEVICES` (the Ascend device
  plugin's physical ids), or through `CUDA_VISIBLE_DEVICES`; "" on CPU;
- `model_name`: the served model name vLLM labels its own metrics with (`model_name`), so that
  our series join vLLM's.

The worker's streamer thread calls `stream_metadata`; the sidecar's gRPC handler threads call
`from_metadata`. Kubernetes names and device ids are cut to the characters Kubernetes names use,
a model name to those model names and paths use; each at most 253 characters, so a client cannot
mint arbitrary label text.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import NamedTuple

POD_NAME_ENV = "ASCEND_GUARD_POD_NAME"
POD_NAMESPACE_ENV = "ASCEND_GUARD_POD_NAMESPACE"
NODE_NAME_ENV = "ASCEND_GUARD_NODE_NAME"

# gRPC metadata keys (lower case, as gRPC requires)
POD_KEY = "x-ascend-guard-pod"
NAMESPACE_KEY = "x-ascend-guard-namespace"
NODE_KEY = "x-ascend-guard-node"
DEVICE_KEY = "x-ascend-guard-device"
MODEL_KEY = "x-ascend-guard-model-name"

# where each runtime lists the devices a process may open, innermost first: the runtime's own
# list numbers devices within the next one (a container's ASCEND_VISIBLE_DEVICES, set by the
# Ascend device plugin, holds the node's physical ids)
VISIBLE_DEVICES = {
    "npu": ("ASCEND_RT_VISIBLE_DEVICES", "ASCEND_VISIBLE_DEVICES"),
    "cuda": ("CUDA_VISIBLE_DEVICES",),
}

# a pod or node name is a DNS subdomain (at most 253 characters), a namespace a DNS label
_MAX_LEN = 253
_UNSAFE = re.compile(r"[^a-z0-9.-]")
# a served model name: a Hugging Face id ("Qwen/Qwen2.5-7B-Instruct") or a path
_UNSAFE_MODEL = re.compile(r"[^A-Za-z0-9._:/@+-]")


class Workload(NamedTuple):
    """Where a rank runs in Kubernetes; "" for what is not known (not in Kubernetes)."""

    namespace: str = ""
    pod: str = ""
    node: str = ""
    device: str = ""  # the accelerator the rank opened, as the node numbers it
    model_name: str = ""  # the served model name vLLM labels its own metrics with

    def known(self) -> bool:
        """The Kubernetes pod is known (what ascend_guard_rank_workload_info needs)."""
        return bool(self.pod)

    def named(self) -> bool:
        """Anything is known."""
        return any(self)


NO_WORKLOAD = Workload()


def _clean(raw: str | None) -> str:
    return _UNSAFE.sub("_", (raw or "").strip().lower())[:_MAX_LEN]


def _clean_model(raw: str | None) -> str:
    return _UNSAFE_MODEL.sub("_", (raw or "").strip())[:_MAX_LEN]


def physical_device(kind: str, index: int, environ: Mapping[str, str] | None = None) -> str:
    """The node's id of device `index` of runtime `kind` ("npu" or "cuda"), through the
    visible-devices lists that renumber it; "" for another kind or a negative index. An entry
    that is not a number (a GPU UUID) is the id itself."""
    if kind not in VISIBLE_DEVICES or index < 0:
        return ""
    env = os.environ if environ is None else environ
    ident = str(index)
    for variable in VISIBLE_DEVICES[kind]:
        listed = _listed(env.get(variable, ""), ranges=kind == "npu")
        if not ident.isdigit() or not listed:
            continue
        if int(ident) >= len(listed):
            break  # a list that does not hold the device: not the list the runtime used
        ident = listed[int(ident)]
    return _clean(ident)


_RANGE = re.compile(r"(\d+)-(\d+)")
_NAMED = re.compile(r"[A-Za-z][A-Za-z0-9]*-(\d+)")  # the Ascend Docker Runtime's "Ascend910-3"


def _listed(text: str, ranges: bool) -> list[str]:
    """The entries of a visible-devices list. The Ascend lists also take ranges ("0-3") and
    device names ("Ascend910-3"); a CUDA list's entries are ids or UUIDs, taken as they are."""
    out: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        span = _RANGE.fullmatch(part) if ranges else None
        named = _NAMED.fullmatch(part) if ranges else None
        if span is not None:
            out += [str(n) for n in range(int(span[1]), int(span[2]) + 1)]
        elif named is not None:
            out.append(named[1])
        else:
            out.append(part)
    return out


def served_model_name(model_config: object) -> str:
    """The model name vLLM's own metrics carry (`model_name`): the first served model name,
    else the model (as vLLM's `get_served_model_name`); "" when there is no model config."""
    served = getattr(model_config, "served_model_name", None)
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    name = served or getattr(model_config, "model", None) or ""
    return _clean_model(str(name))


def from_env(environ: Mapping[str, str] | None = None) -> Workload:
    env = os.environ if environ is None else environ
    return Workload(
        _clean(env.get(POD_NAMESPACE_ENV)),
        _clean(env.get(POD_NAME_ENV)),
        _clean(env.get(NODE_NAME_ENV)),
    )


# the metadata key of each Workload field, in field order
_KEYS = (NAMESPACE_KEY, POD_KEY, NODE_KEY, DEVICE_KEY, MODEL_KEY)


def stream_metadata(workload: Workload) -> tuple[tuple[str, str], ...]:
    """The metadata a worker adds to its stream (only the parts it knows)."""
    return tuple((key, value) for key, value in zip(_KEYS, workload, strict=True) if value)


def from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> Workload:
    """The workload a stream's metadata names (empty fields where it names none)."""
    found: dict[str, str] = {}
    for key, value in metadata or ():
        if key in _KEYS and isinstance(value, str):
            found[key] = _clean_model(value) if key == MODEL_KEY else _clean(value)
    return Workload(*(found.get(key, "") for key in _KEYS))
