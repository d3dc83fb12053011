"""Cost of each sampling detector per wave, host Python and device reduction measured apart.

In-process, no server. A `DetectorSuite` with one detector enabled at a time (and all of them,
and none) is fed what a V1 runner hands it each wave: a real vLLM `ModelRunnerOutput` with one
new token per request (1-4 tokens and 3 drafts per request for spec_acceptance and all+spec)
and a real float32 logits tensor on CPU.

Two figures, because on an accelerator they land on different clocks:

- host µs: the suite's own Python and dispatch work on the engine thread, set up as the
  processor sets it up (token detectors deferred to the detector thread). The logits fed here
  are [requests, 16]: every code path runs as it does at full width, but the reduction's
  arithmetic is left out (its dispatch is not). Variants are interleaved block by block (order
  rotated per block, GC off); the figure is the median over blocks of (variant − none) in the
  same block.
- detector-thread µs: the deferred token work of the same waves, run after each block (on the
  detector thread in a worker, where it competes with the engine thread only for the GIL).
- reduction µs: the one per-wave reduction (`row_max`, an amax per row) alone on full-size
  [requests, vocab] logits, and the logits_stats kernels (every 16 waves by default). On CPU
  this is CPU time too; on an accelerator it runs on the device without a sync
  (bench/gpu_no_sync.py measures it there).

Streams are random tokens, so the repeat detector does its full work without ever reporting.

    python bench/detectors.py [--reqs 16,64,256,1024] [--vocab 32000,152064] [--blocks 15]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from guard.config import IncidentsConfig  # noqa: E402
from guard.detectors import logits as logit_checks  # noqa: E402
from guard.detectors.config import (  # noqa: E402
    DetectorsConfig,
    LogitsFiniteConfig,
    LogitsStatsConfig,
    SpecAcceptanceConfig,
    TokenRangeConfig,
    TokenRepeatConfig,
)
from guard.detectors.evidence import EvidenceDumper  # noqa: E402
from guard.detectors.suite import DetectorSuite  # noqa: E402
from guard.reporter import IncidentReporter  # noqa: E402
from telemetry.table import render_table  # noqa: E402

NAMES = ("logits_finite", "token_repeat", "spec_acceptance", "logits_stats", "token_range")
SECTIONS = {
    "logits_finite": LogitsFiniteConfig,
    "token_repeat": TokenRepeatConfig,
    "spec_acceptance": SpecAcceptanceConfig,
    "logits_stats": LogitsStatsConfig,
    "token_range": TokenRangeConfig,
}
HOST_WIDTH = 16  # logits columns for the host figure: the reduction's arithmetic drops out
VOCAB_IDS = 32000  # sampled ids are drawn below this (token_range sees the runner's vocab)

# the "before" figures (this machine, vocab 32000), printed next to ours
BEFORE = {
    "logits_finite": (37, 1081),
    "token_repeat": (20, 297),
    "spec_acceptance": (15, 202),
    "token_range": (4, 58),
    "all": (138, 1644),
    "all+spec": (183, 2458),
}


def config_with(enabled: set[str]) -> DetectorsConfig:
    return DetectorsConfig(**{name: SECTIONS[name](enabled=name in enabled) for name in NAMES})


def make_suite(enabled: set[str]) -> DetectorSuite:
    config = config_with(enabled)
    reporter = IncidentReporter(
        IncidentsConfig(), run_id="b", current_wave=lambda: 0, sink=lambda i: None
    )
    return DetectorSuite(
        config,
        reporter,
        EvidenceDumper(config.dump, "b", "r"),
        probe=lambda *a: None,
        defer_tokens=True,  # as the processor builds it; drained by the bench, not a thread
    )


class Feed:
    """Pre-built inputs for `waves` waves of `reqs` requests."""

    def __init__(self, reqs: int, waves: int, spec: bool) -> None:
        from vllm.v1.outputs import ModelRunnerOutput

        gen = torch.Generator().manual_seed(0)
        self.req_ids = [f"req-{i}" for i in range(reqs)]
        self.runner = types.SimpleNamespace(
            input_batch=types.SimpleNamespace(req_ids=self.req_ids),
            model_config=types.SimpleNamespace(get_vocab_size=lambda: VOCAB_IDS),
            speculative_config=types.SimpleNamespace(method="ngram"),
        )
        self.logits = [torch.randn(reqs, HOST_WIDTH, generator=gen) for _ in range(4)]
        self.outputs = []
        self.schedules = []
        width = 4 if spec else 1
        for _ in range(waves):
            tokens = torch.randint(0, VOCAB_IDS, (reqs, width), generator=gen).tolist()
            self.outputs.append(
                ModelRunnerOutput(
                    req_ids=list(self.req_ids),  # a fresh list each wave, as the runner does
                    req_id_to_index={r: i for i, r in enumerate(self.req_ids)},
                    sampled_token_ids=[t[: 1 + (i % width)] for i, t in enumerate(tokens)],
                )
            )
            drafts = {r: [1, 2, 3] for r in self.req_ids} if spec else {}
            self.schedules.append(
                types.SimpleNamespace(finished_req_ids=set(), scheduled_spec_decode_tokens=drafts)
            )


def run_waves(suite: DetectorSuite | None, feed: Feed, first_wave: int) -> int:
    """Time one block of waves through the suite; returns nanoseconds."""
    start = time.perf_counter_ns()
    if suite is not None:
        runner = feed.runner
        for n, (output, schedule) in enumerate(zip(feed.outputs, feed.schedules, strict=True)):
            wave = first_wave + n
            suite.on_schedule(wave, schedule)
            suite.on_logits(wave, runner, feed.logits[n % 4], None)
            suite.on_output(wave, runner, output)
    return time.perf_counter_ns() - start


def measure_host(reqs: int, blocks: int, waves: int) -> tuple[dict[str, float], dict[str, float]]:
    """(engine-thread µs per wave, detector-thread µs per wave) per variant."""
    variants = ["none", *NAMES, "all", "all+spec"]
    feeds = {False: Feed(reqs, waves, spec=False), True: Feed(reqs, waves, spec=True)}
    suites = {
        v: make_suite(set() if v == "none" else set(NAMES) if v.startswith("all") else {v})
        for v in variants
    }
    added: dict[str, list[float]] = {v: [] for v in variants}
    deferred: dict[str, list[float]] = {v: [] for v in variants}
    gc.disable()
    try:
        for block in range(blocks + 1):
            order = variants[block % len(variants) :] + variants[: block % len(variants)]
            took, drained = {}, {}
            for v in order:
                spec = v in ("spec_acceptance", "all+spec")
                took[v] = run_waves(suites[v], feeds[spec], 1 + block * waves)
                start = time.perf_counter_ns()
                suites[v].drain()
                drained[v] = time.perf_counter_ns() - start
            if block == 0:
                continue  # warm-up
            for v in variants:
                added[v].append((took[v] - took["none"]) / waves / 1e3)
                deferred[v].append(drained[v] / waves / 1e3)
    finally:
        gc.enable()
    median = statistics.median
    return (
        {v: median(values) for v, values in added.items()},
        {v: median(values) for v, values in deferred.items()},
    )


def time_op(fn, repeats: int) -> float:
    """Median µs of `fn()` over `repeats` calls (after one warm-up call)."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - start) / 1e3)
    return statistics.median(samples)


