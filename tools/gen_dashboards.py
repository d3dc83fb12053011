"""Generate the five focused dashboards from the overview and the panels defined here.

    python tools/gen_dashboards.py          # write dashboards/ascend-guard-<name>.json
    python tools/gen_dashboards.py --check  # exit 1 when the committed files differ

The overview (dashboards/ascend-guard-overview.json) stays hand-edited and is the one home of
its panels' queries, variables and Tempo links: a focused dashboard takes those panels by title,
unchanged but for their place on the grid, and adds panels of its own (the cross-node rank
gauges, a non-finite logits rate). `make dashboards` runs this; tests/unit/dashboards/test_dashboards.py
fails on drift, and tools/dashboard_schema.py checks all six against Grafana's schema.
"""

from __future__ import annotations

import copy
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: tools/ is then on the path, not the root
    sys.path.insert(0, str(ROOT))

from tools.drift import write_or_check  # noqa: E402

DASHBOARDS = ROOT / "dashboards"
OVERVIEW = DASHBOARDS / "ascend-guard-overview.json"

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# the per-replica filter every worker series takes (the overview's variables)
RANK_FILTER = 'node=~"$node", pod=~"$pod", engine=~"$engine", dp=~"$dp", tp=~"$rank"'
RANK_BY = "instance, pod, run_id, engine, dp, tp, pp, node, pid"
RANK_LEGEND = "{{instance}} {{engine}} dp{{dp}} tp{{tp}} pp{{pp}} on {{node}} pid {{pid}}"
NEW_PANEL_ID = 1000  # ids of panels defined here start at this (the overview's stay below)


def _gauge_age(metric: str) -> str:
    """Age of a timestamp gauge at scrape time (docs/cross-node.md: `timestamp(x) - x`)."""
    selector = f"{metric}{{{RANK_FILTER}}}"
    return f"timestamp({selector}) - {selector}"


@dataclass(frozen=True)
class NewPanel:
    """A panel of a focused dashboard that the overview does not have."""

    title: str
    description: str
    unit: str
    targets: tuple[tuple[str, str], ...]  # (expr, legendFormat)
    tempo_link: bool = False  # the overview's "waves of this rank in Tempo" link


NEW_PANELS = {
    "silence": NewPanel(
        "Rank silence by rank (cross-node)",
        "Seconds since each rank's latest sign of life as its own node's sidecar saw it (a "
        "batch, or a look at its liveness record). One line per rank of every node: "
        "AscendGuardClusterRankSilent fires when one is silent while a peer waits.",
        "s",
        (
            (
                f"max by ({RANK_BY}) ({_gauge_age('ascend_guard_rank_last_seen_timestamp_seconds')})",
                RANK_LEGEND,
            ),
        ),
        tempo_link=True,
    ),
    "inside": NewPanel(
        "Time inside the current collective by rank",
        "How long each rank has been inside the collective it is in now (no line while in "
        "none). Peers that wait long while one rank of their replica is silent, or at a lower "
        "sequence number, are the cross-node hang.",
        "s",
        (
            (
                f"max by ({RANK_BY}, group, comm) "
                f"({_gauge_age('ascend_guard_rank_collective_since_timestamp_seconds')})",
                RANK_LEGEND + " {{group}}/{{comm}}",
            ),
        ),
    ),
    "seq_now": NewPanel(
        "Collective sequence number now and reached, by rank",
        "The seq of the collective each rank is inside now, and the highest seq it completed "
        "or entered per group. Ranks of one communicator at different seqs: one has not "
        "arrived (AscendGuardClusterRankNotArrived).",
        "short",
        (
            (
                f"max by ({RANK_BY}, group, comm) "
                f"(ascend_guard_rank_collective_seq{{{RANK_FILTER}}})",
                RANK_LEGEND + " {{group}}/{{comm}} now",
            ),
            (
                f"max by ({RANK_BY}, group, comm) "
                f"(ascend_guard_rank_collective_seq_reached{{{RANK_FILTER}}})",
                RANK_LEGEND + " {{group}}/{{comm}} reached",
            ),
        ),
    ),
    "wait_per_wave": NewPanel(
        "Collective wait per wave by rank (cross-node)",
        "Host time each rank spent inside collectives per wave, from every node's gauges. The "
        "rank that waits least is the one the others wait for: the straggler across nodes "
        "(AscendGuardClusterStraggler).",
        "s",
        (
            (
                f"sum by ({RANK_BY}) (rate(ascend_guard_rank_collective_wait_seconds_total"
                f"{{{RANK_FILTER}}}[$__rate_interval])) / sum by ({RANK_BY}) "
                f"(rate(ascend_guard_rank_collective_waves_total{{{RANK_FILTER}}}[$__rate_interval]))",
                RANK_LEGEND,
            ),
        ),
        tempo_link=True,
    ),
    "nonfinite": NewPanel(
        "Non-finite logits incidents per second by rank",
        "NaN or Inf logits (incident type logits_finite) per second. Any is a numerical fault "
        "of the model or the device; AscendGuardNonFiniteLogitsRate fires above 1 a minute.",
        "ops",
        (
            (
                f"sum by (instance, pod, engine, dp, tp, pp) (rate(ascend_guard_incidents_total"
                f'{{type="logits_finite", {RANK_FILTER}}}[$__rate_interval]))',
                "{{instance}} {{engine}} dp{{dp}} tp{{tp}} pp{{pp}}",
            ),
        ),
    ),
}


