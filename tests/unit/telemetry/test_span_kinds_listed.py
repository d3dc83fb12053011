"""Every span kind the trace search returns is listed everywhere spans are listed: the span list
(`ascend-guard query --spans`, `/ascend-guard/api/spans`), the tag names and tag values
(Grafana's autocomplete).

The store is the one of tests/unit/telemetry/test_trace_status_and_calls.py: waves, their
collectives, one slow call (tp1, wave 3), incidents. What the trace search returns over it is
the reference each list is held to.
"""

from __future__ import annotations

import pytest

from telemetry.cli import main as cli
from telemetry.store import connect
from telemetry.tempo_api import span_list_api, store_search
from telemetry.tempo_api.server import Request, route
from telemetry.traceql import search
from telemetry.traceql.fields import kind_of
from telemetry.traceql.span_list import top_spans
from tests.unit.telemetry.test_request_traces import simulated
from tests.unit.telemetry.test_trace_status_and_calls import (
    END,
    SLOW_CALL_WAVE,
    START,
    _tid,
    conn,
    path,
)

_FIXTURES = (path, conn, simulated)  # the stores of those tests, used here by name


@pytest.fixture
def searched(conn):
    """Every span the trace search returns over the whole store."""
    found = search(conn, "{ }", START, END, limit=10_000, spans_per_spanset=None)
    return [s for m in found for s in m.spans]


def test_the_span_list_holds_every_span_the_trace_search_returns(conn, searched):
    listed = top_spans(conn, "{ }", START, END, sort="start", limit=100_000)
    assert {s.span_id for s in listed} == {s.span_id for s in searched}
    kinds = {kind_of(s.name) for s in listed}
    assert {"slow_call", "collective", "incident", "wave", "rank"} <= kinds


def test_the_span_list_finds_the_slow_call(conn):
    (call,) = top_spans(conn, '{ name =~ "slow_call:.*" }', START, END)
    (found,) = search(conn, '{ name =~ "slow_call:.*" }', START, END)
    assert found.trace_id == _tid(SLOW_CALL_WAVE) and found.spans == [call]
    # slowest first across kinds: the slow call (55 ms) is below its collective (60 ms)
    slowest = top_spans(conn, "{ .tp = 1 }", START, END, sort="duration", limit=3)
    assert [s.name for s in slowest[:2]] == ["collective:all_reduce", "slow_call:all_reduce"]


def test_query_spans_on_the_command_line_lists_it(path, capsys):
    code = cli.main(
        ["query", "--spans", '{ name = "slow_call:all_reduce" }', "--store", str(path),
         "--since", "3650d", "--json"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "slow_call:all_reduce" in out and _tid(SLOW_CALL_WAVE) in out


def test_tag_values_name_every_span_name_the_search_returns(conn, searched):
    listed = {v for _, v in store_search.tag_values(conn, "name", START, END)}
    assert {s.name for s in searched} <= listed
    assert "slow_call:all_reduce" in listed
    assert {v for _, v in store_search.tag_values(conn, "status", START, END)} == {
        s.status for s in searched
    }


def test_tag_names_hold_every_attribute_key_a_span_carries(conn, searched):
    keys = set(store_search.tag_scopes()["span"])
    carried = {k for s in searched for k in s.attributes}
    assert carried <= keys, carried - keys
    # and over the HTTP API, as Grafana asks for them
    endpoint, reply = route(
        str(_path_of(conn)), Request("/api/v2/search/tags", {"scope": ["span"]}, {})
    )
    assert reply.code == 200 and b"ascend_guard.collective.seq" in reply.body


def test_the_span_list_endpoint_answers_slow_calls(path):
    q = {"q": ['{ name = "slow_call:all_reduce" }'], "start": [str(START // 10**9)],
         "end": [str(END // 10**9 + 1)]}  # fmt: skip
    endpoint, reply = route(str(path), Request(span_list_api.ROUTE, q, {}))
    assert endpoint == "spans" and reply.code == 200, reply.body
    assert b"slow_call:all_reduce" in reply.body


def _path_of(conn) -> str:
    (_, _, file) = conn.execute("PRAGMA database_list").fetchone()
    return file


def test_request_spans_are_listed_as_the_search_returns_them(simulated):
    _, _, store_file, _ = simulated
    db = connect(store_file, readonly=True)
    try:
        q = '{ name = "request" || name = "prefill" || name = "decode" }'
        listed = top_spans(db, q, 0, 2**62, sort="start", limit=100_000)
        found = search(db, q, 0, 2**62, limit=10_000, spans_per_spanset=None)
        assert listed and {s.span_id for s in listed} == {s.span_id for m in found for s in m.spans}
        names = {v for _, v in store_search.tag_values(db, "name", 0, 2**62)}
        assert {s.name for s in listed} <= names
    finally:
        db.close()
