"""The probe readings the sidecar exports, one registered entry per name.

Workers send `ProbeValue(name, labels, value)`; only names registered here become metrics
(`ascend_guard_<name>`, with the rank labels plus the declared ones), so a worker cannot create
unbounded metric families. A reading with an unknown name or undeclared labels is counted in
`ascend_guard_ingest_rejected_total{reason="unknown_probe"}` and skipped.
"""

from __future__ import annotations

import dataclasses


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
)
