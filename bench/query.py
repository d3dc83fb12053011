"""TraceQL on a big store: search, trace by id and query_range latencies, and bytes per rank-wave.

The store is written through the real writer sink (telemetry/store/writer.py `Store.write`, wire v2
columns validated as ingest validates them): `--waves` waves x `--ranks` TP ranks spread over
`--span` seconds ending now, batches of `--batch` waves per rank, each rank-wave with 2
collective stats (all_reduce, all_gather). Every 997th wave tp3's all_reduce takes 60 ms (its
execute_model 65 ms): the rare slowness on-call searches look for. Then, over the last hour:

- five typical searches (limit 20, spss 3), `--repeat` times each: p50 and p95 of each, and
  the p95 over all of them;
- trace by id of random waves: `telemetry.traceql.trace_spans` (the summary's figure) and the
  CLI's `telemetry.spans.query.load_trace`, which builds the same spans;
- `query_range` of `quantile_over_time(duration, .99) by (.tp)` with a 60 s step;
- store bytes per rank-wave (used pages / rank-waves).

- one request trace (`telemetry.spans.requests.request_traces` by request id, as `ascend-guard
  request ID` does): tp0 sends request membership, `REQ_LIVE` requests at a time, each running
  `REQ_WAVES` waves (one joins every REQ_WAVES / REQ_LIVE waves).

    python bench/query.py [--waves 1000000] [--ranks 8] [--span 5000] [--store PATH]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from telemetry import store as store_mod  # noqa: E402
from telemetry.ingest.validation import validate_batch  # noqa: E402
from telemetry.pipeline.writer import Item, RankSource  # noqa: E402
from telemetry.spans.query import load_trace  # noqa: E402
from telemetry.spans.requests import request_traces  # noqa: E402
from telemetry.store import block_summary  # noqa: E402
from telemetry.traceql import metrics_range, parse, search, trace_spans  # noqa: E402
from telemetry.wire.proto import guard_pb2  # noqa: E402
from telemetry.wire.trace_ids import format_trace_id, wave_trace_id  # noqa: E402

MS = 1_000_000
RUN = "bench-run"
SLOW_EVERY = 997
SLOW_TP = 3
SLOW_CALL_NS = 55 * MS
SEARCHES = {
    "tp3 all_reduce > 50ms": '{ .tp = 3 && name = "collective:all_reduce" && duration > 50ms }',
    "execute_model > 50ms": '{ name = "execute_model" && duration > 50ms }',
    "everything": "{ }",
    "rank tp1 > execute_model": '{ name = "rank" && .tp = 1 } > { name = "execute_model" }',
    "waves with 8 ranks": '{ name = "rank" } | count() > 7',
}
REQ_LIVE, REQ_WAVES = 32, 256  # requests at a time, waves each one runs
# not among the five of the summary (the figures stay comparable with earlier runs)
EXTRA_SEARCHES = {
    "tp3 slow call > 50ms": '{ name = "slow_call:all_reduce" && duration > 50ms && .tp = 3 }',
    "status = error": "{ status = error }",
}
QUERY_RANGE = '{ name = "execute_model" } | quantile_over_time(duration, .99) by (.tp)'


def _rank(tp: int, ranks: int) -> guard_pb2.RankInfo:
    return guard_pb2.RankInfo(run_id=RUN, engine="eng", dp_rank=0, tp_rank=tp, pp_rank=0,
                              dp_size=1, tp_size=ranks, pp_size=1, node="node0", pid=1000 + tp)  # fmt: skip


def _batch(rank: guard_pb2.RankInfo, waves: range, starts: np.ndarray, rng) -> Item:
    tp, n = rank.tp_rank, len(waves)
    slow = np.array([w % SLOW_EVERY == 0 and tp == SLOW_TP for w in waves])
    all_reduce = np.where(slow, 60 * MS, rng.integers(200_000, 2 * MS, n))
    execute = all_reduce + rng.integers(3 * MS, 6 * MS, n)
    sample = rng.integers(200_000, 1 * MS, n)
    batch = guard_pb2.Batch(rank=rank)
    cols = batch.wave_columns
    cols.wave.extend(waves)
    cols.start_unix_nano.extend(starts.tolist())
    cols.execute_ns.extend(execute.tolist())
    cols.sample_ns.extend(sample.tolist())
    cols.sample_offset_ns.extend((execute + 50_000).tolist())
    reqs = rng.integers(1, 64, n).tolist()
    for name in ("num_reqs", "decode_reqs", "decode_tokens", "sampled_tokens"):
        getattr(cols, name).extend(reqs)
    for name in ("prefill_reqs", "prefill_tokens", "recompute_tokens"):
        getattr(cols, name).extend([0] * n)
    cols.dummy.extend([False] * n)
    cols.sampled.extend([True] * n)
    for wave, start, ar in zip(waves, starts.tolist(), all_reduce.tolist(), strict=True):
        cw = batch.collective_waves.add(wave=wave, first_arrival_unix_nano=start + MS, wait_ns=ar)
        cw.stats.add(op="all_reduce", group="tp", backend="hccl", dtype="bfloat16", calls=64,
                     bytes=64 * 8192, host_ns=ar, max_host_ns=ar // 8, first_seq=64 * wave - 63,
                     last_seq=64 * wave)  # fmt: skip
        cw.stats.add(op="all_gather", group="tp", backend="hccl", dtype="bfloat16", calls=1,
                     bytes=4096, host_ns=150_000, max_host_ns=150_000, first_seq=wave,
                     last_seq=wave)  # fmt: skip
        if ar >= SLOW_CALL_NS:  # the slowed all_reduce: one of its calls took 55 ms
            cw.slow_calls.add(op="all_reduce", group="tp", backend="hccl", dtype="bfloat16",
                              seq=64 * wave - 10, bytes=8192, start_unix_nano=start + 2 * MS,
                              host_ns=SLOW_CALL_NS)  # fmt: skip
    if tp == 0:
        _membership(batch.request_columns, waves)
    records = validate_batch(batch)
    labels = ("eng", "0", str(tp), "0")
    return Item(RankSource(rank, "eng", labels, (RUN, "eng", 0, tp, 0, rank.pid)), batch,
                batch.ByteSize(), records)  # fmt: skip


def _membership(cols: guard_pb2.RequestColumns, waves: range) -> None:
    """Request k runs waves [k * step + 1, k * step + REQ_WAVES], one token a wave."""
    step = REQ_WAVES // REQ_LIVE
    previous = None
    for wave in waves:
        live = list(range(max(0, -(-(wave - REQ_WAVES) // step)), (wave - 1) // step + 1))
        for k in live:
            if k * step + 1 == wave or wave == 1:
                cols.name_index.append(k)
                cols.name_request_id.append(f"cmpl-bench-{k}-0")
        cols.wave.append(wave)
        cols.members.append(len(live))
        cols.same_members.append(live == previous)
        if live != previous:
            cols.req_index.extend(live)
        previous = live
        for name in ("scheduled_each", "sampled_each"):
            getattr(cols, name).append(1)
        for name in ("scheduled_count", "sampled_count", "preempted_count"):
            getattr(cols, name).append(0)
        cols.sampled.append(True)
        done = (wave - 1) // step - REQ_LIVE  # finished before this wave
        ended = [done] if done >= 0 and (wave - 1) % step == 0 else []
        cols.finished_count.append(len(ended))
        cols.finished_index.extend(ended)


def build(path: Path, waves: int, ranks: int, span_s: float, batch: int) -> tuple[int, int]:
    """Write the store; return (first wave start, last wave start)."""
    rng = np.random.default_rng(7)
    end = time.time_ns()
    step = int(span_s * 1e9 / waves)
    begin = end - waves * step
    sink = store_mod.Store(path, prune_every_s=10**12, retention_s=10**9, max_bytes=1 << 40)
    infos = [_rank(tp, ranks) for tp in range(ranks)]
    t0 = time.perf_counter()
    for first in range(1, waves + 1, batch):
        numbers = range(first, min(first + batch, waves + 1))
        starts = begin + np.arange(numbers.start, numbers.stop, dtype=np.int64) * step
        sink.write([_batch(info, numbers, starts, rng) for info in infos])
    sink.close()
    print(f"built {waves} waves x {ranks} ranks in {time.perf_counter() - t0:.1f} s", flush=True)
    return begin + step, begin + waves * step


def _timed(fn, repeat: int) -> tuple[list[float], object]:
    times, result = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        result = fn()
        times.append((time.perf_counter() - t) * 1000)
    return times, result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--waves", type=int, default=1_000_000)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument(
        "--span", type=float, default=5000.0, help="seconds the waves cover (200 steps/s)"
    )
    parser.add_argument("--batch", type=int, default=256, help="waves per batch per rank")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--store", type=Path, help="keep the store here (reused if it exists)")
    args = parser.parse_args(argv)
    tmp = tempfile.TemporaryDirectory()
    path = args.store or Path(tmp.name) / "store.db"
    step = int(args.span * 1e9 / args.waves)
    if not path.exists():
        first, last = build(path, args.waves, args.ranks, args.span, args.batch)
    else:
        conn = store_mod.connect(path, readonly=True)
        first, last = conn.execute("SELECT MIN(start_ns), MAX(end_ns) FROM wave_blocks").fetchone()
        conn.close()
    conn = store_mod.connect(path, readonly=True)
    end = last + 10 * MS
    start = end - 3600 * 10**9
    rank_waves = store_mod.count_waves(conn)
    (pages,) = conn.execute("PRAGMA page_count").fetchone()
    (free,) = conn.execute("PRAGMA freelist_count").fetchone()
    per_rank_wave = (pages - free) * store_mod.PAGE_SIZE / rank_waves
    in_hour = (
        sum(1 for _ in range(1))
        and conn.execute(
            "SELECT COALESCE(SUM(waves), 0) FROM wave_blocks WHERE start_ns >= ?", (start,)
        ).fetchone()[0]
    )
    print(f"store: {rank_waves:,} rank-waves, {in_hour:,} in the last hour, "
          f"{per_rank_wave:.1f} B per rank-wave", flush=True)  # fmt: skip

    t = time.perf_counter()
    for query in [*SEARCHES.values(), QUERY_RANGE]:  # the grammar is built once per process
        parse(query)
    print(f"parser built and queries parsed once: {(time.perf_counter() - t) * 1000:.0f} ms")
    all_times = []
    print(f"{'search (last 1 h, limit 20)':<30} {'p50 ms':>9} {'p95 ms':>9} {'traces':>7}")
    expected_slow = {w for w in range(1, args.waves + 1) if w % SLOW_EVERY == 0}
    for label, query in SEARCHES.items():
        times, found = _timed(lambda q=query: search(conn, q, start, end, 20, 3), args.repeat)
        all_times += times
        print(f"{label:<30} {np.percentile(times, 50):9.1f} {np.percentile(times, 95):9.1f} "
              f"{len(found):7d}", flush=True)  # fmt: skip
        if label == "tp3 all_reduce > 50ms":  # the answer is known: the slowed waves
            got = {int(m.trace_id[16:], 16) for m in found}
            hour = {w for w in expected_slow if start <= first + (w - 1) * step <= end}
            want = set(sorted(hour, reverse=True)[:20])
            assert got == want, (sorted(got), sorted(want))
    search_p95 = float(np.percentile(all_times, 95))
    for label, query in EXTRA_SEARCHES.items():
        times, found = _timed(lambda q=query: search(conn, q, start, end, 20, 3), args.repeat)
        print(f"{label + ' (extra)':<30} {np.percentile(times, 50):9.1f} "
              f"{np.percentile(times, 95):9.1f} {len(found):7d}", flush=True)  # fmt: skip
        if label == "tp3 slow call > 50ms":
            got = {int(m.trace_id[16:], 16) for m in found}
            assert got == want, (sorted(got), sorted(want))

    rng = random.Random(3)
    ids = [format_trace_id(wave_trace_id(RUN, rng.randrange(1, args.waves + 1), 0))
           for _ in range(args.repeat * 5)]  # fmt: skip
    p95 = {}
    for label, load in (("CLI load_trace", load_trace), ("traceql.trace_spans", trace_spans)):
        times = []
        for trace_id in ids:
            took, spans = _timed(lambda t=trace_id, f=load: f(conn, t), 1)
            slow = int(trace_id[16:], 16) % SLOW_EVERY == 0  # + tp3's slow call span
            assert len(spans) == 1 + args.ranks * 5 + slow, len(spans)
            times += took
        p95[label] = float(np.percentile(times, 95))
        print(f"trace by id ({label}): p50 {np.percentile(times, 50):.1f} ms, "
              f"p95 {p95[label]:.1f} ms")  # fmt: skip
    trace_p95 = p95["traceql.trace_spans"]

    newest = (args.waves - REQ_WAVES) // (REQ_WAVES // REQ_LIVE)
    times = []
    for _ in range(args.repeat * 2):
        k = rng.randrange(max(0, newest - 3600 * 200 // (REQ_WAVES // REQ_LIVE)), newest)
        took, found = _timed(lambda k=k: request_traces(conn, f"cmpl-bench-{k}-0"), 1)
        assert len(found) == 1 and len(found[0].waves) == REQ_WAVES, (k, len(found))
        times += took
    request_p95 = float(np.percentile(times, 95))
    print(f"request trace by id: p50 {np.percentile(times, 50):.1f} ms, p95 {request_p95:.1f} ms")

    repeat = max(3, args.repeat // 3)
    range_times, series = _timed(
        lambda: metrics_range(conn, QUERY_RANGE, start, end, 60 * 10**9), repeat
    )
    assert len(series) == args.ranks
    range_p95 = float(np.percentile(range_times, 95))
    print(f"query_range {QUERY_RANGE!r}: p50 {np.percentile(range_times, 50):.0f} ms, "
          f"p95 {range_p95:.0f} ms, {len(series)} series")  # fmt: skip
    # the same query decoding every block (exact quantiles), side by side
    exact_times, exact = _timed(
        lambda: metrics_range(conn, QUERY_RANGE, start, end, 60 * 10**9, summaries=False), 1
    )
    errors = [
        abs(a - b) / b
        for s, e in zip(series, exact, strict=True)
        for (ta, a), (tb, b) in zip(s.samples, e.samples, strict=True)
        if ta == tb and b > 0
    ]
    assert len(errors) == sum(len(e.samples) for e in exact)
    print(f"query_range decoding every block: {exact_times[0]:.0f} ms "
          f"({exact_times[0] / range_p95:.1f}x); histogram p99 vs exact: max relative error "
          f"{max(errors) * 100:.2f} % over {len(errors)} samples "
          f"(bound {block_summary.RELATIVE_WIDTH * 100:.1f} %)")  # fmt: skip
    conn.close()
    print(f"query: search p95 {search_p95:.1f} ms; trace {trace_p95:.1f} ms; "
          f"request {request_p95:.1f} ms; "
          f"query_range {range_p95:.0f} ms; bytes per rank-wave {per_rank_wave:.1f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
