"""Host cost of request membership per wave (issue 12: at most 5 µs at 256 requests).

In-process, no server: a real `GuardProcessor` on tp0 with membership on, and one with it off
(`request_traces: false`), both with a streamer that only keeps the records, are fed the same
pre-built waves through the decorator entry points (`run_step`, `run_sample`): a V1-shaped
scheduler output (request ids as new string objects each wave, as they arrive unpickled at
TP > 1) and runner output (the runner's own id strings, a fresh list each wave), as
tests/support/request_sim.py makes them. The two are timed block by block, interleaved (order
rotated per block, GC off); the cost is the median over blocks of (on - off) per wave. The
engine-thread part alone (`on_schedule` + `on_wave`) and the streamer thread's `fill_batch`
are timed too.

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

from guard.config import GuardConfig  # noqa: E402
from guard.processor import GuardProcessor  # noqa: E402
from guard.request_membership import RETIRED_KEPT, RequestMembership  # noqa: E402
from guard.schedule import sampled_counts  # noqa: E402
from telemetry.proto import guard_pb2  # noqa: E402

RANK = guard_pb2.RankInfo(run_id="bench", engine="b", tp_size=2, dp_size=1, pp_size=1)


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

    def start(self) -> None:
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


def run_waves(proc: GuardProcessor, waves: list[tuple], runner) -> int:
    step, sample = proc.run_step, proc.run_sample
    t0 = time.perf_counter_ns()
    for so, output in waves:
        step(_execute, runner, (so,), {})
        sample(lambda r, out=output: out, runner, (), {})
    return time.perf_counter_ns() - t0


def _execute(runner, scheduler_output):
    return None


def measure(reqs: int, blocks: int, n_waves: int, scenario: str, warm: int) -> dict[str, float]:
    runner = SimpleNamespace(requests={}, max_model_len=4096)
    procs = {True: processor(True), False: processor(False)}
    engines = {on: Engine(reqs, scenario) for on in procs}
    for on, proc in procs.items():
        run_waves(proc, engines[on].waves(2), runner)  # start the streamer, requests in
    alone = RequestMembership(10**6)  # the engine-thread calls alone
    engine = Engine(reqs, scenario)
    for wave, (so, output) in enumerate(engine.waves(2), 1):
        alone.on_schedule(wave, so)
        alone.on_wave(wave, output, *sampled_counts(output, runner))
    number = 2
    # a server that has run a while: in churn, RETIRED_KEPT requests have already finished
    for _ in range(-(-warm // 500)):
        for on, proc in procs.items():
            run_waves(proc, engines[on].waves(500), runner)
            proc.streamer.records.clear()
            if proc.membership is not None:
                proc.membership.fill_batch(guard_pb2.Batch())
        for so, output in engine.waves(500):
            number += 1
            alone.on_schedule(number, so)
            alone.on_wave(number, output, *sampled_counts(output, runner))
        alone._rows.clear()
    diffs, ons, offs, direct, fills = [], [], [], [], []
    for block in range(blocks):
        order = (True, False) if block % 2 else (False, True)
        batch_waves = {on: engines[on].waves(n_waves) for on in procs}
        waves = engine.waves(n_waves)
        # the processor counts these (its cost, the same with membership off)
        counted = [sampled_counts(o, runner) for _, o in waves]
        took = {}
        gc.disable()
        try:
            for on in order:
                proc = procs[on]
                took[on] = run_waves(proc, batch_waves[on], runner) / n_waves / 1000
                proc.streamer.records.clear()
            batch = guard_pb2.Batch()
            t0 = time.perf_counter_ns()
            procs[True].membership.fill_batch(batch)
            fills.append((time.perf_counter_ns() - t0) / n_waves / 1000)
            t0 = time.perf_counter_ns()
            for (so, output), (count, kept) in zip(waves, counted, strict=True):
                number += 1
                alone.on_schedule(number, so)
                alone.on_wave(number, output, count, kept)
            direct.append((time.perf_counter_ns() - t0) / n_waves / 1000)
            alone._rows.clear()
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
        "fill": statistics.median(fills),
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
          f" {'fill us':>8}   (per wave, {args.reqs} requests, median of {args.blocks} blocks)")  # fmt: skip
    for scenario in ("steady", "churn", "shift", "spec"):
        r = measure(args.reqs, args.blocks, args.waves, scenario, args.warm)
        results[scenario] = r
        print(f"{scenario:8} {r['on']:8.2f} {r['off']:8.2f} {r['added']:8.2f} {r['direct']:8.2f}"
              f" {r['direct_p90']:9.2f} {r['fill']:8.2f}")  # fmt: skip
    steady = results["steady"]
    print(
        f"request_membership: {args.reqs} requests, steady decode +{steady['direct']:.2f} us/wave "
        f"(on-off {steady['added']:+.2f} us), churn +{results['churn']['direct']:.2f} us, shift "
        f"+{results['shift']['direct']:.2f} us, spec +{results['spec']['direct']:.2f} us; "
        f"streamer fill {steady['fill']:.2f} us/wave; goal <= 5 us (steady, churn): "
        f"{'met' if max(steady['direct'], results['churn']['direct']) <= 5 else 'MISSED'}"
    )


if __name__ == "__main__":
    main()
