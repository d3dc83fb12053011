"""`ascend-guard doctor`: where the guard attaches to vLLM / vllm-ascend (ascend_runtime/doctor/coverage.py,
run in the vLLM container), and `doctor --live`: ask the running sidecar how complete each
engine's coverage is.

`doctor` parses its own options (they pass through as given), so telemetry/cli/main.py hands it the
raw arguments (`main_raw`) before its own parser runs.

For every engine it serves: are all the ranks of its TP x PP x DP world connected, and has every
connected rank bound every attach point? Exit 0 when all is covered, 1 when something is
missing (the output names it), 2 when the sidecar cannot be reached. Imports neither torch nor
vLLM: it runs in the sidecar's container too.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from telemetry.cli.common import LiveFlag, add_sidecar_argument, deprecated, health_base
from telemetry.cli.http_client import (
    Unreachable,
    add_token_argument,
    get_json,
    refusal_hint,
    token_of,
)
from telemetry.cli.table import render_table
from telemetry.wire import paths


def add_parser(sub: argparse._SubParsersAction) -> None:
    """For the command list and `--help`; `main_raw` parses the real arguments."""
    doctor = sub.add_parser(
        "doctor",
        help="where the guard attaches to vLLM / vllm-ascend, bound or missing (--help for more)",
        add_help=False,
    )
    doctor.add_argument("doctor_args", nargs=argparse.REMAINDER)


def run(args: argparse.Namespace) -> int:
    return main_raw(args.doctor_args)


LIVE_OPTIONS = ("--live", "--sidecar")
SOURCE_TREE = "--source-tree"


def _given(argv: Sequence[str], option: str) -> bool:
    return any(a == option or a.startswith(option + "=") for a in argv)


def main_raw(argv: Sequence[str]) -> int:
    """`ascend-guard doctor ARGS`: `--live` (or `--sidecar URL`) asks the sidecar (imports no
    vLLM); otherwise the attach-point report of ascend_runtime/doctor/coverage.py, which imports
    torch/vLLM only when run. `--source PATH` is the old spelling of `--source-tree PATH`
    (`--source` names where query and trace read)."""
    if any(_given(argv, option) for option in LIVE_OPTIONS):
        return main(argv)
    from ascend_runtime.doctor.coverage import main as doctor_main

    argv = list(argv)
    for i, arg in enumerate(argv):
        if arg == "--source" or arg.startswith("--source="):
            deprecated("ascend-guard doctor", "--source PATH", f"{SOURCE_TREE} PATH")
            argv[i] = SOURCE_TREE + arg[len("--source") :]
    return doctor_main(argv)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ascend-guard doctor --live",
        description="Coverage of the engines a running sidecar serves.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--live",
        action=LiveFlag,
        help="ask the running sidecar (`--live URL` is the old spelling of --sidecar URL)",
    )
    add_sidecar_argument(parser, "health")
    parser.add_argument("--engine", default=None, help="only this engine")
    add_token_argument(parser)
    parser.add_argument(
        "--expect-local",
        type=int,
        default=None,
        metavar="N",
        help="ranks this node should host (default: the whole TP x PP x DP world)",
    )
    parser.add_argument("--json", action="store_true", help="print the sidecar's JSON")
    return parser


def problems(engine: dict[str, Any], expect_local: int | None = None) -> list[str]:
    """What keeps one engine from full coverage; empty when it is fully covered."""
    out = []
    expected = expect_local or engine["expected_ranks"]
    quiet = engine.get("without_stream", [])
    if engine["connected_ranks"] < expected:
        missing = ", ".join(engine["missing"][:8]) + (" ..." if len(engine["missing"]) > 8 else "")
        why = [f"missing {missing}"] if missing else []
        why += [f"{len(quiet)} known with no stream"] if quiet else []
        out.append(f"{engine['connected_ranks']} of {expected} ranks connected ({'; '.join(why)})")
    for r in quiet:  # known to the sidecar, but not streaming: never "covered"
        state = f", process {r['state']}" if r.get("where") == "local" and r.get("state") else ""
        out.append(
            f"dp{r['dp']}/tp{r['tp']}/pp{r['pp']} pid {r['pid']}: {r['stream']} "
            f"({r['where']}{state})"
        )
    if engine.get("hang_verdict"):
        out.append("a hang verdict stands (ascend-guard hangs --live)")
    if engine["skipped_attach_points"]:
        out.append(f"{engine['skipped_attach_points']} attach point(s) skipped")
    if engine["unreported_attach_points"]:
        out.append(
            "no attach-point report yet from " + ", ".join(engine["unreported_attach_points"])
        )
    return out


def main(argv: Sequence[str]) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0) if exc.code in (0, None) else 2
    base = health_base(args)
    if base is None:
        off = paths.health_off_locally() or {}
        print(
            f"ascend-guard doctor --live: {paths.health_off_message(off, 'doctor --live')}",
            file=sys.stderr,
        )
        return 2
    try:
        status, body = get_json(f"{base}/coverage", token=token_of(args))
    except Unreachable as exc:
        print(
            f"ascend-guard doctor --live: {exc}; is the sidecar running with --health-port?",
            file=sys.stderr,
        )
        return 2
    if status != 200:
        print(
            f"ascend-guard doctor --live: {base}/coverage answered {status}{refusal_hint(status)}",
            file=sys.stderr,
        )
        return 2
    engines = [e for e in body.get("engines", []) if not args.engine or e["engine"] == args.engine]
    if args.json:
        print(json.dumps({"sidecar": base, "engines": engines}, indent=2, sort_keys=True))
    if not engines:
        if not args.json:
            which = f"engine {args.engine}" if args.engine else "no engine"
            print(f"{which}: no rank connected to the sidecar at {base}")
            print(
                "next: start vLLM with the runtime_guard config; its sidecar address must be "
                "this sidecar's --listen"
            )
        return 1
    bad = {e["engine"]: problems(e, args.expect_local) for e in engines}
    if not args.json:
        rows = []
        for e in engines:
            for r in e["ranks"]:
                points = r["attach_points"]
                rows.append(
                    (
                        e["engine"],
                        f"dp{r['dp']}/tp{r['tp']}/pp{r['pp']}",
                        r["pid"],
                        r["runner"],
                        points.get("bound", "-"),
                        points.get("skipped", "-"),
                    )
                )
        print(
            render_table(
                ("engine", "rank", "pid", "runner", "bound", "skipped"), rows, right=(2, 4, 5)
            )
        )
        print("")
        for e in engines:
            world = f"tp{e['tp_size']} x pp{e['pp_size']} x dp{e['dp_size']}"
            verdict = "; ".join(bad[e["engine"]]) or "fully covered"
            print(
                f"{e['engine']} ({world}): {e['connected_ranks']} of {e['expected_ranks']} "
                f"ranks connected; {verdict}"
            )
        steps = next_steps(engines, args.expect_local)
        if steps:
            print("next: " + "; ".join(steps))
    return 1 if any(bad.values()) else 0


def next_steps(engines: list[dict[str, Any]], expect_local: int | None = None) -> list[str]:
    """What to do about the problems these engines have, and only those."""
    steps: dict[str, None] = {}
    for e in engines:
        if e["connected_ranks"] < (expect_local or e["expected_ranks"]) or e.get("without_stream"):
            steps["for missing ranks check their sidecar address (docs/runbooks)"] = None
        if e.get("hang_verdict"):
            steps["for the hang verdict run `ascend-guard hangs --live`"] = None
        if e["skipped_attach_points"]:
            steps["for skipped points run `ascend-guard doctor` inside the vLLM container"] = None
        if e["unreported_attach_points"]:
            steps[
                "ranks with no attach-point report yet send one with their next heartbeat "
                "(about a second after connecting): run doctor --live again"
            ] = None
    return list(steps)
