"""A request's W3C traceparent: parsed strictly, carried with the request's name, stored, and
a link on the request trace's root, in the OTLP export, the query API and the CLI.

The parser is checked against OpenTelemetry's own propagator (the one vLLM's `llm_request`
span is parented with): both must take the same headers and read the same ids. The engine's
step objects come from tests/support/request_sim.py (no vLLM runs here), with the
traceparents put on them by the guard's real engine-core hook; membership, streamer batches,
validation, store, trace builder, exporter encoding and query API are the real ones.
"""

from __future__ import annotations

import json

import pytest
from opentelemetry import trace as otel_trace
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CollectorRegistry, generate_latest

from telemetry.export.otlp import to_otlp
from telemetry.metrics import requests as request_metrics
from telemetry.spans import requests as request_spans
from telemetry.store import connect
from telemetry.store import requests as request_store
from telemetry.tempo_api.server import PROTOBUF, Request, route
from telemetry.tempo_api.span_list_api import span_from_json, span_json
from telemetry.wire.proto import guard_pb2
from telemetry.wire.request_columns import validate_request_columns
from telemetry.wire.schema import InvalidBatch
from telemetry.wire.traceparent import MAX_LENGTH, TraceParent, parse_traceparent
from tests.support.metrics import value
from tests.support.request_sim import Sim, SimRequest, drive, guarded, store_batches

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"
GOOD = f"00-{TRACE}-{SPAN}-01"

HEADERS = [
    GOOD,
    f"00-{TRACE}-{SPAN}-00",  # not sampled
    f"00-{TRACE}-{SPAN}-ff",  # every flag bit
    f"01-{TRACE}-{SPAN}-01",  # a later version
    f"01-{TRACE}-{SPAN}-01-extra-fields",  # a later version's own fields
    f"cc-{TRACE}-{SPAN}-09-x",
    f"01-{TRACE}-{SPAN}-01" + "-" + "z" * (MAX_LENGTH - 56),  # just at the limit
    # refused
    f"01-{TRACE}-{SPAN}-01" + "-" + "z" * (MAX_LENGTH - 55),  # past the limit
    f"00-{TRACE}-{SPAN}-01-extra",  # version 00 has nothing after its flags
    f"00-{TRACE}-{SPAN}-01x",
    f"01-{TRACE}-{SPAN}-01x",  # a later version's fields follow a "-"
    f"ff-{TRACE}-{SPAN}-01",  # version ff is invalid
    f"00-{'0' * 32}-{SPAN}-01",  # all-zero trace id
    f"00-{TRACE}-{'0' * 16}-01",  # all-zero parent id
    f"00-{TRACE.upper()}-{SPAN}-01",  # uppercase hex
    f"00-{TRACE}-{SPAN.upper()}-01",
    f"0-{TRACE}-{SPAN}-01",
    f"00-{TRACE[:-1]}-{SPAN}-01",  # a field one short
    f"00-{TRACE}0-{SPAN}-01",  # a field one long
    f"00-{TRACE}-{SPAN}-1",
    f"00_{TRACE}_{SPAN}_01",
    f"00-{TRACE[:-1]}g-{SPAN}-01",  # not hex
    f"0x-{TRACE}-{SPAN}-01",
    "",
    "00",
    "garbage",
]


def _otel(header: str) -> TraceParent | None:
    ctx = otel_trace.get_current_span(
        TraceContextTextMapPropagator().extract({"traceparent": header})
    ).get_span_context()
    if not ctx.is_valid:
        return None
    return TraceParent(ctx.trace_id, ctx.span_id, int(ctx.trace_flags))


@pytest.mark.parametrize("header", HEADERS)
def test_the_parser_takes_what_opentelemetrys_propagator_takes(header: str) -> None:
    assert parse_traceparent(header) == _otel(header)


def test_the_ids_are_the_headers_own() -> None:
    parsed = parse_traceparent(GOOD)
    assert parsed == (int(TRACE, 16), int(SPAN, 16), 1) and parsed.sampled
    assert not parse_traceparent(f"00-{TRACE}-{SPAN}-00").sampled


@pytest.mark.parametrize("header", [f" {GOOD}", f"{GOOD} ", f"\t{GOOD}"])
def test_surrounding_whitespace_is_refused_where_opentelemetry_tolerates_it(header) -> None:
    """An HTTP server strips a header value's surrounding whitespace before vLLM sees it; the
    W3C format has none."""
    assert _otel(header) is not None and parse_traceparent(header) is None


def _traced_requests() -> list[SimRequest]:
    malformed = f"00-{'0' * 32}-{SPAN}-01"
    return [
        SimRequest("cmpl-a-0", prompt=12, max_tokens=4, arrive_wave=1, traceparent=GOOD),
        SimRequest("cmpl-b-0", prompt=40, max_tokens=3, arrive_wave=2),
        SimRequest("cmpl-c-0", prompt=20, max_tokens=5, arrive_wave=2, traceparent=malformed),
        SimRequest(
            "cmpl-d-0",
            prompt=9,
            max_tokens=2,
            arrive_wave=4,
            traceparent=f"00-{'1' * 32}-{'2' * 16}-00",
        ),
    ]


@pytest.fixture
def traced(tmp_path):
    reqs = _traced_requests()
    processor = guarded()
    batches = drive(processor, Sim(reqs, budget=32))
    assert processor.errors.total == 0
    store, path = store_batches(tmp_path, batches)
    yield reqs, batches, store, path
    store.close()


