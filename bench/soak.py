"""Soak: a TP=2 `vllm serve` under steady load while other work hogs the host's CPUs, at product
defaults (heartbeats, sidecar hang thresholds, liveness records). Waves slow down; no process
freezes, so any hang verdict is a false alarm.

One sidecar (with its liveness endpoint) and one server on the tiny model. A client keeps
`--concurrency` completions in flight for `--minutes`. `--hogs` processes spin in pure Python
in bursts (on for 1-8 s, off for 0-4 s, random), so the load on the cores changes all the time.
At the end it reads the sidecar's `/hangs` history and `ascend_guard_hang_verdicts_total`, and
prints waves, tokens/s and the slowest wave seen, ending with one line:

    soak: 600 s TP=2 under 2 CPU hogs: N waves, T tokens, 0 hang verdicts (goal: 0)

    python bench/soak.py [--minutes 10] [--hogs 2] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.metrics import value  # noqa: E402
from tests.support.ports import free_port  # noqa: E402
from tests.support.sidecar import SidecarProcess  # noqa: E402
from tests.support.vllm_server import VllmServer  # noqa: E402
from tools.make_tiny_model import build_tiny_model  # noqa: E402

ENGINE = "soak"


def _hog(seed: int, stop_at: float) -> None:
    """Spin in bursts until stop_at: slows whatever shares the core, freezes nothing."""
    rng = random.Random(seed)
    while time.time() < stop_at:
        until = time.time() + rng.uniform(1.0, 8.0)
        while time.time() < until:
            pass
        time.sleep(rng.uniform(0.0, 4.0))


def _get(port: int, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--hogs", type=int, default=2, help="CPU-spinning processes")
    parser.add_argument("--concurrency", type=int, default=4, help="completions in flight")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args(argv)

    model = Path(build_tiny_model(REPO / ".cache" / "tiny-llama"))
    root = Path(tempfile.mkdtemp(prefix="ag-soak-", dir="/tmp"))
    port = free_port()
    sidecar = SidecarProcess.start(
        root,
        address=f"unix://{root / 'guard.sock'}",
        extra_args=("--health-port", str(port), "--health-host", "127.0.0.1"),
    )
    server = None
    hogs: list[multiprocessing.Process] = []
    tokens = 0
    errors = 0
    live_503 = 0
    try:
        server = VllmServer.start(
            model, root, tp=2, guard={"sidecar": sidecar.address, "engine": ENGINE}
        )
        server.complete_many(["warm", "up"], max_tokens=8)
        duration = args.minutes * 60
        start = time.time()
        stop_at = start + duration
        ctx = multiprocessing.get_context("spawn")
        hogs = [ctx.Process(target=_hog, args=(i, stop_at), daemon=True) for i in range(args.hogs)]
        for hog in hogs:
            hog.start()
        lock = threading.Lock()

        def client(i: int) -> None:
            nonlocal tokens, errors
            n = 0
            while time.time() < stop_at:
                n += 1
                try:
                    out = server.complete(f"Soak client {i} request {n} says", args.max_tokens)
                    with lock:
                        tokens += out["usage"]["completion_tokens"]
                except Exception:  # noqa: BLE001 - counted and reported
                    with lock:
                        errors += 1

        clients = [threading.Thread(target=client, args=(i,)) for i in range(args.concurrency)]
        for c in clients:
            c.start()
        while time.time() < stop_at:
            if _get(port, f"/live/{ENGINE}")[0] == 503:
                live_503 += 1
            time.sleep(1.0)
        for c in clients:
            c.join(300)
        elapsed = time.time() - start
        history = _get(port, "/hangs")[1]["history"]
        text = sidecar.metrics_text()
    finally:
        for hog in hogs:
            hog.terminate()
        if server is not None:
            server.stop()
        sidecar.stop()
    verdicts = [e for e in history if e["event"] == "hang_verdict"]
    counted = value(text, "ascend_guard_hang_verdicts_total")
    waves = min(value(text, "ascend_guard_last_wave", engine=ENGINE, tp=str(tp)) for tp in (0, 1))
    slowest = value(text, "ascend_guard_step_duration_seconds_count", phase="step", engine=ENGINE)
    print(
        f"{elapsed:.0f} s, {args.hogs} hogs, {args.concurrency} clients: {tokens} tokens "
        f"({tokens / elapsed:.1f}/s), {errors} request errors, wave {waves:.0f} reached, "
        f"{slowest:.0f} steps timed"
    )
    print(f"/live 503 seen in {live_503} of ~{elapsed:.0f} one-second probes")
    for v in verdicts:
        print("verdict:", v["summary"])
    print(
        f"soak: {elapsed:.0f} s TP=2 under {args.hogs} CPU hogs: {waves:.0f} waves, {tokens} "
        f"tokens, {len(verdicts)} hang verdicts ({counted:.0f} counted) (goal: 0)"
    )
    return 0 if not verdicts and not counted and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
