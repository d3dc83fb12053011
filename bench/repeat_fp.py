"""How often `token_repeat` flags output that does not loop: its false-positive rate.

A real `vllm serve` (CPU, TP=1, the tiny model) with the guard and default detectors, and a real
sidecar. It sends sampled requests (diverse output) and greedy ones (which loop on this model)
and compares, per request, the detector's verdict with an independent one computed here from
the tokens the API returned: "loops" when some window of 48 tokens uses at most 8 distinct ids.

    python bench/repeat_fp.py [--requests 64] [--max-tokens 512] [--temperature 1.0]
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from telemetry.cli.table import render_table  # noqa: E402
from tests.support.sidecar import SidecarProcess  # noqa: E402
from tests.support.vllm_server import VllmServer, token_ids  # noqa: E402
from tools.make_tiny_model import build_tiny_model  # noqa: E402

WORDS = ("river", "engine", "garden", "signal", "winter", "market", "planet", "window")


def loops_somewhere(tokens: list[int], width: int = 48, distinct: int = 8) -> bool:
    return any(
        len(set(tokens[i : i + width])) <= distinct
        for i in range(0, max(1, len(tokens) - width + 1), 8)
    )


def flagged(store: Path, api_ids: list[str]) -> set[str]:
    conn = sqlite3.connect(f"file:{store}?mode=ro", uri=True, timeout=5)
    try:
        rows = conn.execute(
            "SELECT request_id FROM incidents WHERE type = 'token_repeat'"
        ).fetchall()
    except sqlite3.OperationalError:
        return set()
    finally:
        conn.close()
    out = set()
    for (request_id,) in rows:
        for api_id in api_ids:
            if request_id.startswith(api_id + "-") or request_id == api_id:
                out.add(api_id)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=0.95)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="repeat-fp-"))
    model = build_tiny_model(REPO / ".cache" / "tiny-llama")
    sidecar = SidecarProcess.start(work, address=f"unix://{work / 'guard.sock'}")
    server = None
    try:
        server = VllmServer.start(
            model, work, guard={"sidecar": sidecar.address, "engine": "repeat-fp"},
            extra_args=("--max-num-seqs", "64"),
        )  # fmt: skip
        prompts = [
            f"The {WORDS[i % 8]} and the {WORDS[(i * 3) % 8]} number {i}"
            for i in range(args.requests)
        ]
        print(
            f"{args.requests} sampled requests x {args.max_tokens} tokens (T={args.temperature}, top_p={args.top_p})"
        )
        sampled = []
        for start in range(0, len(prompts), 16):
            sampled += server.complete_many(
                prompts[start : start + 16], max_tokens=args.max_tokens, temperature=args.temperature,
                top_p=args.top_p, seed=1000 + start,
            )  # fmt: skip
        print(f"{args.requests // 2} greedy requests x 128 tokens")
        greedy = server.complete_many(prompts[: args.requests // 2], max_tokens=128)
        time.sleep(2.0)
        results = []
        for name, responses in (("sampled", sampled), ("greedy", greedy)):
            ids = [r["id"] for r in responses]
            marked = flagged(sidecar.store_path, ids)
            truth = {r["id"] for r in responses if loops_somewhere(token_ids(r))}
            fp = len(marked - truth)
            fn = len(truth - marked)
            results.append(
                (name, len(ids), len(truth), len(marked), fp, f"{fp / len(ids):.1%}", fn)
            )
        print(
            render_table(
                ("requests", "n", "loop (independent)", "flagged", "false +", "FP rate", "missed"),
                results, right=(1, 2, 3, 4, 5, 6),
            )
        )  # fmt: skip
        tokens = sum(len(token_ids(r)) for r in sampled)
        print(
            f"{tokens} sampled tokens checked; false positives per 1k requests: {results[0][4] * 1000 / args.requests:.1f}"
        )
    finally:
        if server is not None:
            server.stop()
        sidecar.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
