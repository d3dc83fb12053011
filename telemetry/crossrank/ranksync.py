"""Cross-rank view of collectives: per-rank counters, and waves aligned across the ranks of
one PP stage of one replica (`telemetry.wire.replica`: same run, engine and dp; and the same pp) to
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

The work is per batch over columns (numpy): a stage's rows not judged yet are kept sorted by
(wave, tp rank), a batch's rows merged in, and the waves every rank has reported judged at
once as a [waves, ranks] matrix.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import NamedTuple

import numpy as np

from telemetry.metrics.collectives import CollectiveMetrics
from telemetry.wire.collective_columns import columns_of
from telemetry.wire.proto import guard_pb2
from telemetry.wire.replica import Replica, replica_of

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


_EMPTY = np.zeros(0, dtype=np.int64)
_NO_TIME = np.iinfo(np.int64).max


class _Pending:
    """The rows of one PP stage not judged yet, as columns sorted by (wave, tp)."""

    __slots__ = ("arrival", "injected", "tp", "wait", "wave")

    def __init__(self) -> None:
        self.wave = self.tp = self.arrival = self.wait = self.injected = _EMPTY


class _Judged(NamedTuple):
    """Waves one batch completed, as arrays (one row per wave, one column per TP rank)."""

    engine: str
    dp: int
    pp: int
    wave: np.ndarray
    skew_s: np.ndarray
    arrival_skew_s: np.ndarray
    straggler: np.ndarray  # tp rank, -1: none
    tp: np.ndarray  # [waves, ranks]
    wait_ns: np.ndarray  # [waves, ranks]
    injected_ns: np.ndarray  # [waves, ranks]

    def skews(self, begin: int = 0) -> list[WaveSkew]:
        out = []
        for i in range(begin, len(self.wave)):
            tps = self.tp[i].tolist()
            straggler = int(self.straggler[i])
            out.append(
                WaveSkew(
                    self.engine,
                    self.dp,
                    self.pp,
                    int(self.wave[i]),
                    float(self.skew_s[i]),
                    float(self.arrival_skew_s[i]),
                    straggler if straggler >= 0 else None,
                    {tp: w / 1e9 for tp, w in zip(tps, self.wait_ns[i].tolist(), strict=True)},
                    {
                        tp: d / 1e9
                        for tp, d in zip(tps, self.injected_ns[i].tolist(), strict=True)
                        if d
                    },
                )
            )
        return out


# wave skew from which the slowest rank of a replica stage is counted as a straggler
DEFAULT_STRAGGLER_S = 0.05


class RankSync:
    def __init__(
        self,
        metrics: CollectiveMetrics,
        *,
        straggler_threshold_s: float = DEFAULT_STRAGGLER_S,
        max_pending: int = 256,
        keep_recent: int = 1024,
    ) -> None:
        self.metrics = metrics
        self.straggler_threshold_s = straggler_threshold_s
        self.max_pending = max_pending
        self._lock = threading.Lock()
        self.keep_recent = keep_recent
        # stage -> rows (wave, tp rank) not judged yet
        self._pending: dict[StageKey, _Pending] = {}
        # (judged waves, first row still kept) of the latest batches, `keep_recent` rows in all
        self._recent: collections.deque[tuple[_Judged, int]] = collections.deque()
        self._recent_rows = 0

    def observe(self, engine: str, batch: guard_pb2.Batch) -> list[WaveSkew]:
        """Count one batch's collective records; return the waves it completed."""
        self.count(engine, batch)
        judged = self._align(engine, batch)
        return judged.skews() if judged is not None else []

    def count(self, engine: str, batch: guard_pb2.Batch) -> None:
        """The per-rank collective counters (the sidecar's writer thread)."""
        cols = columns_of(batch)
        if len(cols.wave):
            rank = batch.rank
            labels = (engine, str(rank.dp_rank), str(rank.tp_rank), str(rank.pp_rank))
            self._count(labels, cols)

    def align(self, engine: str, batch: guard_pb2.Batch) -> int:
        """Align one batch's waves with the other ranks'; return how many waves it completed
        (the ingest handler: skew and stragglers must not wait behind storage)."""
        judged = self._align(engine, batch)
        return 0 if judged is None else len(judged.wave)

    @property
    def recent(self) -> list[WaveSkew]:
        """The latest aligned waves (at most `keep_recent`), oldest first."""
        with self._lock:
            chunks = list(self._recent)
        out: list[WaveSkew] = []
        for chunk, begin in chunks:
            out += chunk.skews(begin)
        return out[-self.keep_recent :]

    def _align(self, engine: str, batch: guard_pb2.Batch) -> _Judged | None:
        cols = columns_of(batch)
        n = len(cols.wave)
        rank = batch.rank
        if not n or rank.tp_size <= 1:
            return None
        ranks = rank.tp_size
        key = (replica_of(engine, rank), rank.pp_rank)
        wave = np.array(cols.wave, dtype=np.int64)  # validated: at most 2^63 - 1
        arrival = np.array(cols.first_arrival_unix_nano, dtype=np.int64)
        wait = np.array(cols.wait_ns, dtype=np.int64)
        injected = np.array(cols.injected_delay_ns, dtype=np.int64)
        stage = (engine, str(rank.dp_rank), str(rank.pp_rank))
        with self._lock:
            pending = self._pending.get(key)
            if pending is None:
                pending = self._pending[key] = _Pending()
                self.metrics.waves_unaligned.labels(*stage)
            w = np.concatenate((pending.wave, wave))
            t = np.concatenate((pending.tp, np.full(n, rank.tp_rank, dtype=np.int64)))
            a = np.concatenate((pending.arrival, arrival))
            d = np.concatenate((pending.wait, wait))
            x = np.concatenate((pending.injected, injected))
            order = np.lexsort((t, w))
            w, t, a, d, x = w[order], t[order], a[order], d[order], x[order]
            same = (w[1:] == w[:-1]) & (t[1:] == t[:-1])
            if same.any():  # a rank handed in one wave in two parts (collectives after sampling)
                starts = np.flatnonzero(np.concatenate(([True], ~same)))
                w, t = w[starts], t[starts]
                a = np.minimum.reduceat(np.where(a > 0, a, _NO_TIME), starts)
                a[a == _NO_TIME] = 0
                d = np.add.reduceat(d, starts)
                x = np.add.reduceat(x, starts)
            starts = np.flatnonzero(np.concatenate(([True], w[1:] != w[:-1])))
            sizes = np.diff(np.append(starts, len(w)))
            complete = sizes >= ranks  # every rank of the stage reported the wave
            done_rows = np.repeat(complete, sizes)
            keep = ~done_rows
            unaligned = int(np.count_nonzero(~complete)) - self.max_pending
            if unaligned > 0:  # the oldest incomplete waves are given up, counted
                cutoff = w[starts[~complete][unaligned - 1]]
                keep &= w > cutoff
            pending.wave, pending.tp, pending.arrival, pending.wait, pending.injected = (
                w[keep],
                t[keep],
                a[keep],
                d[keep],
                x[keep],
            )
            judged = None
            if complete.any():
                # a table: one row per line, columns aligned (fmt: skip)
                judged = self._judge(
                    engine, rank.dp_rank, rank.pp_rank, ranks,
                    w[done_rows], t[done_rows], a[done_rows], d[done_rows], x[done_rows],
                )  # fmt: skip
                self._remember(judged)
        if unaligned > 0:
            self.metrics.waves_unaligned.labels(*stage).inc(unaligned)
        if judged is not None:
            self._export(judged)
        return judged

    def _remember(self, judged: _Judged) -> None:
        """Keep the latest `keep_recent` judged waves for /skew (as arrays; made into
        `WaveSkew`s only when read). Call with the lock held."""
        recent = self._recent
        recent.append((judged, 0))
        self._recent_rows += len(judged.wave)
        while self._recent_rows > self.keep_recent:
            chunk, begin = recent[0]
            excess = self._recent_rows - self.keep_recent
            left = len(chunk.wave) - begin
            if left <= excess:
                recent.popleft()
                self._recent_rows -= left
            else:
                recent[0] = (chunk, begin + excess)
                self._recent_rows -= excess

    def _count(self, labels: tuple[str, str, str, str], waves) -> None:
        m = self.metrics
        m.straggler_waves.labels(*labels)  # exist at 0 once a rank reports collectives
        m.straggler_seconds.labels(*labels)
        m.counts.add(labels, waves)

    def _judge(self, engine, dp, pp, ranks, w, t, a, d, x) -> _Judged:
        shape = (-1, ranks)  # complete waves: `ranks` rows each, sorted by tp
        t, a, d, x = t.reshape(shape), a.reshape(shape), d.reshape(shape), x.reshape(shape)
        waits = d / 1e9
        skew = waits.max(axis=1) - waits.min(axis=1)
        arrived = a > 0
        latest = np.where(arrived, a, np.iinfo(np.int64).min).max(axis=1)
        earliest = np.where(arrived, a, _NO_TIME).min(axis=1)
        arrival_skew = np.where(arrived.sum(axis=1) > 1, (latest - earliest) / 1e9, 0.0)
        # the rank with the least time inside is the one the others waited for
        least = t[np.arange(len(t)), d.argmin(axis=1)]
        straggler = np.where(skew >= self.straggler_threshold_s, least, -1)
        return _Judged(engine, dp, pp, w[::ranks], skew, arrival_skew, straggler, t, d, x)

    def _export(self, judged: _Judged) -> None:
        m = self.metrics
        m.skew.add(
            (judged.engine, str(judged.dp), str(judged.pp)), judged.skew_s, judged.arrival_skew_s
        )
        for i in np.flatnonzero(judged.straggler >= 0):  # rare: one Python step each
            rank = (judged.engine, str(judged.dp), str(int(judged.straggler[i])), str(judged.pp))
            m.straggler_waves.labels(*rank).inc()
            m.straggler_seconds.labels(*rank).inc(float(judged.skew_s[i]))