@dataclass(frozen=True)
class Focus:
    """A focused dashboard: overview panels by title (or NEW_PANELS keys), in reading order."""

    name: str
    title: str
    description: str
    stats: tuple[str, ...]  # small panels across the top
    panels: tuple[str, ...]  # two a row below them


FOCUSED = (
    Focus(
        "waves",
        "waves & stragglers",
        "Wave rate, step timings and lockstep across the ranks of each replica; which rank the "
        "others wait for, on one node and across nodes.",
        ("Waves per second", "Oldest heartbeat"),
        ("Waves per second by rank", "Dummy (idle) waves per second by rank",
         "Step duration quantiles by phase", "Step duration p99 by rank", "Last wave by rank",
         "Wave lag behind the leading rank", "Wave skew quantiles",
         "Straggler waves per second by rank", "Time the other ranks waited for each rank",
         "wait_per_wave", "Waves not aligned across ranks"),
    ),
    Focus(
        "collectives",
        "collectives",
        "Collective calls, bytes and latency by op and group; sequence numbers per rank on "
        "every node; slow calls.",
        (),
        ("Collective latency by op and group: mean and slowest call",
         "Collective bytes per second by op, group and backend",
         "Collective calls per second by rank and op", "Share of time inside collectives by rank",
         "Collective sequence lag behind the leading rank", "Slow collective calls per second",
         "inside", "seq_now", "Communicators and HCCL settings"),
    ),
    Focus(
        "sampling",
        "sampling health",
        "What the sampling guard sees: tokens, logits health, detector hits, speculative "
        "decoding acceptance, config reloads.",
        (),
        ("Sampled tokens per second by rank", "Scheduled tokens per second: prefill vs decode",
         "Logits health: max |logit| by rank", "Logits health: mean entropy by rank",
         "Detector hits per second by type", "Speculative decoding acceptance by method",
         "Config generation by rank"),
    ),
    Focus(
        "incidents",
        "incidents & hangs",
        "Incidents by type, non-finite logits, hang verdicts and recoveries, and the cross-node "
        "view: which rank is silent while its peers wait.",
        ("Engines wedged (hang verdict standing)", "Hang verdicts (since sidecar start)",
         "Hang recoveries (since sidecar start)"),
        ("Incidents per second by type", "nonfinite", "Hang verdicts by stopped rank and kind",
         "Stall length until recovery", "Seconds since last heartbeat by rank", "silence",
         "inside", "Records dropped per second by rank"),
    ),
    Focus(
        "runtime",
        "Ascend runtime",
        "What the runtime probes read on each rank: KV cache, rotary tables, device time per "
        "phase, captured graphs and leaked workspaces, speculators, communicators, and what "
        "runs where.",
        (),
        ("KV cache bytes by rank", "KV cache blocks and layers by rank",
         "Device time per phase by rank", "Graph captures by graph",
         "Graph workspaces leaked (bytes) by rank", "Speculator drafts per second by method",
         "Communicators and HCCL settings", "Builds by component", "Attach points by status"),
    ),
)  # fmt: skip


