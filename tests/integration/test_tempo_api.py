"""The sidecar's Tempo-compatible query API, over real HTTP to a real sidecar process.

Every request below is shaped as Grafana's Tempo datasource sends it (research notes
`trace_query_anchors.md` §1.1: paths, parameters, the Accept header, the v2 -> v1 retry on 404);
the fixtures are written here from those documented shapes. Trace bodies are decoded with the
`opentelemetry-proto` classes and compared with the spans `ascend-guard trace` builds from the
same store; search and tag bodies pass a strict JSON schema (no unknown field at any level, as
Grafana's jsonpb decoding requires). The records come from the real worker-side streamer.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import jsonschema
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory
from opentelemetry.proto.trace.v1 import trace_pb2

from telemetry.spans.query import load_trace
from telemetry.store import connect
from telemetry.tempo_api import traceql_adapter
from telemetry.wire import build_info, schema
from tests.support.collective_feed import send_collective_waves
from tests.support.feed import make_streamer, wave_tuple
from tests.support.ports import free_port
from tests.support.sidecar import SidecarProcess

REPO = Path(__file__).resolve().parents[2]
TOKEN = "query-api-test-token"
SLOW_WAVE, SLOW_TP = 7, 1
PROTOBUF = {"Accept": "application/protobuf"}
JSON = {"Accept": "application/json"}


# -- an independent decoder for TraceByIDResponse{trace = 1 (TracesData shape), status = 3} -----
def _trace_by_id_class():
    pool = descriptor_pool.Default()
    name = "tests_tempo_api/trace_by_id.proto"
    try:
        pool.FindFileByName(name)
    except KeyError:
        proto = descriptor_pb2.FileDescriptorProto(
            name=name,
            package="tests_tempo_api",
            dependency=["opentelemetry/proto/trace/v1/trace.proto"],
        )
        msg = proto.message_type.add(name="TraceByIDResponse")
        msg.field.add(name="trace", number=1, type=11, label=1,
                      type_name=".opentelemetry.proto.trace.v1.TracesData")  # fmt: skip
        msg.field.add(name="status", number=3, type=5, label=1)
        pool.Add(proto)
    return message_factory.GetMessageClass(
        pool.FindMessageTypeByName("tests_tempo_api.TraceByIDResponse")
    )


# -- strict schemas of the search and tag responses (Tempo's message fields only) ---------------
def _strict(properties: dict, required: tuple = ()) -> dict:
    return {"type": "object", "properties": properties, "required": list(required),
            "additionalProperties": False}  # fmt: skip


_UINT64 = {"type": "string", "pattern": "^[0-9]+$"}
_ANY_VALUE = {"type": "object", "minProperties": 1, "maxProperties": 1, "additionalProperties": False,
              "properties": {"stringValue": {"type": "string"}, "intValue": _UINT64 | {"pattern": "^-?[0-9]+$"},
                             "boolValue": {"type": "boolean"}, "doubleValue": {"type": "number"}}}  # fmt: skip
_KEY_VALUE = _strict({"key": {"type": "string"}, "value": _ANY_VALUE}, ("key", "value"))
_SPAN = _strict(
    {"spanID": {"type": "string", "pattern": "^[0-9a-f]{16}$"}, "name": {"type": "string"},
     "startTimeUnixNano": _UINT64, "durationNanos": _UINT64,
     "attributes": {"type": "array", "items": _KEY_VALUE}},
    ("spanID", "startTimeUnixNano"),
)  # fmt: skip
_SPANSET = _strict({"spans": {"type": "array", "items": _SPAN}, "matched": {"type": "integer", "minimum": 1},
                    "attributes": {"type": "array", "items": _KEY_VALUE}})  # fmt: skip
SEARCH_SCHEMA = _strict(
    {
        "traces": {"type": "array", "items": _strict(
            {"traceID": {"type": "string", "pattern": "^[0-9a-f]{32}$"}, "rootServiceName": {"type": "string"},
             "rootTraceName": {"type": "string"}, "startTimeUnixNano": _UINT64,
             "durationMs": {"type": "integer", "minimum": 1, "maximum": 2**32 - 1},
             "spanSet": _SPANSET, "spanSets": {"type": "array", "items": _SPANSET},
             "serviceStats": {"type": "object"}},
            ("traceID", "startTimeUnixNano"),
        )},
        "metrics": _strict({k: {"type": "integer"} for k in ("inspectedTraces", "completedJobs", "totalJobs",
                                                              "totalBlocks", "inspectedSpans")}
                           | {k: _UINT64 for k in ("inspectedBytes", "totalBlockBytes")}),
    },
    ("traces",),
)  # fmt: skip
TAGS_SCHEMA = _strict({"scopes": {"type": "array", "items": _strict(
    {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}}, ("name",))},
    "metrics": {"type": "object"}}, ("scopes",))  # fmt: skip
TAG_VALUES_SCHEMA = _strict({"tagValues": {"type": "array", "items": _strict(
    {"type": {"enum": ["string", "int", "float", "bool", "duration", "keyword"]}, "value": {"type": "string"}},
    ("type", "value"))}, "metrics": {"type": "object"}}, ("tagValues",))  # fmt: skip


# -- the sidecar and its records -------------------------------------------------------------
def _feed(address: str) -> None:
    """Waves from tp0 and tp1 of one replica; wave SLOW_WAVE is slow on tp1 only."""
    streamers = []
    for tp in (0, 1):
        streamer = make_streamer(
            address, engine="eng", rank=(0, tp, 0), run_id="run-tempo", pid=6000 + tp
        )
        for n in range(1, 31):
            slow = n == SLOW_WAVE and tp == SLOW_TP
            streamer.offer(wave_tuple(n, execute_ns=80_000_000 if slow else 2_000_000))
        streamer.start()
        streamers.append(streamer)
    deadline = time.monotonic() + 10
    while any(s.sent_waves < 30 for s in streamers):
        assert time.monotonic() < deadline, "waves not sent"
        time.sleep(0.02)
    time.sleep(0.3)
    for streamer in streamers:
        streamer.stop()
    send_collective_waves(address, engine="eng", waves=12, straggler_wave=5, delay_s=0.05)


class Api:
    def __init__(self, sidecar: SidecarProcess, port: int, scheme: str = "http") -> None:
        self.sidecar, self.base = sidecar, f"{scheme}://127.0.0.1:{port}"

    def get(self, path: str, headers: dict | None = None, **query) -> tuple[int, str, bytes]:
        url = self.base + path + ("?" + urllib.parse.urlencode(query) if query else "")
        request = urllib.request.Request(url, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=10) as resp:
                return resp.status, resp.headers.get("Content-Type", ""), resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.headers.get("Content-Type", ""), exc.read()

    def json(self, path: str, **query):
        code, ctype, body = self.get(path, JSON, **query)
        assert code == 200, (code, body)
        assert ctype == "application/json"
        return json.loads(body)


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tempo")
    sock = Path(tempfile_dir()) / "guard.sock"
    port = free_port()
    sidecar = SidecarProcess.start(
        tmp, address=f"unix://{sock}", extra_args=("--query-port", str(port))
    )
    try:
        _feed(sidecar.address)
        sidecar.wait_for(lambda text: "ascend_guard_waves_total{" in text)
        yield Api(sidecar, port)
    finally:
        sidecar.stop()


def tempfile_dir() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="ag-q-", dir="/tmp")


def _stored(api: Api, trace_id: str):
    return load_trace(connect(api.sidecar.store_path, readonly=True), trace_id)


def _slow_trace_id(api: Api) -> str:
    conn = connect(api.sidecar.store_path, readonly=True)
    from telemetry.wire.trace_ids import format_trace_id, wave_trace_id

    trace_id = format_trace_id(wave_trace_id("run-tempo", SLOW_WAVE, 0))
    assert load_trace(conn, trace_id), "the slow wave is not stored"
    return trace_id


def _otlp_spans(data: trace_pb2.TracesData) -> dict[str, tuple]:
    out = {}
    for rs in data.resource_spans:
        resource = {kv.key: kv.value.string_value for kv in rs.resource.attributes}
        # named as the OTLP export names them: the engine is the service
        assert resource["service.name"] == "eng", resource
        assert resource["service.namespace"] == "ascend-guard", resource
        for ss in rs.scope_spans:
            for span in ss.spans:
                attrs = {kv.key: json_format.MessageToDict(kv.value) for kv in span.attributes}
                if schema.ATTR_TP in attrs:  # a rank's span sits in that rank's resource
                    assert resource["service.instance.id"].endswith(
                        f"tp{attrs[schema.ATTR_TP]['intValue']} pp0"
                    ), resource
                out[span.span_id.hex()] = (span.name, span.parent_span_id.hex() or None,
                                           span.start_time_unix_nano, span.end_time_unix_nano)  # fmt: skip
    return out


def _expected(spans) -> dict[str, tuple]:
    return {s.span_hex: (s.name, s.parent_hex, s.start_ns, s.end_ns) for s in spans}


# -- health and version ----------------------------------------------------------------------
def test_echo_answers_grafanas_save_and_test(api):
    code, ctype, body = api.get("/api/echo")
    assert (code, body) == (200, b"echo\n") and ctype.startswith("text/plain")


def test_buildinfo_has_tempos_fields_and_our_version(api):
    body = api.json("/api/status/buildinfo")
    assert set(body) == {"version", "revision", "branch", "buildUser", "buildDate", "goVersion"}
    assert body["version"] == build_info.version()


# -- trace by id -----------------------------------------------------------------------------
def test_trace_v2_protobuf_decodes_and_equals_the_stored_trace(api):
    trace_id = _slow_trace_id(api)
    code, ctype, body = api.get(f"/api/v2/traces/{trace_id}", PROTOBUF)
    assert (code, ctype) == (200, "application/protobuf"), body
    reply = _trace_by_id_class().FromString(body)
    assert reply.status == 0  # COMPLETE
    got = _otlp_spans(reply.trace)
    stored = _stored(api, trace_id)
    assert got == _expected(stored)
    names = {name for name, *_ in got.values()}
    assert {"wave", "rank", "execute_model", "sample_tokens"} <= names
    ranks = {rs_attr for rs in reply.trace.resource_spans for rs_attr in
             [{kv.key: kv.value.string_value for kv in rs.resource.attributes}["service.instance.id"]]}  # fmt: skip
    assert ranks == {"dp0", "dp0 tp0 pp0", "dp0 tp1 pp0"}


def test_trace_as_ascend_guard_trace_shows_it(api):
    trace_id = _slow_trace_id(api)
    out = subprocess.run(
        [sys.executable, "-m", "telemetry.cli", "trace", trace_id, "--store", str(api.sidecar.store_path)],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = [
        line for line in out.stdout.splitlines()[3:] if line.strip() and not line.startswith("-")
    ]
    _, _, body = api.get(f"/api/traces/{trace_id}", PROTOBUF)
    got = _otlp_spans(trace_pb2.TracesData.FromString(body))  # v1: the bare Trace message
    assert len(got) == len(rows), out.stdout
    assert sorted(n for n, *_ in got.values()) == sorted(
        ("rank" if r.strip(" └─").startswith("rank ") else r.strip(" └─").split()[0]) for r in rows
    )


def test_unknown_trace_is_404_on_v2_and_on_the_v1_retry(api):
    missing = "0" * 31 + "1"
    for path in (f"/api/v2/traces/{missing}", f"/api/traces/{missing}"):
        code, _, body = api.get(path, PROTOBUF)
        assert code == 404 and missing.encode() in body and b"not found" in body


def test_trace_json_is_otlp_json(api):
    trace_id = _slow_trace_id(api)
    body = api.json(f"/api/v2/traces/{trace_id}")
    assert set(body) == {"trace"} and set(body["trace"]) == {"resourceSpans"}
    spans = [
        s for rs in body["trace"]["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]
    ]
    for span in spans:
        assert span["traceId"] == trace_id  # hex, not base64
        assert len(span["spanId"]) == 16 and int(span["spanId"], 16) >= 0
        assert isinstance(span["startTimeUnixNano"], str) and span["startTimeUnixNano"].isdigit()
        assert span["kind"] == trace_pb2.Span.SPAN_KIND_INTERNAL  # an integer
    # the same trace as the protobuf body, once ids are turned back into protobuf JSON's base64
    for rs in body["trace"]["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for span in ss["spans"]:
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in span:
                        span[key] = base64.b64encode(bytes.fromhex(span[key])).decode()
    parsed = json_format.ParseDict(body["trace"], trace_pb2.TracesData())
    assert _otlp_spans(parsed) == _expected(_stored(api, trace_id))
    v1 = api.json(f"/api/traces/{trace_id}")
    assert set(v1) == {"batches"} and len(v1["batches"]) == len(body["trace"]["resourceSpans"])


def test_trace_ids_are_case_and_padding_tolerant(api):
    trace_id = _slow_trace_id(api)
    code, _, upper = api.get(f"/api/v2/traces/{trace_id.upper()}", PROTOBUF)
    assert code == 200
    assert _otlp_spans(_trace_by_id_class().FromString(upper).trace) == _expected(
        _stored(api, trace_id)
    )
    code, _, body = api.get(f"/api/v2/traces/{'0' * 31}", PROTOBUF)  # a short id is left-padded
    assert code == 404 and ("0" * 32).encode() in body


@pytest.mark.parametrize(
    ("path", "query", "name"),
    [
        ("/api/v2/traces/not-hex", {}, "traceID"),
        ("/api/v2/traces/" + "a" * 33, {}, "traceID"),
        ("/api/traces/abc", {"start": "yesterday", "end": "2"}, "start"),
        ("/api/traces/abc", {"start": "20", "end": "10"}, "end"),
    ],
)
def test_malformed_trace_requests_are_400_naming_the_parameter(api, path, query, name):
    code, _, body = api.get(path, PROTOBUF, **query)
    assert code == 400 and f"invalid parameter '{name}'".encode() in body, body


# -- search ----------------------------------------------------------------------------------
def test_legacy_tag_search_finds_the_slow_rank_only(api):
    now = int(time.time())
    body = api.json("/api/search", tags="ascend_guard.tp=1 service.name=eng",
                    minDuration="50ms", limit="20", start=str(now - 600), end=str(now + 60))  # fmt: skip
    jsonschema.validate(body, SEARCH_SCHEMA)
    (hit,) = body["traces"]
    assert hit["traceID"] == _slow_trace_id(api)
    assert hit["rootServiceName"] == "eng" and hit["rootTraceName"] == "wave"
    assert hit["durationMs"] >= 80
    spans = hit["spanSets"][0]["spans"]
    assert spans and hit["spanSet"] == hit["spanSets"][0]
    for span in spans:  # tp1's rank and execute_model spans, the ones of 80 ms
        assert int(span["durationNanos"]) >= 50_000_000
        assert {"key": schema.ATTR_TP, "value": {"intValue": "1"}} in span["attributes"]
    assert body["metrics"]["inspectedTraces"] >= 1


def test_search_without_filters_is_newest_first_and_honours_limit_and_spss(api):
    body = api.json("/api/search", limit="5", spss="2")
    jsonschema.validate(body, SEARCH_SCHEMA)
    traces = body["traces"]
    assert len(traces) == 5
    starts = [int(t["startTimeUnixNano"]) for t in traces]
    assert starts == sorted(starts, reverse=True)
    for t in traces:
        assert len(t["spanSets"][0]["spans"]) <= 2 and t["spanSets"][0]["matched"] >= 2


def test_max_duration_and_legacy_bare_tags(api):
    body = api.json("/api/search", tags="name=execute_model tp=1", maxDuration="10ms", limit="50")
    jsonschema.validate(body, SEARCH_SCHEMA)
    found = {t["traceID"] for t in body["traces"]}
    assert len(found) == 29 and _slow_trace_id(api) not in found  # tp1's 80 ms wave is too long
    for t in body["traces"]:
        for span in t["spanSets"][0]["spans"]:
            assert span["name"] == "execute_model" and int(span["durationNanos"]) <= 10_000_000
    # older Grafana: no q, tags or range, every other parameter is a tag
    bare = api.json("/api/search", **{"ascend_guard.tp": "1", "minDuration": "50ms"})
    assert [t["traceID"] for t in bare["traces"]] == [_slow_trace_id(api)]


@pytest.mark.parametrize(
    ("query", "name"),
    [
        ({"limit": "0"}, "limit"),
        ({"limit": "many"}, "limit"),
        ({"spss": "-1"}, "spss"),
        ({"start": "100", "end": "50"}, "end"),
        ({"start": "soon"}, "start"),
        ({"minDuration": "fast"}, "minDuration"),
        ({"minDuration": "50ms", "maxDuration": "10ms"}, "maxDuration"),
        ({"q": "{}", "tags": "a=b"}, "q"),
        ({"tags": 'a="unclosed'}, "tags"),
        ({"tags": "no_such_tag=1"}, "tags"),
        ({"tags": "tp=1", "bogus": "1"}, "bogus"),
    ],
)
def test_bad_search_parameters_are_400_naming_them(api, query, name):
    code, _, body = api.get("/api/search", JSON, **query)
    assert code == 400 and f"invalid parameter '{name}'".encode() in body, body


@pytest.mark.skipif(traceql_adapter.available(), reason="the TraceQL evaluator is installed")
def test_traceql_without_the_evaluator_is_501(api):
    code, _, body = api.get("/api/search", JSON, q="{ .tp = 1 }", limit="20", spss="3")
    assert code == 501 and b"TraceQL" in body
    code, _, body = api.get("/api/metrics/query_range", JSON, q="{} | rate()", start="1", end="100")
    assert code == 501


@pytest.mark.skipif(
    not traceql_adapter.available(), reason="the TraceQL evaluator is not installed"
)
def test_traceql_search_finds_the_slow_rank_only(api):
    now = int(time.time())
    body = api.json("/api/search", q="{span.ascend_guard.tp=1 && duration>50ms}", limit="20",
                    spss="3", start=str(now - 600), end=str(now + 60))  # fmt: skip
    jsonschema.validate(body, SEARCH_SCHEMA)
    assert [t["traceID"] for t in body["traces"]] == [_slow_trace_id(api)]
    code, _, err = api.get("/api/search", JSON, q="{ .tp = }")
    assert code == 400 and b"invalid parameter 'q'" in err and b"column" in err


@pytest.mark.skipif(
    not traceql_adapter.available(), reason="the TraceQL evaluator is not installed"
)
def test_traceql_metrics_query_range(api):
    now = time.time_ns()
    body = api.json("/api/metrics/query_range", q="{name=\"execute_model\"} | count_over_time() by (span.ascend_guard.tp)",
                    start=str(now - 600 * 10**9), end=str(now + 10**9), step="60s")  # fmt: skip
    assert set(body) <= {"series", "metrics"}
    total = sum(s.get("value", 0) for series in body["series"] for s in series["samples"])
    assert total == 60  # 30 waves x 2 ranks


def test_query_range_parameters_are_checked(api):
    for query, name in (({"q": ""}, "q"), ({"q": "{} | rate()", "step": "-5s"}, "step"),
                        ({"q": "{} | rate()", "start": "later"}, "start"),
                        ({"q": "{} | rate()", "start": "100", "end": "50"}, "end")):  # fmt: skip
        code, _, body = api.get("/api/metrics/query_range", JSON, **query)
        assert code == 400 and f"invalid parameter '{name}'".encode() in body, (query, body)


# -- tags ------------------------------------------------------------------------------------
def test_tags_v2_as_grafana_asks_for_them(api):
    body = api.json("/api/v2/search/tags", limit="5000")
    jsonschema.validate(body, TAGS_SCHEMA)
    scopes = {s["name"]: s.get("tags", []) for s in body["scopes"]}
    assert {"resource", "span", "intrinsic"} <= set(scopes)
    assert {schema.ATTR_TP, schema.ATTR_ENGINE, schema.attr("collective.op")} <= set(scopes["span"])
    # request traces' attributes too (Grafana's search offers them)
    request_keys = {schema.attr("request_id"), schema.attr("request.sampled_tokens")}
    assert request_keys <= set(scopes["span"])
    assert {"service.name", "host.name"} <= set(scopes["resource"])
    assert {"duration", "name", "status", "traceDuration"} <= set(scopes["intrinsic"])
    span_only = api.json("/api/v2/search/tags", scope="span", limit="3")
    assert [s["name"] for s in span_only["scopes"]] == ["span"] and len(
        span_only["scopes"][0]["tags"]
    ) == 3
    code, _, err = api.get("/api/v2/search/tags", JSON, scope="everything")
    assert code == 400 and b"'scope'" in err


def _values(api: Api, tag: str, **query) -> list[tuple[str, str]]:
    code, _, body = api.get(f"/api/v2/search/tag/{tag}/values", JSON, **query)
    assert code == 200, body
    doc = json.loads(body)
    jsonschema.validate(doc, TAG_VALUES_SCHEMA)
    return [(v["type"], v["value"]) for v in doc["tagValues"]]


def test_tag_values_come_from_the_store(api):
    assert _values(api, "span.ascend_guard.tp", limit="1000") == [("int", "0"), ("int", "1")]
    assert _values(api, "resource.service.name") == [("string", "eng")]
    assert _values(api, "resource.service.namespace") == [("string", "ascend-guard")]
    assert _values(api, "rootServiceName") == [("string", "eng")]
    assert ("string", "run-tempo") in _values(api, ".run_id")
    assert _values(api, "status") == [("keyword", "unset")]
    names = [v for _, v in _values(api, "name")]
    assert {"wave", "rank", "execute_model"} <= set(names) and "collective:all_reduce" in names
    # older Grafana encoded the tag twice
    twice = urllib.parse.quote(urllib.parse.quote("resource.host.name", safe=""), safe="")
    assert _values(api, twice) == [("string", "test-node")]
    assert _values(api, "span.no_such_attribute") == []
    code, _, body = api.get("/api/v2/search/tag/" + urllib.parse.quote("a b") + "/values")
    assert code == 400 and b"'tag'" in body
    v1 = api.json("/api/search/tag/ascend_guard.tp/values")
    assert v1 == {"tagValues": ["0", "1"]}


# -- read-only, refusals counted ---------------------------------------------------------------
def test_the_api_is_read_only_and_counts_refusals(api):
    request = urllib.request.Request(api.base + "/api/search", data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=5)
    assert info.value.code == 405 and info.value.headers["Allow"] == "GET"
    code, _, _ = api.get("/api/search", JSON, limit="0")
    assert code == 400
    text = api.sidecar.metrics_text()
    assert 'ascend_guard_query_api_refused_total{endpoint="search",reason="bad_parameter"}' in text
    assert (
        'ascend_guard_query_api_refused_total{endpoint="any",reason="method_not_allowed"} 1.0'
        in text
    )


def test_a_token_guards_the_api(tmp_path, sock_dir):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    port = free_port()
    sidecar = SidecarProcess.start(
        tmp_path, address=f"unix://{sock_dir / 'guard.sock'}",
        extra_args=("--query-port", str(port), "--token-file", str(token_file), "--metrics-open"),
    )  # fmt: skip
    try:
        api = Api(sidecar, port)
        assert api.get("/api/echo")[0] == 401
        assert api.get("/api/echo", {"Authorization": "Bearer wrong"})[0] == 401
        assert api.get("/api/echo", {"Authorization": f"Bearer {TOKEN}"})[:1] == (200,)
        text = sidecar.metrics_text()
        assert 'ascend_guard_auth_refused_total{listener="query"} 2.0' in text
        assert (
            'ascend_guard_query_api_refused_total{endpoint="any",reason="unauthorized"} 2.0' in text
        )
    finally:
        sidecar.stop()


def test_a_busy_query_port_stops_start_up(tmp_path, sock_dir):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"cannot serve the query API on 127.0.0.1:{port}"):
            SidecarProcess.start(
                tmp_path, address=f"unix://{sock_dir / 'guard.sock'}",
                extra_args=("--query-port", str(port), "--query-host", "127.0.0.1"),
            )  # fmt: skip


# -- the dashboard's data links ----------------------------------------------------------------
def test_the_dashboards_wave_links_query_this_api(api):
    """Each rank panel's data link, filled in as Grafana fills it for tp1's series, opens a
    TraceQL search this API answers with tp1's waves (501 while the evaluator is absent)."""
    from tests.unit.telemetry.test_tempo_api_units import render_link, wave_links

    now_ms = int(time.time() * 1000)
    labels = {"engine": "eng", "dp": "0", "tp": str(SLOW_TP), "pp": "0"}
    for title, link in wave_links():
        (pane,) = render_link(link["url"], labels, now_ms - 600_000, now_ms + 60_000).values()
        (query,) = pane["queries"]
        start, end = int(pane["range"]["from"]) // 1000, int(pane["range"]["to"]) // 1000
        code, _, body = api.get("/api/search", JSON, q=query["query"], limit="50", spss="10",
                                start=str(start), end=str(end))  # fmt: skip
        if not traceql_adapter.available():
            assert code == 501, title
            continue
        assert code == 200, (title, body)
        doc = json.loads(body)
        jsonschema.validate(doc, SEARCH_SCHEMA)
        assert len(doc["traces"]) == 30, title  # every wave of run-tempo ran on tp1
        for trace in doc["traces"]:
            for span in trace["spanSets"][0]["spans"]:
                assert {"key": schema.ATTR_TP, "value": {"intValue": "1"}} in span["attributes"]
