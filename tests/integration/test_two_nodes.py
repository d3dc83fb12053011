"""A TP group across two "nodes": the cluster hang verdict comes from Prometheus' rules.

Two real sidecars (each its own socket, metrics and health ports) play node A and node B. Two
stand-in rank processes (tests/support/rank_process.py: the real streamer client, heartbeats as
a real rank sends them; they stand in for vLLM workers, whose TP=2 group cannot span two hosts
here) form one TP=2 group of one engine and run: tp0 streams to A, tp1 to B. One real Prometheus
scrapes both every second and evaluates dashboards/prometheus/{alerts,cluster}.yml every
second.

tp1 is frozen (SIGSTOP) as tp0 begins to wait in an all_reduce: AscendGuardClusterRankSilent
must hold (pending; it fires after its `for:`) within 10 s naming tp1 (tp, node, pid), seen
through /api/v1/alerts. Node A, which
sees only tp0, must say tp1 is "not seen by this sidecar" and hold no verdict of its own.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from telemetry.wire import schema
from telemetry.wire.trace_ids import wave_trace_id
from tests.support.cluster_feed import LiveRank
from tests.support.collective_feed import send_collective_waves
from tests.support.dashboard import load_dashboard, panel_queries, render_expr
from tests.support.feed import send_incidents_and_probes, send_waves
from tests.support.otlp_receiver import otlp_receiver
from tests.support.ports import free_port
from tests.support.prometheus import PrometheusServer, find_prometheus
from tests.support.ready import wait_until
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
        # the rule holds within FIRE_WITHIN_S: the alert is pending, and fires after its
        # `for: 30s` (timed by promtool in cluster_test.yml; not waited for here)
        firing = wait_until(
            lambda: alerts(prom, "AscendGuardClusterRankSilent"),
            FIRE_WITHIN_S + 5, "AscendGuardClusterRankSilent to hold",
        )  # fmt: skip
        took = time.monotonic() - frozen
        print(f"AscendGuardClusterRankSilent pending {took:.2f}s after the freeze")
        assert took < FIRE_WITHIN_S, f"held after {took:.1f}s"
        assert firing[0]["state"] == "pending", firing
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
            [sys.executable, "-m", "telemetry.cli", "hangs", "--live", "--sidecar", f"http://127.0.0.1:{a_health}"],
            cwd=REPO, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert cli.returncode == 0, cli.stdout + cli.stderr
        assert "no hang verdict stands on the ranks this sidecar sees" in cli.stdout
        assert f"engine {ENGINE} dp0: tp1/pp0 not seen by this sidecar" in cli.stdout

        # the alert ends once tp1 runs again and tp0's wait ends (its process restarts)
        os.kill(procs[1].pid, signal.SIGCONT)
        wait_until(lambda: not alerts(prom, "AscendGuardClusterRankSilent"), 15, "resolved")


# --------------------------------------------------------------------------- dashboards, traces
DASHBOARD_FILES = sorted((REPO / "dashboards").glob("*.json"))
TRACE_RUN, WAVES = "run-2node-traces", 20
# as a PodMonitor's relabelings set them (deploy/base/podmonitor.yaml)
NODE_LABELS = {
    "a": {"node": "node-a", "pod": "ascend-guard-a"},
    "b": {"node": "node-b", "pod": "ascend-guard-b"},
}
# Panels with no series in this run, and why (a panel not listed must return data; the hang
# panels have series at 0 from the first batch on, the NaN rate from the 3 incidents):
MAY_BE_EMPTY = {
    # the feed is clean: the sidecars refuse nothing, and rejections carry a `reason` label
    "Ingest rejections per second by reason": "no ingest rejection",
    # stand-in ranks are not bound vLLM workers: no attach points to report
    "Attach points by status": "no vLLM classes bound",
    # stand-in ranks run outside Kubernetes: no pod to name (test_dashboard_live.py has one)
    "Workload pod of each rank": "no Downward API env",
}


def _variable_values(prom: PrometheusServer, variable: dict) -> list[str]:
    """What Grafana's Prometheus datasource asks for a `label_values(selector, label)` query."""
    query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
    m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", query.strip())
    assert m, f"{variable['name']}: not a label_values query: {query}"
    selector = render_expr(m.group(1), engine=".*")
    body = prom.api(f"label/{m.group(2)}/values", {"match[]": selector})
    assert body["status"] == "success", body
    return body["data"]


def test_dashboards_and_traces_across_two_nodes(tmp_path):
    """Both sidecars export OTLP to one real receiver (tests/support/otlp_receiver.py) and are
    scraped by one real Prometheus, with the labels a PodMonitor gives them. Fed: engine `moe`,
    one TP=2 replica across the nodes with one run id (tp0 on A, tp1 on B, streams held open
    so the rank gauges stay), and engine `dense`, two TP=2 replicas on node A alone (skew and
    stragglers are judged on one sidecar). Then every variable of the six dashboards resolves,
    every panel's query returns data (but MAY_BE_EMPTY), and a wave's spans from the two nodes
    join into one trace by its deterministic id."""
    find_prometheus()
    with otlp_receiver() as (receiver, otlp_port):
        sidecars = {}
        try:
            for name in ("a", "b"):
                where = tmp_path / f"node-{name}"
                where.mkdir()
                sidecars[name] = SidecarProcess.start(
                    where,
                    extra_args=("--otlp-endpoint", f"http://127.0.0.1:{otlp_port}",
                                "--otlp-keep-one-in", "1"),
                )  # fmt: skip
            _check_dashboards_and_traces(tmp_path, sidecars, receiver)
        finally:
            for sidecar in sidecars.values():
                sidecar.stop()