def _tempo_link(overview: dict[str, Any]) -> dict[str, Any]:
    (panel,) = [p for p in overview["panels"] if p["title"] == "Waves per second by rank"]
    (link,) = panel["fieldConfig"]["defaults"]["links"]
    return link


def _new_panel(spec: NewPanel, panel_id: int, overview: dict[str, Any]) -> dict[str, Any]:
    defaults: dict[str, Any] = {
        "unit": spec.unit,
        "color": {"mode": "palette-classic"},
        "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10,
            "showPoints": "never",
            "spanNulls": False,
        },
        "thresholds": {"mode": "absolute", "steps": [{"color": "green", "value": None}]},
        "min": 0,
    }
    if spec.tempo_link:
        defaults["links"] = [copy.deepcopy(_tempo_link(overview))]
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": spec.title,
        "description": spec.description,
        "datasource": dict(DATASOURCE),
        "gridPos": {},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {
                "displayMode": "table",
                "placement": "bottom",
                "showLegend": True,
                "calcs": ["lastNotNull", "max"],
            },
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": [
            {
                "datasource": dict(DATASOURCE),
                "editorMode": "code",
                "expr": expr,
                "legendFormat": legend,
                "range": True,
                "refId": chr(ord("A") + i),
            }
            for i, (expr, legend) in enumerate(spec.targets)
        ],
    }


def _links() -> list[dict[str, Any]]:
    """Header links to the other ascend-guard dashboards, keeping the time range and variables."""
    return [
        {
            "title": "ascend-guard",
            "type": "dashboards",
            "tags": ["ascend-guard"],
            "asDropdown": True,
            "icon": "external link",
            "tooltip": "",
            "url": "",
            "targetBlank": False,
            "includeVars": True,
            "keepTime": True,
        }
    ]


def focused(focus: Focus, overview: dict[str, Any]) -> dict[str, Any]:
    """The dashboard JSON of `focus`."""
    by_title = {p["title"]: p for p in overview["panels"]}
    panels: list[dict[str, Any]] = []
    next_id = NEW_PANEL_ID

    def take(name: str) -> dict[str, Any]:
        nonlocal next_id
        if name in NEW_PANELS:
            next_id += 1
            return _new_panel(NEW_PANELS[name], next_id, overview)
        if name not in by_title:
            raise KeyError(f"{focus.name}: no panel titled {name!r} on the overview")
        return copy.deepcopy(by_title[name])

    width = 24 // len(focus.stats) if focus.stats else 0
    for i, name in enumerate(focus.stats):
        panel = take(name)
        panel["gridPos"] = {"h": 4, "w": width, "x": i * width, "y": 0}
        panels.append(panel)
    top = 4 if focus.stats else 0
    for i, name in enumerate(focus.panels):
        panel = take(name)
        panel["gridPos"] = {"h": 8, "w": 12, "x": 12 * (i % 2), "y": top + 8 * (i // 2)}
        panels.append(panel)
    header = {k: copy.deepcopy(v) for k, v in overview.items() if k not in ("panels", "links")}
    header.update(
        uid=f"ascend-guard-{focus.name}",
        title=f"ascend-guard / {focus.title}",
        description=focus.description,
        links=_links(),
        panels=panels,
    )
    return header


def rendered() -> dict[Path, str]:
    overview = json.loads(OVERVIEW.read_text())
    return {
        DASHBOARDS / f"ascend-guard-{f.name}.json": json.dumps(focused(f, overview), indent=2)
        + "\n"
        for f in FOCUSED
    }


def main(argv: list[str] | None = None) -> int:
    return write_or_check(
        argv,
        __doc__.splitlines()[0],
        rendered,
        "{names} drifted from tools/gen_dashboards.py; run `make dashboards`",
    )


if __name__ == "__main__":
    sys.exit(main())
