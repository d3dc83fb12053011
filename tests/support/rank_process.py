"""A stand-in worker rank as its own process: the real streamer client, heartbeats saying
what a real rank would say. Lets tests freeze one rank with SIGSTOP without starting vLLM.

    python -m tests.support.rank_process ADDRESS --engine E --tp 1 --tp-size 2 [--in-collective]
"""

from __future__ import annotations

import argparse
import signal
import threading
import time

from guard.streamer import HeartbeatState, Streamer
from telemetry.proto import guard_pb2
from tests.support.feed import FixedHeartbeat

WAVE = 5
SEQ = 31


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("address")
    parser.add_argument("--engine", default="test")
    parser.add_argument("--run-id", default="run-ranks")
    parser.add_argument("--tp", type=int, default=0)
    parser.add_argument("--tp-size", type=int, default=2)
    parser.add_argument("--in-collective", action="store_true",
                        help="heartbeats say: inside all_reduce on tp, seq 31, since start")  # fmt: skip
    args = parser.parse_args()
    started = time.perf_counter_ns()
    rank = guard_pb2.RankInfo(
        run_id=args.run_id, engine=args.engine, tp_rank=args.tp, tp_size=args.tp_size, dp_size=1,
        pp_size=1, node="test-node", pid=__import__("os").getpid(), runner="tests.RankProcess",
    )  # fmt: skip

    def fill(batch: guard_pb2.Batch, with_heartbeat: bool) -> None:
        if with_heartbeat and args.in_collective:
            hb = batch.heartbeat
            hb.collective_op, hb.collective_group, hb.collective_seq = "all_reduce", "tp", SEQ
            hb.collective_backend = "shm"
            hb.collective_age_ns = time.perf_counter_ns() - started

    streamer = Streamer(
        args.address, rank, buffer_size=64, batch_max=16, flush_interval_s=0.02,
        heartbeat_interval_s=0.2, max_backoff_s=0.2,
        fillers=[FixedHeartbeat(HeartbeatState(WAVE, "execute_model", 0), fill)],
    )  # fmt: skip
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    streamer.start()
    print("started", flush=True)
    done.wait()
    streamer.stop()


if __name__ == "__main__":
    main()