def _check_dashboards_and_traces(tmp_path, sidecars, receiver):
    a, b = sidecars["a"], sidecars["b"]
    ranks = [
        LiveRank(a.address, run_id=TRACE_RUN, engine=ENGINE, tp=0, tp_size=2, node="node-a",
                 pid=7100, waves=WAVES, probes=True, nan_incidents=3).start(),
        LiveRank(b.address, run_id=TRACE_RUN, engine=ENGINE, tp=1, tp_size=2, node="node-b",
                 pid=7101, waves=WAVES, probes=True).start(),
    ]  # fmt: skip
    try:
        wait_until(lambda: all(r.handed_over() for r in ranks), 20, "the live ranks' records")
        dense = ((0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0))
        send_waves(a.address, engine="dense", ranks=dense, waves=30, drop=2, run_id="run-dense")
        send_collective_waves(a.address, engine="dense", ranks=dense[:2], run_id="run-dense")
        send_incidents_and_probes(b.address, engine="dense", run_id="run-dense")
        targets = {f"127.0.0.1:{s.metrics_port}": NODE_LABELS[n] for n, s in sidecars.items()}
        with PrometheusServer.start(
            list(targets), rule_files=RULES, workdir=tmp_path / "prom", target_labels=targets
        ) as prom:
            # rate() needs two samples in its window; the rank gauges of both nodes are in
            wait_until(
                lambda: len(prom.query("rate(ascend_guard_waves_total[30s])")) >= 6
                and len(prom.query("ascend_guard_rank_collective_since_timestamp_seconds")) == 2,
                30, "two samples of every rank's waves and both nodes' rank gauges",
            )  # fmt: skip
            _check_variables(prom)
            _check_panels(prom)
    finally:
        for rank_ in ranks:
            rank_.stop()
    for sidecar in sidecars.values():
        sidecar.stop()  # flushes the exporters
    _check_traces(receiver)


def _check_variables(prom: PrometheusServer) -> None:
    expected = {
        "node": {"node-a", "node-b"},
        "pod": {"ascend-guard-a", "ascend-guard-b"},
        "engine": {ENGINE, "dense"},
        "dp": {"0", "1"},
        "rank": {"0", "1"},
    }
    for path in DASHBOARD_FILES:
        variables = load_dashboard(path)["templating"]["list"]
        queried = [v for v in variables if v["type"] == "query"]
        assert {v["name"] for v in queried} == set(expected), path.name
        for variable in queried:
            values = set(_variable_values(prom, variable))
            assert values == expected[variable["name"]], (path.name, variable["name"], values)


def _check_panels(prom: PrometheusServer) -> None:
    failures, seen = [], set()
    for path in DASHBOARD_FILES:
        for title, expr in panel_queries(load_dashboard(path)):
            seen.add(title)
            rendered = render_expr(expr, engine=".*", rate_interval="30s")
            body = prom.query_raw(rendered)
            if body.get("status") != "success" or body.get("warnings"):
                failures.append(f"{path.name} {title!r}: {rendered}\n    {body}")
            elif not body["data"]["result"] and title not in MAY_BE_EMPTY:
                failures.append(f"{path.name} {title!r}: {rendered}\n    returned no series")
    assert set(MAY_BE_EMPTY) <= seen, f"stale MAY_BE_EMPTY: {sorted(set(MAY_BE_EMPTY) - seen)}"
    assert not failures, "panels without data:\n" + "\n".join(failures)
    # the cross-node panels show both nodes' ranks of the one replica
    (silence,) = [
        e for t, e in panel_queries(load_dashboard(REPO / "dashboards" / "ascend-guard-incidents.json"))
        if t == "Rank silence by rank (cross-node)"
    ]  # fmt: skip
    result = prom.query(render_expr(silence, engine=ENGINE))
    assert sorted((s["metric"]["tp"], s["metric"]["node"]) for s in result) == [
        ("0", "node-a"), ("1", "node-b"),
    ]  # fmt: skip
    assert all(float(s["value"][1]) < 5 for s in result), result


def _check_traces(receiver) -> None:
    def spans_of(wave: int) -> list:
        trace = wave_trace_id(TRACE_RUN, wave, 0).to_bytes(16, "big")
        return [s for s in receiver.snapshot() if s.trace_id == trace]

    wait_until(lambda: all(len(spans_of(w)) >= 4 for w in range(1, WAVES + 1)), 15, "the spans")
    for wave in range(1, WAVES + 1):
        spans = spans_of(wave)
        (root,) = [s for s in spans if s.name == "wave"]  # from node A: tp0 is the root rank
        rank_spans = {_attr(s, schema.ATTR_NODE): s for s in spans if s.name == "rank"}
        assert set(rank_spans) == {"node-a", "node-b"}, (wave, sorted(rank_spans))
        for node, span in rank_spans.items():
            assert span.parent_span_id == root.span_id, (wave, node)
            assert _attr(span, schema.ATTR_TP) == {"node-a": 0, "node-b": 1}[node]
        # node B's phases hang under its own rank span, in the same trace
        b_phases = [s for s in spans if s.parent_span_id == rank_spans["node-b"].span_id]
        assert {s.name for s in b_phases} >= {"execute_model", "sample_tokens"}, wave


def _attr(span, key: str):
    for kv in span.attributes:
        if kv.key == key:
            value = kv.value
            return getattr(value, value.WhichOneof("value"))
    return None
