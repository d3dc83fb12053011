"""Static checks of the Grafana dashboards, provisioning files and Prometheus alert rules.

No server is started; `promtool` (Debian package `prometheus`) must be installed.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support.dashboard import (
    iter_panels,
    load_dashboard,
    metric_names_in,
    panel_queries,
    render_expr,
)

ROOT = Path(__file__).resolve().parents[3]

DASHBOARDS = ROOT / "dashboards"
DASHBOARD_FILES = sorted(DASHBOARDS.glob("*.json"))
OVERVIEW = DASHBOARDS / "ascend-guard-overview.json"
ALERTS = DASHBOARDS / "prometheus" / "alerts.yml"
DATASOURCES_YAML = DASHBOARDS / "provisioning" / "datasources" / "ascend-guard.yaml"
PROVIDERS_YAML = DASHBOARDS / "provisioning" / "dashboards" / "ascend-guard.yaml"

# The metric families the sidecar exports (see dashboards/README.md).
WORKER_METRICS = {
    "ascend_guard_waves_total",
    "ascend_guard_dummy_waves_total",
    "ascend_guard_sampled_tokens_total",
    "ascend_guard_scheduled_tokens_total",
    "ascend_guard_step_duration_seconds",
    "ascend_guard_records_dropped_total",
    "ascend_guard_guard_errors_total",
    "ascend_guard_last_wave",
    "ascend_guard_last_heartbeat_timestamp_seconds",
    "ascend_guard_ranks_connected",
    # sampling guard: incidents and detector probes
    "ascend_guard_incidents_total",
    "ascend_guard_detector_hits_total",
    "ascend_guard_logits_max_abs",
    "ascend_guard_logits_entropy_nats",
    "ascend_guard_spec_acceptance_rate",
    "ascend_guard_spec_draft_tokens_total",
    "ascend_guard_spec_accepted_tokens_total",
    "ascend_guard_config_generation",
    # runtime probes (ascend_runtime/probes)
    "ascend_guard_kv_cache_bytes",
    "ascend_guard_kv_cache_blocks",
    "ascend_guard_kv_cache_layers",
    "ascend_guard_rotary_table_rows",
    "ascend_guard_device_phase_ms",
    "ascend_guard_graph_captures",
    "ascend_guard_graph_capture_seconds",
    "ascend_guard_graph_capture_bytes",
    "ascend_guard_graph_workspace_leaked_bytes",
    "ascend_guard_spec_drafts_proposed_total",
    "ascend_guard_spec_drafts_accepted_total",
    "ascend_guard_speculator_info",
    "ascend_guard_device_communicator_info",
    "ascend_guard_hccl_settings_info",
    # collectives, skew, stragglers, hang verdicts (issue 4, telemetry/metrics/collectives.py)
    "ascend_guard_collective_calls_total",
    "ascend_guard_collective_bytes_total",
    "ascend_guard_collective_seconds_total",
    "ascend_guard_collective_max_seconds",
    "ascend_guard_collective_slow_calls_total",
    "ascend_guard_collective_last_seq",
    "ascend_guard_wave_skew_seconds",
    "ascend_guard_wave_arrival_skew_seconds",
    "ascend_guard_straggler_waves_total",
    "ascend_guard_straggler_seconds_total",
    "ascend_guard_waves_unaligned_total",
    "ascend_guard_hang_verdicts_total",
    "ascend_guard_hang_recoveries_total",
    "ascend_guard_engine_wedged",
    "ascend_guard_hang_stall_seconds",
    # what runs and where it attached (telemetry/wire/build_info.py, guard/stream/identity.py)
    "ascend_guard_build_info",
    "ascend_guard_attach_points",
    # the Kubernetes pod of each rank, which the alerts join (telemetry/metrics/workload.py)
    "ascend_guard_rank_workload_info",
}
SIDECAR_METRICS = {"ascend_guard_ingest_rejected_total"}  # no engine label
HISTOGRAMS = {
    "ascend_guard_step_duration_seconds",
    "ascend_guard_wave_skew_seconds",
    "ascend_guard_wave_arrival_skew_seconds",
    "ascend_guard_hang_stall_seconds",
}
EXPORTED = WORKER_METRICS | SIDECAR_METRICS
PROMETHEUS_OWN = {"up"}  # the scrape's own series: the sidecar-down alerts
ALLOWED = (
    EXPORTED
    | PROMETHEUS_OWN
    | {f"{h}{suffix}" for h in HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")}
) - HISTOGRAMS  # a bare histogram name is not a queryable series

PROMTOOL_HINT = (
    "promtool not found: run `make deps` or "
    "`apt-get update && apt-get install -y --no-install-recommends prometheus` "
    "(or `sudo tools/ensure_prometheus.sh`)"
)


def family(name: str) -> str:
    for h in HISTOGRAMS:
        if name in (f"{h}_bucket", f"{h}_sum", f"{h}_count"):
            return h
    return name


def promtool() -> str:
    path = shutil.which("promtool") or (
        "/usr/bin/promtool" if Path("/usr/bin/promtool").exists() else None
    )
    if not path:
        pytest.fail(PROMTOOL_HINT)
    return path


def alert_rules() -> list[dict]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


@pytest.fixture(scope="module")
def overview() -> dict:
    return load_dashboard(OVERVIEW)


# --------------------------------------------------------------------------- dashboard JSON
def test_dashboard_files_load_and_uids_are_unique():
    assert OVERVIEW in DASHBOARD_FILES
    uids = {}
    for path in DASHBOARD_FILES:
        dash = load_dashboard(path)
        uid = dash.get("uid")
        assert uid, f"{path.name}: no uid"
        assert re.fullmatch(r"[A-Za-z0-9_-]{1,40}", uid), f"{path.name}: bad uid {uid!r}"
        assert uid not in uids, f"uid {uid!r} in both {uids[uid]} and {path.name}"
        uids[uid] = path.name
        assert dash.get("title"), f"{path.name}: no title"
        assert dash.get("id") is None, f"{path.name}: remove the instance-specific numeric id"
        assert int(dash.get("schemaVersion", 0)) >= 39, f"{path.name}: schemaVersion < 39"


def test_overview_identity(overview):
    assert overview["uid"] == "ascend-guard-overview"
    assert overview["title"] == "ascend-guard / overview"


def test_template_variables(overview):
    variables = {v["name"]: v for v in overview["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    engine = variables["engine"]
    assert engine["type"] == "query"
    query = engine["query"]["query"] if isinstance(engine["query"], dict) else engine["query"]
    assert query.replace(" ", "") == "label_values(ascend_guard_waves_total,engine)"
    assert engine["multi"] is True and engine["includeAll"] is True
    assert engine["datasource"]["uid"] == "${datasource}"


def test_dp_variable_selects_replicas_of_the_chosen_engines(overview):
    variables = {v["name"]: v for v in overview["templating"]["list"]}
    dp = variables["dp"]
    assert dp["type"] == "query" and dp["datasource"]["uid"] == "${datasource}"
    query = dp["query"]["query"] if isinstance(dp["query"], dict) else dp["query"]
    assert query.replace(" ", "") == 'label_values(ascend_guard_waves_total{engine=~"$engine"},dp)'
    assert dp["multi"] is True and dp["includeAll"] is True and dp["allValue"] == ".*"


def test_per_replica_variables_and_queries(overview):
    """Replicas never fold into one line: every query keeps instance and pod, and is filtered by
    the node, pod, engine and rank variables."""
    variables = {v["name"]: v for v in overview["templating"]["list"]}
    for name in ("node", "pod", "engine", "rank"):
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*", name
    for panel in iter_panels(overview):
        for target in panel.get("targets", []):
            expr = target["expr"]
            for clause in re.findall(r"\b(?:by|on)\s*\(([^)]*)\)", expr):
                assert {"instance", "pod"} <= {c.strip() for c in clause.split(",")}, expr
            for inner in re.findall(r"ascend_guard_\w+\{([^}]*)\}", expr):
                assert 'node=~"$node"' in inner and 'pod=~"$pod"' in inner, expr
            assert not re.search(r"ascend_guard_\w+\[", expr), f"unfiltered selector: {expr}"
            assert "{{instance}}" in target.get("legendFormat", ""), panel["title"]


def test_panel_ids_refids_and_layout(overview):
    panels = [p for p in iter_panels(overview)]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {ids}"
    titles = [p["title"] for p in panels if p.get("type") != "row"]
    assert len(titles) == len(set(titles)), "duplicate panel titles"
    cells = {}
    for p in panels:
        assert p.get("type") in {"timeseries", "stat", "row"}, (p["title"], p.get("type"))
        pos = p["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, (p["title"], pos)
        for dx in range(pos["w"]):
            for dy in range(pos["h"]):
                cell = (pos["x"] + dx, pos["y"] + dy)
                assert cell not in cells, f"{p['title']!r} overlaps {cells[cell]!r}"
                cells[cell] = p["title"]
        refids = [t["refId"] for t in p.get("targets", [])]
        assert len(refids) == len(set(refids)), f"{p['title']}: duplicate refIds"


def test_every_panel_has_a_prometheus_query(overview):
    for panel in iter_panels(overview):
        if panel.get("type") == "row":
            continue
        targets = panel.get("targets") or []
        assert targets and all(t.get("expr", "").strip() for t in targets), panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        for t in targets:
            assert t.get("datasource", panel["datasource"])["uid"] == "${datasource}"
        unit = panel["fieldConfig"]["defaults"].get("unit")
        # percentunit: seconds per second (share of time); Bps: collective payload per second
        assert unit in {"s", "ms", "ops", "short", "percentunit", "bytes", "Bps"}, (
            f"{panel['title']}: unit {unit!r}"
        )


def test_panel_metrics_are_exported_families(overview):
    queries = panel_queries(overview)
    assert queries
    used = set()
    for title, expr in queries:
        names = metric_names_in(expr)
        assert names, f"{title!r}: no metric found in {expr!r}"
        unknown = names - ALLOWED
        assert not unknown, f"{title!r}: unknown metrics {sorted(unknown)} in {expr!r}"
        used |= {family(n) for n in names}
    # Every exported family has a place on the overview.
    assert used == EXPORTED, f"families without a panel: {sorted(EXPORTED - used)}"


def test_worker_queries_filter_by_engine_and_dp(overview):
    for title, expr in panel_queries(overview):
        for m in re.finditer(r"(ascend_guard_\w+)(\{[^}]*\})?", expr):
            name, selector = m.group(1), m.group(2) or ""
            if family(name) in SIDECAR_METRICS:
                assert "engine" not in selector, f"{title!r}: {name} has no engine label"
                continue
            assert 'engine=~"$engine"' in selector, f"{title!r}: {name} not filtered by engine"
            assert 'dp=~"$dp"' in selector, f"{title!r}: {name} not filtered by dp"


def test_lag_panels_compare_ranks_within_one_replica(overview):
    """Each DP engine numbers its own waves and collectives: a lag across replicas means
    nothing, so the leading rank is found per (engine, dp)."""
    lags = [(t, e) for t, e in panel_queries(overview) if "lag behind the leading rank" in t]
    assert len(lags) == 2
    for title, expr in lags:
        clauses = [{c.strip() for c in m.split(",")} for m in re.findall(r"\bon \(([^)]*)\)", expr)]
        assert clauses and all({"engine", "dp"} <= c for c in clauses), (title, expr)


def test_rate_queries_use_rate_interval(overview):
    for title, expr in panel_queries(overview):
        for window in re.findall(r"\[([^\]]+)\]", expr):
            assert window == "$__rate_interval", f"{title!r}: use $__rate_interval, not {window}"


def test_histogram_quantiles_keep_le(overview):
    for title, expr in panel_queries(overview):
        if "histogram_quantile" in expr:
            assert re.search(r"by \([^)]*\ble\b", expr), f"{title!r}: aggregate `by (..., le)`"
            assert "_bucket" in expr, title


def test_rendered_panel_queries_parse(tmp_path):
    """Every rendered query is valid PromQL: promtool parses it as a recording rule."""
    rules = []
    for i, (title, expr) in enumerate(panel_queries(load_dashboard(OVERVIEW))):
        rendered = render_expr(expr, engine="test")
        assert "$" not in rendered, (title, rendered)
        rules.append({"record": f"ascend_guard:panel_query_{i}", "expr": rendered})
    path = tmp_path / "panel_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    proc = subprocess.run(
        [promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --------------------------------------------------------------------------- helpers
def test_metric_names_in():
    assert metric_names_in(
        'sum by (engine,dp,tp,pp) (rate(ascend_guard_waves_total{engine=~"$engine"}[5m]))'
    ) == {"ascend_guard_waves_total"}
    assert metric_names_in("histogram_quantile(0.9, sum by (le, phase) (rate(h_bucket[1m])))") == {
        "h_bucket"
    }
    assert metric_names_in("time() - hb_seconds > 10") == {"hb_seconds"}
    assert metric_names_in("max by (engine) (a) - on (engine) group_right () b") == {"a", "b"}
    assert metric_names_in('x{le="0.1", job="sum"} or y offset 5m unless z') == {"x", "y", "z"}
    assert metric_names_in('{__name__="named_metric"}') == {"named_metric"}


def test_render_expr():
    expr = 'rate(m{engine=~"$engine"}[$__rate_interval]) + rate(m[${__interval}]) + m[$__range]'
    assert render_expr(expr, "e1", "1m", range_="1h") == (
        'rate(m{engine=~"e1"}[1m]) + rate(m[1m]) + m[1h]'
    )
    assert render_expr('m{engine=~"${engine:regex}"}', "x") == 'm{engine=~"x"}'
    with pytest.raises(ValueError):
        render_expr('m{x="$unknown"}', "e")


# --------------------------------------------------------------------------- provisioning
def test_datasource_provisioning():
    doc = yaml.safe_load(DATASOURCES_YAML.read_text())
    assert doc["apiVersion"] == 1
    (ds,) = doc["datasources"]
    assert ds["type"] == "prometheus"
    assert ds["url"] == "${PROMETHEUS_URL}"
    assert ds.get("access", "proxy") == "proxy"
    assert "PROMETHEUS_URL" in DATASOURCES_YAML.read_text().split("url:")[0]  # documented above


def test_dashboard_provisioning():
    doc = yaml.safe_load(PROVIDERS_YAML.read_text())
    assert doc["apiVersion"] == 1
    (provider,) = doc["providers"]
    assert provider["type"] == "file"
    path = provider["options"]["path"]
    assert path.startswith("/") or path.startswith("$"), path
    assert path in PROVIDERS_YAML.read_text().split("providers:")[0], "mount path not documented"


# --------------------------------------------------------------------------- alert rules
def test_alert_rules_pass_promtool():
    proc = subprocess.run(
        [promtool(), "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_alert_rules_cover_the_failure_modes():
    rules = alert_rules()
    by_metric = {}
    for rule in rules:
        assert rule.get("alert"), f"recording rule in alerts.yml: {rule}"
        assert rule.get("labels", {}).get("severity") in {"critical", "warning", "info"}
        assert rule.get("annotations", {}).get("summary"), rule["alert"]
        for name in metric_names_in(rule["expr"]):
            by_metric.setdefault(name, []).append(rule["alert"])
    for rule in rules:  # per replica: one DP engine's trouble is not averaged into another's
        for by in re.findall(r"\b(?:by|on) \(([^)]*)\)", rule["expr"]):
            labels = {label.strip() for label in by.split(",")}
            if "engine" in labels and rule["alert"] != "AscendGuardConfigReloadRefused":
                assert "dp" in labels, f"{rule['alert']}: groups by engine without dp: {by}"
    for needed in (
        "ascend_guard_last_heartbeat_timestamp_seconds",
        "ascend_guard_records_dropped_total",
        "ascend_guard_guard_errors_total",
        "ascend_guard_ranks_connected",
    ):
        assert needed in by_metric, f"no alert on {needed}"
    (stale,) = [r for r in rules if "ascend_guard_last_heartbeat_timestamp_seconds" in r["expr"]]
    assert re.search(r">\s*10\b", stale["expr"]), "heartbeat alert threshold is 10 s"


def test_alert_metrics_are_exported_families():
    for rule in alert_rules():
        names = metric_names_in(rule["expr"])
        assert names, rule["alert"]
        unknown = names - ALLOWED
        assert not unknown, f"{rule['alert']}: unknown metrics {sorted(unknown)}"


def test_dashboard_json_is_canonical():
    """The JSON is stored with 2-space indent, so diffs of hand edits stay reviewable."""
    text = OVERVIEW.read_text()
    assert text == json.dumps(json.loads(text), indent=2) + "\n"
