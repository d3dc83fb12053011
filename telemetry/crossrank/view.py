"""The sidecar's cross-rank view: collective counters, wave skew and stragglers
(`ranksync`), hang verdicts (`hangs`). IngestService hands it every validated batch."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from telemetry.crossrank.hangs import HangDetector, HangSettings, IncidentSink
from telemetry.crossrank.ranksync import DEFAULT_STRAGGLER_S, RankSync
from telemetry.metrics.collectives import CollectiveMetrics
from telemetry.wire.liveness_record import RecordReader
from telemetry.wire.proto import guard_pb2


class CrossRankView:
    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        hang_settings: HangSettings | None = None,
        straggler_threshold_s: float = DEFAULT_STRAGGLER_S,
        incident_sink: IncidentSink | None = None,
        records: RecordReader | None = None,
    ) -> None:
        self.metrics = CollectiveMetrics(registry)
        self.sync = RankSync(self.metrics, straggler_threshold_s=straggler_threshold_s)
        self.hangs = HangDetector(
            self.metrics, hang_settings, incident_sink=incident_sink, records=records
        )

    def observe(self, engine: str, batch: guard_pb2.Batch) -> None:
        """Liveness, hang state and wave alignment (the ingest handler, before queueing)."""
        self.hangs.observe(engine, batch)
        self.sync.align(engine, batch)

    def count(self, engine: str, batch: guard_pb2.Batch) -> None:
        """Collective counters (the writer thread)."""
        self.sync.count(engine, batch)

    def rank_gone(self, engine: str, rank: guard_pb2.RankInfo, clean: bool = False) -> None:
        """A rank's stream ended (`clean`: its worker closed it); the rank is not forgotten."""
        self.hangs.rank_gone(engine, rank, clean)

    def start(self) -> None:
        self.hangs.start()

    def stop(self) -> None:
        self.hangs.stop()
