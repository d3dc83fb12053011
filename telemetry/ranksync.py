"""Cross-rank view of collectives: per-rank counters, and waves aligned across the ranks of
one PP stage of one replica (`telemetry.replica`: same run, engine and dp; and the same pp) to
measure skew and name stragglers. DP engines are never aligned with each other: each has its
own scheduler and wave numbering.

Wave numbers are the same on every rank for the same scheduler step, and within a wave every
rank makes the same collectives, so the wave is the unit of alignment. For each wave:

- skew: the longest minus the shortest host time the ranks spent inside that wave's
  collectives. A collective returns on every rank only once the last one arrived, so the
  ranks that arrived early spend the difference waiting; the rank with the least time inside
  is the one the others waited for (the straggler).
- arrival skew: the spread of the ranks' entry into the wave's first collective (wall clock;
  exact on one node, NTP-bounded across nodes).

A wave is judged once every rank of the replica has reported it; waves still incomplete
when `max_pending` newer ones are waiting are counted as unaligned and dropped.
"""

from __future__ import annotations

import collections
import dataclasses
import threading

from telemetry.collective_metrics import CollectiveMetrics
from telemetry.proto import guard_pb2
from telemetry.replica import Replica, replica_of

StageKey = tuple[Replica, int]  # a replica and one of its PP stages


@dataclasses.dataclass(frozen=True)
class WaveSkew:
    """One aligned wave of one replica."""

    engine: str
    dp: int
    pp: int
    wave: int
    skew_s: float
    arrival_skew_s: float
    straggler_tp: int | None  # set when skew_s reached the straggler threshold
    waits_s: dict[int, float]  # tp rank -> time inside collectives
    injected_s: dict[int, float]  # tp rank -> fire-drill delay reported by that rank


@dataclasses.dataclass
class _RankWave:
    first_arrival_ns: int = 0
    wait_ns: int = 0
    injected_ns: int = 0


class RankSync:
    def __init__(
        self,
        metrics: CollectiveMetrics,
        *,
        straggler_threshold_s: float = 0.05,
        max_pending: int = 256,
        keep_recent: int = 1024,
    ) -> None:
        self.metrics = metrics
        self.straggler_threshold_s = straggler_threshold_s
        self.max_pending = max_pending
        self._lock = threading.Lock()
        # replica -> wave -> tp -> record
        self._pending: dict[StageKey, collections.OrderedDict[int, dict[int, _RankWave]]] = {}
        self.recent: collections.deque[WaveSkew] = collections.deque(maxlen=keep_recent)
        self._skew_children: dict[tuple, tuple] = {}

    def observe(self, engine: str, batch: guard_pb2.Batch) -> list[WaveSkew]:
        """Count one batch's collective records; return the waves it completed."""
        self.count(engine, batch)
        return self.align(engine, batch)

    def count(self, engine: str, batch: guard_pb2.Batch) -> None:
        """The per-rank collective counters (the sidecar's writer thread)."""
        if batch.collective_waves:
            rank = batch.rank
            labels = (engine, str(rank.dp_rank), str(rank.tp_rank), str(rank.pp_rank))
            self._count(labels, batch.collective_waves)

    def align(self, engine: str, batch: guard_pb2.Batch) -> list[WaveSkew]:
        """Align one batch's waves with the other ranks'; return the waves it completed
        (the ingest handler: skew and stragglers must not wait behind storage)."""
        if not batch.collective_waves:
            return []
        rank = batch.rank
        if rank.tp_size <= 1:
            return []
        key = (replica_of(engine, rank), rank.pp_rank)
        done: list[WaveSkew] = []
        with self._lock:
            pending = self._pending.get(key)
            if pending is None:
                pending = self._pending[key] = collections.OrderedDict()
                self.metrics.waves_unaligned.labels(engine, str(rank.dp_rank), str(rank.pp_rank))
            for cw in batch.collective_waves:
                ranks = pending.setdefault(cw.wave, {})
                record = ranks.setdefault(rank.tp_rank, _RankWave())
                # a rank may hand in one wave in two parts (collectives after sample_tokens)
                if not record.first_arrival_ns or (
                    cw.first_arrival_unix_nano
                    and cw.first_arrival_unix_nano < record.first_arrival_ns
                ):
                    record.first_arrival_ns = cw.first_arrival_unix_nano
                record.wait_ns += cw.wait_ns
                record.injected_ns += cw.injected_delay_ns
                if len(ranks) >= rank.tp_size:
                    del pending[cw.wave]
                    done.append(self._judge(engine, rank.dp_rank, rank.pp_rank, cw.wave, ranks))
            while len(pending) > self.max_pending:
                pending.popitem(last=False)
                self.metrics.waves_unaligned.labels(
                    engine, str(rank.dp_rank), str(rank.pp_rank)
                ).inc()
        for skew in done:
            self._export(skew)
        return done

    def _count(self, labels: tuple[str, str, str, str], waves) -> None:
        m = self.metrics
        m.straggler_waves.labels(*labels)  # exist at 0 once a rank reports collectives
        m.straggler_seconds.labels(*labels)
        m.counts.add(labels, waves)

    def _judge(
        self, engine: str, dp: int, pp: int, wave: int, ranks: dict[int, _RankWave]
    ) -> WaveSkew:
        waits = {tp: r.wait_ns / 1e9 for tp, r in ranks.items()}
        arrivals = [r.first_arrival_ns for r in ranks.values() if r.first_arrival_ns]
        skew = max(waits.values()) - min(waits.values())
        arrival_skew = (max(arrivals) - min(arrivals)) / 1e9 if len(arrivals) > 1 else 0.0
        straggler = (
            min(waits, key=waits.__getitem__) if skew >= self.straggler_threshold_s else None
        )
        return WaveSkew(
            engine, dp, pp, wave, skew, arrival_skew, straggler, waits,
            {tp: r.injected_ns / 1e9 for tp, r in ranks.items() if r.injected_ns},
        )  # fmt: skip

    def _export(self, skew: WaveSkew) -> None:
        m = self.metrics
        replica = (skew.engine, skew.dp, skew.pp)
        children = self._skew_children.get(replica)
        if children is None:  # one `.labels()` per replica, not two per wave
            labels = (skew.engine, str(skew.dp), str(skew.pp))
            children = self._skew_children[replica] = (
                m.skew.labels(*labels),
                m.arrival_skew.labels(*labels),
            )
        children[0].observe(skew.skew_s)
        children[1].observe(skew.arrival_skew_s)
        if skew.straggler_tp is not None:
            rank = (skew.engine, str(skew.dp), str(skew.straggler_tp), str(skew.pp))
            m.straggler_waves.labels(*rank).inc()
            m.straggler_seconds.labels(*rank).inc(skew.skew_s)
        self.recent.append(skew)
