"""Fixtures shared by the integration tests: short socket directories and sidecar processes."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from tests.support.sidecar import SidecarProcess


@pytest.fixture
def sock_dir():
    """A short directory for unix sockets (pytest's tmp_path can exceed the 108-byte limit)."""
    path = Path(tempfile.mkdtemp(prefix="ag-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def sidecars(tmp_path, sock_dir):
    """Start sidecars on one socket and store; all are stopped at the end."""
    started: list[SidecarProcess] = []

    def start(**kwargs) -> SidecarProcess:
        sidecar = SidecarProcess.start(
            tmp_path, address=f"unix://{sock_dir / 'guard.sock'}", **kwargs
        )
        started.append(sidecar)
        return sidecar

    yield start
    for sidecar in started:
        sidecar.stop()
