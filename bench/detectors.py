"""Cost of each sampling detector in microseconds per wave, measured side by side.

In-process, no server: a `DetectorSuite` with one detector enabled at a time (and all of them,
and none) is fed what a V1 runner hands it each wave — a real float32 logits tensor of
[requests, vocab] on CPU and a real vLLM `ModelRunnerOutput` with one new token per request
(four with drafts for spec_acceptance) — and timed over the same waves. Variants are
interleaved block by block (order rotated per block, GC off); the cost is the median over
blocks of (variant - none) in the same block. Streams are random tokens, so the repeat
detector does its full work without ever reporting.

    python bench/detectors.py [--reqs 16,256] [--vocab 32000] [--blocks 15] [--waves 64]
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
from guard.incidents import IncidentReporter  # noqa: E402
from telemetry.table import render_table  # noqa: E402

NAMES = ("logits_finite", "token_repeat", "spec_acceptance", "logits_stats", "token_range")
SECTIONS = {
    "logits_finite": LogitsFiniteConfig,
    "token_repeat": TokenRepeatConfig,
    "spec_acceptance": SpecAcceptanceConfig,
    "logits_stats": LogitsStatsConfig,
    "token_range": TokenRangeConfig,
}


def config_with(enabled: set[str]) -> DetectorsConfig:
    return DetectorsConfig(**{name: SECTIONS[name](enabled=name in enabled) for name in NAMES})


def make_suite(enabled: set[str]) -> DetectorSuite:
    config = config_with(enabled)
    reporter = IncidentReporter(
        IncidentsConfig(), run_id="b", current_wave=lambda: 0, sink=lambda i: None
    )
    return DetectorSuite(
        config, reporter, EvidenceDumper(config.dump, "b", "r"), probe=lambda *a: None
    )


class Feed:
    """Pre-built inputs for `waves` waves of `reqs` requests."""

    def __init__(self, reqs: int, vocab: int, waves: int, spec: bool) -> None:
        from vllm.v1.outputs import ModelRunnerOutput

        gen = torch.Generator().manual_seed(0)
        self.req_ids = [f"req-{i}" for i in range(reqs)]
        self.runner = types.SimpleNamespace(
            input_batch=types.SimpleNamespace(req_ids=self.req_ids),
            model_config=types.SimpleNamespace(get_vocab_size=lambda: vocab),
            speculative_config=types.SimpleNamespace(method="ngram"),
        )
        self.logits = [torch.randn(reqs, vocab, generator=gen) for _ in range(4)]
        self.outputs = []
        self.schedules = []
        for _ in range(waves):
            width = 4 if spec else 1
            tokens = torch.randint(0, vocab, (reqs, width), generator=gen).tolist()
            self.outputs.append(
                ModelRunnerOutput(
                    req_ids=self.req_ids,
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


def measure(reqs: int, vocab: int, blocks: int, waves: int) -> dict[str, float]:
    variants = ["none", *NAMES, "all", "all+spec"]
    feeds = {False: Feed(reqs, vocab, waves, spec=False), True: Feed(reqs, vocab, waves, spec=True)}
    suites = {
        v: make_suite(set() if v == "none" else set(NAMES) if v.startswith("all") else {v})
        for v in variants
    }
    added: dict[str, list[float]] = {v: [] for v in variants}
    gc.disable()
    try:
        for block in range(blocks + 1):
            order = variants[block % len(variants) :] + variants[: block % len(variants)]
            took = {}
            for v in order:
                spec = v in ("spec_acceptance", "all+spec")
                took[v] = run_waves(suites[v], feeds[spec], 1 + block * waves)
            if block == 0:
                continue  # warm-up
            for v in variants:
                added[v].append((took[v] - took["none"]) / waves / 1e3)
    finally:
        gc.enable()
    return {v: statistics.median(values) for v, values in added.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reqs", default="16,256", help="requests per wave, comma-separated")
    parser.add_argument("--vocab", type=int, default=32000, help="logits width")
    parser.add_argument("--blocks", type=int, default=15)
    parser.add_argument("--waves", type=int, default=64, help="waves per block")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a pinned worker: 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    counts = [int(x) for x in args.reqs.split(",")]
    results = {n: measure(n, args.vocab, args.blocks, args.waves) for n in counts}
    rows = [(v, *(f"{results[n][v]:.1f}" for n in counts)) for v in (*NAMES, "all", "all+spec")]
    print(
        f"added host time per wave (us), CPU, vocab {args.vocab}, torch threads {args.threads}, "
        f"median of {args.blocks} blocks x {args.waves} waves, vs the same waves with none enabled"
    )
    print(
        render_table(
            ("detector", *(f"{n} reqs" for n in counts)),
            rows,
            right=tuple(range(1, len(counts) + 1)),
        )
    )
    print(
        "logits_stats runs every 16 waves by default; its figure is that cost spread over 16 waves"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
