"""Store faults against a real sidecar process over real gRPC: a full disk, a corrupt or
truncated store file, and kill -9 in the middle of writes.

The full disk is a real one: a tmpfs of a few MiB that the test mounts (root is needed; where
`mount` is not allowed the test is skipped and says why). Records come from the real worker-side
client (`guard.stream.streamer.Streamer`), the store is read back with SQLite from the test.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from telemetry.store import connect, count_waves
from tests.support.feed import make_streamer, send_waves, wave_tuple
from tests.support.metrics import value
from tests.support.ports import free_port
from tests.support.sidecar import SidecarProcess

pytestmark = pytest.mark.timeout(120)
JSON_LOG = ("--log-json",)  # the tests read its lines


def wait_for(check: Callable[[], object], timeout: float, what: str, log: Callable[[], str]):
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{log()[-3000:]}")
        time.sleep(0.05)


def stored_waves(path: Path) -> int:
    conn = connect(path, readonly=True)
    try:
        return count_waves(conn)
    finally:
        conn.close()


def log_events(sidecar: SidecarProcess, event: str) -> list[dict]:
    out = []
    for line in sidecar.log().splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if record.get("event") == event:
                out.append(record)
    return out


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


class Feeder:
    """Two ranks offering waves at a steady rate through the real client, until stopped."""

    def __init__(self, address: str, *, per_tick: int = 10, tick_s: float = 0.01) -> None:
        self.streamers = [
            make_streamer(address, engine="faults", rank=(0, tp, 0), pid=5000 + tp)
            for tp in range(2)
        ]
        self.offered = 0  # per rank
        self._per_tick = per_tick
        self._tick_s = tick_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Feeder:
        for streamer in self.streamers:
            streamer.start()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            for _ in range(self._per_tick):
                self.offered += 1
                for streamer in self.streamers:
                    streamer.offer(wave_tuple(self.offered))
            self._stop.wait(self._tick_s)

    def pause(self) -> None:
        self._stop.set()
        self._thread.join()

    def stop(self) -> None:
        self.pause()
        for streamer in self.streamers:
            streamer.stop()


# -- a full disk ----------------------------------------------------------------------------------
@contextlib.contextmanager
def small_filesystem(size: str) -> Iterator[Path]:
    """A tmpfs of `size`, mounted for the test and unmounted after it."""
    where = Path(tempfile.mkdtemp(prefix="ag-full-", dir="/tmp"))
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        where.rmdir()
        pytest.skip(
            f"cannot mount a small tmpfs here (uid {os.getuid()}): {done.stderr.strip()}; the "
            "disk-full test needs a real file system that fills up"
        )
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
        shutil.rmtree(where, ignore_errors=True)


def fill(directory: Path) -> Path:
    """Write zeros into `directory` until its file system has no space left."""
    filler = directory / "filler"
    chunk = b"\0" * 65536
    with open(filler, "wb") as handle:
        try:
            while True:
                handle.write(chunk)
                handle.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    with contextlib.suppress(OSError), open(filler, "ab") as handle:  # the last partial page
        while True:
            handle.write(b"\0" * 512)
            handle.flush()
    return filler


def test_a_full_disk_degrades_the_store_and_writing_resumes_when_space_returns(
    tmp_path, sock_dir
) -> None:
    """While the disk is full: /metrics and /live answer, `ascend_guard_store_degraded` is 1,
    every record the store could not write is counted (stage=store, reason=disk_full), one
    `store_degraded` line is logged. Once space returns the store writes again
    (`store_resumed`, degraded 0) and sent = stored + counted drops holds."""
    with small_filesystem("4m") as disk:
        store = disk / "store.db"
        health = free_port()
        sidecar = SidecarProcess.start(
            tmp_path,
            address=f"unix://{sock_dir / 'guard.sock'}",
            store_path=store,
            # a budget the 4 MiB volume can hold at start (a larger one is refused); the test
            # then fills the volume from outside the store
            extra_args=(
                "--log-json",
                "--health-port",
                str(health),
                "--health-host",
                "127.0.0.1",
                "--max-store-bytes",
                "3MiB",
            ),
        )
        try:
            metrics = sidecar.metrics_text
            assert value(metrics(), "ascend_guard_store_degraded") == 0
            send_waves(sidecar.address, engine="full", waves=40)  # before: stored
            wait_for(
                lambda: value(metrics(), "ascend_guard_store_committed_records_total") == 80,
                15,
                "the first waves committed",
                sidecar.log,
            )
            filler = fill(disk)
            feeder = Feeder(sidecar.address).start()
            wait_for(
                lambda: value(metrics(), "ascend_guard_store_degraded") == 1,
                20,
                "the store to report degraded",
                sidecar.log,
            )
            # alive and scraped while degraded, records keep arriving and are counted
            dropped_then = value(
                metrics(), "ascend_guard_pipeline_dropped_records_total", stage="store"
            )
            wait_for(
                lambda: (
                    value(
                        metrics(),
                        "ascend_guard_pipeline_dropped_records_total",
                        stage="store",
                        reason="disk_full",
                    )
                    > dropped_then + 1000
                ),
                20,
                "more records counted as dropped by the full store",
                sidecar.log,
            )
            assert http_status(f"http://127.0.0.1:{health}/live") == 200
            assert sidecar.proc.poll() is None
            # one line per degraded episode, not per failed write. A write can succeed while the
            # volume is full (SQLite reuses pages its own retention freed inside the file): that
            # ends the episode (store_resumed) and the next failure opens another
            # the resumes are read before the episodes, so a resume between the two reads cannot
            # make a count look short
            resumed_so_far = len(log_events(sidecar, "store_resumed"))
            episodes = log_events(sidecar, "store_degraded")
            assert resumed_so_far <= len(episodes) <= resumed_so_far + 1, sidecar.log()[-3000:]
            assert all(e["reason"] == "disk_full" for e in episodes), episodes

            filler.unlink()  # space returns
            wait_for(
                lambda: value(metrics(), "ascend_guard_store_degraded") == 0,
                20,
                "the store to resume",
                sidecar.log,
            )
            committed_at_resume = value(metrics(), "ascend_guard_store_committed_records_total")
            wait_for(
                lambda: (
                    value(metrics(), "ascend_guard_store_committed_records_total")
                    > committed_at_resume + 100
                ),
                20,
                "writes after the resume",
                sidecar.log,
            )
            feeder.stop()
            sent = 2 * (40 + feeder.offered)

            def settled() -> str | None:
                """The scrape once every wave is received and the store has written or counted
                each of its records: the receive counter runs ahead of the store's writer."""
                t = metrics()
                received = value(t, "ascend_guard_waves_total") == sent
                accounted = (
                    value(t, "ascend_guard_store_committed_records_total")
                    + value(t, "ascend_guard_pipeline_dropped_records_total")
                    == sent
                )
                return t if received and accounted else None

            text = wait_for(settled, 20, "every wave received and written or counted", sidecar.log)
            resumed = log_events(sidecar, "store_resumed")
            assert len(resumed) == len(log_events(sidecar, "store_degraded")), resumed
            assert sum(r["lost_records"] for r in resumed) > 0, resumed
        finally:
            sidecar.stop()
        # the sidecar's own account, and the store read independently, after a clean stop
        committed = value(text, "ascend_guard_store_committed_records_total")
        drops = value(text, "ascend_guard_pipeline_dropped_records_total")
        store_drops = value(text, "ascend_guard_pipeline_dropped_records_total", stage="store")
        assert drops == store_drops  # nothing shed anywhere else
        assert stored_waves(store) == committed
        assert committed + drops == sent, (committed, drops, sent)
        print(
            f"disk full: sent {sent}, committed {committed:.0f}, counted as dropped (disk_full) "
            f"{drops:.0f}; store_resumed lost_records={resumed[0]['lost_records']} "
            f"after {resumed[0]['degraded_s']} s degraded"
        )


