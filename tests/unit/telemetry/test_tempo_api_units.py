"""The query API's pieces without a server: parameters, OTLP/JSON ids, provisioning, links."""

from __future__ import annotations

import json
import re
import urllib.parse
from pathlib import Path

import pytest
import yaml

from telemetry.cli import main as cli
from telemetry.tempo_api import otlp, params
from telemetry.tempo_api.params import BadParameter
from telemetry.tempo_api.server import tag_identifier
from telemetry.wire import paths

ROOT = Path(__file__).resolve().parents[3]
TEMPO_YAML = ROOT / "dashboards" / "provisioning" / "datasources" / "ascend-guard-tempo.yaml"
OVERVIEW = ROOT / "dashboards" / "ascend-guard-overview.json"
LABELS = {"engine": "eng", "dp": "0", "tp": "1", "pp": "0"}


@pytest.mark.parametrize(
    ("text", "ns"),
    [("100ms", 10**8), ("1.5s", 1_500_000_000), ("1m30s", 90 * 10**9), ("250us", 250_000),
     ("250µs", 250_000), ("2h", 7200 * 10**9), ("0", 0), (".5s", 500_000_000)],
)  # fmt: skip
def test_go_durations(text, ns):
    assert params.go_duration_ns("minDuration", text) == ns


@pytest.mark.parametrize("text", ["", "5", "-5s", "5 s", "fast", "5sm", "1d"])
def test_bad_go_durations_name_the_parameter(text):
    with pytest.raises(BadParameter, match="invalid parameter 'maxDuration'"):
        params.go_duration_ns("maxDuration", text)


def test_logfmt_tags():
    assert params.logfmt("tags", 'a=b  c="d e" f="q\\"x" g=') == [
        ("a", "b"), ("c", "d e"), ("f", 'q"x'), ("g", "")]  # fmt: skip
    for bad in ('a="open', "novalue", '"k"=v', "=v"):
        with pytest.raises(BadParameter, match="'tags'"):
            params.logfmt("tags", bad)


def test_trace_ids_are_padded_and_checked():
    assert params.trace_id("ABC") == "0" * 29 + "abc"
    assert params.trace_id("f" * 32) == "f" * 32
    for bad in ("", "xyz", "f" * 33, "12-34"):
        with pytest.raises(BadParameter, match="'traceID'"):
            params.trace_id(bad)


def test_search_window_and_metrics_times():
    assert params.search_window("10", "20") == (10 * 10**9, 21 * 10**9 - 1)
    assert params.search_window(None, None) == (None, None)
    with pytest.raises(BadParameter, match="'end'"):
        params.search_window("20", "20")
    assert params.metrics_time_ns("start", "1700000000") == 1_700_000_000 * 10**9
    assert params.metrics_time_ns("start", "1700000000123456789") == 1_700_000_000_123_456_789
    assert params.metrics_time_ns("start", "1700000000.5") == 1_700_000_000_500_000_000
    assert params.metrics_time_ns("end", "2023-11-14T22:13:20Z") == 1_700_000_000 * 10**9
    assert params.step_ns("30s") == params.step_ns("30") == 30 * 10**9
    with pytest.raises(BadParameter, match="'step'"):
        params.step_ns("0")


def test_tag_identifiers_are_decoded_until_stable():
    assert tag_identifier("resource.host.name") == "resource.host.name"
    assert tag_identifier("resource%252Ehost%252Ename") == "resource.host.name"
    for bad in ("", "..", "a b", "x}"):
        with pytest.raises(BadParameter, match="'tag'"):
            tag_identifier(bad)


