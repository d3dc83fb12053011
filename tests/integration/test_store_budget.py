"""The store's budget on a real small volume (a tmpfs the test mounts, as the disk-full test
does; root is needed, the test is skipped where `mount` is refused): under steady load through
the real client and a real sidecar, the store rolls its oldest minutes at its cap and the volume
never fills, so a pod whose emptyDir holds the store is never evicted for it. And a budget the
volume cannot hold is refused at start, naming both sizes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from tests.integration.test_store_faults import small_filesystem
from tests.support.feed import make_streamer, wave_tuple
from tests.support.metrics import value
from tests.support.sidecar import SidecarProcess

VOLUME = "8m"  # the volume's limit
CAP = 2 * 2**20  # --max-store-bytes
# SQLite's WAL reaches its checkpoint size (1000 pages of 4 KiB, with frame headers) and stays
# there; one transaction more and the -shm file on top
WAL_ALLOWANCE = 1000 * (4096 + 24) + 2**20
# waves are stamped 50 ms apart from two days ago: the store holds many one-minute buckets, as
# a long-running one does, and its cap rolls out one bucket at a time (retention is 7 days)
STEP_NS = 50_000_000


def _used(path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_the_store_rolls_at_its_cap_and_never_fills_its_volume(tmp_path, sock_dir):
    with small_filesystem(VOLUME) as disk:
        limit = os.statvfs(disk).f_blocks * os.statvfs(disk).f_frsize
        sidecar = SidecarProcess.start(
            tmp_path,
            address=f"unix://{sock_dir / 'guard.sock'}",
            store_path=disk / "store.db",
            extra_args=("--log-json", "--max-store-bytes", str(CAP), "--retention", "7d"),
        )
        streamers = [
            make_streamer(sidecar.address, engine="budget", rank=(0, tp, 0), pid=6000 + tp)
            for tp in range(2)
        ]
        peak = [0]
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], _used(disk))
                stop.wait(0.02)

        watcher = threading.Thread(target=watch, daemon=True)
        try:
            watcher.start()
            for streamer in streamers:
                streamer.start()
            wave = 0
            t0 = time.time_ns() - 2 * 86400 * 10**9
            deadline = time.monotonic() + 90
            while sidecar.log().count('"store_pruned"') < 1:
                assert time.monotonic() < deadline, (
                    "the store never reached its cap\n" + sidecar.log()[-3000:]
                )
                for _ in range(200):
                    wave += 1
                    for streamer in streamers:
                        streamer.offer(
                            wave_tuple(wave)._replace(start_unix_nano=t0 + wave * STEP_NS)
                        )
                time.sleep(0.01)
            metrics = sidecar.metrics_text()
            print(f"waves per rank {wave}, volume peak {peak[0]} of {limit} B, cap {CAP} B")
            assert value(metrics, "ascend_guard_store_degraded") == 0
            assert value(
                metrics,
                "ascend_guard_pipeline_dropped_records_total",
                stage="store",
                reason="disk_full",
            ) in (None, 0)
            assert peak[0] <= CAP + WAL_ALLOWANCE < limit
        finally:
            stop.set()
            for streamer in streamers:
                streamer.stop()
            sidecar.stop()


def test_a_budget_above_the_volume_is_refused_naming_both_sizes(tmp_path):
    with small_filesystem(VOLUME) as disk:
        done = subprocess.run(
            [sys.executable, "-m", "telemetry.cli", "sidecar", "--listen", f"unix://{tmp_path / 'g.sock'}",
             "--store", str(disk / "store.db"), "--max-store-bytes", "64MiB", "--metrics-port", "0",
             "--health-port", "0", "--query-port", "0"],
            capture_output=True, text=True, timeout=60,
            env={**os.environ, "ASCEND_GUARD_RUNTIME_DIR": str(tmp_path)},
        )  # fmt: skip
        assert done.returncode == 1, done.stderr
        assert "--max-store-bytes 64.0 MiB is above the" in done.stderr, done.stderr
        assert "MiB free" in done.stderr and str(disk) in done.stderr
