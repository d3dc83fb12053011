"""Per-call cost of the runtime-binding wrappers on the engine thread, side by side in one run.

The hot-path additions of the runtime bindings are the worker-level `device_time` wrapper
(every `execute_model` / `sample_tokens` of the worker; on CPU it finds no device clock and
passes through) and the per-proposal speculator hook. Each is timed against the bare call on
the same object, alternating, with the guard on (a real GuardProcessor installed).

    PYTHONPATH=. python bench/bindings.py [--calls 200000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

from ascend_runtime.attach import actions, detect
from ascend_runtime.attach.points import AttachPoint
from ascend_runtime.probes import speculators
from guard.config.runtime_guard import GuardConfig
from guard.decorators import install
from guard.processor import GuardProcessor
from telemetry.wire.proto import guard_pb2


class Worker:
    def execute_model(self, scheduler_output):
        return scheduler_output


class Runner:
    def __init__(self) -> None:
        self.drafter = object()
        self.speculative_config = type("Spec", (), {"method": "ngram"})()

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids):
        return self.drafts


def per_call_ns(fn, calls: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - start) / calls


def compare(name: str, bare, wrapped, calls: int, rounds: int) -> None:
    pairs = []
    for _ in range(rounds):
        b = per_call_ns(bare, calls)
        w = per_call_ns(wrapped, calls)
        pairs.append((b, w))
    b = statistics.median(p[0] for p in pairs)
    w = statistics.median(p[1] for p in pairs)
    print(f"{name:<44} {b:9.0f} {w:9.0f} {w - b:9.0f} {w / b:7.2f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    processor = GuardProcessor(GuardConfig(sidecar="localhost:1"), lambda r: guard_pb2.RankInfo())
    # its real Streamer, not started: probe readings land in its dict as in a streaming worker
    install(processor)
    detect.platform()  # detected once per process, as in a worker

    step = AttachPoint("worker", __name__, "Worker", "execute_model", "device_time", ("cpu-v1",))
    worker = Worker()
    bare_step = Worker.execute_model
    timed_step = actions.WRAPPERS["device_time"](bare_step, step)

    propose = AttachPoint(
        "speculator", __name__, "Runner", "propose_draft_token_ids", "speculator_propose",
        ("cpu-v1",),
    )  # fmt: skip
    runner = Runner()
    runner.drafts = [[1, 2, 3]] * 32  # 32 requests x 3 drafts
    sampled = [[5, 6]] * 32
    bare_propose = Runner.propose_draft_token_ids
    hooked_propose = actions.WRAPPERS["speculator_propose"](bare_propose, propose)
    speculators.STATS = speculators.SpeculatorStats()

    print(f"platform {detect.platform()}; median of {args.rounds} rounds x {args.calls} calls")
    print(f"{'call':<44} {'bare ns':>9} {'bound ns':>9} {'added':>9} {'ratio':>7}")
    compare("worker execute_model (device_time)", lambda: bare_step(worker, None),
            lambda: timed_step(worker, None), args.calls, args.rounds)  # fmt: skip
    compare("V1 propose_draft_token_ids, 32 reqs", lambda: bare_propose(runner, None, sampled),
            lambda: hooked_propose(runner, None, sampled), args.calls // 10, args.rounds)  # fmt: skip
    install(None)


if __name__ == "__main__":
    main()
