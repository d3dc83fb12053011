"""`make demo`: a guarded `vllm serve` (TP=2 on CPU) streaming to a real sidecar, end to end.

Builds a tiny local model, starts `ascend-guard sidecar` and `vllm serve` with the guard on,
sends a short load through the OpenAI API, prints what the guard saw (per rank, cross-checked
against vLLM's own metrics), the slowest waves from a trace query and one wave's trace, then
shuts everything down. `--keep` leaves it running until Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from telemetry.cli import main as cli  # noqa: E402
from telemetry.cli.table import format_duration_ns, render_table  # noqa: E402
from telemetry.store import connect  # noqa: E402
from telemetry.traceql.span_list import top_spans  # noqa: E402
from telemetry.wire import paths  # noqa: E402
from tests.support.metrics import value  # noqa: E402
from tests.support.ports import free_port  # noqa: E402
from tests.support.sidecar import SidecarProcess  # noqa: E402
from tests.support.vllm_server import VllmServer, completion_tokens  # noqa: E402
from tools.make_tiny_model import build_tiny_model  # noqa: E402

PROMPTS = [
    "The quick brown fox", "Once upon a time", "In the morning the engineers", "A small model can",
    "Prometheus scrapes the sidecar", "Every rank reports its wave", "The weather today is", "Numbers agree",
]  # fmt: skip


def step(message: str) -> float:
    print(f"==> {message}", flush=True)
    return time.monotonic()


def rank_summary(text: str, tp: int, store: Path) -> str:
    """Per rank: counters from the sidecar's /metrics, step times from the trace store."""
    conn = connect(store, readonly=True)
    rows = []
    for rank in range(tp):
        labels = {"engine": "demo", "dp": "0", "tp": str(rank), "pp": "0"}
        steps = [
            span.duration_ns
            for span in top_spans(
                conn, f'{{ name = "rank" && .tp = {rank} }}', 0, time.time_ns(), limit=10**9
            )
        ]
        rows.append((
            f"dp0 tp{rank} pp0",
            int(value(text, "ascend_guard_waves_total", **labels)),
            int(value(text, "ascend_guard_scheduled_tokens_total", kind="prefill", **labels)),
            int(value(text, "ascend_guard_scheduled_tokens_total", kind="decode", **labels)),
            int(value(text, "ascend_guard_sampled_tokens_total", **labels)),
            format_duration_ns(statistics.median(steps)) if steps else "-",
            format_duration_ns(max(steps)) if steps else "-",
            int(value(text, "ascend_guard_records_dropped_total", **labels)),
        ))  # fmt: skip
    headers = ("rank", "waves", "prefill tok", "decode tok", "sampled tok", "median step", "max step",
               "dropped")  # fmt: skip
    return render_table(headers, rows, right=(1, 2, 3, 4, 5, 6, 7))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tp", type=int, default=2, choices=(1, 2), help="tensor parallel size (default 2)"
    )
    parser.add_argument("--requests", type=int, default=16, help="concurrent requests in the load")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    parser.add_argument(
        "--metrics-port", type=int, default=0, help="sidecar /metrics port (default: free port)"
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep sidecar and vLLM running until Ctrl-C"
    )
    parser.add_argument(
        "--workdir", default=str(REPO / ".demo"), help="socket, store and logs go here"
    )
    args = parser.parse_args(argv)

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    # the deployment paths (/run/ascend-guard, /var/lib/ascend-guard) need root; the demo keeps
    # socket, store, spool and dumps in its work folder, and the guarded workers inherit that
    os.environ.setdefault(paths.RUNTIME_DIR_ENV, str(work))
    os.environ.setdefault(paths.STATE_DIR_ENV, str(work / "state"))
    store = work / "store.db"
    for leftover in (store, Path(f"{store}-wal"), Path(f"{store}-shm")):
        leftover.unlink(missing_ok=True)

    t0 = step("building the tiny local model (cached after the first run)")
    model = build_tiny_model(REPO / ".cache" / "tiny-llama")
    print(f"    {model} ({time.monotonic() - t0:.1f}s)")

    sidecar = server = None
    try:
        step("starting the sidecar")
        sidecar = SidecarProcess.start(
            work, address=f"unix://{work / 'guard.sock'}", metrics_port=args.metrics_port or free_port(),
            store_path=store,
        )  # fmt: skip
        print(f"    gRPC {sidecar.address}   /metrics {sidecar.metrics_url}   store {store}")

        t0 = step(f"starting vllm serve on CPU with the guard on (TP={args.tp}); about 30-60 s")
        guard = {"sidecar": sidecar.address, "engine": "demo"}
        server = VllmServer.start(model, work, tp=args.tp, guard=guard)
        print(
            f"    healthy after {time.monotonic() - t0:.0f}s at {server.base} (log {server.log_path})"
        )

        vllm_before = value(server.metrics_text(), "vllm:generation_tokens_total")
        t0 = step(f"sending {args.requests} concurrent completions x {args.max_tokens} tokens")
        prompts = [PROMPTS[i % len(PROMPTS)] + f" #{i}" for i in range(args.requests)]
        responses = server.complete_many(prompts, max_tokens=args.max_tokens)
        took = time.monotonic() - t0
        api_tokens = completion_tokens(responses)
        print(f"    {api_tokens} tokens in {took:.2f}s ({api_tokens / took:.0f} tok/s)")
        vllm_tokens = value(server.metrics_text(), "vllm:generation_tokens_total") - vllm_before

        labels = {"engine": "demo", "dp": "0", "tp": "0", "pp": "0"}
        with contextlib.suppress(TimeoutError):  # the cross-check below says what arrived
            sidecar.wait_for(
                lambda t: value(t, "ascend_guard_sampled_tokens_total", **labels) >= api_tokens, 10
            )
        time.sleep(1.0)  # let the span batch reach the store
        text = sidecar.metrics_text()

        print("\nWhat the guard saw, per rank")
        print(rank_summary(text, args.tp, store))
        guard_tokens = int(value(text, "ascend_guard_sampled_tokens_total", **labels))
        agree = "agree" if guard_tokens == vllm_tokens == api_tokens else "DISAGREE"
        print(
            f"\nCross-check: guard sampled {guard_tokens}, vllm:generation_tokens_total grew {int(vllm_tokens)}, "
            f"API returned {api_tokens}: {agree}"
        )

        print("\nSlowest waves (ascend-guard query --name rank --limit 5)")
        cli.main(["query", "--name", "rank", "--limit", "5", "--store", str(store)])
        slowest = top_spans(
            connect(store, readonly=True), '{ name = "rank" }', 0, time.time_ns(), limit=1
        )
        if slowest:
            print(f"\nThe slowest wave as a trace (ascend-guard trace {slowest[0].trace_hex})")
            cli.main(["trace", slowest[0].trace_hex, "--store", str(store)])

        print("\nIncidents the sampling detectors raised (ascend-guard incidents)")
        cli.main(["incidents", "--store", str(store), "--limit", "8"])

        print("\nWhere things are")
        print(f"    metrics   {sidecar.metrics_url}")
        print(f"    store     {store}   (ascend-guard query --store {store})")
        print(f"    logs      {sidecar.log_path}  {server.log_path}")
        print("    dashboard dashboards/ascend-guard-overview.json (see dashboards/README.md)")
        if args.keep:
            print(
                f"\nRunning; send requests to {server.base}/v1/completions. Ctrl-C stops everything."
            )
            with contextlib.suppress(KeyboardInterrupt):
                signal.pause()
        else:
            print(
                "\nNext: `make demo DEMO_ARGS=--keep` keeps it running; `make test` runs the test suite."
            )
        return 0 if agree == "agree" else 1
    finally:
        step("shutting down")
        if server is not None:
            server.stop()
        if sidecar is not None:
            sidecar.stop()


if __name__ == "__main__":
    sys.exit(main())
