"""Read Grafana dashboards and the PromQL inside them (for static and live dashboard tests)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# PromQL functions, aggregation operators and keywords: identifiers that are never metric names.
_FUNCTIONS = """
    abs absent absent_over_time acos acosh asin asinh atan atanh avg_over_time ceil changes clamp
    clamp_max clamp_min cos cosh count_over_time days_in_month day_of_month day_of_week
    day_of_year deg delta deriv exp floor histogram_avg histogram_count histogram_fraction
    histogram_quantile histogram_stddev histogram_stdvar histogram_sum holt_winters
    double_exponential_smoothing hour idelta increase irate label_join label_replace last_over_time
    ln log10 log2 mad_over_time max_over_time min_over_time minute month pi predict_linear
    present_over_time quantile_over_time rad rate resets round scalar sgn sin sinh sort
    sort_by_label sort_by_label_desc sort_desc sqrt stddev_over_time stdvar_over_time
    sum_over_time tan tanh time timestamp vector year info
"""
_AGGREGATIONS = """
    sum min max avg group stddev stdvar count count_values bottomk topk quantile limitk limit_ratio
"""
_KEYWORDS = """
    by without on ignoring group_left group_right bool offset and or unless atan2 le inf nan
    start end
"""
PROMQL_FUNCTIONS = frozenset(_FUNCTIONS.split())
PROMQL_AGGREGATIONS = frozenset(_AGGREGATIONS.split())
PROMQL_KEYWORDS = frozenset(_KEYWORDS.split())
NOT_METRICS = PROMQL_FUNCTIONS | PROMQL_AGGREGATIONS | PROMQL_KEYWORDS

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"' r"|'(?:[^'\\]|\\.)*'" r"|`[^`]*`")
_SELECTOR = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(
    r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", re.IGNORECASE
)
_IDENT = re.compile(r"(?<![\w.$:])([A-Za-z_:][A-Za-z0-9_:]*)(?=[\s{\[)]|$)")


def load_dashboard(path: str | Path) -> dict[str, Any]:
    """Load a dashboard JSON file; accepts a bare dashboard or an API envelope {dashboard: ...}."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if isinstance(data, dict) and "dashboard" in data and "panels" not in data:
        data = data["dashboard"]
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a dashboard must be a JSON object")
    return data


def iter_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, including those nested in (collapsed) rows."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from iter_panels(panel)  # rows keep collapsed children under "panels"


def panel_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """``(panel_title, expr)`` for every Prometheus target of every non-row panel."""
    out: list[tuple[str, str]] = []
    for panel in iter_panels(dashboard):
        if panel.get("type") == "row":
            continue
        for target in panel.get("targets", []) or []:
            expr = target.get("expr")
            if expr and not target.get("hide"):
                out.append((panel.get("title", ""), expr))
    return out


def metric_names_in(expr: str) -> set[str]:
    """Metric names referenced by a PromQL expression.

    A metric name is an identifier followed by ``{``, ``[``, ``)``, whitespace or the end, that is
    not a function, aggregation or keyword. String literals, label matchers, range/subquery
    brackets and grouping clauses (``by (...)``, ``on (...)``, ...) are removed first so that label
    names there are not mistaken for metrics. ``{__name__="x"}`` selectors are counted too.
    """
    names: set[str] = set()
    for m in re.finditer(r'__name__\s*=\s*"([A-Za-z_:][A-Za-z0-9_:]*)"', expr):
        names.add(m.group(1))
    text = _STRING.sub('""', expr)
    text = _SELECTOR.sub("{}", text)
    text = _RANGE.sub("[]", text)
    text = _GROUPING.sub(" ", text)
    for m in _IDENT.finditer(text):
        ident = m.group(1)
        if ident.lower() in NOT_METRICS:
            continue
        names.add(ident)
    return names


def render_expr(
    expr: str,
    engine: str,
    rate_interval: str = "30s",
    *,
    interval: str | None = None,
    range_: str = "5m",
    datasource: str = "prometheus",
    extra: dict[str, str] | None = None,
) -> str:
    """Substitute Grafana variables so that ``expr`` can run against a real Prometheus.

    ``$engine`` / ``${engine}`` / ``[[engine]]`` (and ``${engine:regex}``-style formats) become
    ``engine``; ``$dp`` becomes ``.*`` (the variable's "All"); ``$__rate_interval`` becomes ``rate_interval``; ``$__interval`` becomes
    ``interval`` (``rate_interval`` when not given); ``$__range`` becomes ``range_``;
    ``$__range_s`` / ``$__range_ms`` and ``$__interval_ms`` the matching numbers;
    ``$datasource`` becomes ``datasource``; ``$node``, ``$pod``, ``$rank`` become ``.*`` (All).
    ``extra`` adds or overrides variables by name.
    Raises ``ValueError`` when a ``$variable`` remains unsubstituted.
    """
    interval = interval or rate_interval
    values: dict[str, str] = {
        "engine": engine,
        # the per-replica filters at "All" (their allValue)
        "node": ".*",
        "dp": ".*",
        "pod": ".*",
        "rank": ".*",
        "datasource": datasource,
        "__rate_interval": rate_interval,
        "__interval": interval,
        "__interval_ms": str(int(_seconds(interval) * 1000)),
        "__range": range_,
        "__range_s": str(int(_seconds(range_))),
        "__range_ms": str(int(_seconds(range_) * 1000)),
    }
    if extra:
        values.update(extra)

    def sub(m: re.Match[str]) -> str:
        name = m.group("b") or m.group("p") or m.group("s")
        if name not in values:
            return m.group(0)
        return values[name]

    # ${name} / ${name:format} / [[name]] / $name (longest names first via \w+ greediness).
    pattern = re.compile(r"\$\{(?P<b>\w+)(?::[^}]*)?\}|\[\[(?P<s>\w+)(?::[^\]]*)?\]\]|\$(?P<p>\w+)")
    rendered = pattern.sub(sub, expr)
    leftover = re.findall(r"\$\{?\w+", rendered)
    if leftover:
        raise ValueError(f"unsubstituted Grafana variables {leftover} in {expr!r}")
    return rendered


_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


def _seconds(duration: str) -> float:
    """Seconds in a Prometheus duration such as ``30s``, ``1m30s`` or ``500ms``."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w|y)", duration)
    if not parts or "".join(n + u for n, u in parts) != duration:
        raise ValueError(f"not a Prometheus duration: {duration!r}")
    return sum(float(n) * _UNITS[u] for n, u in parts)
