"""Cost of each sampling detector in microseconds per wave, measured side by side.

In-process, no server: a `DetectorSuite` with one detector enabled at a time (and all of them,
and none) is fed what a V1 runner hands it each wave — a real float32 logits tensor of
[requests, vocab] on CPU and a real vLLM `ModelRunnerOutput` with one new token per request
(four with drafts for spec_acceptance) — and timed over the same waves. Variants are
interleaved block by block (order rotated per block, GC off); the cost is the median over
blocks of (variant - none) in the same block. Streams are random tokens, so the repeat
detector does its full work without ever reporting.

The logits detectors' kernels (`logits.row_max`, one `amax` per row, every wave; and
`logits.health_rows` every 16 waves: on a device, launches the host does not wait for; here
on the CPU they run on the host) are timed alone in the same blocks, each less the same call
on a 1 x 8 tensor (the calls' own Python and dispatch stay host work). The host figures, as
the issue's host goal counts them, come from the same suites on the same waves with
[requests, 16] logits: every call and dispatch runs, the kernels' arithmetic shrinks to
nothing. (The variants less their kernels timed alone are printed too; at large shapes the
kernels' noise swamps the host work in that difference.)
Waves per block shrink as [requests, vocab] grows, so the largest shapes stay a few seconds
a block. The last line reads
`detectors: host us per wave 16 req X; 256 req Y; reduction 256x32000 Z us` (all default
detectors, at vocab 32000 or the first one given).

    python bench/detectors.py [--reqs 16,64,256,1024] [--vocab 32000,152064] [--blocks 15]
                              [--waves 64]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from guard.config.detectors import (  # noqa: E402
    DetectorsConfig,
    LogitsFiniteConfig,
    LogitsStatsConfig,
    SpecAcceptanceConfig,
    TokenRangeConfig,
    TokenRepeatConfig,
)
from guard.config.runtime_guard import IncidentsConfig  # noqa: E402
from guard.detectors import logits as logit_checks  # noqa: E402
from guard.detectors.evidence import EvidenceDumper  # noqa: E402
from guard.detectors.suite import DetectorSuite  # noqa: E402
from guard.stream.reporter import IncidentReporter  # noqa: E402
from telemetry.cli.table import render_table  # noqa: E402

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
    """Pre-built inputs for `waves` waves of `reqs` requests.

    Each wave's token lists are made from a tensor with `tolist()` as the wave is fed, in every
    variant (none included, so the difference leaves it out), as a runner makes them just before
    it hands them back: lists built ahead for thousands of waves would be read cold from memory.
    """

    def __init__(
        self, reqs: int, vocab: int, waves: int, spec: bool, logits: list[torch.Tensor]
    ) -> None:
        from vllm.v1.outputs import ModelRunnerOutput

        gen = torch.Generator().manual_seed(0)
        self.req_ids = [f"req-{i}" for i in range(reqs)]
        self.runner = types.SimpleNamespace(
            input_batch=types.SimpleNamespace(req_ids=self.req_ids),
            model_config=types.SimpleNamespace(get_vocab_size=lambda: vocab),
            speculative_config=types.SimpleNamespace(method="ngram"),
        )
        self.logits = logits
        self.spec = spec
        self.width = 4 if spec else 1
        self.lengths = [1 + (i % self.width) for i in range(reqs)]  # tokens back per request
        self.tokens = torch.randint(0, vocab, (waves, reqs, self.width), generator=gen)
        self.output = ModelRunnerOutput(
            req_ids=self.req_ids, req_id_to_index={r: i for i, r in enumerate(self.req_ids)}
        )
        drafts = {r: [1, 2, 3] for r in self.req_ids} if spec else {}
        self.schedule = types.SimpleNamespace(
            finished_req_ids=set(), scheduled_spec_decode_tokens=drafts
        )

    def output_of(self, index: int) -> Any:
        """Wave `index`'s runner output, its token lists made now."""
        rows = self.tokens[index].tolist()
        if self.spec:
            rows = [row[:length] for row, length in zip(rows, self.lengths, strict=True)]
        self.output.sampled_token_ids = rows
        return self.output


