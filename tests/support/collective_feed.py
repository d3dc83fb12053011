"""Streams synthetic collective records through the real client (no wave records: those come
from `tests.support.feed`).

Each rank reports `waves` waves of 5 all-reduces and 1 all-gather on group tp; in wave
`straggler_wave`, rank `straggler_tp` arrives `delay_s` late, so its peers wait that long;
that wave also carries one slow call.
"""

from __future__ import annotations

import time

from guard.stream.streamer import HeartbeatState, Streamer
from telemetry.wire.proto import guard_pb2
from tests.support.feed import FixedHeartbeat


def _filler(tp: int, waves: int, straggler_wave: int, straggler_tp: int, delay_s: float):
    pending = list(range(1, waves + 1))

    def fill(batch: guard_pb2.Batch, with_heartbeat: bool) -> None:
        while pending:
            n = pending.pop(0)
            late = n == straggler_wave
            wait_ns = 200_000 + (int(delay_s * 1e9) if late and tp != straggler_tp else 0)
            cw = batch.collective_waves.add(
                wave=n, first_arrival_unix_nano=time.time_ns(), wait_ns=wait_ns,
                injected_delay_ns=int(delay_s * 1e9) if late and tp == straggler_tp else 0,
            )  # fmt: skip
            cw.stats.add(op="all_reduce", group="tp", backend="shm", dtype="float32", calls=5,
                         bytes=2560, host_ns=wait_ns - 50_000, max_host_ns=wait_ns - 60_000,
                         first_seq=6 * n - 5, last_seq=6 * n - 1)  # fmt: skip
            cw.stats.add(op="all_gather", group="tp", backend="shm", dtype="float32", calls=1,
                         bytes=1024, host_ns=50_000, max_host_ns=50_000, first_seq=6 * n,
                         last_seq=6 * n)  # fmt: skip
            if late and tp != straggler_tp:
                cw.slow_calls.add(op="all_reduce", group="tp", backend="shm", dtype="float32",
                                  seq=6 * n - 5, bytes=512, start_unix_nano=time.time_ns(),
                                  host_ns=int(delay_s * 1e9))  # fmt: skip
        if with_heartbeat:
            batch.heartbeat.collective_op = "all_reduce"
            batch.heartbeat.collective_group = "tp"
            batch.heartbeat.collective_seq = 6 * waves + 1
            batch.heartbeat.collective_age_ns = 1000

    return fill


def send_collective_waves(
    address: str,
    *,
    engine: str = "test",
    ranks=((0, 0, 0), (0, 1, 0)),
    waves: int = 20,
    straggler_wave: int = 10,
    straggler_tp: int = 1,
    delay_s: float = 0.3,
    run_id: str = "run-coll",
    timeout: float = 10.0,
) -> None:
    """Send the waves from every rank; return once all were handed to the sidecar."""
    streamers = []
    for index, (dp, tp, pp) in enumerate(ranks):
        info = guard_pb2.RankInfo(
            run_id=run_id, engine=engine, dp_rank=dp, tp_rank=tp, pp_rank=pp, dp_size=1,
            tp_size=len(ranks), pp_size=1, node="test-node", pid=5000 + index, runner="tests.Fake",
        )  # fmt: skip
        streamer = Streamer(
            address, info, buffer_size=1024, batch_max=256, flush_interval_s=0.02,
            heartbeat_interval_s=0.2, max_backoff_s=0.2,
            fillers=[FixedHeartbeat(HeartbeatState(waves, "execute_model", 0),
                                    _filler(tp, waves, straggler_wave, straggler_tp, delay_s))],
        )  # fmt: skip
        streamer.start()
        streamers.append(streamer)
    deadline = time.monotonic() + timeout
    while any(s._seq < 2 for s in streamers):  # the first batch carried all collective records
        if time.monotonic() > deadline:
            raise TimeoutError("the collective records were not sent")
        time.sleep(0.02)
    time.sleep(0.3)
    for streamer in streamers:
        streamer.stop()
