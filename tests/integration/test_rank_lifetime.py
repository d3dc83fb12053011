"""A rank lives as long as its process, not its stream: real sidecar processes, stand-in
ranks in their own processes (the real streamer client, the real liveness record,
tests/support/rank_process.py), frozen with SIGSTOP, killed with SIGKILL.

Why a stopped rank's stream ends: gRPC closes a connection whose ping goes unacknowledged
for its ping timeout (gRPC's default: one minute, for the flow-control pings it sends after
reading data), and a stopped process acknowledges nothing. The sidecar's
`--stream-ping-timeout` (default 1h) is that timeout; here it is shortened to 2 s and
`--stream-keepalive 1s` makes gRPC ping at once, so the stream of a stopped rank ends within
seconds, deterministically; the control keeps the default timeout and the stream stays.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.integration.test_hang_verdicts import (
    REPO,
    Ranks,
    get,
    sidecar_dir,
    sidecar_with,  # noqa: F401 - the fixture
    wait_until,
)
from tests.support.ports import free_port
from tests.support.sidecar import SidecarProcess

pytestmark = pytest.mark.timeout(120)
SHORT_PINGS = ("--stream-keepalive", "1s", "--stream-ping-timeout", "2s")


def stream_ended(sidecar: SidecarProcess, tp: int) -> bool:
    return any(
        "rank_disconnected" in line and f"tp={tp}" in line for line in sidecar.log().splitlines()
    )


def verdict_names(body: dict, tp: int) -> bool:
    return any(r["tp"] == tp for v in body.get("verdicts", []) for r in v["stopped"])


def hangs_live(port: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "telemetry.cli", "hangs", "--live", "--sidecar", f"http://127.0.0.1:{port}"],
        cwd=REPO, capture_output=True, text=True, timeout=30,
    )  # fmt: skip


def test_a_stopped_ranks_stream_dropped_by_grpc_does_not_end_its_verdict(sidecar_with):  # noqa: F811
    sidecar, port = sidecar_with("--hang-wait", "60s", *SHORT_PINGS)
    ranks = Ranks(sidecar.address, "drop", waiting=(0,), record_dir=sidecar_dir(sidecar))
    try:
        wait_until(lambda: len(get(port, "/live/drop")[1].get("ranks", [])) == 2, 20, "ranks")
        victim = ranks.procs[1].pid
        os.kill(victim, signal.SIGSTOP)
        stopped = time.monotonic()
        wait_until(lambda: verdict_names(get(port, "/live/drop")[1], 1), 10, "a verdict")
        assert time.monotonic() - stopped < 2.5
        # the cause at work: gRPC closes the stopped rank's connection, as a broken one
        wait_until(lambda: stream_ended(sidecar, 1), 10, "gRPC to drop the stopped rank")
        line = next(x for x in sidecar.log().splitlines() if "rank_disconnected" in x)
        assert "clean=False" in line, line
        # the verdict stands at every poll, naming the same rank, local, its stream ended
        until = time.monotonic() + 6.0
        while time.monotonic() < until:
            status, body = get(port, "/live/drop")
            assert status == 503 and verdict_names(body, 1), body
            time.sleep(0.5)
        rank1 = next(r for r in body["ranks"] if r["tp"] == 1)
        assert (rank1["where"], rank1["stream"], rank1["state"]) == ("local", "stream_ended", "T")
        live = hangs_live(port)
        assert live.returncode == 3 and "other nodes" not in live.stdout, live.stdout
        assert "stream_ended" in live.stdout, live.stdout
        doctor = subprocess.run(
            [sys.executable, "-m", "telemetry.cli", "doctor", "--live", "--sidecar", f"http://127.0.0.1:{port}"],
            cwd=REPO, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert doctor.returncode == 1, doctor.stdout + doctor.stderr
        assert "stream_ended (local, process T)" in doctor.stdout, doctor.stdout
        assert "a hang verdict stands" in doctor.stdout and "missing dp" not in doctor.stdout
        ready = subprocess.run(
            [sys.executable, "-m", "telemetry.cli", "ready", "--engine", "drop", "--sidecar",
             f"http://127.0.0.1:{port}"],
            cwd=REPO, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert ready.returncode == 1 and "hang verdict" in ready.stdout, ready.stdout
        os.kill(victim, signal.SIGCONT)  # it reconnects and moves again
        resumed = time.monotonic()
        wait_until(lambda: get(port, "/live/drop")[0] == 200, 5, "recovery")
        assert time.monotonic() - resumed < 5.0
        events = [e["event"] for e in get(port, "/hangs")[1]["history"]]
        assert events == ["hang_verdict", "hang_recovered"], events
    finally:
        ranks.stop()


def test_with_the_default_ping_timeout_a_stopped_ranks_stream_stays(sidecar_with):  # noqa: F811
    """The control: gRPC pings every second, as above, and no ack comes for 6 s; with the
    sidecar's default ping timeout the connection stays."""
    sidecar, port = sidecar_with("--hang-wait", "60s", "--stream-keepalive", "1s")
    ranks = Ranks(sidecar.address, "keep", waiting=(0,), record_dir=sidecar_dir(sidecar))
    try:
        wait_until(lambda: len(get(port, "/live/keep")[1].get("ranks", [])) == 2, 20, "ranks")
        os.kill(ranks.procs[1].pid, signal.SIGSTOP)
        time.sleep(6.0)
        assert not stream_ended(sidecar, 1), sidecar.log()
        body = get(port, "/live/keep")[1]
        assert next(r for r in body["ranks"] if r["tp"] == 1)["stream"] == "streaming"
    finally:
        ranks.stop()


