"""What `ascend-guard timeline` costs: build time, file bytes and memory per rank-wave.

Builds a store through the real writer sink (`telemetry.store.writer.Store`): WAVES waves x RANKS
ranks of one TP group, in batches of 256 waves per rank, each wave with the collective record
`guard/collectives/tracker.py` sends for a small model (2 stats: all_reduce and all_gather on tp), and
one rank 2 ms late in every 50th wave (so there are wait arrows). Then times `build_timeline`
plus `write_timeline` over all of it, as the CLI runs them, in this process.

    python bench/timeline.py [--waves 12500] [--ranks 8]

Last line: `timeline: N rank-waves in X s (Y µs per rank-wave); B bytes per rank-wave; peak
RSS +M MiB; A arrows`.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from telemetry.ingest.validation import validate_batch  # noqa: E402
from telemetry.pipeline.writer import Item, RankSource  # noqa: E402
from telemetry.spans.timeline import build_timeline, write_timeline  # noqa: E402
from telemetry.spans.timeline_select import TimelineQuery  # noqa: E402
from telemetry.store import Store, connect  # noqa: E402
from telemetry.wire.proto import guard_pb2  # noqa: E402
from telemetry.wire.wave_columns import to_columns  # noqa: E402

MS = 1_000_000
BATCH = 256


def _batch(rank: guard_pb2.RankInfo, first: int, count: int, t0: int) -> Item:
    tp = rank.tp_rank
    batch = guard_pb2.Batch(rank=rank)
    for wave in range(first, first + count):
        t = t0 + wave * 10 * MS
        late = wave % 50 == 0 and tp == 1
        batch.waves.add(
            wave=wave, start_unix_nano=t, execute_ns=8 * MS, sample_ns=MS // 2,
            sample_offset_ns=8 * MS + 100_000, num_reqs=32, decode_reqs=32, decode_tokens=32,
            sampled_tokens=32, sampled=True,
        )  # fmt: skip
        wait = 300_000 + (2 * MS if wave % 50 == 0 and not late else 0)
        cw = batch.collective_waves.add(
            wave=wave, first_arrival_unix_nano=t + MS + (2 * MS if late else 0), wait_ns=wait
        )
        cw.stats.add(op="all_reduce", group="tp", backend="hccl", dtype="bfloat16", calls=33,
                     bytes=33 * 8192, host_ns=wait - 50_000, max_host_ns=wait // 3,
                     first_seq=34 * wave - 33, last_seq=34 * wave - 1)  # fmt: skip
        cw.stats.add(op="all_gather", group="tp", backend="hccl", dtype="bfloat16", calls=1,
                     bytes=128_000, host_ns=50_000, max_host_ns=50_000, first_seq=34 * wave,
                     last_seq=34 * wave)  # fmt: skip
    to_columns(batch)
    records = validate_batch(batch)
    labels = ("bench", "0", str(tp), "0")
    source = RankSource(rank, "bench", labels, (rank.run_id, "bench", 0, tp, 0, rank.pid))
    return Item(source, batch, batch.ByteSize(), records)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waves", type=int, default=12_500)
    parser.add_argument("--ranks", type=int, default=8)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "store.db"
        sink = Store(path)
        t0 = time.time_ns() - (args.waves + 10) * 10 * MS
        for first in range(1, args.waves + 1, BATCH):
            count = min(BATCH, args.waves + 1 - first)
            items = []
            for tp in range(args.ranks):
                rank = guard_pb2.RankInfo(
                    run_id="bench-run", engine="bench", dp_rank=0, tp_rank=tp, pp_rank=0,
                    dp_size=1, tp_size=args.ranks, pp_size=1, node="n1", pid=100 + tp,
                )  # fmt: skip
                items.append(_batch(rank, first, count, t0))
            sink.write(items)
        sink.close()
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out = Path(tmp) / "timeline.json"
        start = time.perf_counter()
        conn = connect(path, readonly=True)
        query = TimelineQuery(first_wave=1, last_wave=args.waves, max_rank_waves=10**9)
        timeline = build_timeline(conn, query)
        write_timeline(timeline, out)
        seconds = time.perf_counter() - start
        rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        size = os.path.getsize(out)
    n = timeline.rank_waves
    print(f"{n} rank-waves, {timeline.events} events, {size} bytes, {timeline.flows} arrows")
    print(
        f"timeline: {n} rank-waves in {seconds:.2f} s ({seconds / n * 1e6:.0f} µs per rank-wave); "
        f"{size / n:.0f} bytes per rank-wave; peak RSS +{(rss_after - rss_before) / 1024:.0f} MiB; "
        f"{timeline.flows} arrows"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
