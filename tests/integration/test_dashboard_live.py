"""Live dashboard test: every panel query of the overview dashboard runs against a real
Prometheus that scrapes a real sidecar fed with wave records through the real client.

Needs the `prometheus` binary (`make deps` or `apt-get install prometheus`).
"""

from __future__ import annotations

import re
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from telemetry.wire import workload
from tests.support.collective_feed import send_collective_waves
from tests.support.dashboard import load_dashboard, metric_names_in, panel_queries, render_expr
from tests.support.feed import make_streamer, send_incidents_and_probes, send_waves, wave_tuple
from tests.support.metrics import SIDECAR_WIDE
from tests.support.prometheus import PrometheusServer
from tests.support.sidecar import SidecarProcess

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.prometheus, pytest.mark.timeout(240)]

OVERVIEW = ROOT / "dashboards" / "ascend-guard-overview.json"
ALERTS = ROOT / "dashboards" / "prometheus" / "alerts.yml"
ENGINE = "test"
RANKS = ((0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0))  # (dp, tp, pp): two DP engines of TP=2
COLLECTIVE_RANKS = RANKS[:2]
WAVES = 50
SAMPLED_PER_WAVE = 4
DROPPED_PER_RANK = 2  # reported by each rank's client as dropped before the sidecar
RATE_INTERVAL = "30s"

# Panels that are legitimately empty in this run: a clean feed makes the sidecar refuse nothing,
# and ingest rejections carry a `reason` label, so there is no series until one happens. Every
# other panel must return at least one series: the sidecar creates each rank's series (at zero for
# dummy waves and guard errors) when the rank connects, and the feed reports drops.
# The synthetic feed is not a bound vLLM worker, so it reports no attach points either; and its
# clients close their streams when done, so the engine has left and the sidecar removed its
# ranks_connected series (tests/integration/test_operator_paths.py checks that panel's metric).
# The feed runs outside Kubernetes, so no rank names its pod (the workload panel's metric is
# checked by test_daemonset_labels_name_the_workload_in_prometheus).
MAY_BE_EMPTY = frozenset(
    {
        "Ingest rejections per second by reason",
        "Attach points by status",
        "Ranks connected",
        "Workload pod of each rank",
    }
)

HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def _family(name: str, types: dict[str, str]) -> str:
    """Family name under which `name` is declared by a `# TYPE` line."""
    for suffix in HISTOGRAM_SUFFIXES:
        base = name.removesuffix(suffix)
        if base != name and types.get(base) in ("histogram", "summary"):
            return base
    if name not in types and name.endswith("_total") and types.get(name[: -len("_total")]):
        return name[: -len("_total")]  # OpenMetrics writes counters without `_total`
    return name


def _expected_type(name: str) -> str:
    if name.endswith(HISTOGRAM_SUFFIXES):
        return "histogram"
    if name.endswith("_total"):
        return "counter"
    return "gauge"


def _type_lines(metrics_text: str) -> dict[str, str]:
    return dict(re.findall(r"^# TYPE (\S+) (\S+)\s*$", metrics_text, flags=re.MULTILINE))