def test_otlp_json_ids_are_hex():
    from opentelemetry.proto.trace.v1 import trace_pb2

    data = trace_pb2.TracesData()
    span = (
        data.resource_spans.add()
        .scope_spans.add()
        .spans.add(
            trace_id=bytes(range(16)), span_id=bytes(range(8)), name="x", start_time_unix_nano=2**62
        )
    )
    span.links.add(trace_id=bytes(16), span_id=b"\x01" * 8)
    doc = otlp.otlp_json(data)["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert doc["traceId"] == bytes(range(16)).hex() and doc["spanId"] == bytes(range(8)).hex()
    assert doc["startTimeUnixNano"] == str(2**62)
    assert doc["links"][0]["spanId"] == "01" * 8
    assert otlp.trace_by_id_v2(data)[:1] == b"\x0a"


@pytest.mark.parametrize("engine", ["qwen-7b", ""])
def test_the_query_apis_resources_name_the_service_as_the_otlp_export_does(engine):
    from telemetry.export.resource import resource_attributes
    from telemetry.spans.builders import Span

    span = Span(1, 2, None, "rank", 0, 1, "run", engine, 1, 0, 1, 0, attributes={})
    (attrs,) = otlp.resources([span]).values()
    exported = resource_attributes(("run", engine, 0, 1, 0), "node0")
    for key in ("service.name", "service.namespace"):
        assert attrs[key] == exported[key], key
    assert attrs["service.name"] == (engine or "ascend-guard")


def test_the_query_port_defaults_to_the_metrics_port_plus_two():
    assert paths.query_port(paths.DEFAULT_METRICS_PORT) == 9466
    assert paths.query_port(9500) == 9502 and paths.query_port(9500, 0) == 0
    args = cli._parser().parse_args(["sidecar"])
    assert args.query_port is None and args.query_host == "0.0.0.0"
    assert cli._parser().parse_args(["sidecar", "--query-port", "7000"]).query_port == 7000


def test_tempo_datasource_provisioning():
    text = TEMPO_YAML.read_text()
    (ds,) = yaml.safe_load(text)["datasources"]
    assert ds["type"] == "tempo" and ds["uid"] == "ascend-guard-tempo"
    assert ds["url"] == "${ASCEND_GUARD_QUERY_URL}" and ds.get("access", "proxy") == "proxy"
    assert ds["jsonData"]["streamingEnabled"] == {"search": False, "metrics": False}
    assert "ASCEND_GUARD_QUERY_URL=" in text.split("apiVersion")[0]  # documented above


def render_link(
    url: str, labels: dict[str, str], from_ms: int = 1, to_ms: int = 2, traces: str = "tempo-uid"
) -> dict:
    """The Explore state a data link opens, with Grafana's variables filled in (`traces`: the
    uid the dashboard's Traces datasource variable holds)."""
    values = {f"__field.labels.{k}": v for k, v in labels.items()}
    values |= {"__from": str(from_ms), "__to": str(to_ms), "traces": traces}

    def fill(match: re.Match) -> str:
        name, _, fmt = match.group(1).partition(":")
        value = values[name]
        return urllib.parse.quote(value, safe="") if fmt == "percentencode" else value

    filled = re.sub(r"\$\{([^}]+)\}", fill, url)
    parsed = urllib.parse.urlsplit(filled)
    assert parsed.path == "/explore"
    query = urllib.parse.parse_qs(parsed.query)
    assert query["schemaVersion"] == ["1"]
    return json.loads(query["panes"][0])


def wave_links() -> list[tuple[str, dict]]:
    overview = json.loads(OVERVIEW.read_text())
    return [(p["title"], link) for p in overview["panels"]
            for link in p.get("fieldConfig", {}).get("defaults", {}).get("links", [])]  # fmt: skip


def test_rank_panels_link_to_their_waves_in_the_tempo_datasource():
    links = wave_links()
    titles = {title for title, _ in links}
    assert {"Waves per second by rank", "Step duration p99 by rank", "Last wave by rank"} <= titles
    # the links open the datasource the Traces variable names (the cluster's Tempo, or a
    # node's sidecar); by default the provisioned sidecar datasource
    overview = json.loads(OVERVIEW.read_text())
    (traces,) = [v for v in overview["templating"]["list"] if v["name"] == "traces"]
    assert traces["type"] == "datasource" and traces["query"] == "tempo"
    assert (
        traces["current"]["value"]
        == yaml.safe_load(TEMPO_YAML.read_text())["datasources"][0]["uid"]
    )
    uid = "cluster-tempo"
    for title, link in links:
        assert "ascend-guard-tempo" not in link["url"], title  # no datasource hard-coded
        (pane,) = render_link(link["url"], LABELS, traces=uid).values()
        assert pane["datasource"] == uid, title
        (query,) = pane["queries"]
        assert query["datasource"] == {"type": "tempo", "uid": uid}
        assert query["queryType"] == "traceql"
        assert 'span.ascend_guard.engine="eng"' in query["query"]
        assert (
            "span.ascend_guard.tp=1" in query["query"]
            and "span.ascend_guard.dp=0" in query["query"]
        )
        assert pane["range"] == {"from": "1", "to": "2"}
