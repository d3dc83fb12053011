"""Prometheus families for collectives, cross-rank skew, stragglers and hang verdicts.

Registered on the sidecar's registry next to `SidecarMetrics`. Op and group values come off
the wire, so they are bounded: unknown names beyond `MAX_LABEL_VALUES` share one value.
"""

from __future__ import annotations

import threading

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from telemetry.metrics.waves import RANK_LABELS
from telemetry.wire.collective_columns import array, key_rows, last_seq_by_group
from telemetry.wire.labels import MAX_LABEL_VALUES, OVERFLOW, BoundedValues  # noqa: F401
from telemetry.wire.replica import REPLICA_LABELS

COLLECTIVE_LABELS = (*RANK_LABELS, "op", "group", "backend")
STAGE_LABELS = (*REPLICA_LABELS, "pp")  # the ranks of one replica's PP stage align waves
# skew / waits: 100 us .. 60 s
# a table: one row per line, columns aligned (fmt: skip)
SKEW_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
STALL_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)


class CollectiveCounts:
    """Per-rank collective counters, summed once per batch and yielded at scrape time (a
    prometheus-client custom Collector: no `.labels().inc()` per stat on the record path)."""

    def __init__(self, label_value: BoundedValues) -> None:
        self._value = label_value
        self._lock = threading.Lock()
        self._ops: dict[tuple, list] = {}  # (*rank labels, op, group, backend) -> sums
        self._slow: dict[tuple, int] = {}
        self._seq: dict[tuple, int] = {}  # (*rank labels, group) -> last seq

    def add(self, labels: tuple[str, str, str, str], cols) -> None:
        """Sum one batch's `CollectiveColumns` per key (numpy over the columns)."""
        # summed under the raw wire values first; bounded label values once per key per batch
        ops: dict[tuple, list] = {}
        slow: dict[tuple, int] = {}
        keys = key_rows(cols)
        if keys:
            stats = cols.stats
            calls = array(stats, "calls")
            nbytes = array(stats, "bytes")
            host = array(stats, "host_ns")
            max_host = array(stats, "max_host_ns")
            for k, rows in keys:
                entry = cols.keys[k]
                key = (entry.op, entry.group, entry.backend)
                if rows is None:
                    sums = [int(calls.sum()), int(nbytes.sum()), int(host.sum())]
                    last = len(max_host) - 1
                else:
                    sums = [int(calls[rows].sum()), int(nbytes[rows].sum()), int(host[rows].sum())]
                    last = int(rows[-1])
                known = ops.get(key)
                if known is None:
                    ops[key] = [*sums, int(max_host[last]), last]
                else:  # the same (op, group, backend) with another dtype
                    for i in range(3):
                        known[i] += sums[i]
                    if last > known[4]:  # the latest wave's
                        known[3], known[4] = int(max_host[last]), last
        seqs = last_seq_by_group(cols, keys)
        for call in cols.slow_calls:
            key = (call.op, call.group, call.backend)
            slow[key] = slow.get(key, 0) + 1
        value = self._value
        with self._lock:
            for (op, group, backend), (calls, nbytes, host_ns, max_ns, _) in ops.items():
                full = (*labels, value(op), value(group), value(backend))
                sums = self._ops.get(full)
                if sums is None:
                    self._ops[full] = [calls, nbytes, host_ns, max_ns]
                else:
                    sums[0] += calls
                    sums[1] += nbytes
                    sums[2] += host_ns
                    sums[3] = max_ns
            for (op, group, backend), count in slow.items():
                full = (*labels, value(op), value(group), value(backend))
                self._slow[full] = self._slow.get(full, 0) + count
                self._ops.setdefault(full, [0, 0, 0, 0])
            for group, seq in seqs.items():
                self._seq[(*labels, value(group))] = seq

    def forget(self, engine: str) -> int:
        """Drop every series of `engine` (it left: telemetry/crossrank/roster.py); how many went."""
        removed = 0
        with self._lock:
            for table in (self._ops, self._slow, self._seq):
                gone = [key for key in table if key[0] == engine]
                for key in gone:
                    del table[key]
                removed += len(gone)
        return removed

    def collect(self):
        with self._lock:
            ops = {k: list(v) for k, v in self._ops.items()}
            slow = dict(self._slow)
            seqs = dict(self._seq)
        families = (
            CounterMetricFamily(
                "ascend_guard_collective_calls",
                "Collective calls a rank made, by op, group and backend.",
                labels=COLLECTIVE_LABELS,
            ),
            CounterMetricFamily(
                "ascend_guard_collective_bytes",
                "Payload bytes a rank handed to collectives.",
                labels=COLLECTIVE_LABELS,
            ),
            CounterMetricFamily(
                "ascend_guard_collective_seconds",
                "Host time a rank spent inside collectives (transfer plus waiting for peers).",
                labels=COLLECTIVE_LABELS,
            ),
            GaugeMetricFamily(
                "ascend_guard_collective_max_seconds",
                "Longest single call of (op, group) in the rank's latest wave.",
                labels=COLLECTIVE_LABELS,
            ),
        )
        calls, nbytes, seconds, max_seconds = families
        slow_family = CounterMetricFamily(
            "ascend_guard_collective_slow_calls",
            "Collective calls over the guard's slow-call threshold.",
            labels=COLLECTIVE_LABELS,
        )
        for key, (n, b, host_ns, max_ns) in ops.items():
            calls.add_metric(key, n)
            nbytes.add_metric(key, b)
            seconds.add_metric(key, host_ns / 1e9)
            max_seconds.add_metric(key, max_ns / 1e9)
            slow_family.add_metric(key, slow.get(key, 0))
        last_seq = GaugeMetricFamily(
            "ascend_guard_collective_last_seq",
            "Per-group sequence number of the rank's latest finished collective.",
            labels=(*RANK_LABELS, "group"),
        )
        for key, seq in seqs.items():
            last_seq.add_metric(key, seq)
        yield from families
        yield slow_family
        yield last_seq


