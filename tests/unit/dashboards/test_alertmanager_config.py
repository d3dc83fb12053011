"""The example Alertmanager config (deploy/examples/alertmanager/alertmanager.yml) is valid for
`amtool check-config` and routes by engine and severity as its comments say (`amtool config
routes test`, the Debian package prometheus-alertmanager; `make deps` installs it)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / "deploy" / "examples" / "alertmanager" / "alertmanager.yml"


def _amtool(*args: str) -> subprocess.CompletedProcess:
    tool = shutil.which("amtool") or (
        "/usr/bin/amtool" if Path("/usr/bin/amtool").exists() else None
    )
    if tool is None:
        pytest.fail("amtool is not installed: run `make deps` (Debian prometheus-alertmanager)")
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=60)


def test_amtool_accepts_the_config():
    run = _amtool("check-config", str(CONFIG))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout


@pytest.mark.parametrize(
    ("labels", "receiver"),
    [
        ("alertname=AscendGuardClusterRankSilent engine=llama-0 dp=0 severity=critical", "pager"),
        ("alertname=AscendGuardClusterRankSilent engine=deepseek-v3 dp=1 severity=critical",
         "pager-moe-team"),
        ("alertname=AscendGuardNonFiniteLogits engine=deepseek-v3 dp=0 severity=critical",
         "pager-moe-team"),
        ("alertname=AscendGuardNonFiniteLogits engine=llama-0 dp=0 severity=critical", "pager"),
        ("alertname=AscendGuardClusterStraggler engine=deepseek-v3 dp=0 severity=warning", "chat"),
        ("alertname=AscendGuardIngestRejected instance=n1:9464 severity=info", "ticket"),
    ],
)  # fmt: skip
def test_routes_by_engine_and_severity(labels, receiver):
    run = _amtool("config", "routes", "test", f"--config.file={CONFIG}", *labels.split())
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip() == receiver


def test_every_alert_the_config_names_exists():
    rules = [
        yaml.safe_load((ROOT / "dashboards" / "prometheus" / name).read_text())
        for name in ("alerts.yml", "cluster.yml")
    ]
    alerts = {
        r["alert"] for doc in rules for g in doc["groups"] for r in g["rules"] if "alert" in r
    }
    named = set(re.findall(r"AscendGuard[A-Za-z]+", CONFIG.read_text()))
    assert named and named <= alerts, named - alerts
