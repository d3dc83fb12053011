"""Prometheus metrics of the sidecar, fed from validated wave batches.

Per-rank series carry `engine`, `dp`, `tp`, `pp`; per-replica series `engine`, `dp`. Workers send cumulative counts of dropped
records and internal errors; the sidecar turns them into counter increments per worker process,
so counters stay monotonic across worker and sidecar restarts.

The per-wave families (waves, tokens, step durations, last wave, heartbeats, drops, guard
errors) come from `WaveStats`, a prometheus-client custom Collector: the writer adds each batch
once, as numpy sums and bucket counts over the batch's columns, and `collect()` yields
`CounterMetricFamily` / `HistogramMetricFamily` / `GaugeMetricFamily` at scrape time, under
the same names and labels the dashboards and alerts use.
"""

from __future__ import annotations

import threading

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from telemetry.wire.labels import BoundedValues
from telemetry.wire.probes import PROBE_METRICS
from telemetry.wire.proto import guard_pb2
from telemetry.wire.replica import REPLICA_LABELS
from telemetry.wire.wave_columns import to_columns

RANK_LABELS = ("engine", "dp", "tp", "pp")
PHASES = ("execute_model", "sample_tokens", "step")
# Host time per phase: 50 us .. 60 s
# a table: one row per line, columns aligned (fmt: skip)
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
        self.waves = WaveStats()
        r.register(self.waves)
        self.ranks_connected = Gauge(
            "ascend_guard_ranks_connected",
            "Worker streams connected to this sidecar, per replica (DP engine).",
            REPLICA_LABELS,
            registry=r,
        )
        self.rejected = Counter(
            "ascend_guard_ingest_rejected",
            "Messages the sidecar refused, by reason; invalid_probe and invalid_incident count one "
            "bad probe reading or incident dropped from a batch whose other records were kept.",
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

    def observe_heartbeat(self, labels: RankLabels, time_unix_nano: int) -> None:
        """A rank's latest heartbeat (the ingest handler: liveness does not wait for the writer)."""
        self.waves.heartbeat(labels, time_unix_nano)

    def observe_batch(self, labels: RankLabels, batch: guard_pb2.Batch, source: tuple) -> int:
        """Count one validated batch from the worker process identified by `source` (the writer
        thread); return how many records the worker newly reported as dropped."""
        if batch.waves:  # a v1 batch handed over directly (ingest converts them first)
            to_columns(batch)
        with self._lock:
            seen_dropped, seen_errors = self._cumulative.get(source, (0, 0))
            self._cumulative[source] = (
                max(seen_dropped, batch.dropped_total),
                max(seen_errors, batch.guard_errors_total),
            )
        dropped = max(0, batch.dropped_total - seen_dropped)
        errors = max(0, batch.guard_errors_total - seen_errors)
        self.waves.add(labels, batch.wave_columns, dropped, errors)
        for raw_type, total in batch.detector_hits_total.items():
            type_ = self._hit_type(raw_type)
            key = (*source, type_)
            with self._lock:
                seen = self._hits_seen.get(key, 0)
                self._hits_seen[key] = max(seen, total)
            if total > seen:
                self.detector_hits.labels(*labels, type_).inc(total - seen)
        return dropped

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


_BOUNDS_NS = np.array([round(b * 1e9) for b in DURATION_BUCKETS], dtype=np.int64)
_LE = [floatToGoString(b) for b in DURATION_BUCKETS] + ["+Inf"]
# counters kept per rank, in this order
_WAVES, _DUMMY, _SAMPLED, _PREFILL, _DECODE, _RECOMPUTE, _DROPPED, _ERRORS = range(8)


class _RankSeries:
    __slots__ = ("buckets", "counts", "heartbeat", "last_wave", "sums_ns")

    def __init__(self) -> None:
        self.counts = [0] * 8
        self.buckets = np.zeros((len(PHASES), len(_LE)), dtype=np.int64)
        self.sums_ns = [0, 0, 0]
        self.last_wave = 0
        self.heartbeat = 0.0


class WaveStats:
    """Per-rank wave families, fed once per batch (custom Collector)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ranks: dict[RankLabels, _RankSeries] = {}

    def _series(self, labels: RankLabels) -> _RankSeries:
        series = self._ranks.get(labels)
        if series is None:
            series = self._ranks[labels] = _RankSeries()
        return series

    def heartbeat(self, labels: RankLabels, time_unix_nano: int) -> None:
        with self._lock:
            self._series(labels).heartbeat = time_unix_nano / 1e9

    def add(
        self, labels: RankLabels, cols: guard_pb2.WaveColumns, dropped: int, errors: int
    ) -> None:
        n = len(cols.wave)
        if n:
            execute = np.array(cols.execute_ns, np.int64)
            sample = np.array(cols.sample_ns, np.int64)
            sampled = np.array(cols.sampled, bool)
            step = execute + sample
            sample_taken = sample[sampled]
            nb = len(_LE)
            hist = np.stack(
                (
                    np.bincount(np.searchsorted(_BOUNDS_NS, execute), minlength=nb),
                    np.bincount(np.searchsorted(_BOUNDS_NS, sample_taken), minlength=nb),
                    np.bincount(np.searchsorted(_BOUNDS_NS, step), minlength=nb),
                )
            )
            sums = (int(execute.sum()), int(sample_taken.sum()), int(step.sum()))
            counts = (
                n,
                sum(cols.dummy),
                sum(cols.sampled_tokens),
                sum(cols.prefill_tokens),
                sum(cols.decode_tokens),
                sum(cols.recompute_tokens),
            )
            last = max(cols.wave)
        with self._lock:
            series = self._series(labels)
            c = series.counts
            if n:
                for i, value in enumerate(counts):
                    c[i] += value
                series.buckets += hist
                for i, value in enumerate(sums):
                    series.sums_ns[i] += value
                series.last_wave = max(series.last_wave, last)
            c[_DROPPED] += dropped
            c[_ERRORS] += errors

    def forget(self, engine: str) -> int:
        """Drop every series of `engine` (it left: telemetry/crossrank/roster.py); how many went."""
        with self._lock:
            gone = [labels for labels in self._ranks if labels[0] == engine]
            for labels in gone:
                del self._ranks[labels]
        return len(gone)

    def collect(self):
        with self._lock:
            snapshot = [
                (
                    labels,
                    list(s.counts),
                    s.buckets.cumsum(axis=1),
                    list(s.sums_ns),
                    s.last_wave,
                    s.heartbeat,
                )
                for labels, s in self._ranks.items()
            ]
        counters = (
            ("ascend_guard_waves", "Engine steps (waves) reported by a rank.", _WAVES),
            (
                "ascend_guard_dummy_waves",
                "Idle or dummy waves (nothing scheduled) reported by a rank.",
                _DUMMY,
            ),
            (
                "ascend_guard_sampled_tokens",
                "Tokens a rank's runner sampled that the scheduler keeps (drafts accepted past a "
                "stop are left out): vllm:generation_tokens_total on each sampling rank, except "
                "tokens of aborted requests (client gone, stop string) sampled after vLLM's front "
                "end stopped counting them, which are counted here and not there.",
                _SAMPLED,
            ),
            (
                "ascend_guard_records_dropped",
                "Records a rank dropped before they reached the sidecar.",
                _DROPPED,
            ),
            (
                "ascend_guard_guard_errors",
                "Guard-internal errors caught (and survived) on a rank.",
                _ERRORS,
            ),
        )
        for name, help_text, index in counters:
            family = CounterMetricFamily(name, help_text, labels=RANK_LABELS)
            for labels, counts, *_ in snapshot:
                family.add_metric(labels, counts[index])
            yield family
        scheduled = CounterMetricFamily(
            "ascend_guard_scheduled_tokens",
            "Tokens scheduled on a rank. kind=prefill: prompt tokens computed for the first "
            "time, i.e. vllm:prompt_tokens_total less prefix-cache hits "
            '(vllm:prompt_tokens_by_source{source="local_compute"}); kind=recompute: what '
            "preempted requests compute again on resuming (vLLM exports only their count, "
            "vllm:num_preemptions_total); kind=decode: the rest, drafts included.",
            labels=(*RANK_LABELS, "kind"),
        )
        for labels, counts, *_ in snapshot:
            scheduled.add_metric((*labels, "prefill"), counts[_PREFILL])
            scheduled.add_metric((*labels, "decode"), counts[_DECODE])
            scheduled.add_metric((*labels, "recompute"), counts[_RECOMPUTE])
        yield scheduled
        durations = HistogramMetricFamily(
            "ascend_guard_step_duration_seconds",
            "Host time of a wave's phases on a rank.",
            labels=(*RANK_LABELS, "phase"),
        )
        last_wave = GaugeMetricFamily(
            "ascend_guard_last_wave", "Latest wave number reported by a rank.", labels=RANK_LABELS
        )
        heartbeat = GaugeMetricFamily(
            "ascend_guard_last_heartbeat_timestamp_seconds",
            "Unix time of a rank's latest heartbeat.",
            labels=RANK_LABELS,
        )
        for labels, counts, cumulative, sums, last, beat in snapshot:
            if counts[_WAVES]:
                for p, phase in enumerate(PHASES):
                    durations.add_metric(
                        (*labels, phase),
                        list(zip(_LE, cumulative[p].tolist(), strict=True)),
                        sums[p] / 1e9,
                    )
                last_wave.add_metric(labels, last)
            if beat:
                heartbeat.add_metric(labels, beat)
        yield durations
        yield last_wave
        yield heartbeat
