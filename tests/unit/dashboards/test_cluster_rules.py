"""The cross-node rules with `promtool test rules` (Debian `prometheus`), from the source file
and from deploy/'s generated PrometheusRule; and every alert of alerts.yml has a unit test
that fires it and one that does not."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tools import render_deploy

ROOT = Path(__file__).resolve().parents[3]
PROM = ROOT / "dashboards" / "prometheus"
TESTS = ("alerts_test.yml", "cluster_test.yml")


def _promtool() -> str:
    found = shutil.which("promtool") or (
        "/usr/bin/promtool" if Path("/usr/bin/promtool").exists() else None
    )
    if not found:
        pytest.fail("promtool is not installed; run `make deps`")
    return found


def _test_rules(where: Path, name: str = "cluster_test.yml") -> subprocess.CompletedProcess:
    return subprocess.run(
        [_promtool(), "test", "rules", name], cwd=where, capture_output=True, text=True, timeout=120
    )


def _rules(name: str = "cluster.yml") -> dict:
    return yaml.safe_load((PROM / name).read_text())


def _copy(tmp_path: Path, rules: dict) -> Path:
    (tmp_path / "cluster.yml").write_text(yaml.safe_dump(rules, sort_keys=False))
    shutil.copy(PROM / "cluster_test.yml", tmp_path / "cluster_test.yml")
    return tmp_path


def test_cluster_rules_pass_their_unit_tests():
    run = _test_rules(PROM)
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_generated_prometheus_rule_passes_them_too(tmp_path):
    doc = yaml.safe_load(render_deploy.prometheus_rule())
    run = _test_rules(_copy(tmp_path, doc["spec"]))
    assert run.returncode == 0, run.stdout + run.stderr


def _alerts() -> list[dict]:
    return [
        rule
        for name in ("alerts.yml", "cluster.yml")
        for group in _rules(name)["groups"]
        for rule in group["rules"]
        if "alert" in rule
    ]


def test_every_alert_has_a_firing_and_a_quiet_unit_test():
    alerts = [r["alert"] for r in _alerts()]
    fires, quiet = set(), set()
    for name in TESTS:
        for test in yaml.safe_load((PROM / name).read_text())["tests"]:
            for case in test.get("alert_rule_test", []):
                (fires if case.get("exp_alerts") else quiet).add(case["alertname"])
    assert [a for a in alerts if a not in fires] == []
    assert [a for a in alerts if a not in quiet] == []


def test_the_silence_rule_without_its_self_exclusion_fails_a_test(tmp_path):
    """The tests can fail: a rank frozen inside the collective must not count as the peer
    that waits for it."""
    rules = _rules()
    for group in rules["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == "AscendGuardClusterRankSilent":
                rule["expr"] = (
                    "ascend_guard:rank_silence_seconds > 4 and on (run_id, engine, dp) "
                    "(max by (run_id, engine, dp) (ascend_guard:rank_collective_wait_seconds) > 3)"
                )
    run = _test_rules(_copy(tmp_path, rules))
    assert run.returncode != 0
    assert "the only rank that waits is the silent one itself" in run.stdout + run.stderr


def test_the_prometheus_rule_holds_both_files():
    doc = yaml.safe_load(render_deploy.prometheus_rule())
    names = [g["name"] for g in doc["spec"]["groups"]]
    expected = [g["name"] for n in ("alerts.yml", "cluster.yml") for g in _rules(n)["groups"]]
    assert names == expected


def test_every_cluster_alert_has_its_runbook():
    catalogue = (ROOT / "docs" / "runbooks" / "README.md").read_text()
    for rule in _rules()["groups"][0]["rules"]:
        if "alert" not in rule:
            continue
        name = rule["alert"]
        assert rule["annotations"]["runbook_url"].endswith(f"/docs/runbooks/{name}.md")
        text = (ROOT / "docs" / "runbooks" / f"{name}.md").read_text()
        for section in ("## Run", "## What the output means", "## Decide", "## Escalate"):
            assert section in text, f"{name}.md lacks {section!r}"
        assert f"[{name}.md]({name}.md)" in catalogue, name


def test_cluster_rules_join_on_the_engine_labels_every_node_shares():
    group = next(g for g in _rules()["groups"] if g["name"] == "ascend-guard-cluster")
    exprs = {r.get("alert") or r["record"]: r["expr"] for r in group["rules"]}
    for name in ("AscendGuardClusterRankSilent", "AscendGuardClusterRankNotArrived"):
        assert "on (run_id, engine, dp" in exprs[name], name


def _workload_tests(where: Path) -> subprocess.CompletedProcess:
    shutil.copy(PROM / "workload_test.yml", where / "workload_test.yml")
    return _test_rules(where, "workload_test.yml")


def test_alerts_carry_the_workloads_namespace_pod_and_node(tmp_path):
    """workload_test.yml against deploy/'s PrometheusRule: a DaemonSet sidecar's alerts name the
    vLLM pod and namespace (from ascend_guard_rank_workload_info), not the sidecar's, and
    AscendGuardWavesStalled joins vLLM's series by that pod whatever the engine label is."""
    groups = yaml.safe_load(render_deploy.prometheus_rule())["spec"]["groups"]
    for file in ("alerts.yml", "cluster.yml"):
        wanted = {g["name"] for g in _rules(file)["groups"]}
        doc = {"groups": [g for g in groups if g["name"] in wanted]}
        (tmp_path / file).write_text(yaml.safe_dump(doc, sort_keys=False))
    run = _workload_tests(tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_workload_tests_fail_without_the_join(tmp_path):
    """The tests can fail: with the workload recording rules emptied, the alerts carry the
    sidecar's pod and the shared-engine WavesStalled stays silent."""
    for name in ("alerts.yml", "cluster.yml"):
        text = (PROM / name).read_text()
        text = text.replace("(1, ascend_guard_rank_workload_info)", "(1, absent_nothing_here)")
        (tmp_path / name).write_text(text)
    run = _workload_tests(tmp_path)
    out = run.stdout + run.stderr
    assert run.returncode != 0
    assert "vllm-qwen-7c9d-abcde" in out and "AscendGuardWavesStalled" in out


def test_the_dashboards_readme_lists_every_alert():
    readme = (ROOT / "dashboards" / "README.md").read_text()
    missing = [r["alert"] for r in _alerts() if f"| `{r['alert']}` |" not in readme]
    assert missing == [], missing
