"""A rank that keeps its stream open: waves, the same waves' collectives, probes and incidents
through the real client, then heartbeats saying it waits inside the next all_reduce, until
`stop()`. The rank gauges (telemetry/crossrank/rank_gauges.py) exist only while a rank's stream is live,
so the two-node dashboard test feeds through these rather than through the helpers of
tests.support.feed, which close their streams once the records are handed over.
"""

from __future__ import annotations

import time

from guard.stream.streamer import HeartbeatState, Streamer
from telemetry.wire.proto import guard_pb2
from tests.support.feed import DASHBOARD_PROBES, FixedHeartbeat, attach_reporter, wave_tuple

CALLS_PER_WAVE = 6  # 5 all_reduce + 1 all_gather on tp


class LiveRank:
    """One rank of `engine` (run `run_id`, dp `dp`) on `node`, streaming to `address`."""

    def __init__(
        self,
        address: str,
        *,
        run_id: str,
        engine: str,
        tp: int,
        tp_size: int,
        node: str,
        pid: int,
        waves: int,
        dp: int = 0,
        probes: bool = False,
        nan_incidents: int = 0,
    ) -> None:
        self.waves = waves
        self.nan_incidents = nan_incidents
        self.entered_ns = time.perf_counter_ns()
        info = guard_pb2.RankInfo(
            run_id=run_id, engine=engine, dp_rank=dp, tp_rank=tp, pp_rank=0, dp_size=1,
            tp_size=tp_size, pp_size=1, node=node, pid=pid, runner="tests.LiveRank",
        )  # fmt: skip
        self._pending = list(range(1, waves + 1))
        self.streamer = Streamer(
            address, info, buffer_size=4096, batch_max=256, flush_interval_s=0.02,
            heartbeat_interval_s=0.2, max_backoff_s=0.2,
            fillers=[FixedHeartbeat(HeartbeatState(waves, "execute_model", 0), self._fill)],
        )  # fmt: skip
        for n in range(1, waves + 1):
            self.streamer.offer(wave_tuple(n))
        if probes:
            for name, value, labels in DASHBOARD_PROBES:  # every probe a panel shows
                self.streamer.offer_probe(name, float(value), labels)
        self.reporter = attach_reporter(self.streamer, run_id, wave=2)
        for n in range(nan_incidents):
            self.reporter.report("logits_finite", "error", "nan row", request_id=f"{node}-{n}")

    def _fill(self, batch: guard_pb2.Batch, with_heartbeat: bool) -> None:
        while self._pending:
            n = self._pending.pop(0)
            seq = CALLS_PER_WAVE * n
            cw = batch.collective_waves.add(
                wave=n, first_arrival_unix_nano=time.time_ns(), wait_ns=300_000
            )
            cw.stats.add(op="all_reduce", group="tp", backend="hccl", dtype="bfloat16", calls=5,
                         bytes=2560, host_ns=250_000, max_host_ns=60_000, first_seq=seq - 5,
                         last_seq=seq - 1)  # fmt: skip
            cw.stats.add(op="all_gather", group="tp", backend="hccl", dtype="bfloat16", calls=1,
                         bytes=1024, host_ns=50_000, max_host_ns=50_000, first_seq=seq,
                         last_seq=seq)  # fmt: skip
        if with_heartbeat:  # the next wave's first all_reduce, entered after the last wave
            hb = batch.heartbeat
            hb.collective_op, hb.collective_group = "all_reduce", "tp"
            hb.collective_seq = CALLS_PER_WAVE * self.waves + 1
            hb.collective_backend = "hccl"
            hb.collective_age_ns = time.perf_counter_ns() - self.entered_ns

    def start(self) -> LiveRank:
        self.streamer.start()
        return self

    def handed_over(self) -> bool:
        s = self.streamer
        return (
            s.sent_waves >= self.waves and s.incidents_sent >= self.nan_incidents and not s._probes
        )

    def stop(self) -> None:
        self.streamer.stop()