def _referenced_metrics() -> set[str]:
    names = set()
    for _title, expr in panel_queries(load_dashboard(OVERVIEW)):
        names |= metric_names_in(expr)
    doc = yaml.safe_load(ALERTS.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            names |= metric_names_in(rule["expr"])
    return names


def _rank_key(sample: dict) -> tuple[str, str, str]:
    m = sample["metric"]
    return (m.get("dp"), m.get("tp"), m.get("pp"))


def _expected_ranks() -> set[tuple[str, str, str]]:
    return {(str(dp), str(tp), str(pp)) for dp, tp, pp in RANKS}


@pytest.fixture
def sidecar(tmp_path):
    workdir = tmp_path / "sidecar"
    workdir.mkdir()
    proc = SidecarProcess.start(workdir)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def prometheus_for(tmp_path):
    servers: list[PrometheusServer] = []

    def start(metrics_port: int) -> PrometheusServer:
        server = PrometheusServer.start(
            [f"127.0.0.1:{metrics_port}"], workdir=tmp_path / "prometheus", rule_files=[ALERTS]
        )
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def test_every_dashboard_query_runs_against_live_sidecar(sidecar, prometheus_for):
    send_waves(
        sidecar.address,
        engine=ENGINE,
        ranks=RANKS,
        waves=WAVES,
        sampled_per_wave=SAMPLED_PER_WAVE,
        drop=DROPPED_PER_RANK,
    )
    send_incidents_and_probes(sidecar.address, engine=ENGINE)
    # collective records (issue 4's panels): per-op counters, skew, one straggler wave
    send_collective_waves(sidecar.address, engine=ENGINE, ranks=COLLECTIVE_RANKS)

    # 1. Every metric the dashboard and the alert rules reference is declared by the sidecar.
    with urllib.request.urlopen(sidecar.metrics_url, timeout=10) as resp:
        metrics_text = resp.read().decode("utf-8", errors="replace")
    types = _type_lines(metrics_text)
    problems = []
    for name in sorted(_referenced_metrics() - {"up"}):  # `up` is Prometheus' own series
        family = _family(name, types)
        if family not in types:
            problems.append(f"{name}: no `# TYPE {family} ...` line in {sidecar.metrics_url}")
        elif types[family] != _expected_type(name):
            problems.append(f"{name}: declared as {types[family]}, expected {_expected_type(name)}")
    assert not problems, "\n".join(problems)
    # every series a rank made is per DP rank (the sidecar-wide families have no rank)
    no_dp = sorted(
        {
            line.split("{")[0]
            for line in metrics_text.splitlines()
            if line.startswith("ascend_guard_")
            and not line.startswith(SIDECAR_WIDE)
            and 'dp="' not in line
        }
    )
    assert not no_dp, f"series without a dp label: {no_dp}"

    # 2. A real Prometheus scrapes the sidecar.
    prom = prometheus_for(sidecar.metrics_port)
    deadline = time.monotonic() + 30
    while not prom.targets_up():
        assert time.monotonic() < deadline, f"scrape target never up: {prom.targets()}"
        time.sleep(0.25)
    waves = prom.wait_for(
        f'ascend_guard_waves_total{{engine="{ENGINE}"}}',
        lambda r: {_rank_key(s) for s in r} >= _expected_ranks(),
        timeout=30,
    )
    # rate() needs two samples inside the window: wait for them before running the panels.
    prom.wait_for(
        f'rate(ascend_guard_waves_total{{engine="{ENGINE}"}}[{RATE_INTERVAL}])',
        lambda r: len(r) >= len(RANKS),
        timeout=30,
    )

    # 3. The numbers made it through the real path unchanged.
    assert {_rank_key(s) for s in waves} == _expected_ranks(), waves
    for s in waves:
        assert float(s["value"][1]) == WAVES, s
    sampled = prom.query(f'ascend_guard_sampled_tokens_total{{engine="{ENGINE}"}}')
    assert {_rank_key(s) for s in sampled} == _expected_ranks(), sampled
    for s in sampled:
        assert float(s["value"][1]) == WAVES * SAMPLED_PER_WAVE, s

    dropped = prom.query(f'ascend_guard_records_dropped_total{{engine="{ENGINE}"}}')
    assert {_rank_key(s) for s in dropped} == _expected_ranks(), dropped
    for s in dropped:
        assert float(s["value"][1]) == DROPPED_PER_RANK, s

    # 4. The `engine` template variable finds the engine.
    body = prom.api("label/engine/values", {"match[]": "ascend_guard_waves_total"})
    assert body["status"] == "success" and ENGINE in body["data"], body

    # 4b. The `dp` variable finds both DP engines, and choosing one shows that replica only.
    body = prom.api(
        "label/dp/values", {"match[]": f'ascend_guard_waves_total{{engine="{ENGINE}"}}'}
    )
    assert body["status"] == "success" and set(body["data"]) == {"0", "1"}, body
    (per_rank,) = [
        e for t, e in panel_queries(load_dashboard(OVERVIEW)) if t == "Waves per second by rank"
    ]
    one = prom.query(
        render_expr(per_rank, engine=ENGINE, rate_interval=RATE_INTERVAL, extra={"dp": "1"})
    )
    assert {_rank_key(s) for s in one} == {("1", "0", "0"), ("1", "1", "0")}, one

    # 5. Every panel query is accepted, and all but the explicit few return series.
    dashboard = load_dashboard(OVERVIEW)
    queries = panel_queries(dashboard)
    titles = {title for title, _ in queries}
    assert titles >= MAY_BE_EMPTY, f"stale MAY_BE_EMPTY entries: {sorted(MAY_BE_EMPTY - titles)}"
    failures = []
    for title, expr in queries:
        rendered = render_expr(expr, engine=ENGINE, rate_interval=RATE_INTERVAL)
        body = prom.query_raw(rendered)
        if body.get("status") != "success" or body.get("error"):
            failures.append(f"{title!r}: {rendered}\n    rejected: {body}")
            continue
        if body.get("warnings"):
            failures.append(f"{title!r}: {rendered}\n    warnings: {body['warnings']}")
        result = body["data"]["result"]
        if not result and title not in MAY_BE_EMPTY:
            failures.append(f"{title!r}: {rendered}\n    returned no series")
    assert not failures, "dashboard queries failed against live data:\n" + "\n".join(failures)

    # 6. The alert rules load and evaluate without error against the same data.
    deadline = time.monotonic() + 30
    while True:
        rules = prom.rules()
        evaluated = [r for r in rules if not r.get("lastEvaluation", "").startswith("0001-")]
        if rules and len(evaluated) == len(rules):
            break
        assert time.monotonic() < deadline, f"alert rules not evaluated: {rules}"
        time.sleep(0.25)
    unhealthy = [(r["name"], r.get("health"), r.get("lastError")) for r in rules]
    unhealthy = [u for u in unhealthy if u[1] != "ok"]
    assert not unhealthy, f"alert rules failed to evaluate: {unhealthy}"
    firing = {r["name"] for r in rules if r.get("state") == "firing"}
    # Drops were reported, so that alert fires; a clean feed has no errors and no rejections.
    assert "AscendGuardRecordsDropped" in firing, rules
    assert not firing & {"AscendGuardErrors", "AscendGuardIngestRejected"}, firing


def test_daemonset_labels_name_the_workload_in_prometheus(tmp_path, monkeypatch):
    """What Prometheus stores from a DaemonSet sidecar scraped as deploy/base's PodMonitor does
    (target labels: the sidecar's namespace and pod, the node; honorLabels): the worker's pod,
    namespace and node (its Downward API env) reach ascend_guard_rank_workload_info through the
    real client and sidecar, the rank series keep `node` (no `exported_node`), and the rules'
    join gives the workload's pod. Nothing here is faked but the Kubernetes API server."""
    monkeypatch.setenv(workload.POD_NAME_ENV, "vllm-qwen-7c9d-abcde")
    monkeypatch.setenv(workload.POD_NAMESPACE_ENV, "serving")
    monkeypatch.setenv(workload.NODE_NAME_ENV, "node-a")
    (tmp_path / "sidecar").mkdir()
    side = SidecarProcess.start(tmp_path / "sidecar")
    streamers = []
    try:
        for index, rank in enumerate(((0, 0, 0), (0, 1, 0))):
            # the node a real worker reports (ascend_runtime/attach/ranks.py) with that env
            streamer = make_streamer(
                side.address, engine="qwen", rank=rank, pid=5000 + index, node="node-a"
            )
            for n in range(1, 11):
                streamer.offer(wave_tuple(n))
            streamer.start()
            streamers.append(streamer)
        target = f"127.0.0.1:{side.metrics_port}"
        sidecar_pod = {"namespace": "ascend-guard", "pod": "ascend-guard-x7k2p", "node": "node-a"}
        with PrometheusServer.start(
            [target], workdir=tmp_path / "prometheus", rule_files=[ALERTS],
            target_labels={target: sidecar_pod}, honor_labels=True,
        ) as prom:  # fmt: skip
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                # the join the alert rules make (dashboards/prometheus/alerts.yml)
                joined = prom.query(
                    "ascend_guard_ranks_connected * on (instance, engine, dp) "
                    "group_left (namespace, pod, node) "
                    "topk by (instance, engine, dp) (1, ascend_guard_rank_workload_info)"
                )
                if joined:
                    break
                time.sleep(0.5)
            info = prom.query("ascend_guard_rank_workload_info")
            assert {(s["metric"]["tp"], s["metric"]["namespace"], s["metric"]["pod"], s["metric"]["node"]) for s in info} == {
                ("0", "serving", "vllm-qwen-7c9d-abcde", "node-a"), ("1", "serving", "vllm-qwen-7c9d-abcde", "node-a"),
            }  # fmt: skip
            assert [(s["metric"]["namespace"], s["metric"]["pod"]) for s in joined] == [
                ("serving", "vllm-qwen-7c9d-abcde")
            ], joined
            assert prom.query('{__name__=~"ascend_guard_.+", exported_node!=""}') == []
            seen = prom.query("ascend_guard_rank_last_seen_timestamp_seconds")
            assert seen and {s["metric"]["node"] for s in seen} == {"node-a"}
            # the sidecar's own series keep the target's (the sidecar's) pod
            up = prom.query("up")
            assert [s["metric"]["pod"] for s in up] == ["ascend-guard-x7k2p"]
    finally:
        for streamer in streamers:
            streamer.stop()
        side.stop()