def run_waves(suite: DetectorSuite | None, feed: Feed, first_wave: int, waves: int) -> int:
    """Time one block of waves through the suite; returns nanoseconds."""
    start = time.perf_counter_ns()
    if suite is not None:
        runner, schedule = feed.runner, feed.schedule
        for n in range(waves):
            wave = first_wave + n
            suite.on_schedule(wave, schedule)
            suite.on_logits(wave, runner, feed.logits[n % 4], None)
            suite.on_output(wave, runner, feed.output_of(wave - 1))  # fresh tokens every block
    return time.perf_counter_ns() - start


_TINY = torch.randn(1, 8)
STATS_EVERY = LogitsStatsConfig().every_n_waves


def run_reduction(feed: Feed, first_wave: int, count: int) -> tuple[int, int]:
    """The logits detectors' kernels alone over the same waves, in nanoseconds: the row max of
    every wave (logits_finite) and the health stats of every `STATS_EVERY`-th (logits_stats),
    each less the same call on a 1 x 8 tensor, so that the calls' own Python and dispatch
    (host work on a device too) stay in the host figures."""
    row_max, health_rows = logit_checks.row_max, logit_checks.health_rows
    waves = range(first_wave, first_wave + count)
    stats_waves = [n for n, wave in enumerate(waves) if wave % STATS_EVERY == 0]

    def timed(call: Any, tensors: Any) -> int:
        start = time.perf_counter_ns()
        for tensor in tensors:
            call(tensor)
        return time.perf_counter_ns() - start

    rows = timed(row_max, (feed.logits[n % 4] for n in range(len(waves))))
    rows -= timed(row_max, (_TINY for _ in waves))
    stats = timed(health_rows, (feed.logits[n % 4] for n in stats_waves))
    stats -= timed(health_rows, (_TINY for _ in stats_waves))
    return max(0, rows), max(0, stats)


WITH_REDUCTION = ("logits_finite", "logits_stats", "all", "all+spec")
NARROW = 16  # logits width of the host-only runs: every code path, no reduction arithmetic
ELEMENTS_PER_BLOCK = 64 * 256 * 32000  # the largest block of the first version of this bench