# -- a corrupt or truncated store file --------------------------------------------------------------
def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _scribble(path: Path) -> None:
    with open(path, "r+b") as handle:  # pages in the middle of the file overwritten
        handle.seek(path.stat().st_size // 2 // 4096 * 4096)
        handle.write(os.urandom(3 * 4096))


def _garbage(path: Path) -> None:
    path.write_bytes(os.urandom(64 * 1024))


@pytest.mark.parametrize("damage", [_truncate, _scribble, _garbage], ids=lambda f: f.__name__[1:])
def test_a_corrupt_store_is_moved_aside_and_a_fresh_one_begins(tmp_path, sock_dir, damage) -> None:
    store = tmp_path / "store.db"
    address = f"unix://{sock_dir / 'guard.sock'}"
    first = SidecarProcess.start(tmp_path, address=address, store_path=store, extra_args=JSON_LOG)
    try:
        send_waves(first.address, engine="before", waves=3000)
        first.wait_for(lambda t: value(t, "ascend_guard_store_committed_records_total") == 6000)
    finally:
        first.stop()
    assert not Path(f"{store}-wal").exists() or Path(f"{store}-wal").stat().st_size == 0
    assert store.stat().st_size > 64 * 1024  # pages enough that a cut lands inside data
    damage(store)
    damaged = store.read_bytes()

    second = SidecarProcess.start(tmp_path, address=address, store_path=store, extra_args=JSON_LOG)
    try:
        moved = log_events(second, "store_moved_aside")
        assert len(moved) == 1, second.log()
        aside = Path(moved[0]["moved_to"])
        assert aside.name.startswith("store.db.corrupt-") and aside.parent == tmp_path
        assert aside.read_bytes() == damaged  # kept as it was, for inspection
        assert moved[0]["problem"], moved
        assert value(second.metrics_text(), "ascend_guard_store_moved_aside_total") == 1
        send_waves(second.address, engine="after", waves=25)
        second.wait_for(lambda t: value(t, "ascend_guard_store_committed_records_total") == 50)
    finally:
        second.stop()
    assert stored_waves(store) == 50  # a fresh store: only what came after
    conn = connect(store, readonly=True)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        engines = {row[0] for row in conn.execute("SELECT DISTINCT engine FROM ranks")}
    finally:
        conn.close()
    assert engines == {"after"}

    third = SidecarProcess.start(tmp_path, address=address, store_path=store, extra_args=JSON_LOG)
    try:  # a sound store is kept
        assert not log_events(third, "store_moved_aside"), third.log()
        assert value(third.metrics_text(), "ascend_guard_store_moved_aside_total") == 0
    finally:
        third.stop()
    assert stored_waves(store) == 50


# -- kill -9 in the middle of writes ----------------------------------------------------------------
def test_kill_9_during_writes_loses_no_committed_row(tmp_path, sock_dir) -> None:
    """SIGKILL right after a scrape: every record the sidecar had reported committed
    (`ascend_guard_store_committed_records_total`) is in the store a new sidecar opens."""
    store = tmp_path / "store.db"
    address = f"unix://{sock_dir / 'guard.sock'}"
    sidecar = SidecarProcess.start(tmp_path, address=address, store_path=store, extra_args=JSON_LOG)
    feeder = Feeder(address).start()
    try:
        committed = 0.0
        deadline = time.monotonic() + 30
        while committed < 8_000:  # writes well under way, WAL checkpoints included
            assert time.monotonic() < deadline, sidecar.log()[-3000:]
            committed = value(sidecar.metrics_text(), "ascend_guard_store_committed_records_total")
        before_kill = value(sidecar.metrics_text(), "ascend_guard_store_committed_records_total")
        os.kill(sidecar.proc.pid, signal.SIGKILL)
        sidecar.proc.wait(10)
    finally:
        feeder.pause()
    assert before_kill >= committed > 0
    assert stored_waves(store) >= before_kill  # read as the dead sidecar left it (WAL included)

    restarted = SidecarProcess.start(
        tmp_path, address=address, store_path=store, extra_args=JSON_LOG
    )
    try:
        assert not log_events(restarted, "store_moved_aside"), restarted.log()
        in_store = stored_waves(store)
        assert in_store >= before_kill
        # the workers keep streaming into the restarted sidecar, on the same store (new waves:
        # what was buffered at the kill may all have gone into the dead stream)
        for n in range(feeder.offered + 1, feeder.offered + 11):
            for streamer in feeder.streamers:
                streamer.offer(wave_tuple(n))
        restarted.wait_for(
            lambda t: value(t, "ascend_guard_store_committed_records_total") > 0, timeout=20
        )
    finally:
        feeder.stop()
        restarted.stop()
    conn = connect(store, readonly=True)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        conn.close()
    assert stored_waves(store) > in_store
    print(f"kill -9: {before_kill:.0f} reported committed, {in_store} in the reopened store")


def test_a_restarted_sidecar_counts_the_waves_missing_after_a_ranks_last_stored_wave(
    tmp_path, sock_dir
) -> None:
    """Waves 1-40 of tp0 and tp2 stored by one sidecar (each worker had dropped 5 records by
    then); a second one, on the same store, first receives wave 71 of tp0: 30 waves are counted
    in ascend_guard_store_restart_gap_records_total and named in a `store_restart_gap` line.
    tp2's worker overflowed its 16-record buffer with waves 51-90 before the second sidecar was
    up: it dropped 51-74 and counted them, so of the 34 waves between 40 and 75 only 41-50 (lost
    with the first sidecar) are the gap's: a long outage's worker drops are not counted twice.
    A rank that simply goes on (tp1, new to the store) counts nothing."""
    store = tmp_path / "store.db"
    address = f"unix://{sock_dir / 'guard.sock'}"
    sizes = (1, 3, 1)
    first = SidecarProcess.start(tmp_path, address=address, store_path=store, extra_args=JSON_LOG)
    try:
        send_waves(
            first.address,
            engine="gap",
            ranks=((0, 0, 0), (0, 2, 0)),
            waves=40,
            drop=5,
            run_id="run-gap",
        )
        first.wait_for(lambda t: value(t, "ascend_guard_store_committed_records_total") == 80)
    finally:
        first.stop()
    second = SidecarProcess.start(tmp_path, address=address, store_path=store, extra_args=JSON_LOG)
    try:
        streamers = [
            make_streamer(
                address,
                engine="gap",
                rank=(0, tp, 0),
                sizes=sizes,
                run_id="run-gap",
                pid=4000 + tp,
                buffer_size=16 if tp == 2 else 8192,
            )
            for tp in range(3)
        ]
        for streamer in (streamers[0], streamers[2]):
            streamer.dropped = 5  # the same workers: their counts go on from the first sidecar's
        for n in range(71, 81):  # tp0 lost 41-70; tp1 is new to the store
            streamers[0].offer(wave_tuple(n))
            streamers[1].offer(wave_tuple(n - 70))
        for n in range(51, 91):  # tp2 lost 41-50 with the first sidecar, then dropped 51-74
            streamers[2].offer(wave_tuple(n))
        assert streamers[2].dropped == 5 + 24
        for streamer in streamers:
            streamer.start()
        text = second.wait_for(
            lambda t: value(t, "ascend_guard_store_committed_records_total") == 10 + 10 + 16
        )
        for streamer in streamers:
            streamer.stop()
        assert value(text, "ascend_guard_store_restart_gap_records_total") == 30 + 10
        gaps = sorted(log_events(second, "store_restart_gap"), key=lambda g: g["tp"])
        assert [
            (
                g["tp"],
                g["last_stored_wave"],
                g["first_received_wave"],
                g["missing_waves"],
                g["dropped_by_worker"],
            )
            for g in gaps
        ] == [(0, 40, 71, 30, 0), (2, 40, 75, 10, 24)], gaps
    finally:
        second.stop()
