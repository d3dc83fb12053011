"""Does the guard hold back requests that arrive in a burst right after another burst?

Found while fixing a flaky end-to-end test (tests/e2e/test_sampling_guard.py): with the guard on,
short requests sent while long ones decode, in a burst that follows the previous one at once,
sometimes came back only when the long ones ended, seconds later. Without the guard they came
back in about 0.1 s. Not understood yet; this bench reproduces it so a fix can be measured.

One tiny-Llama `vllm serve` (TP=1) per mode, guard off then guard on (all detectors off, so only
the wave path runs), each serving the same rounds back to back with no pause between them:
3 long streamed requests, then, once each has its first token, 3 short ones. Per round it
records how long the short ones took. It prints a table and one summary line:

    burst_latency: short requests p50 off 0.07 s, on 2.10 s; max off 0.09 s, on 6.30 s; ...

Run: `.venv/bin/python bench/burst_latency.py [--rounds 6]` (about 2 minutes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.sidecar import SidecarProcess  # noqa: E402
from tests.support.vllm_server import VllmServer  # noqa: E402
from tools.make_tiny_model import build_tiny_model  # noqa: E402

LONG_TOKENS, SHORT_TOKENS, PER_ROUND = 1000, 11, 3


def guard_config(sock: Path) -> dict:
    off = {"enabled": False}
    return {
        "sidecar": f"unix://{sock}",
        "engine": "burst",
        "detectors": {"logits_stats": off, "logits_finite": off, "token_repeat": off},
    }


def one_round(server: VllmServer, round_no: int) -> float:
    """Seconds the short requests of one round took, from their submission."""
    started = threading.Semaphore(0)
    with ThreadPoolExecutor(max_workers=2 * PER_ROUND) as pool:
        long = [
            pool.submit(
                server.complete_streamed, [21 + i, 30, 61 + i, 81 + i], LONG_TOKENS, started.release
            )
            for i in range(PER_ROUND)
        ]
        for _ in long:
            if not started.acquire(timeout=60):
                raise RuntimeError("a long request never started")
        sent = time.monotonic()
        short = [
            pool.submit(server.complete, [20 + i + 5 * round_no, 40 + i, 60, 80, 100], SHORT_TOKENS)
            for i in range(PER_ROUND)
        ]
        for f in short:
            f.result()
        took = time.monotonic() - sent
        for f in long:
            f.result()
    return took


def run_mode(model: Path, root: Path, guard: bool, rounds: int) -> list[float]:
    root.mkdir(parents=True)
    sidecar = SidecarProcess.start(root, address=f"unix://{root / 'guard.sock'}") if guard else None
    try:
        config = guard_config(root / "guard.sock") if guard else None
        server = VllmServer.start(model, root, tp=1, guard=config)
        try:
            return [one_round(server, r) for r in range(rounds)]
        finally:
            server.stop()
    finally:
        if sidecar is not None:
            sidecar.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    model = build_tiny_model(REPO / ".cache" / "tiny-llama")
    with tempfile.TemporaryDirectory(prefix="burst-") as tmp:
        results = {}
        for name, guard in (("off", False), ("on", True)):
            print(f"guard {name}: {args.rounds} rounds ...", flush=True)
            results[name] = run_mode(model, Path(tmp) / name, guard, args.rounds)
    print(f"{'round':>5}  {'off (s)':>8}  {'on (s)':>8}")
    for i, (off, on) in enumerate(zip(results["off"], results["on"], strict=True)):
        print(f"{i:>5}  {off:>8.3f}  {on:>8.3f}")
    p50 = {k: statistics.median(v) for k, v in results.items()}
    worst = {k: max(v) for k, v in results.items()}
    print(
        f"burst_latency: short requests p50 off {p50['off']:.2f} s, on {p50['on']:.2f} s; "
        f"max off {worst['off']:.2f} s, on {worst['on']:.2f} s; "
        f"p50 ratio on/off {p50['on'] / p50['off']:.1f}"
    )


if __name__ == "__main__":
    main()
