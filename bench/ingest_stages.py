"""Where a record's sidecar CPU goes: the ingest path's stages timed in process, per record.

    python bench/ingest_stages.py [--ranks 4] [--records 25600]

Batches are built as the flood clients of bench/sidecar_ingest.py build them (the worker's
streamer and collective tracker, 256 waves of a TP rank with 2 collective stats each), then
serialized. Each stage runs over every batch of every rank in turn, with `time.process_time`
around it: parse, validate, hang state, cross-rank alignment, wave metrics, collective
counters, store. No gRPC: that part is the gap between this total and the bench's figure.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prometheus_client import CollectorRegistry  # noqa: E402

from telemetry.crossrank.view import CrossRankView  # noqa: E402
from telemetry.ingest.validation import validate_batch  # noqa: E402
from telemetry.metrics.waves import SidecarMetrics  # noqa: E402
from telemetry.pipeline.writer import Item, RankSource  # noqa: E402
from telemetry.store import Store  # noqa: E402
from telemetry.wire.proto import guard_pb2  # noqa: E402
from tests.support import flood  # noqa: E402


def build(ranks: int, records: int) -> list[list[bytes]]:
    out = []
    for tp in range(ranks):
        args = argparse.Namespace(
            run_id="run-stages", engine="stages", tp=tp, tp_size=ranks, address="unix:/nonexistent"
        )
        streamer = flood.make_streamer(args.address, args)
        out.append(list(flood.batches(streamer, records, 0.0, seed=tp)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--records", type=int, default=25_600)
    args = parser.parse_args(argv)
    wire = build(args.ranks, args.records)
    metrics = SidecarMetrics()
    cross = CrossRankView(CollectorRegistry())
    work = tempfile.mkdtemp(prefix="ingest-stages-")
    store = Store(os.path.join(work, "store.db"))
    stages = dict.fromkeys(
        ("parse", "validate", "hang state", "alignment", "wave metrics", "collective counters",
         "store"), 0.0,
    )  # fmt: skip
    clock = time.process_time
    total = 0
    rank_of: dict[int, guard_pb2.RankInfo] = {}
    for i in range(max(len(b) for b in wire)):
        for tp, per_rank in enumerate(wire):
            if i >= len(per_rank):
                continue
            data = per_rank[i]
            t0 = clock()
            batch = guard_pb2.Batch.FromString(data)
            t1 = clock()
            records = validate_batch(batch, rank_known=tp in rank_of)
            t2 = clock()
            if tp not in rank_of:
                rank_of[tp] = guard_pb2.RankInfo()
                rank_of[tp].CopyFrom(batch.rank)
            else:
                batch.rank.CopyFrom(rank_of[tp])
            rank = batch.rank
            labels = ("stages", str(rank.dp_rank), str(rank.tp_rank), str(rank.pp_rank))
            source = RankSource(rank, "stages", labels, ("run-stages", "stages", 0, tp, 0, 1))
            cross.hangs.observe("stages", batch)
            t3 = clock()
            cross.sync.align("stages", batch)
            t4 = clock()
            metrics.observe_batch(labels, batch, source.process)
            t5 = clock()
            cross.count("stages", batch)
            t6 = clock()
            store.write([Item(source, batch, len(data), records)])
            t7 = clock()
            total += records
            for name, (a, b) in zip(
                stages,
                ((t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5), (t5, t6), (t6, t7)),
                strict=True,
            ):
                stages[name] += b - a
    store.close()
    per = {name: seconds / total * 1e6 for name, seconds in stages.items()}
    for name, us in per.items():
        print(f"{name:20s} {us:6.2f} us/record")
    whole = sum(per.values())
    print(f"{'total':20s} {whole:6.2f} us/record ({1e6 / whole:,.0f} records per CPU-second)")
    print(f"records {total}; store {Path(work, 'store.db').stat().st_size / total:.1f} B/record")
    fill_us, wire_bytes = worker_fill_cost()
    print(
        f"worker: finished waves -> collective columns -> serialized batch: {fill_us:.2f} us "
        f"and {wire_bytes:.1f} B per wave (256 waves, 2 stats each; median of 15)"
    )
    return 0


def worker_fill_cost() -> tuple[float, float]:
    """The worker's streamer-thread cost of handing 256 finished waves to a batch (the
    collective tracker's `add_waves`) and serializing it, per wave."""
    from guard.collectives.columns import add_waves
    from guard.collectives.records import FinishedWave

    items = []
    for wave in range(1, 257):
        stats = {
            ("all_reduce", "tp"): [2, 16384, 50_000, 25_000, 3 * wave - 2, 3 * wave - 1, "hccl",
                                   "bfloat16", 0],
            ("all_gather", "tp"): [1, 128_000, 10_000, 10_000, 3 * wave, 3 * wave, "hccl",
                                   "bfloat16", 0],
        }  # fmt: skip
        items.append(FinishedWave(wave, 10**18 + wave, 60_000, stats, [], 0, 0))
    samples = []
    data = b""
    for _ in range(15):
        began = time.process_time()
        for _ in range(20):
            batch = guard_pb2.Batch()
            add_waves(batch.collective_columns, items)
            data = batch.SerializeToString()
        samples.append((time.process_time() - began) / 20 / len(items) * 1e6)
    samples.sort()
    return samples[len(samples) // 2], len(data) / len(items)


if __name__ == "__main__":
    raise SystemExit(main())
