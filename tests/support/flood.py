"""A client process that streams wave records of one TP rank at full speed (or a set rate).

Batches are made by the real worker streamer (`Streamer._make_batch`, wire v2 columns, the rank
in the first batch only), with what `guard/collectives/tracker.py` adds for a TP rank of a small model:
per wave 2 collective stats (all_reduce and all_gather on group tp), as wire v3 collective
columns built by the tracker's own `add_waves`. They go
over one real gRPC client stream, as the worker's streamer sends them.

    python -m tests.support.flood ADDRESS --tp 0 --tp-size 4 --records 100000 [--rate 12500]

Prints `ready` once connected, waits for a line on stdin (so that every client starts at
once), streams, and prints one JSON line: records and batches sent, and the sidecar's Ack.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import grpc

from guard.collectives.columns import add_waves
from guard.collectives.records import FinishedWave
from guard.stream.streamer import HeartbeatState, Streamer, WaveTuple
from telemetry.wire.proto import guard_pb2
from tests.support.feed import FixedHeartbeat

METHOD = "/ascend_guard.v1.GuardIngest/Stream"
BATCH = 256


def _filler(tp: int):
    """What the worker's collective tracker adds for a TP rank: per wave an all_reduce (2
    calls) and an all_gather on group tp, handed over as `FinishedWave`s and written into the
    batch's collective columns by the tracker's own `add_waves` (wire v3)."""

    def fill(batch: guard_pb2.Batch, with_heartbeat: bool) -> None:
        cols = batch.wave_columns
        items = []
        for wave, start, execute in zip(
            cols.wave, cols.start_unix_nano, cols.execute_ns, strict=True
        ):
            wait = 40_000 + (wave * 7919 + tp) % 60_000
            stats = {
                ("all_reduce", "tp"): [
                    2, 2 * 8192, wait - 10_000, wait // 2, 3 * wave - 2, 3 * wave - 1,
                    "hccl", "bfloat16", 0, 0,
                ],
                ("all_gather", "tp"): [
                    1, 4 * 32000, 10_000, 10_000, 3 * wave, 3 * wave, "hccl", "bfloat16", 0, 0,
                ],
            }  # fmt: skip
            items.append(FinishedWave(wave, start + execute // 3, wait, stats, [], 0, 0))
        add_waves(batch.collective_columns, items)

    return fill


def make_streamer(address: str, args: argparse.Namespace) -> Streamer:
    rank = guard_pb2.RankInfo(
        run_id=args.run_id,
        engine=args.engine,
        tp_rank=args.tp,
        tp_size=args.tp_size,
        dp_size=1,
        pp_size=1,
        node="flood-node",
        pid=os.getpid(),
        runner="tests.Flood",
    )
    return Streamer(
        address,
        rank,
        buffer_size=BATCH,
        batch_max=BATCH,
        flush_interval_s=0.01,
        heartbeat_interval_s=1.0,
        max_backoff_s=0.2,
        fillers=[
            FixedHeartbeat(
                HeartbeatState(0, "execute_model", 0),
                None if getattr(args, "waves_only", False) else _filler(args.tp),
            )
        ],
    )


def synthetic_wave(rng: random.Random, wave: int, start_ns: int) -> WaveTuple:
    """A decode wave of 1-63 requests, 5 ms after the one before, with random host times."""
    execute = rng.randrange(2_000_000, 9_000_000)
    sample = rng.randrange(200_000, 900_000)
    reqs = rng.randrange(1, 64)
    # the fields in WaveTuple's order: times, then requests and tokens (prefill 0), sampled
    return WaveTuple(
        wave,
        start_ns + wave * 5_000_000,
        execute,
        sample,
        execute + 20_000,
        reqs,
        0,
        reqs,
        0,
        reqs,
        reqs,
        False,
        True,
    )


def batches(streamer: Streamer, records: int, rate: float, seed: int):
    """Serialized batches of `records` waves in all, paced to `rate` records/s (0: no pacing)."""
    rng = random.Random(seed)
    start_ns = time.time_ns()
    began = time.monotonic()
    sent = 0
    wave = 0
    last_beat = 0.0
    while sent < records:
        n = min(BATCH, records - sent)
        tuples = []
        for _ in range(n):
            wave += 1
            tuples.append(synthetic_wave(rng, wave, start_ns))
        now = time.monotonic()
        beat = now - last_beat >= 1.0
        if beat:
            last_beat = now
        yield streamer._make_batch(tuples, beat).SerializeToString()
        sent += n
        if rate:
            ahead = sent / rate - (time.monotonic() - began)
            if ahead > 0:
                time.sleep(ahead)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("address")
    parser.add_argument("--engine", default="flood")
    parser.add_argument("--run-id", default="run-flood")
    parser.add_argument("--tp", type=int, default=0)
    parser.add_argument("--tp-size", type=int, default=4)
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--rate", type=float, default=0.0, help="records/s (0: full speed)")
    parser.add_argument(
        "--waves-only", action="store_true", help="no collective stats in the batches"
    )
    args = parser.parse_args()
    streamer = make_streamer(args.address, args)
    channel = grpc.insecure_channel(args.address)
    grpc.channel_ready_future(channel).result(timeout=30)
    call = channel.stream_unary(
        METHOD, request_serializer=lambda b: b, response_deserializer=guard_pb2.Ack.FromString
    )
    print("ready", flush=True)
    sys.stdin.readline()
    counted = {"batches": 0}

    def counting():
        for data in batches(streamer, args.records, args.rate, seed=args.tp):
            counted["batches"] += 1
            yield data

    began = time.monotonic()
    error = ""
    try:
        ack = call(counting(), timeout=600)
        acked = (ack.batches, ack.waves)
    except grpc.RpcError as exc:
        acked = (0, 0)
        error = f"{exc.code()}: {exc.details()}"
    # every batch but a short last one holds BATCH records
    sent = min(args.records, counted["batches"] * BATCH)
    print(
        json.dumps(
            {
                "records": sent,
                "batches": counted["batches"],
                "acked": acked,
                "seconds": time.monotonic() - began,
                "error": error,
            }
        ),
        flush=True,
    )
    channel.close()


if __name__ == "__main__":
    main()
