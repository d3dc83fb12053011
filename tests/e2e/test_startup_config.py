"""A `runtime_guard` config that does not validate stops `vllm serve` at start-up, naming the
bad key and value, before any engine process is spawned."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.side_by_side import side_by_side
from tests.support.vllm_server import cpu_env

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


CASES = {
    "wrong-type": (
        {"buffer_size": "big"},
        "runtime_guard.buffer_size: expected an integer, got 'big'",
    ),
    "bad-address": ({"sidecar": "nowhere"}, "runtime_guard.sidecar: 'nowhere' is not an address"),
    "unknown-key": (
        {"flush_everything": True},
        "runtime_guard.flush_everything: unknown key (value True)",
    ),
}


def _serve(model, guard: dict) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--dtype", "float32", "--enforce-eager", "--gpu-memory-utilization", "0.1", "--port", "1",
        "--additional-config", json.dumps({"runtime_guard": guard}),
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, env=cpu_env(1), timeout=240)


@pytest.fixture(scope="module")
def runs(tiny_model):
    """Every case's `vllm serve`, side by side: each is some 12 s of importing vLLM on one core
    before the config is read."""
    yield from side_by_side(
        _serve, {case: (tiny_model, guard) for case, (guard, _) in CASES.items()}
    )


@pytest.mark.parametrize("case", list(CASES))
def test_bad_guard_config_stops_startup(runs, case) -> None:
    result = runs[case].result()
    expected = CASES[case][1]
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert expected in output, output[-3000:]
    assert "EngineCore" not in output or "Started engine" not in output
