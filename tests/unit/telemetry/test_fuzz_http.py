"""Fuzzing what people and probes type: the liveness HTTP endpoints' paths and query strings
(a real `LivenessServer` on a loopback port), and the query layer's parsers (durations, times,
rank selectors). Every input gets an answer: an HTTP status with a JSON body, or a
`QueryError` that says what is wrong; never a dropped connection, a 500 or another exception."""

from __future__ import annotations

import http.client
import json
import urllib.parse

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from telemetry.cli.args import parse_duration_ns, parse_rank, parse_time_ns
from telemetry.crossrank.liveness import LivenessServer
from telemetry.crossrank.view import CrossRankView
from telemetry.spans.query import QueryError

FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
paths = st.one_of(
    st.text(max_size=60),
    st.builds(
        lambda p, e: f"/live/{p}{e}", st.text(max_size=40), st.sampled_from(["", "/", "?x=1"])
    ),
    st.sampled_from(["/live", "/hangs", "/skew", "/live/%ff%fe", "/live/%00", "//", "/.." * 20]),
)
queries = st.dictionaries(st.text(max_size=20), st.text(max_size=40), max_size=4)


@pytest.fixture(scope="module")
def server():
    view = CrossRankView(CollectorRegistry())
    live = LivenessServer(view, "127.0.0.1", 0)
    live.start()
    yield live
    live.stop()


@FUZZ
@given(path=paths, query=queries)
def test_every_path_and_query_gets_a_status_and_json(server, path, query):
    target = urllib.parse.quote(path, safe="/%?=&") or "/"
    if not target.startswith("/"):
        target = "/" + target
    if query:
        target += ("&" if "?" in target else "?") + urllib.parse.urlencode(query)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        conn.request("GET", target)
        resp = conn.getresponse()
        body = resp.read()
    finally:
        conn.close()
    assert resp.status in (200, 400, 404, 503), (target, resp.status)
    if resp.status != 400:  # http.server answers a malformed request line itself (HTML)
        json.loads(body)


@FUZZ
@given(
    text=st.one_of(
        st.text(max_size=30),
        st.from_regex(r"-?[0-9]{1,25}(\.[0-9]*)?(ns|us|ms|s|m|h|d)?", fullmatch=True),
    )
)
def test_durations_and_times_parse_or_say_why(text):
    for parse in (parse_duration_ns, parse_time_ns):
        try:
            value = parse(text, "--x")
        except QueryError as exc:
            assert "--x" in str(exc) or str(exc), text
        else:
            assert isinstance(value, int)


@FUZZ
@given(
    text=st.one_of(
        st.text(max_size=30), st.from_regex(r"((dp|tp|pp)=[0-9]{1,12},?){0,4}", fullmatch=True)
    )
)
def test_rank_selectors_parse_or_say_why(text):
    try:
        parsed = parse_rank(text)
    except QueryError:
        return
    assert set(parsed) <= {"dp", "tp", "pp"} and all(isinstance(v, int) for v in parsed.values())
