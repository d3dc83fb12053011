"""Latency of the sidecar's Tempo-compatible query API over real HTTP, on a store of many waves.

Writes a store with the sidecar's own writer (telemetry/store/writer.py): TP ranks of one replica,
WAVES waves each at 200 steps/s, one wave slow on one rank (the needle), then serves it with
`TempoApiServer` (in this process, real HTTP on loopback) and times the requests Grafana sends:
trace by id (protobuf), newest-20 search, the needle by `minDuration`, a `maxDuration` search,
tags and tag values. Prints the median and p90 of each, and one summary line.

    .venv/bin/python bench/query_api.py [--waves 100000] [--tp 4] [--runs 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prometheus_client import CollectorRegistry  # noqa: E402

from telemetry.pipeline.writer import Item, RankSource  # noqa: E402
from telemetry.store import Store  # noqa: E402
from telemetry.tempo_api import TempoApiServer  # noqa: E402
from telemetry.wire import schema  # noqa: E402
from telemetry.wire.proto import guard_pb2  # noqa: E402
from telemetry.wire.trace_ids import format_trace_id, wave_trace_id  # noqa: E402

RUN, ENGINE = "bench-run", "bench"
STEP_NS = 5_000_000  # 200 steps/s


def build(path: str, waves: int, tp_size: int, needle: int) -> int:
    store = Store(path, prune_every_s=1e9)
    start = time.time_ns() - waves * STEP_NS - 10**9
    for tp in range(tp_size):
        rank = guard_pb2.RankInfo(run_id=RUN, engine=ENGINE, dp_rank=0, tp_rank=tp, pp_rank=0,
                                  dp_size=1, tp_size=tp_size, pp_size=1, node="bench-node",
                                  pid=100 + tp, runner="bench")  # fmt: skip
        source = RankSource(rank, ENGINE, (ENGINE, "0", str(tp), "0"), (RUN, ENGINE, 0, tp, 0, 1))
        for first in range(1, waves + 1, 256):
            batch = guard_pb2.Batch()
            cols = batch.wave_columns
            for n in range(first, min(first + 256, waves + 1)):
                slow = n == needle and tp == tp_size - 1
                values = {name: 0 for name in schema.WAVE_FIELDS}
                values.update(wave=n, start_unix_nano=start + n * STEP_NS, num_reqs=8,
                              decode_tokens=8, sampled_tokens=8, sampled=1, sample_ns=300_000,
                              execute_ns=90_000_000 if slow else 3_000_000,
                              sample_offset_ns=(90_000_000 if slow else 3_000_000) + 1000)  # fmt: skip
                for name in schema.WAVE_FIELDS:
                    getattr(cols, name).append(values[name])
            store.write([Item(source, batch, batch.ByteSize(), len(cols.wave))])
    store.close()
    return start


def timed(url: str, headers: dict, runs: int) -> tuple[float, float, int]:
    samples, size = [], 0
    for _ in range(runs):
        t0 = time.perf_counter()
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60) as r:
            size = len(r.read())
        samples.append((time.perf_counter() - t0) * 1e3)
    samples.sort()
    return statistics.median(samples), samples[int(0.9 * (len(samples) - 1))], size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--waves", type=int, default=100_000)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    needle = args.waves // 3
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/store.db"
        t0 = time.perf_counter()
        build(path, args.waves, args.tp, needle)
        print(f"store: {args.tp} ranks x {args.waves} waves in {time.perf_counter() - t0:.1f}s, "
              f"{Path(path).stat().st_size / 2**20:.1f} MiB")  # fmt: skip
        server = TempoApiServer(path, "127.0.0.1", 0, CollectorRegistry())
        server.start()
        base = f"http://127.0.0.1:{server.port}"
        trace = format_trace_id(wave_trace_id(RUN, needle, 0))
        cases = [
            ("trace by id (v2, protobuf)", f"/api/v2/traces/{trace}", {"Accept": "application/protobuf"}),
            ("trace by id (v2, OTLP/JSON)", f"/api/v2/traces/{trace}", {}),
            ("search newest 20", "/api/search?limit=20&spss=3", {}),
            ("search needle minDuration=50ms", "/api/search?minDuration=50ms&limit=20", {}),
            ("search tags tp=1 maxDuration=100us (no match)", "/api/search?tags=tp%3D1&maxDuration=100us&limit=20", {}),
            ("tags v2", "/api/v2/search/tags?limit=5000", {}),
            ("tag values span.ascend_guard.tp", "/api/v2/search/tag/span.ascend_guard.tp/values", {}),
        ]  # fmt: skip
        results = {}
        for name, path_q, headers in cases:
            runs = max(3, args.runs // 5) if "no match" in name else args.runs
            med, p90, size = timed(base + path_q, headers, runs)
            results[name] = med
            print(f"{name:48s} median {med:8.2f} ms  p90 {p90:8.2f} ms  {size:7d} B  ({runs} runs)")
        server.stop()
    print(f"summary: {args.tp}x{args.waves} rank-waves; trace-by-id {results[cases[0][0]]:.1f} ms, "
          f"newest-20 search {results[cases[2][0]]:.1f} ms, needle search {results[cases[3][0]]:.1f} ms "
          f"(medians)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
