"""Prometheus families for collectives, cross-rank skew, stragglers and hang verdicts.

Registered on the sidecar's registry next to `SidecarMetrics`. Op and group values come off
the wire, so they are bounded: unknown names beyond `MAX_LABEL_VALUES` share one value.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from telemetry.labels import MAX_LABEL_VALUES, OVERFLOW, BoundedValues  # noqa: F401
from telemetry.metrics import RANK_LABELS
from telemetry.replica import REPLICA_LABELS

COLLECTIVE_LABELS = (*RANK_LABELS, "op", "group", "backend")
STAGE_LABELS = (*REPLICA_LABELS, "pp")  # the ranks of one replica's PP stage align waves
# skew / waits: 100 us .. 60 s
SKEW_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
STALL_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)


class CollectiveMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.label_value = BoundedValues()
        self.calls = Counter(
            "ascend_guard_collective_calls",
            "Collective calls a rank made, by op, group and backend.",
            COLLECTIVE_LABELS,
            registry=r,
        )
        self.bytes = Counter(
            "ascend_guard_collective_bytes",
            "Payload bytes a rank handed to collectives.",
            COLLECTIVE_LABELS,
            registry=r,
        )
        self.seconds = Counter(
            "ascend_guard_collective_seconds",
            "Host time a rank spent inside collectives (transfer plus waiting for peers).",
            COLLECTIVE_LABELS,
            registry=r,
        )
        self.max_seconds = Gauge(
            "ascend_guard_collective_max_seconds",
            "Longest single call of (op, group) in the rank's latest wave.",
            COLLECTIVE_LABELS,
            registry=r,
        )
        self.slow_calls = Counter(
            "ascend_guard_collective_slow_calls",
            "Collective calls over the guard's slow-call threshold.",
            COLLECTIVE_LABELS,
            registry=r,
        )
        self.last_seq = Gauge(
            "ascend_guard_collective_last_seq",
            "Per-group sequence number of the rank's latest finished collective.",
            (*RANK_LABELS, "group"),
            registry=r,
        )
        self.skew = Histogram(
            "ascend_guard_wave_skew_seconds",
            "Per wave: how much longer the most-waiting rank spent in collectives than the "
            "least-waiting one (the time the ranks waited for the slowest).",
            STAGE_LABELS,
            buckets=SKEW_BUCKETS,
            registry=r,
        )
        self.arrival_skew = Histogram(
            "ascend_guard_wave_arrival_skew_seconds",
            "Per wave: spread of the ranks' arrival at the wave's first collective.",
            STAGE_LABELS,
            buckets=SKEW_BUCKETS,
            registry=r,
        )
        self.straggler_waves = Counter(
            "ascend_guard_straggler_waves",
            "Waves in which this rank was the one the others waited for (skew over threshold).",
            RANK_LABELS,
            registry=r,
        )
        self.straggler_seconds = Counter(
            "ascend_guard_straggler_seconds",
            "Time the other ranks waited for this rank, summed over its straggler waves.",
            RANK_LABELS,
            registry=r,
        )
        self.waves_unaligned = Counter(
            "ascend_guard_waves_unaligned",
            "Waves whose collective records did not arrive from every rank in time.",
            STAGE_LABELS,
            registry=r,
        )
        self.hang_verdicts = Counter(
            "ascend_guard_hang_verdicts",
            "Hang verdicts naming this rank as stopped, by kind.",
            (*RANK_LABELS, "kind"),
            registry=r,
        )
        self.hang_recoveries = Counter(
            "ascend_guard_hang_recoveries",
            "Hangs after which the replica (DP engine) moved again.",
            REPLICA_LABELS,
            registry=r,
        )
        self.wedged = Gauge(
            "ascend_guard_engine_wedged",
            "1 while a hang verdict on the replica (DP engine) stands, else 0.",
            REPLICA_LABELS,
            registry=r,
        )
        self.stall_duration = Histogram(
            "ascend_guard_hang_stall_seconds",
            "Length of a replica's stall, from its onset to recovery.",
            REPLICA_LABELS,
            buckets=STALL_BUCKETS,
            registry=r,
        )
