"""A `runtime_guard` config that does not validate stops `vllm serve` at start-up, naming the
bad key and value, before any engine process is spawned."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.vllm_server import cpu_env

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.mark.parametrize(
    ("guard", "expected"),
    [
        ({"buffer_size": "big"}, "runtime_guard.buffer_size: expected an integer, got 'big'"),
        ({"sidecar": "nowhere"}, "runtime_guard.sidecar: 'nowhere' is not an address"),
        ({"flush_everything": True}, "runtime_guard.flush_everything: unknown key (value True)"),
    ],
    ids=["wrong-type", "bad-address", "unknown-key"],
)
def test_bad_guard_config_stops_startup(tiny_model, guard, expected) -> None:
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model),
        "--dtype", "float32", "--enforce-eager", "--gpu-memory-utilization", "0.1", "--port", "1",
        "--additional-config", json.dumps({"runtime_guard": guard}),
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, env=cpu_env(1), timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert expected in output, output[-3000:]
    assert "EngineCore" not in output or "Started engine" not in output
