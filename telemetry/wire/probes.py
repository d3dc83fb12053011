"""The probe readings the sidecar exports, one registered entry per name.

Workers send `ProbeValue(name, labels, value)`; only names registered here become metrics
(`ascend_guard_<name>`, with the rank labels plus the declared ones), so a worker cannot create
unbounded metric families. A reading with an unknown name or undeclared labels is counted in
`ascend_guard_ingest_rejected_total{reason="unknown_probe"}` and skipped.
"""

from __future__ import annotations

import dataclasses

from telemetry.wire.build_info import LABELS as BUILD_LABELS


@dataclasses.dataclass(frozen=True)
class ProbeMetric:
    name: str
    help: str
    labels: tuple[str, ...] = ()
    # "gauge": the latest reading; "counter": a cumulative count per worker process, exported
    # as `ascend_guard_<name>_total` and turned into increments (monotonic across restarts)
    kind: str = "gauge"


def _register(*metrics: ProbeMetric) -> dict[str, ProbeMetric]:
    return {m.name: m for m in metrics}


PROBE_METRICS: dict[str, ProbeMetric] = _register(
    ProbeMetric(
        "logits_max_abs",
        "Largest |logit| in the latest sampled wave checked by logits_stats.",
    ),
    ProbeMetric(
        "logits_entropy_nats",
        "Mean entropy (nats) of the next-token distribution in the latest checked wave.",
    ),
    ProbeMetric(
        "spec_acceptance_rate",
        "Draft-token acceptance over the spec_acceptance window, by speculative method.",
        ("method",),
    ),
    ProbeMetric(
        "spec_draft_tokens",
        "Draft tokens scheduled for verification, by speculative method.",
        ("method",),
        kind="counter",
    ),
    ProbeMetric(
        "spec_accepted_tokens",
        "Draft tokens accepted by the target model, by speculative method.",
        ("method",),
        kind="counter",
    ),
    ProbeMetric(
        "config_generation",
        "Generation of the runtime_guard config in force on a rank (1 = as started).",
    ),
    # -- what runs and where it attached (guard/stream/identity.py; the sidecar adds its own
    # build_info series with empty rank labels and component="sidecar") -----------------------
    ProbeMetric(
        "build_info",
        "ascend-guard build, wire version and package versions of a worker rank or the sidecar (value 1).",
        BUILD_LABELS,
    ),
    ProbeMetric(
        "attach_points",
        "Attach points of a rank by outcome: bound, or skipped (class or method missing in this version, or wrapping failed).",
        ("status",),
    ),
    # -- Ascend runtime probes (ascend_runtime/probes) --------------------------------------
    ProbeMetric("kv_cache_bytes", "Bytes of KV cache bound to the attention layers after init."),
    ProbeMetric("kv_cache_blocks", "KV-cache blocks allocated (vLLM's num_gpu_blocks)."),
    ProbeMetric("kv_cache_layers", "Attention layers whose KV-cache layout was checked."),
    ProbeMetric(
        "device_phase_ms",
        "Device time of the latest resolved phase from NPU/CUDA events (read without a sync).",
        ("phase",),
    ),
    ProbeMetric("graph_captures", "Captures of one graph (batch descriptor).", ("graph",)),
    ProbeMetric("graph_capture_seconds", "Time spent capturing one graph.", ("graph",)),
    ProbeMetric(
        "graph_capture_bytes", "Device memory allocated while capturing one graph.", ("graph",)
    ),
    ProbeMetric(
        "graph_workspace_leaked_bytes",
        "FULL-mode attention workspaces that survived their capture (never freed).",
    ),
    ProbeMetric("rotary_table_rows", "Rows of the MLA cos/sin tables (vllm-ascend)."),
    ProbeMetric(
        "speculator_info",
        "The speculator the runtime dispatched for a speculative method (value 1).",
        ("method", "speculator"),
    ),
    ProbeMetric(
        "spec_drafts_proposed", "Draft tokens proposed, by method.", ("method",), kind="counter"
    ),
    ProbeMetric(
        "spec_drafts_accepted",
        "Draft tokens accepted by the target, by method.",
        ("method",),
        kind="counter",
    ),
    ProbeMetric(
        "device_communicator_info",
        "Device communicator of a process group (value 1): HCCL, NCCL or CPU.",
        ("communicator", "backend", "group"),
    ),
    ProbeMetric(
        "hccl_settings_info",
        "HCCL settings of the rank (value 1; unset variables show HCCL's defaults).",
        ("communicator", "hccl_algo", "hccl_exec_timeout", "hccl_connect_timeout"),
    ),
)
