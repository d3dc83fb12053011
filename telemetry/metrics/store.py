"""The store's own health as Prometheus families, read from the writer at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from telemetry.store.writer import Store


class StoreMetrics(Collector):
    """The store's health on /metrics, read from the sidecar's `Store` at scrape time."""

    def __init__(self, registry: CollectorRegistry | None, store: Store | None = None) -> None:
        self.store = store
        self.moved_aside = 0
        if registry is not None:
            registry.register(self)

    def collect(self):
        store = self.store
        degraded = GaugeMetricFamily(
            "ascend_guard_store_degraded",
            "1 while the store cannot write (disk full, I/O error, corruption); its records are "
            'counted in ascend_guard_pipeline_dropped_records_total{stage="store"}.',
        )
        degraded.add_metric([], 1.0 if store is not None and store.degraded_reason else 0.0)
        yield degraded
        committed = CounterMetricFamily(
            "ascend_guard_store_committed_records",
            "Wave records committed to the store by this sidecar (a batch sent again counts once).",
        )
        committed.add_metric([], float(store.stored_waves if store is not None else 0))
        yield committed
        gap = CounterMetricFamily(
            "ascend_guard_store_restart_gap_records",
            "Waves missing between a rank's last stored wave and the first this sidecar received, "
            "less those the worker counted in ascend_guard_records_dropped_total: lost with a "
            "previous sidecar that was killed before writing them.",
        )
        gap.add_metric([], float(store.restart_gap_waves if store is not None else 0))
        yield gap
        moved = CounterMetricFamily(
            "ascend_guard_store_moved_aside",
            "Store files this sidecar found unusable at start and moved aside (<store>.corrupt-*).",
        )
        moved.add_metric([], float(self.moved_aside))
        yield moved