def measure_reduction(reqs: int, vocab: int, repeats: int) -> tuple[float, float]:
    """(row check µs per wave, logits_stats µs per call) on [reqs, vocab] float32 logits."""
    logits = torch.randn(reqs, vocab, generator=torch.Generator().manual_seed(1))
    row = time_op(lambda: logit_checks.row_max(logits), repeats)
    stats = time_op(lambda: logit_checks.health_stats(logits), repeats)
    return row, stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reqs", default="16,64,256,1024", help="requests per wave")
    parser.add_argument("--vocab", default="32000,152064", help="logits widths, comma-separated")
    parser.add_argument("--blocks", type=int, default=15)
    parser.add_argument("--waves", type=int, default=64, help="waves per block")
    parser.add_argument("--repeats", type=int, default=9, help="timed calls per reduction")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a pinned worker: 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    counts = [int(x) for x in args.reqs.split(",")]
    vocabs = [int(x) for x in args.vocab.split(",")]
    measured = {n: measure_host(n, args.blocks, args.waves) for n in counts}
    host = {n: measured[n][0] for n in counts}
    thread = {n: measured[n][1] for n in counts}
    reduction = {(n, v): measure_reduction(n, v, args.repeats) for n in counts for v in vocabs}

    print(
        f"HOST: added host time per wave (us), torch threads {args.threads}, median of "
        f"{args.blocks} blocks x {args.waves} waves, each against the same waves with none "
        f"enabled; logits [requests, {HOST_WIDTH}] so the reduction's arithmetic is left out "
        "(it does not depend on the vocabulary)"
    )
    rows = []
    for v in (*NAMES, "all", "all+spec"):
        before = BEFORE.get(v)
        rows.append(
            (
                "all (default)" if v == "all" else v,
                *(f"{host[n][v]:.1f}" for n in counts),
                f"{before[0]} / {before[1]}" if before else "-",
            )
        )
    print(
        render_table(
            ("detector", *(f"{n} reqs" for n in counts), "before: 16 / 256 reqs"),
            rows,
            right=tuple(range(1, len(counts) + 2)),
        )
    )
    print(
        "the 'before' column is the issue's measurement of the per-request Python detectors; "
        "it included the CPU reduction (logits_finite at 256 reqs mostly the reduction itself)"
    )
    print("\nDETECTOR THREAD: the deferred token work of the same waves, us per wave")
    print(
        render_table(
            ("detector", *(f"{n} reqs" for n in counts)),
            [
                (v, *(f"{thread[n][v]:.1f}" for n in counts))
                for v in ("token_repeat", "spec_acceptance", "all", "all+spec")
            ],
            right=tuple(range(1, len(counts) + 1)),
        )
    )
    print(
        f"\nREDUCTION: one row check per wave (amax per row) and logits_stats (every 16 waves), "
        f"us, float32 on CPU, median of {args.repeats} calls"
    )
    red_rows = []
    for n in counts:
        for v in vocabs:
            row, stats = reduction[(n, v)]
            red_rows.append((f"{n} x {v}", f"{row:.1f}", f"{stats:.1f}", f"{stats / 16:.1f}"))
    print(
        render_table(
            ("logits", "row check", "logits_stats call", "logits_stats per wave"),
            red_rows,
            right=(1, 2, 3),
        )
    )
    goals = []
    for n, goal in ((16, 30.0), (256, 60.0)):
        if n in host:
            verdict = "met" if host[n]["all"] <= goal else "MISSED"
            goals.append(f"{n} req {host[n]['all']:.1f} us (goal <= {goal:.0f}: {verdict})")
    if goals:
        print("\ngoals, all default detectors, host: " + "; ".join(goals))
    x = f"{host[16]['all']:.1f}" if 16 in host else "n/a"
    y = f"{host[256]['all']:.1f}" if 256 in host else "n/a"
    z = f"{reduction[(256, 32000)][0]:.1f}" if (256, 32000) in reduction else "n/a"
    print(f"detectors: host us per wave 16 req {x}; 256 req {y}; reduction 256x32000 {z} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
