"""Shared fixtures: the tiny local model, built once per machine into .cache/.

The suite runs without root: the deployment paths (/run/ascend-guard, /var/lib/ascend-guard)
are pointed at a temporary folder through the environment, which every sidecar, vLLM server and
worker the tests start inherits. The health port defaults to off, so parallel sidecars never
race for 9465; tests that probe it pass --health-port.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from telemetry.wire import paths

_SCRATCH = tempfile.mkdtemp(prefix="ascend-guard-test-")
os.environ.setdefault(paths.RUNTIME_DIR_ENV, os.path.join(_SCRATCH, "run"))
os.environ.setdefault(paths.STATE_DIR_ENV, os.path.join(_SCRATCH, "state"))
os.environ.setdefault(paths.HEALTH_PORT_ENV, "0")

REPO = Path(__file__).resolve().parent.parent
MODEL_CACHE = REPO / ".cache" / "tiny-llama"


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from tools.make_tiny_model import build_tiny_model

    return Path(build_tiny_model(MODEL_CACHE))