def waves_for(reqs: int, vocab: int, waves: int) -> int:
    return max(8, min(waves, ELEMENTS_PER_BLOCK // (reqs * vocab)))


def measure(reqs: int, vocab: int, blocks: int, waves: int) -> dict[str, float]:
    """Per variant, the added µs per wave (median over blocks); "reduction" is the logits
    kernels alone, "row max kernel" logits_finite's part of them, "<variant> host" the
    variant's added time less its kernels, and "<variant> narrow" its added time on the same
    waves with [requests, NARROW] logits (the host work without the kernels' arithmetic)."""
    full = ["none", *NAMES, "all", "all+spec"]
    narrow = [f"{v} narrow" for v in full]
    variants = [*full, *narrow, "reduction"]
    gen = torch.Generator().manual_seed(0)
    logits = [torch.randn(reqs, vocab, generator=gen) for _ in range(4)]
    thin = [torch.randn(reqs, NARROW, generator=gen) for _ in range(4)]
    feeds = {
        # distinct waves for every block: streams that came back would be loops to the detectors
        (spec, width): Feed(
            reqs, vocab, waves * (blocks + 1), spec=spec, logits=logits if width else thin
        )
        for spec in (False, True)
        for width in (True, False)
    }
    suites = {}
    for v in (*full, *narrow):
        name = v.removesuffix(" narrow")
        enabled = set() if name == "none" else set(NAMES) if name.startswith("all") else {name}
        suites[v] = make_suite(enabled)
    added: dict[str, list[float]] = {v: [] for v in variants}
    host: dict[str, list[float]] = {v: [] for v in WITH_REDUCTION}
    row_kernel: list[float] = []
    gc.disable()
    try:
        for block in range(blocks + 1):
            order = variants[block % len(variants) :] + variants[: block % len(variants)]
            took = {}
            for v in order:
                if v == "reduction":
                    rows, stats = run_reduction(feeds[(False, True)], 1 + block * waves, waves)
                    took["logits_finite kernel"], took["logits_stats kernel"] = rows, stats
                    took[v] = rows + stats
                    continue
                spec = v.removesuffix(" narrow") in ("spec_acceptance", "all+spec")
                feed = feeds[(spec, not v.endswith(" narrow"))]
                took[v] = run_waves(suites[v], feed, 1 + block * waves, waves)
            if block == 0:
                continue  # warm-up
            for v in variants:
                base = 0 if v == "reduction" else took["none"]
                if v.endswith(" narrow"):
                    base = took["none narrow"]
                added[v].append((took[v] - base) / waves / 1e3)
            row_kernel.append(took["logits_finite kernel"] / waves / 1e3)
            for v in WITH_REDUCTION:
                kernels = took["reduction"] if v.startswith("all") else took[f"{v} kernel"]
                host[v].append((took[v] - took["none"] - kernels) / waves / 1e3)
    finally:
        gc.enable()
    result = {v: statistics.median(values) for v, values in added.items()}
    result.update({f"{v} host": statistics.median(values) for v, values in host.items()})
    result["row max kernel"] = statistics.median(row_kernel)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--reqs", default="16,64,256,1024", help="requests per wave, comma-separated"
    )
    parser.add_argument("--vocab", default="32000,152064", help="logits widths, comma-separated")
    parser.add_argument("--blocks", type=int, default=15)
    parser.add_argument(
        "--waves", type=int, default=64, help="waves per block at most (fewer for large shapes)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a pinned worker: 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    counts = [int(x) for x in args.reqs.split(",")]
    vocabs = [int(x) for x in args.vocab.split(",")]
    results = {}
    for vocab in vocabs:
        for n in counts:
            waves = waves_for(n, vocab, args.waves)
            print(
                f"  measuring {n} requests x vocab {vocab} ({waves} waves a block) ...", flush=True
            )
            results[(n, vocab)] = measure(n, vocab, args.blocks, waves)
    variants = (*NAMES, "all", "all+spec")
    for vocab in vocabs:
        rows = [(v, *(f"{results[(n, vocab)][v]:.1f}" for n in counts)) for v in variants]
        rows += [
            (f"{v}: less its kernels", *(f"{results[(n, vocab)][v + ' host']:.1f}" for n in counts))
            for v in WITH_REDUCTION
        ]
        rows += [
            (
                f"{v}: host, logits x{NARROW}",
                *(f"{results[(n, vocab)][v + ' narrow']:.1f}" for n in counts),
            )
            for v in variants
        ]
        kernels = (
            ("row max kernel (logits_finite)", "row max kernel"),
            ("logits kernels, with health stats", "reduction"),
        )
        for label, key in kernels:
            rows.append((label, *(f"{results[(n, vocab)][key]:.1f}" for n in counts)))
        print(
            f"\nadded time per wave (us), CPU, vocab {vocab}, torch threads {args.threads}, median "
            f"of {args.blocks} blocks, vs the same waves with none enabled"
        )
        print(
            render_table(
                ("detector", *(f"{n} reqs" for n in counts)),
                rows,
                right=tuple(range(1, len(counts) + 1)),
            )
        )
    print(
        "\nlogits_stats runs every 16 waves by default; its figure is that cost spread over 16 "
        "waves. 'less its kernels' is the variant less its logits kernels timed alone (the row "
        "max per wave, the health stats every 16), which on a device are launches the host "
        "does not wait for; where the kernels dwarf the host work, their noise swamps it. "
        f"'host, logits x{NARROW}' is the variant on the same waves with [requests, {NARROW}] "
        "logits: every call and dispatch, none of the kernels' arithmetic. The summary's host "
        "figure is that one."
    )
    vocab = 32000 if 32000 in vocabs else vocabs[0]

    def host_at(n: int) -> str:
        found = results.get((n, vocab))
        return f"{found['all narrow']:.1f}" if found else "n/a"

    at_256 = results.get((256, vocab))
    kernel = f"{at_256['row max kernel']:.1f} us" if at_256 else "n/a"
    print(
        f"detectors: host us per wave 16 req {host_at(16)}; 256 req {host_at(256)}; reduction "
        f"256x{vocab} {kernel}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
