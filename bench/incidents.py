"""The incident matrix with full holds: is the hang verdict right, and does it stand, from the
fault to its end? (tests/support/incident_matrix.py has the scenarios and how each is judged.)

One `vllm serve` (tiny model, TP=2, guard on) and one sidecar at its defaults, unless
`--stream-ping-timeout` is given: `1m` is gRPC's own default, under which a stopped rank's
stream ended after 60 s. Each scenario holds its fault `--hold` seconds (150 by default), polls
`/live/<engine>` every second, and prints one JSON line; a table and the summary line follow.
Holds the vLLM lock for its whole run when started under `flock /tmp/ag-vllm.lock`.

    python bench/incidents.py [--hold 150] [--stream-ping-timeout 1m] [--only tp1_stop,...]

Goal: P/P polls, F = 0 false verdicts, W = 0 wrong ranks, recovery p50 R <= 5 s.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from telemetry.cli.table import render_table  # noqa: E402
from tests.support.incident_matrix import SCENARIOS, Matrix, Outcome, summary  # noqa: E402
from tools.make_tiny_model import build_tiny_model  # noqa: E402


def bundle_cell(o: Outcome) -> str:
    """The verdict's bundle per rank: role, process state, ring length, an open call, a stack."""
    return (
        ", ".join(
            f"tp{tp} {b['role']} {b['state']} ring {b['ring']}"
            + (f" open {b['open_op']}" if b["open"] else "")
            + (" stack" if b["stack"] else " no stack")
            for tp, b in sorted(o.bundle.items())
        )
        or "-"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hold", type=float, default=150.0, help="seconds each fault is held")
    parser.add_argument(
        "--stream-ping-timeout", default=None, help="the sidecar's flag (default: its own)"
    )
    parser.add_argument("--only", default="", help="comma-separated scenarios, in matrix order")
    args = parser.parse_args()
    names = tuple(n for n in SCENARIOS if not args.only or n in args.only.split(","))
    stream_args = (
        ("--stream-ping-timeout", args.stream_ping_timeout) if args.stream_ping_timeout else ()
    )
    model = Path(build_tiny_model(REPO / ".cache" / "tiny-llama"))
    with tempfile.TemporaryDirectory(prefix="ag-incidents-") as tmp:
        matrix = Matrix(Path(tmp), model, args.hold, stream_args)
        try:
            outcomes = matrix.run(names)
        finally:
            matrix.stop()
    rows = [
        (
            o.name, "ok" if o.ok else "FAIL", o.detect_s if o.detect_s is not None else "-",
            f"{o.stood}/{o.polls}", o.unanswered, o.false_verdicts, o.wrong_ranks,
            o.recovered_during, o.recovery_s if o.recovery_s is not None else "-",
            bundle_cell(o), "; ".join(o.notes)[:90],
        )
        for o in outcomes
    ]  # fmt: skip
    print(
        render_table(
            (
                "scenario",
                "",
                "detect s",
                "stood",
                "unanswered",
                "false",
                "wrong",
                "recovered during",
                "recovery s",
                "bundle",
                "notes",
            ),
            rows,
        )  # fmt: skip
    )
    print(f"hold {args.hold:g} s; sidecar stream flags: {' '.join(stream_args) or 'defaults'}")
    print(summary(outcomes))
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