_SKEW_BOUNDS = np.array(SKEW_BUCKETS)


class SkewHistograms:
    """`ascend_guard_wave_skew_seconds` and `..._arrival_skew_seconds` per PP stage of a
    replica, fed with one array of aligned waves at a time (a custom Collector: bucket counts
    by `searchsorted`, no `observe` per wave). Same names, labels and buckets as before."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # stage labels -> (bucket counts [2, buckets + 1], sums [2])
        self._series: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    def add(self, labels: tuple[str, str, str], skew: np.ndarray, arrival: np.ndarray) -> None:
        nb = len(SKEW_BUCKETS) + 1
        counts = np.stack(
            (
                np.bincount(np.searchsorted(_SKEW_BOUNDS, skew), minlength=nb),
                np.bincount(np.searchsorted(_SKEW_BOUNDS, arrival), minlength=nb),
            )
        )
        sums = np.array((skew.sum(), arrival.sum()))
        with self._lock:
            series = self._series.get(labels)
            if series is None:
                self._series[labels] = (counts, sums)
            else:
                series[0][...] += counts
                series[1][...] += sums

    def forget(self, engine: str) -> int:
        with self._lock:
            gone = [key for key in self._series if key[0] == engine]
            for key in gone:
                del self._series[key]
        return len(gone) * 2

    def collect(self):
        with self._lock:
            series = {k: (c.copy(), s.copy()) for k, (c, s) in self._series.items()}
        families = (
            HistogramMetricFamily(
                "ascend_guard_wave_skew_seconds",
                "Per wave: how much longer the most-waiting rank spent in collectives than the "
                "least-waiting one (the time the ranks waited for the slowest).",
                labels=STAGE_LABELS,
            ),
            HistogramMetricFamily(
                "ascend_guard_wave_arrival_skew_seconds",
                "Per wave: spread of the ranks' arrival at the wave's first collective.",
                labels=STAGE_LABELS,
            ),
        )
        bounds = [*(floatToGoString(b) for b in SKEW_BUCKETS), "+Inf"]
        for key, (counts, sums) in series.items():
            for row, family in enumerate(families):
                cumulative = np.cumsum(counts[row])
                family.add_metric(
                    key,
                    list(zip(bounds, (int(c) for c in cumulative), strict=True)),
                    float(sums[row]),
                )
        yield from families


class CollectiveMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.label_value = BoundedValues()
        # calls, bytes, seconds, max_seconds, slow_calls, last_seq: summed per batch
        self.counts = CollectiveCounts(self.label_value)
        r.register(self.counts)
        # wave skew and arrival skew: bucket counts per batch of aligned waves (numpy)
        self.skew = SkewHistograms()
        r.register(self.skew)
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
        self.hang_check_late = Counter(
            "ascend_guard_hang_check_late_seconds",
            "Time the hang checker woke later than its interval: this sidecar went unscheduled "
            "(a starved or paused host), and any verdict due meanwhile came that much later.",
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
