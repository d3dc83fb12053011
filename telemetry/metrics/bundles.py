"""The evidence bundles' own counters (telemetry/crossrank/bundle.py): written, and dropped or
cut by reason. Incremented on the bundle thread and, for a full queue, the hang checker's."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

DROP_REASONS = ("queue_full", "write_failed", "evicted", "cut_to_size")


class BundleMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.written = Counter(
            "ascend_guard_hang_bundles",
            "Evidence bundles written at hang verdicts (local files; `ascend-guard hangs --bundle`).",
            registry=registry,
        )
        self.dropped = Counter(
            "ascend_guard_hang_bundle_drops",
            "Evidence bundles not written (queue_full, write_failed), removed to keep the newest "
            "(evicted), or parts cut to fit the size bound (cut_to_size).",
            ["reason"],
            registry=registry,
        )
        for reason in DROP_REASONS:
            self.dropped.labels(reason)
