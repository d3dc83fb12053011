"""Host cost of request membership per wave (issue 12: at most 5 µs at 256 requests).

In-process, no server: a real `GuardProcessor` on tp0 with membership on, and one with it off
(`request_traces: false`), both with a streamer that only keeps the records, are fed the same
pre-built waves through the decorator entry points (`run_step`, `run_sample`): a V1-shaped
scheduler output (request ids as new string objects each wave, as they arrive unpickled at
TP > 1) and runner output (the runner's own id strings, a fresh list each wave), as
tests/support/request_sim.py makes them. The two are timed block by block, interleaved (order
rotated per block, GC off); the cost is the median over blocks of (on - off) per wave. The
engine-thread call alone (`on_record`, with the read of the schedule's fields that the processor
shares with its prefill tracker; it queues the fields and the counts) is timed too, and
beside it the streamer thread's part: working the queued steps out into rows
(`drain`, every FLUSH_WAVES waves, as the streamer packs) and `fill_batch`. The goal is on the
engine thread (the serving path); the streamer's part is the same host CPU as before the
calls were queued, spent while the engine thread is in the model.

Scenarios at `--reqs` requests:
- steady: decode, the same requests every wave, one token each (the common case);
- churn: one request finishes and a new one joins every wave, taking the freed slot as in
  vLLM's persistent batch (`InputBatch`: the lowest free slot first);
- shift: as churn, but the make-up moves every wave (the oldest leaves, the new one goes last,
  every position changes): the worst case, each request's id is looked up;
- spec: the same requests, 4 tokens scheduled each (n-gram drafts), 1-4 sampled.

Before timing, `--warm` waves run (default RETIRED_KEPT + 1000): a server that has served a
while, whose bound on finished requests is full (in churn one request finishes per wave).

    python bench/request_membership.py [--reqs 256] [--blocks 15] [--waves 200] [--warm N]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from guard.config.runtime_guard import GuardConfig  # noqa: E402
from guard.processor import GuardProcessor  # noqa: E402
from guard.wave.request_membership import RETIRED_KEPT, RequestMembership  # noqa: E402
from guard.wave.schedule import read_sampled, read_schedule  # noqa: E402
from telemetry.wire.proto import guard_pb2  # noqa: E402

RANK = guard_pb2.RankInfo(run_id="bench", engine="b", tp_size=2, dp_size=1, pp_size=1)
SCENARIOS = ("steady", "churn", "shift", "spec")
FLUSH_WAVES = 10  # waves per streamer batch: its 50 ms flush at 5 ms a wave


class KeepStreamer:
    """Keeps what the processor offers (the real buffer append is the same deque call)."""

    def __init__(self, *args, **kwargs) -> None:
        self.records: list = []

    def offer(self, record) -> None:
        self.records.append(record)

    def offer_probe(self, *args) -> None:
        return

    def offer_incident(self, *args) -> None:
        return

    def start(self, rank=None, spool=None) -> None:
        return

    def stop(self) -> None:
        return


def _fresh(text: str) -> str:
    return text.encode().decode()


class Engine:
    """Makes the step objects of consecutive waves; the runner's id strings persist (they are
    the `NewRequestData` strings of each request's first wave, as in vLLM's runner)."""

    def __init__(self, reqs: int, scenario: str) -> None:
        self.scenario = scenario
        self.count = 0
        self.live = [self._new_id() for _ in range(reqs)]
        self.joining = list(self.live)  # named by the next wave as new requests

    def _new_id(self) -> str:
        self.count += 1
        return f"cmpl-{self.count:032x}-0-{self.count:08x}"

    def waves(self, n: int) -> list[tuple]:
        return [self.wave() for _ in range(n)]

    def wave(self) -> tuple:
        live, scenario = self.live, self.scenario
        new, self.joining = self.joining, []
        finished = set()
        if not new and scenario == "churn":
            slot = (self.count * 37) % len(live)  # somewhere in the batch
            finished = {_fresh(live[slot])}
            new = [self._new_id()]
            live[slot] = new[0]
        elif not new and scenario == "shift":
            finished = {_fresh(live.pop(0))}
            new = [self._new_id()]
            live.append(new[0])
        fresh = set(new)
        each = 4 if scenario == "spec" else 1
        scheduled = {_fresh(r): 32 if r in fresh else each for r in live}
        so = SimpleNamespace(
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            scheduled_new_reqs=[SimpleNamespace(req_id=r, prompt_token_ids=[0] * 32,
                                                num_computed_tokens=0) for r in new],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(),
                                                  num_computed_tokens=[], all_token_ids={}),
            finished_req_ids=finished,
            preempted_req_ids=set(),
        )  # fmt: skip
        if scenario == "spec":
            sampled = [[7] if r in fresh else [7] * (1 + (i + self.count) % 4)
                       for i, r in enumerate(live)]  # fmt: skip
        else:
            sampled = [[7] for _ in live]
        req_ids = list(live)
        to_index = {r: i for i, r in enumerate(req_ids)}  # ModelRunnerOutput.req_id_to_index
        return so, SimpleNamespace(req_ids=req_ids, req_id_to_index=to_index,
                                   sampled_token_ids=sampled)  # fmt: skip


def processor(on: bool) -> GuardProcessor:
    config = GuardConfig(sidecar="localhost:1", liveness_record=False, request_traces=on)
    return GuardProcessor(config, lambda runner: RANK, KeepStreamer)


def run_waves(proc: GuardProcessor, waves: list[tuple], runner) -> tuple[int, int]:
    """(ns on the engine thread, ns the streamer spent working membership steps out): the
    steps are worked out every FLUSH_WAVES waves, as the streamer does when it packs."""
    step, sample, membership = proc.run_step, proc.run_sample, proc.membership
    engine = streamer = 0
    for at in range(0, len(waves), FLUSH_WAVES):
        t0 = time.perf_counter_ns()
        for so, output in waves[at : at + FLUSH_WAVES]:
            step(_execute, runner, (so,), {})
            sample(lambda r, out=output: out, runner, (), {})
        t1 = time.perf_counter_ns()
        if membership is not None:
            membership.drain()
        engine += t1 - t0
        streamer += time.perf_counter_ns() - t1
    return engine, streamer


def call_alone(alone: RequestMembership, waves: list[tuple], counted: list, number: int) -> int:
    """ns of the engine thread's call alone (`on_record`, with the schedule's read) over `waves`
    (numbered from `number` + 1), the queued steps worked out every FLUSH_WAVES waves,
    untimed."""
    took = 0
    for at in range(0, len(waves), FLUSH_WAVES):
        t0 = time.perf_counter_ns()
        for (so, output), (count, kept) in zip(
            waves[at : at + FLUSH_WAVES], counted[at : at + FLUSH_WAVES], strict=True
        ):
            number += 1
            alone.on_record(number, read_schedule(so), output, count, kept)
        took += time.perf_counter_ns() - t0
        alone.drain()
        alone._rows.clear()
    return took


def _execute(runner, scheduler_output):
    return None


def measure(reqs: int, blocks: int, n_waves: int, scenario: str, warm: int) -> dict[str, float]:
    runner = SimpleNamespace(requests={}, max_model_len=4096)
    procs = {True: processor(True), False: processor(False)}
    engines = {on: Engine(reqs, scenario) for on in procs}
    alone = RequestMembership(10**6)  # the engine-thread calls alone
    engine = Engine(reqs, scenario)
    number = 0
    # 2 waves start the streamers and bring the requests in; then a server that has run a
    # while: in churn, RETIRED_KEPT requests have already finished
    for size in [2] + [500] * -(-warm // 500):
        for on, proc in procs.items():
            run_waves(proc, engines[on].waves(size), runner)
            proc.streamer.records.clear()
            if proc.membership is not None:
                proc.membership.fill_batch(guard_pb2.Batch())
        waves = engine.waves(size)
        call_alone(alone, waves, [read_sampled(o, runner)[:2] for _, o in waves], number)
        number += size
    diffs, ons, offs, direct, streamer = [], [], [], [], []
    for block in range(blocks):
        order = (True, False) if block % 2 else (False, True)
        batch_waves = {on: engines[on].waves(n_waves) for on in procs}
        waves = engine.waves(n_waves)
        # the processor counts these (its cost, the same with membership off)
        counted = [read_sampled(o, runner)[:2] for _, o in waves]
        took, worked = {}, 0
        gc.disable()
        try:
            for on in order:
                proc = procs[on]
                ns, spent = run_waves(proc, batch_waves[on], runner)
                took[on] = ns / n_waves / 1000
                if on:
                    worked = spent
                proc.streamer.records.clear()
            batch = guard_pb2.Batch()
            t0 = time.perf_counter_ns()
            procs[True].membership.fill_batch(batch)
            streamer.append((worked + time.perf_counter_ns() - t0) / n_waves / 1000)
            direct.append(call_alone(alone, waves, counted, number) / n_waves / 1000)
            number += n_waves
        finally:
            gc.enable()
        diffs.append(took[True] - took[False])
        ons.append(took[True])
        offs.append(took[False])
    assert procs[True].errors.total == 0 and procs[False].errors.total == 0
    return {
        "added": statistics.median(diffs),
        "on": statistics.median(ons),
        "off": statistics.median(offs),
        "direct": statistics.median(direct),
        "direct_p90": sorted(direct)[int(0.9 * (len(direct) - 1))],
        "streamer": statistics.median(streamer),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reqs", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=15)
    parser.add_argument("--waves", type=int, default=200)
    parser.add_argument(
        "--warm",
        type=int,
        default=RETIRED_KEPT + 1000,
        help="waves run before timing (churn: more requests finish than the membership keeps)",
    )
    args = parser.parse_args()
    results = {}
    print(f"{'scenario':8} {'on us':>8} {'off us':>8} {'on-off':>8} {'calls':>8} {'calls p90':>9}"
          f" {'streamer':>8}   (per wave, {args.reqs} requests, median of {args.blocks} blocks)")  # fmt: skip
    for scenario in SCENARIOS:
        r = measure(args.reqs, args.blocks, args.waves, scenario, args.warm)
        results[scenario] = r
        print(f"{scenario:8} {r['on']:8.2f} {r['off']:8.2f} {r['added']:8.2f} {r['direct']:8.2f}"
              f" {r['direct_p90']:9.2f} {r['streamer']:8.2f}")  # fmt: skip
    steady, churn = results["steady"], results["churn"]
    engine = ", ".join(f"{s} +{results[s]['direct']:.2f} us" for s in SCENARIOS[1:])
    streamer = ", ".join(f"{s} {results[s]['streamer']:.2f} us" for s in SCENARIOS[1:])
    print(
        f"request_membership: {args.reqs} requests, engine thread steady decode "
        f"+{steady['direct']:.2f} us/wave (on-off {steady['added']:+.2f} us), {engine}; "
        f"streamer thread steady {steady['streamer']:.2f} us/wave, {streamer}; "
        f"goal <= 5 us on the engine thread (steady, churn): "
        f"{'met' if max(steady['direct'], churn['direct']) <= 5 else 'MISSED'}"
    )


if __name__ == "__main__":
    main()