def test_a_traceparent_travels_once_with_the_requests_name(traced) -> None:
    reqs, batches, _, _ = traced
    sent = [
        (cols.name_request_id[list(cols.name_index).index(i)], text)
        for b in batches
        for cols in [b.request_columns]
        for i, text in zip(cols.traceparent_index, cols.traceparent, strict=True)
    ]
    assert sorted(sent) == sorted((r.req_id, r.traceparent) for r in reqs if r.traceparent)


def test_the_request_trace_root_links_to_the_traceparents_trace_and_span(traced) -> None:
    reqs, _, store, path = traced
    conn = connect(path, readonly=True)
    roots = {}
    for req in reqs:
        (trace,) = request_spans.request_traces(conn, req.req_id)
        (root,) = [s for s in trace.spans if s.parent_id is None]
        assert root.name == request_spans.REQUEST_SPAN
        roots[req.req_id] = root
        # the other spans keep their own links (to their waves), none to the traceparent
        assert all(link["trace_id"] != int(TRACE, 16) for s in trace.spans[1:] for link in s.links)
    (link,) = roots["cmpl-a-0"].links
    assert (link["trace_id"], link["span_id"]) == (int(TRACE, 16), int(SPAN, 16))
    assert link["flags"] == 0x01 | 0x100 | 0x200  # sampled; the context is remote
    assert link["attributes"] == {request_spans.ATTR_LINK: "traceparent"}
    (unsampled,) = roots["cmpl-d-0"].links
    assert unsampled["trace_id"] == int("1" * 32, 16) and unsampled["flags"] == 0x300
    assert roots["cmpl-b-0"].links == [] and roots["cmpl-c-0"].links == []  # none; malformed
    # counted where an operator sees it: one linked, one malformed... and one more linked
    registry = CollectorRegistry()
    registry.register(request_metrics.RequestMetrics(store.requests))
    text = generate_latest(registry).decode()
    name = "ascend_guard_request_traceparents_total"
    assert value(text, name, engine="sim", outcome="linked") == 2
    assert value(text, name, engine="sim", outcome="malformed") == 1
    # OTLP, as the exporter and the query API encode it
    encoded = to_otlp(roots["cmpl-a-0"]).links[0]
    assert encoded.trace_id.hex() == TRACE and encoded.span_id.hex() == SPAN
    assert encoded.flags == 0x301
    # the span list API's JSON keeps the flags
    assert span_from_json(json.loads(json.dumps(span_json(roots["cmpl-a-0"])))).links == [link]
    conn.close()


def test_the_query_api_serves_the_link(traced) -> None:
    reqs, _, _, path = traced
    conn = connect(path, readonly=True)
    (row,) = request_store.find_requests(conn, "cmpl-a-0")
    conn.close()
    _, proto = route(path, Request(f"/api/traces/{row.trace_hex}", {}, {"Accept": PROTOBUF}))
    assert proto.code == 200
    data = trace_pb2.TracesData.FromString(proto.body)
    (root,) = [
        s
        for rs in data.resource_spans
        for ss in rs.scope_spans
        for s in ss.spans
        if s.name == "request"
    ]
    (link,) = root.links
    assert (link.trace_id.hex(), link.span_id.hex(), link.flags) == (TRACE, SPAN, 0x301)
    _, reply = route(path, Request(f"/api/v2/traces/{row.trace_hex}", {}, {}))
    body = json.loads(reply.body)
    (root_json,) = [
        s
        for rs in body["trace"]["resourceSpans"]
        for ss in rs["scopeSpans"]
        for s in ss["spans"]
        if s["name"] == "request"
    ]
    assert [(x["traceId"], x["spanId"]) for x in root_json["links"]] == [(TRACE, SPAN)]


def test_a_traceparent_for_a_request_not_named_in_the_batch_is_refused() -> None:
    cols = guard_pb2.RequestColumns()
    cols.name_index.append(1)
    cols.name_request_id.append("a")
    cols.traceparent_index.append(2)
    cols.traceparent.append(GOOD)
    with pytest.raises(InvalidBatch, match="traceparent_index\\[0\\]: 2 is not named"):
        validate_request_columns(cols)
    cols.traceparent.append(GOOD)
    with pytest.raises(InvalidBatch, match="traceparent: 2 values for 1 traceparent_index"):
        validate_request_columns(cols)


def test_a_store_written_before_traceparents_reads_without_links(traced) -> None:
    """A store file no writer of this version has opened (read-only: the CLI on an older
    node's file) lacks the traceparent columns: its requests read, without links."""
    import sqlite3

    _, _, store, path = traced
    store.close()
    raw = sqlite3.connect(path)
    for column in ("traceparent_hi", "traceparent_lo", "traceparent_span", "traceparent_flags"):
        raw.execute(f"ALTER TABLE requests DROP COLUMN {column}")
    raw.commit()
    raw.close()
    conn = connect(path, readonly=True)
    (trace,) = request_spans.request_traces(conn, "cmpl-a-0")
    assert trace.requests[0].traceparent is None and trace.spans[0].links == []
    conn.close()


def test_traceql_finds_the_request_trace_from_the_gateways_trace_id(traced) -> None:
    """On the node, from a gateway's trace id to the guard's request trace: the root's link."""
    from telemetry.traceql.search import search as traceql_search
    from telemetry.wire.trace_ids import format_trace_id, request_trace_id

    _, _, _, path = traced
    conn = connect(path, readonly=True)
    (match,) = traceql_search(conn, f'{{ name = "request" && link:traceID = "{TRACE}" }}', 0, 2**62)
    assert match.trace_id == format_trace_id(request_trace_id("run-sim", "sim", 0, "cmpl-a-0"))
    conn.close()
