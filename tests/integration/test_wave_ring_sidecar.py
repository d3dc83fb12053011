"""A real sidecar process drains a rank's wave ring (telemetry/ingest/ring_drain.py).

The rank is this test process: it writes waves into a real ring file in the sidecar's liveness
directory (the writer the guard's engine thread uses) and opens a real gRPC stream with the
worker's own streamer, which names the rank and carries heartbeats. The sidecar is stopped with
SIGSTOP to let the ring overflow for real. Every wave written is stored or counted as dropped:
the check reads the sidecar's metrics and its store.
"""

from __future__ import annotations

import mmap
import os
import signal
import sqlite3
import time
from pathlib import Path

import numpy as np
import pytest

from telemetry.wire.wave_ring import HEADER_BYTES, RingWriter, ring_path
from tests.support.feed import make_streamer, wave_tuple
from tests.support.metrics import value
from tests.support.sidecar import SidecarProcess

pytestmark = pytest.mark.timeout(60)
RUN = "run-ring"


def wait_until(check, timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def stored_waves(path: Path) -> int:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
    try:
        (count,) = conn.execute("SELECT COALESCE(SUM(waves), 0) FROM wave_blocks").fetchone()
        return count
    finally:
        conn.close()


@pytest.fixture
def sidecar(tmp_path: Path):
    live = tmp_path / "live"
    live.mkdir()
    proc = SidecarProcess.start(
        tmp_path, extra_args=("--liveness-dir", str(live), "--ring-poll", "20ms")
    )
    proc.live_dir = live
    try:
        yield proc
    finally:
        os.kill(proc.proc.pid, signal.SIGCONT)
        proc.stop()


def totals(sidecar: SidecarProcess, engine: str) -> tuple[float, float]:
    text = sidecar.metrics_text()
    labels = dict(engine=engine, dp="0", tp="0", pp="0")
    return (
        value(text, "ascend_guard_waves_total", **labels),
        value(text, "ascend_guard_records_dropped_total", **labels),
    )


def test_the_sidecar_drains_the_ring_and_every_wave_is_stored_or_counted(sidecar):
    engine = "ring"
    path = ring_path(str(sidecar.live_dir), RUN, 0, 0, 0)
    writer = RingWriter.create(path, slots=64, slot_bytes=512)
    for n in range(1, 41):  # written before the stream opens: the ring keeps them
        writer.write(wave_tuple(n))
    streamer = make_streamer(sidecar.address, engine=engine, run_id=RUN, pid=os.getpid())
    streamer.start()
    try:
        wait_until(lambda: totals(sidecar, engine) == (40, 0), what="40 waves from the ring")
        assert streamer.sent_waves == 0  # none went over gRPC
        # the sidecar stands still while the rank writes 200 waves into 64 slots
        os.kill(sidecar.proc.pid, signal.SIGSTOP)
        for n in range(41, 241):
            writer.write(wave_tuple(n))
        os.kill(sidecar.proc.pid, signal.SIGCONT)
        wait_until(lambda: totals(sidecar, engine) == (104, 136), what="64 more, 136 dropped")
        for n in range(241, 251):
            writer.write(wave_tuple(n))
        # a write begun and never finished (the worker died in it): counted when the stream ends
        with open(path, "r+b") as handle:
            words = np.frombuffer(mmap.mmap(handle.fileno(), 0), dtype="<u8")
        words[(HEADER_BYTES + (251 - 1) % 64 * 512) // 8] = 2 * 251 - 1
    finally:
        streamer.stop()
    wait_until(lambda: totals(sidecar, engine) == (114, 137), what="the last 10, and the torn one")
    wait_until(lambda: stored_waves(sidecar.store_path) == 114, what="114 waves in the store")
    assert "ring_detached" in sidecar.log()


def test_a_ring_of_an_unknown_layout_is_refused_and_its_waves_counted(sidecar):
    engine = "newer"
    path = ring_path(str(sidecar.live_dir), RUN, 0, 0, 0)
    writer = RingWriter.create(path, slots=16, slot_bytes=512, version=9)
    for n in range(1, 6):
        writer.write(wave_tuple(n))
    streamer = make_streamer(sidecar.address, engine=engine, run_id=RUN, pid=os.getpid())
    streamer.start()
    try:

        def refused() -> bool:
            text = sidecar.metrics_text()
            return (
                value(
                    text,
                    "ascend_guard_pipeline_dropped_records_total",
                    stage="ingest",
                    reason="ring_layout",
                )  # fmt: skip
                == 5
            )

        wait_until(refused, what="5 waves counted at the refused ring")
    finally:
        streamer.stop()
    log = sidecar.log()
    assert "layout version 9; this sidecar reads 1" in log
    assert (
        value(sidecar.metrics_text(), "ascend_guard_ingest_rejected_total", reason="ring_layout")
        == 1
    )


def test_a_rank_without_a_ring_streams_over_grpc_as_before(sidecar):
    engine = "grpc"
    streamer = make_streamer(sidecar.address, engine=engine, run_id=RUN, pid=os.getpid())
    for n in range(1, 11):
        streamer.offer(wave_tuple(n))
    streamer.start()
    try:
        wait_until(lambda: totals(sidecar, engine) == (10, 0), what="10 waves over gRPC")
    finally:
        streamer.stop()
