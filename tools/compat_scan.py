"""`make compat`: the attach points each vLLM release really holds, read from its wheel's source.

    python tools/compat_scan.py                       # vLLM 0.33.0 and 0.34.0 (COMPAT_VERSIONS)
    python tools/compat_scan.py 0.34.0 --ascend DIR   # one release, and a vllm-ascend checkout
    python tools/compat_scan.py --record              # also rewrite tests/data/vllm_layouts.json

For each version, `pip download --no-deps vllm==V` brings the wheel into .cache/compat/ (a CUDA
build: it is never installed or imported), its `vllm/*.py` files are unpacked next to it, and
`ascend-guard doctor --source-tree` scans them. A vllm-ascend checkout (`--ascend`, or
VLLM_ASCEND_SRC) is scanned the same way; PyPI's vllm-ascend is an sdist that pip cannot prepare
without torch_npu, so there is no download for it. One line per tree: found, missing and
"not in this version" (a runner the release does not hold). Exit 1 when any point is missing.

`--record` writes what each release's source holds at the table's vLLM attach points (module ->
class -> the table's methods it defines) to tests/data/vllm_layouts.json, from which
tests/unit/ascend_runtime/test_runner_versions.py rebuilds each release's tree without downloading it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "compat"
COMPAT_VERSIONS = ("0.33.0", "0.34.0")
LAYOUTS = ROOT / "tests" / "data" / "vllm_layouts.json"


def wheel_source(version: str) -> Path:
    """The unpacked Python source of vLLM `version`'s wheel (downloaded once)."""
    tree = CACHE / f"vllm-{version}"
    if (tree / "vllm" / "_version.py").is_file():
        return tree
    wheels = CACHE / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob(f"vllm-{version}-*.whl"))
    if not found:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
             f"vllm=={version}", "-d", str(wheels)],
            check=True,
        )  # fmt: skip
        found = sorted(wheels.glob(f"vllm-{version}-*.whl"))
    with zipfile.ZipFile(found[-1]) as wheel:
        members = [n for n in wheel.namelist() if n.startswith("vllm/") and n.endswith(".py")]
        wheel.extractall(tree, members)
    return tree


def layout(tree: Path) -> dict:
    """What `tree` holds at the table's vLLM attach points: its version, and per module that
    exists, per class it defines, the table's methods that class defines in its own body."""
    import ast

    sys.path.insert(0, str(ROOT))
    from ascend_runtime.attach.points import ATTACH_POINTS
    from ascend_runtime.doctor.source_scan import _find_class, _walk_defs, module_file, tree_version

    modules: dict[str, dict[str, list[str]]] = {}
    for point in (p for p in ATTACH_POINTS if p.package == "vllm"):
        path = module_file(tree, point.module)
        if path is None:
            continue
        cls = _find_class(ast.parse(path.read_text(encoding="utf-8")), point.qualname)
        if cls is None:
            modules.setdefault(point.module, {})
            continue
        methods = modules.setdefault(point.module, {}).setdefault(point.qualname, [])
        defined = {n.name for n in _walk_defs(cls.body) if isinstance(n, ast.FunctionDef)}
        if point.method in defined and point.method not in methods:
            methods.append(point.method)
    return {"version": tree_version(tree, "vllm"), "modules": modules}


def scan(tree: Path) -> tuple[dict, int]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "telemetry.cli", "doctor", "--source-tree", str(tree), "--json"],
        capture_output=True, text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    if out.returncode not in (0, 1):
        raise SystemExit(f"doctor --source-tree {tree} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout), out.returncode


def summary(label: str, document: dict) -> str:
    counts: dict[str, int] = {}
    for point in document["attach_points"]:
        counts[point["status"]] = counts.get(point["status"], 0) + 1
    reasons = sorted(
        {p["detail"] for p in document["attach_points"] if p["status"] == "not in this version"}
    )
    missing = [
        f"{p['module']}.{p['class']}.{p['method']}"
        for p in document["attach_points"]
        if p["status"] == "missing"
    ]
    line = (
        f"{label}: {counts.get('found', 0)} found, {len(missing)} missing, "
        f"{counts.get('not in this version', 0)} not in this version"
    )
    if reasons:
        line += f" ({'; '.join(reasons)})"
    if missing:
        line += "\n  missing: " + ", ".join(missing)
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("versions", nargs="*", default=list(COMPAT_VERSIONS))
    parser.add_argument("--ascend", default=os.environ.get("VLLM_ASCEND_SRC") or None)
    parser.add_argument("--record", action="store_true", help=f"rewrite {LAYOUTS.name}")
    args = parser.parse_args(argv)
    trees = [(f"vllm {v}", wheel_source(v)) for v in args.versions]
    if args.record:
        LAYOUTS.parent.mkdir(exist_ok=True)
        recorded = {v: layout(tree) for v, (_, tree) in zip(args.versions, trees, strict=True)}
        LAYOUTS.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
    if args.ascend:
        trees.append((f"vllm-ascend {args.ascend}", Path(args.ascend)))
    worst = 0
    for label, tree in trees:
        document, rc = scan(tree)
        worst = max(worst, rc)
        print(summary(label, document))
    return worst


if __name__ == "__main__":
    sys.exit(main())
