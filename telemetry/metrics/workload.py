"""`ascend_guard_rank_workload_info`: which Kubernetes pod each rank of this sidecar runs in,
on which device, serving which model.

    ascend_guard_rank_workload_info{engine, dp, tp, pp, namespace, pod, node, device, model_name} 1

A DaemonSet sidecar's scrape target carries the sidecar's own namespace and pod; this family
carries the workload's, as the worker sent them when it opened its stream
(telemetry/wire/workload.py), with the NPU the rank opened (`device`, the node's device id: N of /dev/davinciN)
and vLLM's `model_name`. The alert rules join it on (instance, engine, dp, tp, pp) to put the
workload's namespace, pod, node, device and model name on their alerts; the PodMonitors scrape
with honorLabels, so these labels are kept as they are, not renamed exported_*. Ranks that named
no pod (not in Kubernetes, or an older worker) have no series here, so that a join never blanks
the target's own namespace and pod; their device and model still reach the hang verdicts
(`WorkloadBook.get`).

`WorkloadBook` is written by the gRPC handler threads when a stream opens or ends; the collector
reads it at scrape time. A rank's entry outlives its stream by the engine linger, as the
engine's other series do, so an alert on a replica whose streams all broke still names its pod.
Bounded by the number of ranks streaming to this sidecar (ingest caps the streams).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from prometheus_client.core import GaugeMetricFamily

from telemetry.wire.workload import NO_WORKLOAD, Workload

WORKLOAD_INFO = "ascend_guard_rank_workload_info"
WORKLOAD_LABELS = ("engine", "dp", "tp", "pp", "namespace", "pod", "node", "device", "model_name")

# (engine label, dp, tp, pp): one series per rank coordinate, so that a rule's join on them
# never meets two (a restarted pod's rank replaces the entry of the one before)
RankKey = tuple[str, int, int, int]


class WorkloadBook:
    """The workload of each rank with a stream, and of those whose stream ended lately."""

    def __init__(self, linger_s: float = 900.0, clock: Callable[[], float] = time.monotonic):
        self.linger_s = linger_s
        self._clock = clock
        self._lock = threading.Lock()
        # key -> (workload, open streams, monotonic time the last one ended)
        self._entries: dict[RankKey, tuple[Workload, int, float]] = {}

    def opened(self, key: RankKey, workload: Workload) -> None:
        if not workload.named():
            return
        with self._lock:
            _, streams, _ = self._entries.get(key, (workload, 0, 0.0))
            self._entries[key] = (workload, streams + 1, 0.0)

    def closed(self, key: RankKey) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries[key] = (entry[0], max(entry[1] - 1, 0), self._clock())

    def get(self, key: RankKey) -> Workload:
        """The workload of one rank, empty when it named none (read by the hang verdicts)."""
        with self._lock:
            entry = self._entries.get(key)
        return entry[0] if entry is not None else NO_WORKLOAD

    def snapshot(self) -> list[tuple[RankKey, Workload]]:
        now = self._clock()
        with self._lock:
            for key, (_, streams, ended) in list(self._entries.items()):
                if streams == 0 and now - ended > self.linger_s:
                    del self._entries[key]
            return [(key, entry[0]) for key, entry in self._entries.items()]


class WorkloadInfo:
    """Custom Collector over a `WorkloadBook` (read at scrape time)."""

    def __init__(self, book: WorkloadBook) -> None:
        self._book = book

    def describe(self):
        return [GaugeMetricFamily(WORKLOAD_INFO, _HELP, labels=WORKLOAD_LABELS)]

    def collect(self):
        family = GaugeMetricFamily(WORKLOAD_INFO, _HELP, labels=WORKLOAD_LABELS)
        for (engine, dp, tp, pp), workload in sorted(self._book.snapshot()):
            if workload.known():  # a pod to join on; see the module's docstring
                family.add_metric([engine, str(dp), str(tp), str(pp), *workload], 1.0)
        yield family


_HELP = (
    "The Kubernetes namespace, pod and node each rank runs in (Downward API), the NPU it "
    "opened (device: the node's device id, N of /dev/davinciN) and vLLM's model_name, as its "
    "worker reported "
    "them; join on engine, dp, tp, pp."
)
