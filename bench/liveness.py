"""What the shared-memory liveness record (telemetry/wire/liveness_record.py) and heartbeats cost.

In-process, side by side in one run, interleaved rounds (best round and median reported):

- **per collective**: `CollectiveTracker.run` around a no-op call carrying a 512-byte stand-in
  tensor, with no record, with a record without its ring (`ring_slots=0`) and with the record
  and its ring of the last collectives (enter + leave: the words written on the engine thread
  for every collective; the ring adds a slot of six words and the payload's bytes);
- **per phase change**: `LivenessRecord.phase` (four per wave: execute, idle, sample, idle);
- **sidecar look**: `RecordReader.read` (the record plus `/proc/<pid>/stat`), paid only for a
  rank that has been silent on its stream for 0.25 s;
- **heartbeat**: one heartbeat-only batch built and serialized by the streamer thread, and
  what it costs a rank's CPU per second at 1 s (default) and at 0.25 s intervals.

    python bench/liveness.py [--calls 50000] [--rounds 15]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from guard.collectives.tracker import CollectiveTracker  # noqa: E402
from guard.config.collectives import CollectivesConfig  # noqa: E402
from guard.stream.streamer import HeartbeatState, Streamer  # noqa: E402
from telemetry.cli.table import render_table  # noqa: E402
from telemetry.wire.liveness_record import LivenessRecord, RecordReader  # noqa: E402
from telemetry.wire.proto import guard_pb2  # noqa: E402
from tests.support.feed import FixedHeartbeat  # noqa: E402

CALLS_PER_WAVE = 6  # tiny model at TP=2: 5 all-reduces + 1 all-gather per step


class Group:
    unique_name, world_size, rank_in_group, backend = "tp:0", 2, 0, "shm"


def _noop(group: Group, value: int) -> int:
    return value


class _Tensor:
    nbytes = 512


def _first_arg(args: tuple, kwargs: dict, result: object) -> object:
    return args[0] if args else None


def _per_call(fn, calls: int) -> float:
    gc.disable()
    try:
        start = time.perf_counter_ns()
        fn(calls)
        return (time.perf_counter_ns() - start) / calls
    finally:
        gc.enable()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=50_000, help="calls per round")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    directory = tempfile.mkdtemp(prefix="ag-bench-live-")
    wave = {"n": 1}
    plain = CollectiveTracker(CollectivesConfig(), wave_source=lambda: wave["n"])
    recorded = CollectiveTracker(CollectivesConfig(), wave_source=lambda: wave["n"])
    ringless = CollectiveTracker(CollectivesConfig(), wave_source=lambda: wave["n"])
    record = LivenessRecord.create(directory, "bench", 0, 0, 0)
    bare = LivenessRecord.create(directory, "bench", 0, 0, 1, ring_slots=0)
    assert record is not None and bare is not None
    recorded.record = record
    ringless.record = bare
    names = ("no record", "record, no ring", "record")
    groups = {name: Group() for name in names}
    trackers = {"no record": plain, "record, no ring": ringless, "record": recorded}
    tensor = _Tensor()

    def collectives(name: str):
        tracker, group = trackers[name], groups[name]

        def loop(n: int) -> None:
            run = tracker.run
            for i in range(n):
                if i % CALLS_PER_WAVE == 0:
                    wave["n"] += 1
                run("all_reduce", _noop, group, (tensor,), {}, _first_arg)
            tracker.finished.clear()

        return loop

    def phases(n: int) -> None:
        phase = record.phase
        now = time.perf_counter_ns()
        for i in range(n):
            phase("execute_model", now, i)

    reader = RecordReader(directory)
    pid = os.getpid()

    def looks(n: int) -> None:
        read = reader.read
        for _ in range(n):
            read("bench", 0, 0, 0, pid)

    rank = guard_pb2.RankInfo(run_id="bench", engine="bench", tp_size=2, pid=pid, node="n")
    streamer = Streamer(
        "unix:///nonexistent",
        rank,
        buffer_size=64,
        batch_max=16,
        flush_interval_s=0.05,
        heartbeat_interval_s=1.0,
        max_backoff_s=1.0,
        fillers=[FixedHeartbeat(HeartbeatState(5, "execute_model", 1000)), plain],
    )

    def heartbeats(n: int) -> None:
        make = streamer._make_batch
        for _ in range(n):
            make([], True).SerializeToString()

    samples: dict[str, list[float]] = {name: [] for name in names}
    other: dict[str, list[float]] = {"phase": [], "look": [], "heartbeat": []}
    for r in range(args.rounds + 1):
        order = list(names) if r % 2 else list(reversed(names))
        got = {name: _per_call(collectives(name), args.calls) for name in order}
        got_phase = _per_call(phases, args.calls)
        got_look = _per_call(looks, max(1, args.calls // 10))
        got_beat = _per_call(heartbeats, max(1, args.calls // 10))
        if r:  # round 0 warms up
            for name, ns in got.items():
                samples[name].append(ns)
            other["phase"].append(got_phase)
            other["look"].append(got_look)
            other["heartbeat"].append(got_beat)
    record.close()
    bare.close()

    best = {k: min(v) for k, v in samples.items()}
    median = {k: statistics.median(v) for k, v in samples.items()}
    pairs = [b - a for a, b in zip(samples["no record"], samples["record"], strict=True)]
    added = statistics.median(pairs)
    ring_pairs = [b - a for a, b in zip(samples["record, no ring"], samples["record"], strict=True)]
    ring = statistics.median(ring_pairs)
    rows = [
        ("tracker.run, no record", f"{best['no record']:.0f}", f"{median['no record']:.0f}"),
        (
            "tracker.run, record without ring",
            f"{best['record, no ring']:.0f}",
            f"{median['record, no ring']:.0f}",
        ),
        ("tracker.run, record and ring", f"{best['record']:.0f}", f"{median['record']:.0f}"),
        ("record.phase", f"{min(other['phase']):.0f}", f"{statistics.median(other['phase']):.0f}"),
        ("sidecar look", f"{min(other['look']):.0f}", f"{statistics.median(other['look']):.0f}"),
        (
            "heartbeat batch",
            f"{min(other['heartbeat']):.0f}",
            f"{statistics.median(other['heartbeat']):.0f}",
        ),
    ]
    print(f"ns per call, {args.rounds} interleaved rounds of {args.calls} calls")
    print(render_table(("what", "best round", "median"), rows, right=(1, 2)))
    beat = statistics.median(other["heartbeat"])
    print(
        f"paired (with record - no record) per collective: median {added:+.0f} ns, "
        f"range {min(pairs):+.0f}..{max(pairs):+.0f} ns"
    )
    print(
        f"paired (record and ring - record without ring) per collective: median {ring:+.0f} ns, "
        f"range {min(ring_pairs):+.0f}..{max(ring_pairs):+.0f} ns"
    )
    print(
        f"heartbeat CPU per rank: {beat / 1e3:.1f} us each = {100 * beat / 1e9:.4f}% of a core "
        f"at 1 s, {400 * beat / 1e9:.4f}% at 0.25 s"
    )
    print(
        f"liveness record: {added:+.0f} ns per collective "
        f"({median['no record']:.0f} -> {median['record']:.0f} ns; its ring {ring:+.0f} ns), "
        f"{statistics.median(other['phase']):.0f} ns per phase change, "
        f"sidecar look {statistics.median(other['look']) / 1e3:.1f} us"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
