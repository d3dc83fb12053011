"""A TP group across two "nodes": the cluster hang verdict comes from Prometheus' rules.

Two real sidecars (each its own socket, metrics and health ports) play node A and node B. Two
stand-in rank processes (tests/support/rank_process.py: the real streamer client, heartbeats as
a real rank sends them; they stand in for vLLM workers, whose TP=2 group cannot span two hosts
here) form one TP=2 group of one engine and run: tp0 streams to A, tp1 to B. One real Prometheus
scrapes both every second and evaluates dashboards/prometheus/{alerts,cluster}.yml every
second.

tp1 is frozen (SIGSTOP) as tp0 begins to wait in an all_reduce: AscendGuardClusterRankSilent
must fire within 10 s naming tp1 (tp, node, pid), seen through /api/v1/alerts. Node A, which
sees only tp0, must say tp1 is "not seen by this sidecar" and hold no verdict of its own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.support.ports import free_port
from tests.support.prometheus import PrometheusServer, find_prometheus
from tests.support.sidecar import SidecarProcess

REPO = Path(__file__).resolve().parents[2]
RULES = [REPO / "dashboards" / "prometheus" / name for name in ("alerts.yml", "cluster.yml")]
pytestmark = pytest.mark.timeout(120)

ENGINE, RUN = "moe", "run-2node"
# AscendGuardClusterRankSilent: silence over 4 s with a peer waiting over 3 s, scraped and
# evaluated every second; the bound
FIRE_WITHIN_S = 10.0


def get(port: int, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def wait_until(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.1)


def rank(address: str, tp: int, node: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.rank_process", address, "--engine", ENGINE,
         "--run-id", RUN, "--tp", str(tp), "--tp-size", "2", "--node", node, "--seq-done", "30",
         *extra],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip


def alerts(prom: PrometheusServer, name: str) -> list[dict]:
    body = prom.api("alerts")
    return [a for a in body["data"]["alerts"] if a["labels"].get("alertname") == name]


@pytest.fixture
def two_nodes(tmp_path):
    find_prometheus()
    started: list = []
    nodes = {}
    for name in ("a", "b"):
        where = tmp_path / f"node-{name}"
        where.mkdir()
        health = free_port()
        sidecar = SidecarProcess.start(
            where, extra_args=("--health-port", str(health), "--health-host", "127.0.0.1")
        )
        started.append(sidecar)
        nodes[name] = (sidecar, health)
    procs = {
        0: rank(nodes["a"][0].address, 0, "node-a", "--enter-on-usr1"),
        1: rank(nodes["b"][0].address, 1, "node-b"),
    }
    try:
        yield nodes, procs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.terminate()
                proc.wait(10)
        for sidecar in started:
            sidecar.stop()


def test_frozen_rank_on_node_b_is_named_by_the_cluster_rule(two_nodes, tmp_path):
    nodes, procs = two_nodes
    (a, a_health), (b, _) = nodes["a"], nodes["b"]
    targets = [f"127.0.0.1:{a.metrics_port}", f"127.0.0.1:{b.metrics_port}"]
    with PrometheusServer.start(targets, rule_files=RULES, workdir=tmp_path / "prom") as prom:
        # both ranks, through both sidecars, with their seq 30 on tp
        wait_until(
            lambda: len(prom.query(
                f'ascend_guard_rank_collective_seq_reached{{run_id="{RUN}",engine="{ENGINE}"}}'
            )) == 2,
            30, "both ranks' gauges in Prometheus",
        )  # fmt: skip
        rules = {r["name"]: r for r in prom.rules()}
        assert rules["AscendGuardClusterRankSilent"]["health"] == "ok", rules
        assert not alerts(prom, "AscendGuardClusterRankSilent")

        os.kill(procs[1].pid, signal.SIGSTOP)
        os.kill(procs[0].pid, signal.SIGUSR1)  # tp0 enters all_reduce seq 31 and waits
        frozen = time.monotonic()
        firing = wait_until(
            lambda: [
                x for x in alerts(prom, "AscendGuardClusterRankSilent") if x["state"] == "firing"
            ],
            FIRE_WITHIN_S + 5, "AscendGuardClusterRankSilent to fire",
        )  # fmt: skip
        took = time.monotonic() - frozen
        print(f"AscendGuardClusterRankSilent fired {took:.2f}s after the freeze")
        assert took < FIRE_WITHIN_S, f"fired after {took:.1f}s"
        assert len(firing) == 1, firing
        labels = firing[0]["labels"]
        assert (labels["tp"], labels["pp"], labels["node"], labels["pid"]) == (
            "1", "0", "node-b", str(procs[1].pid),
        )  # fmt: skip
        assert (labels["run_id"], labels["engine"], labels["dp"]) == (RUN, ENGINE, "0")
        assert labels["instance"] == targets[1]
        assert "node node-b" in firing[0]["annotations"]["summary"]
        # the silent rank is named as silent, not as one that never arrived
        assert not alerts(prom, "AscendGuardClusterRankNotArrived")
        # tp0 waits in the collective, as node A's gauges say
        waiting = prom.query("ascend_guard:rank_collective_wait_seconds > 3")
        assert [(w["metric"]["tp"], w["metric"]["node"]) for w in waiting] == [("0", "node-a")]

        # node A sees tp0 waiting and nothing of tp1: it says so, and judges nothing
        status, body = get(a_health, f"/live/{ENGINE}")
        assert status == 200 and body["live"] is True and body["verdicts"] == [], body
        (replica,) = body["replicas"]
        assert replica["not_seen"] == [{"tp": 1, "pp": 0, "note": "not seen by this sidecar"}]
        assert [r["tp"] for r in replica["ranks"]] == [0]
        assert replica["ranks"][0]["op"] == "all_reduce"
        hangs = get(a_health, "/hangs")[1]
        assert hangs["standing"] == [] and hangs["history"] == []
        assert [(p["engine"], p["not_seen"][0]["tp"]) for p in hangs["partial"]] == [(ENGINE, 1)]
        cli = subprocess.run(
            [sys.executable, "-m", "telemetry.cli", "hangs", "--live", f"http://127.0.0.1:{a_health}"],
            cwd=REPO, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert cli.returncode == 0, cli.stdout + cli.stderr
        assert "no hang verdict stands on the ranks this sidecar sees" in cli.stdout
        assert f"engine {ENGINE} dp0: tp1/pp0 not seen by this sidecar" in cli.stdout

        # the alert ends once tp1 runs again and tp0's wait ends (its process restarts)
        os.kill(procs[1].pid, signal.SIGCONT)
        wait_until(lambda: not alerts(prom, "AscendGuardClusterRankSilent"), 15, "resolved")
