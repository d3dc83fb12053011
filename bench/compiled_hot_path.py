"""Would compiled code take the guard under 1% of a wave? The hot path compiled, in the engine.

Issue 10's in-engine goal (the guard with defaults, timed in place, at most 1% of a tiny-model
wave) holds at 256 requests and not at 16, where the wave lasts about 1.2 ms. The earlier
sessions left two ways to close that gap: compiled code on the hot path, or a goal set at
production batch sizes. This bench measures the first.

It copies this tree to a temporary folder, compiles there every module on the engine thread's
per-wave path (`HOT_MODULES`) with Cython, unchanged (pure Python mode: annotations are not
read as C types, so the semantics stay), and checks that the copy imports the compiled
modules. Then it runs `bench/toggle.py --engine-core` alternately on the copy and on this
tree, `--pairs` times with the order swapped each pair, and reads each run's in-place goal
line and its per-call medians. Cython comes from the package index on demand (the project
does not depend on it): `.venv/bin/pip install cython`. A C compiler and Python's headers
are needed too.

    python bench/compiled_hot_path.py [--pairs 3] [any bench/toggle.py option]

The last line reads
`compiled_hot_path: in place us per wave source X; compiled Y (N pairs, medians); paired ratio compiled/source R`.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from telemetry.cli.table import render_table  # noqa: E402

# The engine thread's per-wave path with the default settings: the decorators, the processor
# and what it calls in each wave (schedule reads, the record's hand-over, the liveness record,
# request membership), and the detectors' suite with the state it touches.
HOT_MODULES = (
    "guard/decorators.py",
    "guard/processor.py",
    "guard/wave/observers.py",
    "guard/wave/schedule.py",
    "guard/stream/streamer.py",
    "telemetry/wire/liveness_record.py",
    "guard/wave/request_membership.py",
    "guard/detectors/host.py",
    "guard/detectors/suite.py",
    "guard/detectors/tokens.py",
    "guard/detectors/slots.py",
    "guard/detectors/logits.py",
)
# what the copy leaves out: the environment (linked back in), builds and caches
NOT_COPIED = (".git", ".venv", ".cache", "node_modules", "__pycache__", "build", "*.so", "*.c")
LINKED = (".venv", ".cache")  # the tiny model's weights and the kernels' cache, shared

BUILD_SCRIPT = """
import sys
from Cython.Build import cythonize
from setuptools import setup
directives = {"annotation_typing": False, "binding": True}
setup(
    ext_modules=cythonize(sys.argv[2:], language_level=3, compiler_directives=directives, quiet=True),
    script_args=["build_ext", "--inplace", "--build-temp", sys.argv[1]],
)
"""
GOAL_LINE = re.compile(r"^in-place goal: .*?: ([\d.]+) us per wave = ([\d.]+)% of the wave", re.M)
PER_CALL_LINE = re.compile(
    r"run_step median ([\d.]+) .*?run_sample median ([\d.]+) .*?on_logits median ([\d.]+)"
)
CROSS_CHECK = re.compile(r"^cross-check: .*\(match\).*identical across all rounds: True$", re.M)


def compiled_copy(workdir: Path) -> Path:
    """This tree copied under `workdir`, its hot modules compiled in place."""
    tree = workdir / "tree"
    shutil.copytree(REPO, tree, ignore=shutil.ignore_patterns(*NOT_COPIED), symlinks=True)
    for name in LINKED:
        if (REPO / name).exists():
            (tree / name).symlink_to(REPO / name)
    print(f"compiling {len(HOT_MODULES)} modules with Cython in {tree} ...", flush=True)
    build = subprocess.run(
        [sys.executable, "-c", BUILD_SCRIPT, str(workdir / "build"), *HOT_MODULES],
        cwd=tree,
        capture_output=True,
        text=True,
    )
    if build.returncode != 0:
        sys.exit(f"the Cython build failed (exit {build.returncode}):\n{build.stderr[-3000:]}")
    _check_compiled(tree)
    return tree


def _check_compiled(tree: Path) -> None:
    """Each hot module, imported the way the toggle imports it, comes from its compiled file."""
    names = [m.removesuffix(".py").replace("/", ".") for m in HOT_MODULES]
    probe = (
        f"import importlib, sys; sys.path.insert(0, {str(tree)!r}); "
        f"print('\\n'.join(importlib.import_module(n).__file__ for n in {names!r}))"
    )
    files = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout.split()
    source = [f for f in files if not f.endswith(".so")]
    if source or len(files) != len(names):
        sys.exit(f"the copy still imports source modules: {source or files}")


def run_toggle(tree: Path, toggle_args: list[str]) -> dict[str, float]:
    """One `bench/toggle.py --engine-core` run on `tree`: its in-place figures."""
    command = [sys.executable, str(tree / "bench" / "toggle.py"), "--engine-core", *toggle_args]
    done = subprocess.run(command, capture_output=True, text=True)
    goal = GOAL_LINE.search(done.stdout)
    per_call = PER_CALL_LINE.search(done.stdout)
    if done.returncode != 0 or goal is None or per_call is None:
        sys.exit(
            f"bench/toggle.py on {tree} gave no in-place figures (exit {done.returncode}):\n"
            f"{(done.stdout + done.stderr)[-3000:]}"
        )
    if CROSS_CHECK.search(done.stdout) is None:
        sys.exit(f"bench/toggle.py on {tree}: its cross-check failed:\n{done.stdout[-2000:]}")
    run_step, run_sample, on_logits = (float(v) for v in per_call.groups())
    return {
        "us": float(goal.group(1)),
        "pct": float(goal.group(2)),
        "run_step": run_step,
        "run_sample": run_sample,
        "on_logits": on_logits,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Other options go to bench/toggle.py as they are (for example --requests 256).",
    )
    parser.add_argument("--pairs", type=int, default=3, help="runs of each tree (default 3)")
    args, toggle_args = parser.parse_known_args()
    if args.pairs < 1:
        parser.error(f"--pairs must be at least 1, not {args.pairs}")
    if "--engine-core" in toggle_args:
        toggle_args.remove("--engine-core")
    try:
        import Cython  # noqa: F401
    except ImportError:
        sys.exit(
            "this bench compiles a copy of the hot path with Cython, which the project does "
            f"not depend on: `{sys.executable} -m pip install cython`, then run it again"
        )

    rows, results = [], {"source": [], "compiled": []}
    with tempfile.TemporaryDirectory(prefix="guard-compiled-") as workdir:
        trees = {"source": REPO, "compiled": compiled_copy(Path(workdir))}
        for pair in range(args.pairs):
            order = ("source", "compiled") if pair % 2 == 0 else ("compiled", "source")
            for side in order:
                print(f"pair {pair + 1}/{args.pairs}: {side} ...", flush=True)
                run = run_toggle(trees[side], toggle_args)
                results[side].append(run)
                rows.append(
                    [
                        str(pair + 1),
                        side,
                        f"{run['us']:.1f}",
                        f"{run['pct']:.2f}%",
                        f"{run['run_step']:.1f}",
                        f"{run['run_sample']:.1f}",
                        f"{run['on_logits']:.1f}",
                    ]
                )

    print()
    print(
        "the guard in place, per wave (bench/toggle.py's goal line; per-call medians with timers)"
    )
    header = ["pair", "tree", "us", "of wave", "run_step", "run_sample", "on_logits"]
    print(render_table(header, rows, right=range(2, len(header))))
    source = statistics.median(r["us"] for r in results["source"])
    compiled = statistics.median(r["us"] for r in results["compiled"])
    ratio = statistics.median(
        c["us"] / s["us"] for s, c in zip(results["source"], results["compiled"], strict=True)
    )
    print(
        f"compiled_hot_path: in place us per wave source {source:.1f}; compiled {compiled:.1f} "
        f"({args.pairs} pairs, medians); paired ratio compiled/source {ratio:.2f}"
    )


if __name__ == "__main__":
    main()
