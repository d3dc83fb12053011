"""Nothing lost without a count: N real client processes stream M records each at full speed
over real gRPC into a real sidecar. Records stored (counted in the store file itself) plus the
drops the sidecar counts (by stage and reason) equal the records sent; with room to keep up,
drops are 0; with a queue too small to keep up, the drops are there, counted, and the
sidecar's memory stays bounded."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from telemetry import store as store_mod
from tests.support.metrics import samples, value
from tests.support.sidecar import SidecarProcess

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(180)
CLIENTS = 3
RECORDS = 20_000


def flood(sidecar: SidecarProcess, engine: str) -> int:
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.support.flood",
                sidecar.address,
                "--tp",
                str(tp),
                "--tp-size",
                str(CLIENTS),
                "--records",
                str(RECORDS),
                "--engine",
                engine,
            ],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for tp in range(CLIENTS)
    ]
    for proc in procs:
        assert proc.stdout.readline().strip() == "ready"
    for proc in procs:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    sent = 0
    for proc in procs:
        result = json.loads(proc.stdout.readline())
        proc.wait(30)
        assert not result["error"], result
        assert result["acked"][1] == result["records"]  # the sidecar took every batch
        sent += result["records"]
    return sent


def settle(sidecar: SidecarProcess, sent: int) -> tuple[int, float, dict]:
    """Wait until every record is stored or counted as dropped; (stored, dropped, by stage)."""
    deadline = time.monotonic() + 60
    while True:
        text = sidecar.metrics_text()
        drops = {
            (labels["stage"], labels["reason"]): v
            for labels, v in samples(text, "ascend_guard_pipeline_dropped_records_total")
        }
        conn = store_mod.connect(sidecar.store_path, readonly=True)
        try:
            stored = store_mod.count_waves(conn)
        finally:
            conn.close()
        if stored + sum(drops.values()) >= sent or time.monotonic() > deadline:
            return stored, sum(drops.values()), drops
        time.sleep(0.2)


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def test_stored_plus_counted_drops_equal_sent_and_no_drops_when_keeping_up(sidecars):
    sidecar = sidecars()
    sent = flood(sidecar, "acct")
    assert sent == CLIENTS * RECORDS
    stored, dropped, drops = settle(sidecar, sent)
    assert (stored, dropped) == (sent, 0), drops
    # the metrics agree with the store
    text = sidecar.metrics_text()
    assert value(text, "ascend_guard_waves_total", engine="acct") == sent


def test_a_queue_too_small_to_keep_up_drops_counted_and_memory_stays_bounded(sidecars):
    sidecar = sidecars(extra_args=("--queue-bytes", "64KiB"))
    sent = flood(sidecar, "flood")
    stored, dropped, drops = settle(sidecar, sent)
    assert stored + dropped == sent, (stored, drops)
    assert dropped > 0 and set(drops) == {("sidecar_queue", "full")}, drops
    assert peak_rss_mib(sidecar.proc.pid) < 300
