"""Prometheus metrics of the sidecar, fed from validated wave batches.

Per-rank series carry `engine`, `dp`, `tp`, `pp`; per-replica series `engine`, `dp`. Workers send cumulative counts of dropped
records and internal errors; the sidecar turns them into counter increments per worker process,
so counters stay monotonic across worker and sidecar restarts.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from telemetry.labels import BoundedValues
from telemetry.probes import PROBE_METRICS
from telemetry.proto import guard_pb2
from telemetry.replica import REPLICA_LABELS

RANK_LABELS = ("engine", "dp", "tp", "pp")
PHASES = ("execute_model", "sample_tokens", "step")
# Host time per phase: 50 us .. 60 s
DURATION_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip

RankLabels = tuple[str, str, str, str]

# `*_created` series double the exposition and no dashboard uses them
disable_created_metrics()


class SidecarMetrics:
    """All metric families the sidecar exports, on one registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.waves = Counter(
            "ascend_guard_waves",
            "Engine steps (waves) reported by a rank.",
            RANK_LABELS,
            registry=r,
        )
        self.dummy_waves = Counter(
            "ascend_guard_dummy_waves",
            "Idle or dummy waves (nothing scheduled) reported by a rank.",
            RANK_LABELS,
            registry=r,
        )
        self.sampled_tokens = Counter(
            "ascend_guard_sampled_tokens",
            "Tokens a rank's runner sampled that the scheduler keeps (drafts accepted past a "
            "stop are left out): vllm:generation_tokens_total on each sampling rank, except "
            "tokens of aborted requests (client gone, stop string) sampled after vLLM's front "
            "end stopped counting them, which are counted here and not there.",
            RANK_LABELS,
            registry=r,
        )
        self.scheduled_tokens = Counter(
            "ascend_guard_scheduled_tokens",
            "Tokens scheduled on a rank. kind=prefill: prompt tokens computed for the first "
            "time, i.e. vllm:prompt_tokens_total less prefix-cache hits "
            '(vllm:prompt_tokens_by_source{source="local_compute"}); kind=recompute: what '
            "preempted requests compute again on resuming (vLLM exports only their count, "
            "vllm:num_preemptions_total); kind=decode: the rest, drafts included.",
            (*RANK_LABELS, "kind"),
            registry=r,
        )
        self.step_duration = Histogram(
            "ascend_guard_step_duration_seconds",
            "Host time of a wave's phases on a rank.",
            (*RANK_LABELS, "phase"),
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.dropped = Counter(
            "ascend_guard_records_dropped",
            "Records a rank dropped before they reached the sidecar.",
            RANK_LABELS,
            registry=r,
        )
        self.guard_errors = Counter(
            "ascend_guard_guard_errors",
            "Guard-internal errors caught (and survived) on a rank.",
            RANK_LABELS,
            registry=r,
        )
        self.last_wave = Gauge(
            "ascend_guard_last_wave",
            "Latest wave number reported by a rank.",
            RANK_LABELS,
            registry=r,
        )
        self.last_heartbeat = Gauge(
            "ascend_guard_last_heartbeat_timestamp_seconds",
            "Unix time of a rank's latest heartbeat.",
            RANK_LABELS,
            registry=r,
        )
        self.ranks_connected = Gauge(
            "ascend_guard_ranks_connected",
            "Worker streams connected to this sidecar, per replica (DP engine).",
            REPLICA_LABELS,
            registry=r,
        )
        self.rejected = Counter(
            "ascend_guard_ingest_rejected",
            "Messages the sidecar refused, by reason.",
            ("reason",),
            registry=r,
        )
        self.incidents = Counter(
            "ascend_guard_incidents",
            "Incidents recorded (deduplicated), by type and severity.",
            (*RANK_LABELS, "type", "severity"),
            registry=r,
        )
        self.detector_hits = Counter(
            "ascend_guard_detector_hits",
            "Detector hits on a rank, reported or held back by the per-request cap.",
            (*RANK_LABELS, "type"),
            registry=r,
        )
        self.probes = {
            name: (Counter if probe.kind == "counter" else Gauge)(
                f"ascend_guard_{name}", probe.help, (*RANK_LABELS, *probe.labels), registry=r
            )
            for name, probe in PROBE_METRICS.items()
        }
        self._probe_seen: dict[tuple, float] = {}
        self._cumulative: dict[tuple, tuple[int, int]] = {}
        self._hits_seen: dict[tuple, int] = {}
        # label values from the wire (detector names, probe label values): bounded
        self._hit_type = BoundedValues()
        self._probe_label = {
            (name, label): BoundedValues()
            for name, probe in PROBE_METRICS.items()
            for label in probe.labels
        }
        self._lock = threading.Lock()

    def observe_batch(self, labels: RankLabels, batch: guard_pb2.Batch, source: tuple) -> None:
        """Count one validated batch from the worker process identified by `source`."""
        waves = batch.waves
        if waves:
            self._observe_waves(labels, waves)
        if batch.HasField("heartbeat"):
            self.last_heartbeat.labels(*labels).set(batch.heartbeat.time_unix_nano / 1e9)
        with self._lock:
            seen_dropped, seen_errors = self._cumulative.get(source, (0, 0))
            self._cumulative[source] = (
                max(seen_dropped, batch.dropped_total),
                max(seen_errors, batch.guard_errors_total),
            )
        if batch.dropped_total > seen_dropped:
            self.dropped.labels(*labels).inc(batch.dropped_total - seen_dropped)
        if batch.guard_errors_total > seen_errors:
            self.guard_errors.labels(*labels).inc(batch.guard_errors_total - seen_errors)
        # make the series exist (at 0) as soon as a rank speaks, so dashboards and alerts see it
        self.dropped.labels(*labels)
        self.guard_errors.labels(*labels)
        for raw_type, total in batch.detector_hits_total.items():
            type_ = self._hit_type(raw_type)
            key = (*source, type_)
            with self._lock:
                seen = self._hits_seen.get(key, 0)
                self._hits_seen[key] = max(seen, total)
            if total > seen:
                self.detector_hits.labels(*labels, type_).inc(total - seen)

    def observe_probe(
        self, labels: RankLabels, probe: guard_pb2.ProbeValue, source: tuple = ()
    ) -> bool:
        """Export a registered probe reading; False for an unknown name or undeclared labels."""
        spec = PROBE_METRICS.get(probe.name)
        if spec is None or set(probe.labels) != set(spec.labels):
            return False
        extra = [self._probe_label[probe.name, k](probe.labels[k]) for k in spec.labels]
        series = self.probes[probe.name].labels(*labels, *extra)
        if spec.kind != "counter":
            series.set(probe.value)
            return True
        key = (*source, probe.name, *extra)
        with self._lock:
            seen = self._probe_seen.get(key, 0.0)
            self._probe_seen[key] = max(seen, probe.value)
        if probe.value > seen:
            series.inc(probe.value - seen)
        return True

    def _observe_waves(self, labels: RankLabels, waves) -> None:
        execute = self.step_duration.labels(*labels, "execute_model")
        sample = self.step_duration.labels(*labels, "sample_tokens")
        step = self.step_duration.labels(*labels, "step")
        sampled = prefill = decode = recompute = dummies = 0
        last = 0
        for wave in waves:
            execute.observe(wave.execute_ns / 1e9)
            if wave.sampled:
                sample.observe(wave.sample_ns / 1e9)
            step.observe((wave.execute_ns + wave.sample_ns) / 1e9)
            sampled += wave.sampled_tokens
            prefill += wave.prefill_tokens
            decode += wave.decode_tokens
            recompute += wave.recompute_tokens
            dummies += wave.dummy
            last = max(last, wave.wave)
        self.waves.labels(*labels).inc(len(waves))
        self.dummy_waves.labels(*labels).inc(dummies)
        self.sampled_tokens.labels(*labels).inc(sampled)
        self.scheduled_tokens.labels(*labels, "prefill").inc(prefill)
        self.scheduled_tokens.labels(*labels, "decode").inc(decode)
        self.scheduled_tokens.labels(*labels, "recompute").inc(recompute)
        self.last_wave.labels(*labels).set(last)
