"""The Kubernetes workload a worker runs in, carried from the worker to the sidecar.

A DaemonSet sidecar serves every vLLM pod of its node from another pod, so its scrape target's
`namespace` and `pod` are its own. The worker knows its own: deploy/'s vllm-guard component sets
`ASCEND_GUARD_POD_NAME`, `ASCEND_GUARD_POD_NAMESPACE` and `ASCEND_GUARD_NODE_NAME` from the
Downward API. The worker sends them as gRPC metadata when it opens its stream (no wire-schema
change: a sidecar that does not read them ignores them), and the sidecar publishes them on
`ascend_guard_rank_workload_info` (telemetry/metrics/workload.py), which the alert rules join so
that alerts carry the workload's namespace, pod and node.

The worker's streamer thread calls `stream_metadata`; the sidecar's gRPC handler threads call
`from_metadata`. Values are cut to the characters Kubernetes names use, so a client cannot mint
arbitrary label text.
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

# a pod or node name is a DNS subdomain (at most 253 characters), a namespace a DNS label
_MAX_LEN = 253
_UNSAFE = re.compile(r"[^a-z0-9.-]")


class Workload(NamedTuple):
    """Where a rank runs in Kubernetes; "" for what is not known (not in Kubernetes)."""

    namespace: str = ""
    pod: str = ""
    node: str = ""

    def known(self) -> bool:
        return bool(self.pod)


NO_WORKLOAD = Workload()


def _clean(raw: str | None) -> str:
    return _UNSAFE.sub("_", (raw or "").strip().lower())[:_MAX_LEN]


def from_env(environ: Mapping[str, str] | None = None) -> Workload:
    env = os.environ if environ is None else environ
    return Workload(
        _clean(env.get(POD_NAMESPACE_ENV)),
        _clean(env.get(POD_NAME_ENV)),
        _clean(env.get(NODE_NAME_ENV)),
    )


def stream_metadata(workload: Workload) -> tuple[tuple[str, str], ...]:
    """The metadata a worker adds to its stream (only the parts it knows)."""
    pairs = (
        (NAMESPACE_KEY, workload.namespace),
        (POD_KEY, workload.pod),
        (NODE_KEY, workload.node),
    )
    return tuple((key, value) for key, value in pairs if value)


def from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> Workload:
    """The workload a stream's metadata names (empty fields where it names none)."""
    found: dict[str, str] = {}
    for key, value in metadata or ():
        if key in (NAMESPACE_KEY, POD_KEY, NODE_KEY) and isinstance(value, str):
            found[key] = _clean(value)
    return Workload(found.get(NAMESPACE_KEY, ""), found.get(POD_KEY, ""), found.get(NODE_KEY, ""))
