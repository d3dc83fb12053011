"""The pipeline's metrics sink: each written batch's per-batch aggregates into the metric families,
the cross-rank counters and the rank gauges. Runs on the pipeline's writer thread, first of the
sinks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from telemetry.metrics.waves import SidecarMetrics
from telemetry.pipeline.writer import STAGE_WORKER, Drops

if TYPE_CHECKING:  # the sidecar hands them in; crossrank/ sits above metrics/
    from telemetry.crossrank.rank_gauges import RankGauges
    from telemetry.crossrank.view import CrossRankView


class MetricsSink:
    """Per-batch aggregates into the metrics (the writer's first sink)."""

    stage = "metrics"

    def __init__(
        self,
        metrics: SidecarMetrics,
        cross_rank: CrossRankView,
        drops: Drops,
        rank_gauges: RankGauges | None = None,
    ) -> None:
        self._metrics = metrics
        self._cross_rank = cross_rank
        self._drops = drops
        self._rank_gauges = rank_gauges

    def write(self, items) -> None:
        for item in items:
            source = item.source
            dropped = self._metrics.observe_batch(source.labels, item.batch, source.process)
            if dropped:
                self._drops.add(STAGE_WORKER, "buffer_full_or_lost_in_flight", dropped)
            self._cross_rank.count(source.engine, item.batch)
            if self._rank_gauges is not None:
                self._rank_gauges.count(source.engine, item.batch)

    def close(self) -> None:
        pass