def test_a_killed_rank_is_its_own_incident_and_its_replica_stays_wedged(sidecar_with):  # noqa: F811
    """SIGKILL: the stream breaks and the process is gone. This test is the rank's parent and
    has not reaped it yet, so /proc still shows how it ended (signal 9)."""
    sidecar, port = sidecar_with("--hang-wait", "60s")
    ranks = Ranks(sidecar.address, "kill", waiting=(0,), record_dir=sidecar_dir(sidecar))
    try:
        wait_until(lambda: len(get(port, "/live/kill")[1].get("ranks", [])) == 2, 20, "ranks")
        os.kill(ranks.procs[1].pid, signal.SIGKILL)
        killed = time.monotonic()
        status, body = wait_until(
            lambda: (r := get(port, "/live/kill"))[0] == 503 and r, 10, "a verdict"
        )
        assert time.monotonic() - killed < 2.0
        assert body["verdicts"][0]["kind"] == "rank_exited"
        exited = get(port, "/hangs")[1]["history"][0]
        assert exited["event"] == "rank_exited" and exited["tp"] == 1
        assert exited["exit"]["signal"] == 9 and exited["peers_running"] == 1
        for _ in range(6):  # the one rank left waits: wedged, never recovered
            time.sleep(0.5)
            assert get(port, "/live/kill")[0] == 503
        ranks.procs[1].wait(5)
    finally:
        ranks.stop()
    # its peer shuts down as well: the verdict is closed, not recovered
    wait_until(lambda: get(port, "/hangs")[1]["standing"] == [], 10, "the verdict to close")
    events = [e["event"] for e in get(port, "/hangs")[1]["history"]]
    assert "hang_recovered" not in events and events[-1] == "hang_closed", events
    stored = subprocess.run(
        [sys.executable, "-m", "telemetry.cli", "hangs", "--store", str(sidecar.store_path)],
        cwd=REPO, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert "rank_exited" in stored.stdout and "killed by SIGKILL" in stored.stdout, stored.stdout
    assert "closed" in stored.stdout and "recovered" not in stored.stdout, stored.stdout


def test_a_restarted_sidecar_finds_the_stopped_rank_from_its_record(tmp_path):
    live_dir = tmp_path / "live"
    port = free_port()
    args = ("--health-port", str(port), "--health-host", "127.0.0.1", "--liveness-dir",
            str(live_dir), "--hang-wait", "60s")  # fmt: skip
    sock = f"unix://{tmp_path / 'guard.sock'}"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = SidecarProcess.start(tmp_path / "a", address=sock, extra_args=args)
    ranks = Ranks(sock, "again", waiting=(0,), record_dir=live_dir)
    second = None
    try:
        wait_until(lambda: len(get(port, "/live/again")[1].get("ranks", [])) == 2, 20, "ranks")
        victim = ranks.procs[1].pid
        os.kill(victim, signal.SIGSTOP)
        wait_until(lambda: verdict_names(get(port, "/live/again")[1], 1), 10, "a verdict")
        first.stop(signal.SIGKILL)
        second = SidecarProcess.start(tmp_path / "b", address=sock, extra_args=args)
        ready = time.monotonic()
        seen = []
        while time.monotonic() - ready < 8.0:
            try:
                status, body = get(port, "/live/again")
            except OSError:
                continue
            seen.append((round(time.monotonic() - ready, 2), status, verdict_names(body, 1)))
            time.sleep(0.1)
        named = [t for t, status, names in seen if status == 503 and names]
        assert named and named[0] < 2.0 + 2.5, seen  # --hang-after, after rank 0 reconnects
        after = [x for x in seen if x[0] >= named[0]]
        assert all(status == 503 and names for _, status, names in after), seen
        assert not any(status == 200 for _, status, _ in seen), seen  # never "all moving"
        body = get(port, "/live/again")[1]
        rank1 = next(r for r in body["ranks"] if r["tp"] == 1)
        assert (rank1["pid"], rank1["stream"], rank1["state"]) == (victim, "found", "T")
    finally:
        ranks.stop()
        for sidecar in (first, second):
            if sidecar is not None:
                sidecar.stop()


def test_a_starved_sidecar_gives_no_verdict_on_an_idle_engine(sidecar_with):  # noqa: F811
    """The sidecar SIGSTOPped for 3 s under two CPU hogs: when it runs again every rank has
    been silent past --hang-after, yet nothing is judged before ingest caught up."""
    sidecar, port = sidecar_with()
    ranks = Ranks(sidecar.address, "idle", waiting=(), record_dir=sidecar_dir(sidecar))
    hog = "import time\nend = time.monotonic() + 12\nwhile time.monotonic() < end: pass"
    hogs = [subprocess.Popen([sys.executable, "-c", hog]) for _ in range(2)]
    try:
        wait_until(lambda: len(get(port, "/live/idle")[1].get("ranks", [])) == 2, 20, "ranks")
        os.kill(sidecar.proc.pid, signal.SIGSTOP)
        time.sleep(3.0)
        os.kill(sidecar.proc.pid, signal.SIGCONT)
        time.sleep(4.0)
        assert get(port, "/hangs")[1]["history"] == []
        assert "hang_check_late" in sidecar.log()
    finally:
        os.kill(sidecar.proc.pid, signal.SIGCONT)
        for h in hogs:
            h.kill()
            h.wait()
        ranks.stop()
