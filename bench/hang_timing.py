"""Distribution of SIGSTOP -> /live 503 with stand-in ranks (no vLLM): the margins of the hang
tests' timing bounds come from here.

A real sidecar at product defaults and two stand-in ranks (tests/support/rank_process.py: the
real streamer, heartbeats every 0.2 s; rank 0 inside all_reduce). Each trial SIGSTOPs rank 1,
polls `/live` every 20 ms until 503, SIGCONTs, and waits for 200. Two set-ups, one sidecar each:

- **records**: the ranks write liveness records, so the sidecar sees state T (frozen rule);
- **stream only**: no records, as for ranks on another node (silence rule, --hang-after 1.5s
  as tests/integration/test_hang_verdicts.py uses).

    python bench/hang_timing.py [--trials 30]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.integration.test_hang_verdicts import Ranks, get, wait_until  # noqa: E402
from tests.support.ports import free_port  # noqa: E402
from tests.support.sidecar import SidecarProcess  # noqa: E402


def trials(n: int, records: bool) -> list[float]:
    root = Path(tempfile.mkdtemp(prefix="ag-hang-timing-"))
    port = free_port()
    extra = ("--hang-wait", "60s", "--liveness-dir", str(root / "live"))
    if not records:
        extra += ("--hang-after", "1.5s")
    sidecar = SidecarProcess.start(
        root,
        address=f"unix://{root / 'guard.sock'}",
        extra_args=("--health-port", str(port), "--health-host", "127.0.0.1", *extra),
    )
    engine = "timing"
    ranks = Ranks(
        sidecar.address, engine, waiting=(0,), record_dir=root / "live" if records else None
    )
    out = []
    try:
        wait_until(lambda: len(get(port, f"/live/{engine}")[1].get("ranks", [])) == 2, 20, "ranks")
        victim = ranks.procs[1].pid
        for _ in range(n):
            time.sleep(0.5)
            os.kill(victim, signal.SIGSTOP)
            stopped = time.monotonic()
            try:
                wait_until(lambda: get(port, f"/live/{engine}")[0] == 503, 10, "a verdict")
                out.append(time.monotonic() - stopped)
            finally:
                os.kill(victim, signal.SIGCONT)
            wait_until(lambda: get(port, f"/live/{engine}")[0] == 200, 10, "recovery")
    finally:
        ranks.stop()
        sidecar.stop()
    return out


def _summary(name: str, values: list[float]) -> str:
    q = statistics.quantiles(values, n=20) if len(values) >= 2 else values * 19
    return (
        f"{name}: n={len(values)} min {min(values):.3f} median {statistics.median(values):.3f} "
        f"p95 {q[18]:.3f} max {max(values):.3f} s"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=30)
    args = parser.parse_args(argv)
    with_records = trials(args.trials, records=True)
    stream_only = trials(args.trials, records=False)
    print(_summary("records (frozen rule, product defaults)", with_records))
    print(_summary("stream only (silence rule, --hang-after 1.5s)", stream_only))
    print(
        f"hang timing: SIGSTOP -> 503 median {statistics.median(with_records):.2f} s with "
        f"records vs {statistics.median(stream_only):.2f} s stream only; max "
        f"{max(with_records):.2f} vs {max(stream_only):.2f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
