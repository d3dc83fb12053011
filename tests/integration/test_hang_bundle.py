"""The evidence bundle of a hang verdict, across real processes: a real sidecar and two
stand-in ranks (tests/support/rank_process.py: the real streamer, the real liveness record and
its ring written by the real collective tracker, the real stack signal), rank 1 SIGSTOPped,
rank 0 waiting inside its collective while holding the GIL.

The bundle must hold both rings, rank 0's Python stack (it answers although no thread of it can
run Python) and rank 1's process state instead of a stack (stopped: never signalled). The rings
are checked against an independent source: the last sequence number the sidecar's metrics
report for each rank, which it read from the stream's collective waves, not from the records.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.metrics import value
from tests.support.ports import free_port
from tests.support.sidecar import SidecarProcess

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(90)
CALLS = 30  # returned calls before the stuck one: seq 31, as the stand-in's heartbeats say


def _get(port: int, path: str) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _wait(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (result := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return result


def _rank(address: str, tp: int, live: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.rank_process", address, "--engine", "bun",
         "--tp", str(tp), "--record-dir", str(live), "--tracker-calls", str(CALLS),
         "--evidence", *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "telemetry.cli", "hangs", *args],
        cwd=REPO, capture_output=True, text=True, timeout=30,
    )  # fmt: skip


def test_the_verdict_names_a_bundle_with_both_rings_and_the_waiting_rank_stack(tmp_path):
    port = free_port()
    live, bundles = tmp_path / "live", tmp_path / "bundles"
    sidecar = SidecarProcess.start(
        tmp_path,
        extra_args=("--health-port", str(port), "--health-host", "127.0.0.1", "--liveness-dir",
                    str(live), "--bundle-dir", str(bundles), "--hang-wait", "60s"),
    )  # fmt: skip
    waiting = _rank(sidecar.address, 0, live, "--in-collective", "--hold-gil-after", "0.3")
    victim = _rank(sidecar.address, 1, live)
    procs = (waiting, victim)
    try:
        _wait(lambda: len(_get(port, "/live/bun")[1].get("ranks", [])) == 2, 20, "two ranks")

        # the stream's view of each rank's collectives, before anything is stopped
        def last_seqs() -> dict[int, float] | None:
            text = sidecar.metrics_text()
            got = {tp: value(text, "ascend_guard_collective_last_seq", tp=str(tp)) for tp in (0, 1)}
            return got if all(got.values()) else None

        seqs = _wait(last_seqs, 20, "the collective waves on the stream")
        assert seqs == {0: CALLS, 1: CALLS}
        os.kill(victim.pid, signal.SIGSTOP)
        status, body = _wait(lambda: (r := _get(port, "/live/bun"))[0] == 503 and r, 10, "verdict")
        verdict = body["verdicts"][0]
        assert verdict["kind"] == "no_heartbeat" and verdict["stopped"][0]["tp"] == 1
        history = _get(port, "/hangs")[1]["history"]
        named = next(e["bundle"] for e in history if e["event"] == "hang_verdict")
        assert Path(named["path"]).parent == bundles
        _wait(lambda: Path(named["path"]).exists(), 10, "the bundle file")
        bundle = json.loads(Path(named["path"]).read_text())
        ranks = {r["tp"]: r for r in bundle["ranks"]}

        stuck = ranks[1]
        assert stuck["role"] == "stopped" and stuck["pid"] == victim.pid
        assert stuck["process"]["state"].startswith("T")
        assert not stuck["stack"]["answered"] and "SIGCONT" in stuck["stack"]["note"]
        ring1 = stuck["collectives"]["entries"]
        assert [e["seq"] for e in ring1] == list(range(1, CALLS + 1))
        assert all(e["end_unix"] != "not returned" and e["bytes"] == 512 for e in ring1)
        assert max(e["seq"] for e in ring1) == seqs[1]  # = the stream's last seq for tp1

        peer = ranks[0]
        assert peer["role"] == "waiting" and peer["process"]["state"].startswith("S")
        ring0 = peer["collectives"]["entries"]
        *returned, last = ring0
        assert max(e["seq"] for e in returned) == seqs[0]
        assert (last["op"], last["group"], last["seq"], last["end_unix"]) == (
            "all_reduce", "tp", verdict["seq"], "not returned",
        )  # fmt: skip
        assert last["seq"] == seqs[0] + 1
        # it answers from C (faulthandler) while the GIL is held by the sleep inside the call
        assert peer["stack"]["answered"], peer["stack"]
        engine = peer["stack"]["threads"][0]
        assert engine["engine"] and any(
            "rank_process.py" in f and "hold" in f for f in engine["frames"]
        )
        assert any("tracker.py" in f and "in run" in f for f in engine["frames"])
        for rank in (peer, stuck):
            assert rank["flight_recorder"]["available"] is False

        shown = _cli("--bundle", named["id"], "--bundle-dir", str(bundles))
        assert shown.returncode == 0, shown.stderr
        assert "NOT RETURNED" in shown.stdout and "engine thread" in shown.stdout
        assert "STOPPED" in shown.stdout and "SIGCONT" in shown.stdout
        text = sidecar.metrics_text()
        assert value(text, "ascend_guard_hang_bundles_total") == 1
        assert value(text, "ascend_guard_hang_bundle_drops_total", reason="queue_full") == 0
        os.kill(victim.pid, signal.SIGCONT)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.terminate()
                proc.wait(10)
        sidecar.stop()
    listed = _cli("--store", str(sidecar.store_path))
    assert f"ascend-guard hangs --bundle {named['id']}" in listed.stdout, listed.stdout
