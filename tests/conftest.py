"""Shared fixtures: the tiny local model, built once per machine into .cache/."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MODEL_CACHE = REPO / ".cache" / "tiny-llama"


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from tools.make_tiny_model import build_tiny_model

    return Path(build_tiny_model(MODEL_CACHE))
