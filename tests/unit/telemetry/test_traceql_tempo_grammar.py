"""TraceQL as Grafana Tempo parses, validates and runs it: the constructs Tempo's grammar has
(arithmetic, bare fields, pipelines that start with an aggregate, by() or select(), negated and
union structural operators, pipelines as spanset operands, the event / link / instrumentation
scopes, span:id, trace:id, the nested set intrinsics, histogram_over_time), the ill-typed
queries Tempo refuses, and generated queries that may only ever fail with a TraceQL error.

Answers are checked against the store of tests/unit/telemetry/test_traceql_search.py, whose
waves are known, and against a second evaluation written here: spans loaded one trace at a
time with the CLI's `load_trace` and related by their parent ids in plain Python.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from telemetry import store
from telemetry.spans.query import load_trace
from telemetry.tempo_api import traceql_adapter
from telemetry.tempo_api.params import BadParameter
from telemetry.tempo_api.server import Request, route
from telemetry.traceql import TraceQLError, ast, metrics_range, parse, search
from telemetry.traceql.evaluate import TraceView
from telemetry.traceql.plan import plan_leaf
from telemetry.traceql.search import CandidatePass
from telemetry.traceql.validate import TraceQLValidationError
from tests.unit.telemetry.test_traceql_search import (
    END,
    SLOW_TP0,
    SLOW_TP1,
    START,
    STEP_NS,
    WAVES,
    _all_spans,
    _start,
    _tid,
    _waves,
    conn,
    path,
)

_FIXTURES = (path, conn)  # the known store of the search tests, used here by name
EVERY_WAVE = set(range(1, WAVES + 1))
INCIDENT_WAVE = 5  # the fixture's one incident, under tp1's rank span

# -- parsing: every construct Tempo's grammar has that the issue lists ----------------------------
VALID = [
    "{ .a + 1 = 2 }",
    "{ .a - 1 = 2 }",
    "{ .a * 2 > .b / 3 }",
    "{ .a % 2 = 0 }",
    "{ .a ^ 2 = 4 }",
    "{ duration > 1s * 2 }",
    "{ duration < (10s * 20s) }",
    "{ 1 * 1h = 1 }",
    "{ -.a = 2 }",
    "{ .a }",
    "{ !.a }",
    "{ .a && false }",
    "{ .a || true }",
    "max(duration) > 3s | { status = error || .http.status = 500 }",
    "avg(.field) > 1",
    "count() = 1 | { true }",
    "1 < count()",
    "select(.a)",
    "by(.a) | { true }",
    "{ true } | by(1 + .a)",
    '{ .http.status >= "200" }',
    "{ nil = nil }",
    "{ name != nil }",
    "({ true } | count() > 1 | { false }) >> ({ true } | count() > 1 | { false })",
    "({ true } | count() > 1 | { false }) && ({ true } | count() > 1 | { false })",
    '{ event:name = "exception" }',
    "{ event:timeSinceStart > 1s }",
    '{ event.foo = "bar" }',
    '{ link:traceID = "f1f1f1f1f1f1ff1f1f1f1f1f1f1f1f1" }',
    '{ link:spanID = "f1f1f1f1f1f1f1f1" }',
    '{ link.foo = "bar" }',
    '{ instrumentation:name = "grpc" }',
    '{ instrumentation:version = "v3.34" }',
    '{ instrumentation.foo = "bar" }',
    '{ trace:id = "aasdf4ergf" }',
    '{ span:id = "61626364656667" }',
    '{ span:parentID = "84737586494" }',
    "{ span:childCount > 2 }",
    "{ nestedSetLeft > 3 }",
    "{ } >> { kind = server } | select(nestedSetLeft, nestedSetRight, nestedSetParent)",
    "{ } | histogram_over_time(duration)",
    "{ } | histogram_over_time(duration) by (.tp)",
] + [f"{{ true }} {op} {{ true }}" for op in ast.ALL_STRUCTURAL_OPS]


@pytest.mark.parametrize("text", VALID)
def test_tempos_constructs_parse_and_print_back(text):
    query = parse(text)
    assert parse(str(query)) == query


def test_the_trees_of_the_new_constructs():
    assert parse("{ .a + 1 = 2 }").spanset.expr == ast.Comparison(
        "=",
        ast.Arithmetic("+", ast.Attribute("a"), ast.Static(1, "int", "1")),
        ast.Static(2, "int", "2"),
    )
    # * binds tighter than +, ^ tighter than *, and ^ groups to the right
    e = parse("{ .a + .b * .c ^ .d ^ .e = 1 }").spanset.expr.left
    assert e.op == "+" and e.right.op == "*" and e.right.right.op == "^"
    assert e.right.right.right.op == "^"
    assert parse("{ .a }").spanset.expr == ast.Attribute("a")
    q = parse("max(duration) > 3s | { .a = 1 }")
    assert q.spanset == ast.SpansetFilter(None) and isinstance(q.stages[0], ast.ScalarFilter)
    assert parse("1 < count()").stages[0].op == ">"  # a static on the left is flipped
    q = parse("({ .a = 1 } | count() > 1) !> { .b = 1 }")
    assert q.spanset.op == "!>" and isinstance(q.spanset.left, ast.SubPipeline)
    assert parse("({ .a = 1 })").spanset == ast.SpansetFilter(parse("{ .a = 1 }").spanset.expr)
    assert parse('{ span:id = "ab" }').spanset.expr.left == ast.Intrinsic("span:id")
    assert parse("{ event.x = 1 }").spanset.expr.left == ast.Attribute("x", "event")
    assert parse("{ } | histogram_over_time(duration)").metrics == ast.MetricsAggregate(
        "histogram_over_time", ast.Intrinsic("duration")
    )


@pytest.mark.parametrize(
    "text",
    [
        "{ } | histogram_over_time()",
        "{ } | histogram_over_time(duration, 0.5)",
        "({ } | rate()) > { }",
        "coalesce() | { }",
        "{ } | count()",
        "{ true } + { true }",
        "{ . }",
        '{ span:rootName = "a" }',
        "{ trace:status = error }",
    ],
)
def test_what_tempos_grammar_refuses_does_not_parse(text):
    with pytest.raises(TraceQLError):
        parse(text)


# -- validation: what Tempo refuses after parsing -------------------------------------------------
REFUSED = {
    '{ 1 = "foo" }': "binary operations must operate on the same type",
    "{ status > ok }": "illegal operation for the given types",
    "{ rootServiceName = 1 }": "binary operations must operate on the same type",
    "{ true } | by(1)": "grouping field expressions must reference the span",
    '{ true } | by("foo")': "grouping field expressions must reference the span",
    "{ !1 = 1 }": "illegal operation for the given type",
    '{ !name = "foo" }': "illegal operation for the given type",
    '{ !"foo" = "bar" }': "illegal operation for the given type",
    "{ !1h = 1 }": "illegal operation for the given type",
    "{ -true }": "illegal operation for the given type",
    '{ -name = "foo" }': "illegal operation for the given type",
    "{ status }": "span filter field expressions must resolve to a boolean",
    "{ 1 + 1 }": "span filter field expressions must resolve to a boolean",
    '{ "foo" }': "span filter field expressions must resolve to a boolean",
    '{ 1 + "foo" = 1 }': "binary operations must operate on the same type",
    "{ 1 / ok = 1 }": "binary operations must operate on the same type",
    "{ 1 != true }": "binary operations must operate on the same type",
    '{ 1 && "foo" }': "binary operations must operate on the same type",
    "{ true || 1.1 }": "binary operations must operate on the same type",
    "{ kind < consumer }": "illegal operation for the given types",
    '{ traceDuration > "test" }': "binary operations must operate on the same type",
    "{ rootName != 3.2 }": "binary operations must operate on the same type",
    '{ "foo" = span:childCount }': "binary operations must operate on the same type",
    "{ span:status = nil }": "intrinsics cannot be nil",
    "{ nil = span:status }": "intrinsics cannot be nil",
    "{ resource.service.name = nil }": "resource.service.name cannot be nil",
    '{ nestedSetLeft = "foo" }': "binary operations must operate on the same type",
    "{ nestedSetRight = false }": "binary operations must operate on the same type",
    "sum(3) = 2": "aggregate field expressions must reference the span",
    "max(1h + 2h) > 1": "aggregate field expressions must reference the span",
    "min(1 = 3) = 1": "aggregate field expressions must resolve to a number type",
    "{ } | avg(name) > 1": "aggregate field expressions must resolve to a number type",
}


@pytest.mark.parametrize("text", sorted(REFUSED))
def test_ill_typed_queries_are_refused_as_tempo_refuses_them(text, conn):
    with pytest.raises(TraceQLValidationError) as info:
        parse(text)
    assert info.value.reason.endswith(REFUSED[text]) or REFUSED[text] in info.value.reason
    assert str(info.value).startswith("TraceQL: invalid query: ")
    # every entry point refuses it with that error, the HTTP API as a bad `q`
    with pytest.raises(TraceQLError):
        search(conn, text, START, END)
    with pytest.raises(TraceQLError):
        metrics_range(conn, text + " | rate()", START, END, STEP_NS)
    with pytest.raises(BadParameter, match="invalid query"):
        traceql_adapter.search(conn, text, START, END, 5, 3)


# -- evaluation against the store, checked by a second evaluation ---------------------------------
def _spans_of(matches) -> dict[str, set[int]]:
    return {m.trace_id: {s.span_id for s in m.spans} for m in matches}


def _search(conn, text: str) -> dict[str, set[int]]:
    return _spans_of(search(conn, text, START, END, limit=1000, spans_per_spanset=None))


def _oracle(conn, pick) -> dict[str, set[int]]:
    """trace id -> the span ids `pick(spans)` returns, for the traces where it returns any."""
    out = {}
    for wave, spans in _all_spans(conn).items():
        ids = {s.span_id for s in pick(spans)}
        if ids:
            out[_tid(wave)] = ids
    return out


def _attr(span, key):
    return span.attributes.get(f"ascend_guard.{key}")


def test_arithmetic_in_field_expressions(conn):
    # num_reqs is 1 + wave % 3 (the fixture)
    got = _search(conn, '{ .num_reqs + 1 = 3 && name = "rank" }')
    assert _waves(search(conn, '{ .num_reqs + 1 = 3 && name = "rank" }', START, END, limit=99)) == {
        n for n in EVERY_WAVE if n % 3 == 1
    }
    assert got == _oracle(
        conn, lambda spans: [s for s in spans if s.name == "rank" and _attr(s, "num_reqs") == 2]
    )
    slow = '{ duration > 25ms * 2 && .op = "all_reduce" }'
    assert _waves(search(conn, slow, START, END, limit=99)) == SLOW_TP1 | SLOW_TP0
    # / and % are integer operations on integers, rounding toward zero (as Tempo's Go does)
    assert _search(conn, '{ .wave / 10 = 2 && .wave % 10 = 3 && name = "rank" }') == _oracle(
        conn, lambda spans: [s for s in spans if s.name == "rank" and s.wave == 23]
    )
    assert _search(conn, '{ -.wave = -4 && name = "wave" }').keys() == {_tid(4)}
    assert _search(conn, '{ .wave ^ 2 = 16 && name = "wave" }').keys() == {_tid(4)}
    # a division by zero is nil: no span matches it, and nothing fails
    assert _search(conn, "{ .wave / 0 = 1 }") == {}
    assert _search(conn, "{ .wave % 0 != 1 }") == {}


def test_a_bare_field_holds_where_it_is_true(conn):
    # `dummy` is false on every rank span of the fixture
    assert _search(conn, "{ .dummy }") == {}
    assert _search(conn, "{ .dummy && false }") == {}
    not_dummy = _search(conn, "{ !.dummy }")
    assert (
        not_dummy == _oracle(conn, lambda spans: [s for s in spans if _attr(s, "dummy") is False])
        and not_dummy
    )
    assert _search(conn, "{ .dummy || true }") == _search(conn, "{ }")


def test_pipelines_that_start_with_an_aggregate_by_or_select(conn):
    # a wave trace holds the root, 2 ranks x (rank, execute_model, sample_tokens, 2
    # collectives): 11 spans; wave 5 also its incident
    assert _waves(search(conn, "count() > 11", START, END, limit=99)) == {INCIDENT_WAVE}
    every = search(conn, 'count() > 10 | { name = "wave" }', START, END, limit=99)
    assert _waves(every) == EVERY_WAVE
    assert all(m.spansets[0].attributes["count()"] >= 11 for m in every)
    q = 'max(duration) > 50ms | { name = "collective:all_reduce" && duration > 50ms }'
    assert _waves(search(conn, q, START, END, limit=99)) == SLOW_TP1 | SLOW_TP0
    (one,) = search(conn, "select(.num_reqs)", _start(7), _start(7))
    assert ast.Attribute("num_reqs") in one.fetched
    (seven,) = search(conn, 'by(.tp) | { name = "rank" }', _start(7), _start(7))
    assert sorted(
        (ss.attributes["by(.tp)"], [s.name for s in ss.spans]) for ss in seven.spansets
    ) == [
        (0, ["rank"]),
        (1, ["rank"]),
    ]


def _related(spans, left, right, op: str):
    """A second implementation of the structural operators over parent ids."""
    by_id = {s.span_id: s for s in spans}

    def ancestors(s):
        seen = set()
        while s.parent_id in by_id and s.parent_id not in seen:
            seen.add(s.parent_id)
            s = by_id[s.parent_id]
            yield s

    relation = {
        ">": lambda lft, r: r.parent_id == lft.span_id,
        "<": lambda lft, r: lft.parent_id == r.span_id,
        ">>": lambda lft, r: lft in ancestors(r),
        "<<": lambda lft, r: r in ancestors(lft),
        "~": lambda lft, r: (
            lft is not r
            and r.parent_id is not None
            and lft.parent_id == r.parent_id
            and r.parent_id in by_id
        ),
    }[op.lstrip("!&")]
    ls = [s for s in spans if left(s)]
    rs = [s for s in spans if right(s)]
    hits = [r for r in rs if any(relation(lft, r) for lft in ls)]
    if op.startswith("!"):
        return [r for r in rs if r not in hits]
    if op.startswith("&"):
        return hits + [lft for lft in ls if any(relation(lft, r) for r in rs)]
    return hits


_SIDES = [
    ('{ name = "rank" && .tp = 1 }', lambda s: s.name == "rank" and s.tp == 1,
     '{ .op = "all_reduce" && duration > 50ms }',
     lambda s: _attr(s, "collective.op") == "all_reduce" and s.duration_ns > 50_000_000),
    ('{ name = "execute_model" }', lambda s: s.name == "execute_model",
     '{ name =~ "collective:.*" }', lambda s: s.name.startswith("collective:")),
    ('{ name = "wave" }', lambda s: s.name == "wave",
     '{ name = "incident:nan_logits" || name = "sample_tokens" && .tp = 0 }',
     lambda s: s.name == "sample_tokens" and s.tp == 0),
    ('{ status = error }', lambda s: s.status == "error",
     '{ name = "rank" }', lambda s: s.name == "rank"),
]  # fmt: skip


@pytest.mark.parametrize("op", ast.ALL_STRUCTURAL_OPS)
@pytest.mark.parametrize("sides", range(len(_SIDES)))
def test_structural_operators_plain_negated_and_union(conn, op, sides):
    left_q, left, right_q, right = _SIDES[sides]
    got = _search(conn, f"{left_q} {op} {right_q}")
    assert got == _oracle(conn, lambda spans: _related(spans, left, right, op))


def test_structural_operators_have_known_answers(conn):
    # collectives hang under their rank span, never under execute_model
    not_child = '{ name = "execute_model" } !> { name = "collective:all_reduce" }'
    assert _waves(search(conn, not_child, START, END, limit=99)) == EVERY_WAVE
    assert _search(conn, '{ name = "rank" } !> { name = "collective:all_reduce" }') == {}
    union = '{ name = "rank" && .tp = 1 } &> { .op = "all_reduce" && duration > 50ms }'
    for match in search(conn, union, START, END, limit=99, spans_per_spanset=None):
        assert sorted(s.name for s in match.spans) == ["collective:all_reduce", "rank"]
    assert _waves(search(conn, union, START, END, limit=99)) == SLOW_TP1


def test_pipelines_as_spanset_operands(conn):
    q = '({ name = "rank" } | count() > 1) > ({ .op = "all_reduce" } | select(.bytes))'
    assert _search(conn, q) == _oracle(
        conn, lambda spans: [s for s in spans if s.name == "collective:all_reduce"]
    )
    assert _search(conn, '({ name = "rank" } | count() > 2) > { }') == {}
    q = '({ name = "wave" } | count() = 1) && ({ status = error } | count() > 2)'
    assert _waves(search(conn, q, START, END, limit=99)) == {INCIDENT_WAVE}
    with pytest.raises(TraceQLError, match="multiple spansets"):
        search(conn, '({ name = "rank" } | by(.tp)) > { }', START, END)
    # && and || take every spanset of their operands
    q = '({ name = "rank" } | by(.tp)) && { name = "wave" }'
    assert _waves(search(conn, q, START, END, limit=99)) == EVERY_WAVE


def test_event_link_and_instrumentation_scopes(conn):
    incident = _search(conn, '{ event:name = "incident" }')
    assert incident.keys() == {_tid(INCIDENT_WAVE)}
    assert _search(conn, '{ event.incident.request_id = "req-42" }') == incident
    assert _search(conn, "{ event:timeSinceStart = 0ns }") == incident  # an instant span
    # the store has no events on other spans and no links on wave spans: nil, as in Tempo
    assert _search(conn, "{ event:name != nil }") == incident
    assert _search(conn, "{ link:traceID != nil || link:spanID != nil }") == {}
    assert _search(conn, "{ link.x = nil && event.x = nil }") == _search(conn, "{ }")
    # an intrinsic is never nil (Tempo refuses `= nil` on one); `!= nil` asks for a value
    with pytest.raises(TraceQLValidationError, match="intrinsics cannot be nil"):
        parse("{ event:name = nil }")
    assert _search(conn, '{ instrumentation:name = "ascend_guard.sidecar" }') == _search(
        conn, "{ }"
    )
    assert _search(conn, "{ instrumentation:version != nil || instrumentation.x != nil }") == {}


def test_events_and_links_prune_before_any_block_is_read(conn):
    ranks = store.ranks(conn)
    plan = plan_leaf(parse('{ event:name = "incident" }').spanset, ranks)
    assert plan.kinds == {} and plan.incidents  # only incident spans carry an event
    plan = plan_leaf(parse("{ link:traceID != nil || link.x = 1 }").spanset, ranks)
    assert plan.kinds == {} and not plan.incidents
    plan = plan_leaf(parse('{ instrumentation:name = "ascend_guard.sidecar" }').spanset, ranks)
    assert all(len(kinds) >= 5 for kinds in plan.kinds.values()) and plan.incidents
    finder = CandidatePass(conn, parse('{ event:name = "incident" }'))
    finder.scan(START, END)
    assert finder.blocks_read == 0


def test_span_and_trace_ids(conn):
    spans = load_trace(conn, _tid(9))
    pick = next(s for s in spans if s.name == "sample_tokens" and s.tp == 1)
    assert _search(conn, f'{{ span:id = "{pick.span_hex}" }}') == {_tid(9): {pick.span_id}}
    assert _search(conn, f'{{ trace:id = "{_tid(9)}" }}') == {_tid(9): {s.span_id for s in spans}}
    # the trace id is read off the block columns: the one trace is the only candidate
    finder = CandidatePass(conn, parse(f'{{ trace:id = "{_tid(9)}" && name = "rank" }}'))
    finder.scan(START, END)
    assert [wave for _, _, wave in finder.candidates(None)] == [9]
    parent = next(s for s in spans if s.span_id == pick.parent_id)
    q = f'{{ span:parentID = "{parent.span_hex}" && name = "sample_tokens" }}'
    assert _search(conn, q) == {_tid(9): {pick.span_id}}
    assert _search(conn, "{ !(span:parentID != nil) }") == _search(conn, '{ name = "wave" }')


def test_nested_set_intrinsics(conn):
    for wave, spans in _all_spans(conn).items():
        spans = sorted(spans, key=lambda s: (s.start_ns, s.name))
        view = TraceView(spans)
        left, right, parent = (view.per_span[k] for k in ast.NESTED_SET_INTRINSICS)
        index = {s.span_id: i for i, s in enumerate(spans)}
        assert sorted(left + right) == list(range(1, 2 * len(spans) + 1)), wave
        for i, s in enumerate(spans):
            if s.parent_id is None:
                assert parent[i] == -1
                continue
            p = index[s.parent_id]
            assert parent[i] == left[p] and left[p] < left[i] < right[i] < right[p]
    assert _search(conn, "{ nestedSetParent = -1 }") == _search(conn, '{ name = "wave" }')
    assert _search(conn, "{ nestedSetLeft = 1 }") == _search(conn, '{ name = "wave" }')
    # leaves: right = left + 1
    leaves = _search(conn, "{ nestedSetRight - nestedSetLeft = 1 }")
    assert leaves == _oracle(
        conn, lambda spans: [s for s in spans if not any(c.parent_id == s.span_id for c in spans)]
    )
    # a rank has execute_model, sample_tokens and two collectives; tp1's of wave 5 an incident too
    assert _search(conn, "{ span:childCount = 5 }").keys() == {_tid(INCIDENT_WAVE)}
    four = search(conn, '{ span:childCount = 4 && name = "rank" }', START, END, limit=99)
    assert _waves(four) == EVERY_WAVE


def test_histogram_over_time(conn):
    step = 4 * STEP_NS
    series = metrics_range(
        conn, '{ name = "execute_model" } | histogram_over_time(duration)', START, END, step
    )
    expected: dict[float, dict[int, int]] = {}
    base = START - START % step
    for spans in _all_spans(conn).values():
        for s in spans:
            if s.name == "execute_model":
                bucket = 2 ** math.ceil(math.log2(s.duration_ns)) / 1e9
                at = base + (s.start_ns - base) // step * step
                expected.setdefault(bucket, {}).setdefault(at, 0)
                expected[bucket][at] += 1
    got = {s.labels["__bucket"]: dict(s.samples) for s in series}
    assert got == {b: {t: float(c) for t, c in steps.items()} for b, steps in expected.items()}
    assert len(got) >= 2  # the slow waves fall in a higher bucket
    by_tp = metrics_range(conn, "{ } | histogram_over_time(duration) by (.tp)", START, END, step)
    assert {s.labels.get(".tp") for s in by_tp} == {0, 1, None}
    # through the HTTP adapter, as Grafana's Traces Drilldown asks
    out = traceql_adapter.metrics_range(
        conn, "{ } | histogram_over_time(duration)", START, END, step
    )
    assert out and all("__bucket" in labels for labels, _ in out)


def test_histogram_over_time_over_http_as_traces_drilldown_asks(path):
    q = '{ name = "execute_model" } | histogram_over_time(duration) by (resource.host.name)'
    query = {
        "q": [q],
        "start": [str(START)],
        "end": [str(END)],
        "step": [f"{4 * STEP_NS // 10**6}ms"],
    }
    endpoint, reply = route(str(path), Request("/api/metrics/query_range", query, {}))
    assert (endpoint, reply.code) == ("query_range", 200), reply.body
    series = json.loads(reply.body)["series"]
    buckets = {
        label["value"]["doubleValue"]
        for item in series
        for label in item["labels"]
        if label["key"] == "__bucket"
    }
    assert len(series) == len(buckets) >= 2
    assert sum(float(p.get("value", 0)) for item in series for p in item["samples"]) == 2 * WAVES
    # an ill-typed query is a 400 naming what is wrong
    query["q"] = ["{ status > ok } | rate()"]
    _, reply = route(str(path), Request("/api/metrics/query_range", query, {}))
    assert reply.code == 400 and b"illegal operation for the given types" in reply.body


def test_new_fields_in_metrics(conn):
    (series,) = metrics_range(
        conn, "{ nestedSetParent = -1 } | count_over_time()", START, END, STEP_NS
    )
    assert sum(v for _, v in series.samples) == WAVES
    (series,) = metrics_range(
        conn, '{ .num_reqs * 2 > 4 && name = "rank" } | count_over_time()', START, END, STEP_NS
    )
    assert sum(v for _, v in series.samples) == 2 * len([n for n in EVERY_WAVE if n % 3 == 2])


# -- generated queries: nothing but a TraceQL error, from the parser, planner or evaluator ------
_FIELDS = [".tp", ".num_reqs", ".op", ".dummy", ".wave", "span.bytes", "resource.host.name",
           "resource.service.name", "name", "duration", "status", "kind", "statusMessage",
           "rootName", "rootServiceName", "traceDuration", "nestedSetLeft", "nestedSetRight",
           "nestedSetParent", "span:id", "trace:id", "span:parentID", "span:childCount",
           "event:name", "event:timeSinceStart", "event.incident.type", "link:traceID",
           "link.x", "instrumentation:name", "instrumentation.x", ".nope", "span:name",
           "trace:duration"]  # fmt: skip
_STATICS = ['"all_reduce"', '"rank"', '""', "1", "0", "-1", "99999999999999999999", "1.5",
            "-0.5", "1e300", "50ms", "-5s", "0ns", "true", "false", "nil", "ok", "error",
            "unset", "internal", "server"]  # fmt: skip
_CMP = ["=", "!=", ">", ">=", "<", "<=", "=~", "!~"]
_ARITH = ["+", "-", "*", "/", "%", "^"]


def _field_expr():
    leaf = st.sampled_from(_FIELDS + _STATICS)

    def extend(inner):
        return st.one_of(
            st.tuples(inner, st.sampled_from(_CMP + _ARITH + ["&&", "||"]), inner).map(
                lambda t: (
                    f"{t[0]} {t[1]} {t[2]}" if t[1] not in ("=~", "!~") else f'{t[0]} {t[1]} "a.*"'
                )
            ),
            inner.map(lambda e: f"!{e}"),
            inner.map(lambda e: f"-{e}"),
            inner.map(lambda e: f"({e})"),
        )

    return st.recursive(leaf, extend, max_leaves=5)


def _spanset():
    filt = st.one_of(st.just("{ }"), _field_expr().map(lambda e: f"{{ {e} }}"))
    ops = ["&&", "||", *ast.ALL_STRUCTURAL_OPS]
    return st.recursive(
        filt,
        lambda inner: st.one_of(
            st.tuples(inner, st.sampled_from(ops), inner).map(lambda t: f"{t[0]} {t[1]} {t[2]}"),
            st.tuples(inner, _stage()).map(lambda t: f"({t[0]} | {t[1]})"),
        ),
        max_leaves=3,
    )


def _stage():
    agg = st.one_of(
        st.just("count()"),
        st.tuples(st.sampled_from(["avg", "min", "max", "sum"]), _field_expr()).map(
            lambda t: f"{t[0]}({t[1]})"
        ),
    )
    return st.one_of(
        st.tuples(agg, st.sampled_from(["=", "!=", ">", "<", ">="]), st.sampled_from(_STATICS)).map(
            " ".join
        ),
        _field_expr().map(lambda e: f"by({e})"),
        st.sampled_from(_FIELDS).map(lambda f: f"select({f})"),
        st.just("coalesce()"),
        _field_expr().map(lambda e: f"{{ {e} }}"),
    )


_METRICS = ["rate()", "count_over_time()", "quantile_over_time(duration, 0.5)",
            "histogram_over_time(duration)", "histogram_over_time(.wave)", "avg_over_time(.tp)",
            "max_over_time(span:childCount)", "min_over_time(nestedSetLeft)",
            "sum_over_time(.num_reqs) by (.tp)", "histogram_over_time(.op) by (name)"]  # fmt: skip


def _query():
    head = st.one_of(_spanset(), _stage())
    pipeline = st.tuples(head, st.lists(_stage(), max_size=2)).map(
        lambda t: " | ".join([t[0], *t[1]])
    )
    return st.tuples(pipeline, st.one_of(st.none(), st.sampled_from(_METRICS))).map(
        lambda t: t[0] if t[1] is None else f"{t[0]} | {t[1]}"
    )


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(_query())
def test_generated_queries_raise_nothing_but_traceql_errors(conn, text):
    try:
        query = parse(text)
    except TraceQLError:
        return
    assert parse(str(query)) == query
    try:
        if query.metrics is None:
            search(conn, query, START, END, limit=3)
        else:
            metrics_range(conn, query, START, END, 4 * STEP_NS)
    except TraceQLError:
        pass


# -- a search that cannot be narrowed is capped as the legacy search is ---------------------------
def test_a_search_that_cannot_narrow_stops_at_the_inspection_cap(conn, path, monkeypatch):
    """`rootName` and `traceDuration` only a built trace knows: every trace of the range is a
    candidate. The exact pass stops at the cap and says so (SearchStats, the API's
    inspectedTraces); below the cap it inspects each candidate once."""
    import sys

    from telemetry.traceql import MAX_TRACES_INSPECTED, SearchStats

    assert MAX_TRACES_INSPECTED == 5000  # the legacy search's cap, as docs/traceql.md says
    stats = SearchStats()
    found = search(conn, '{ rootName = "wave" }', START, END, limit=99, stats=stats)
    assert {m.trace_id for m in found} == {_tid(w) for w in EVERY_WAVE}
    assert (stats.inspected_traces, stats.capped) == (WAVES, False)
    monkeypatch.setattr(sys.modules["telemetry.traceql.search"], "MAX_TRACES_INSPECTED", 5)
    stats = SearchStats()
    found = search(conn, '{ rootName = "wave" }', START, END, limit=99, stats=stats)
    assert (stats.inspected_traces, stats.capped) == (5, True)
    assert [m.trace_id for m in found] == [_tid(w) for w in range(WAVES, WAVES - 5, -1)]
    # a limit reached first is no cap
    stats = SearchStats()
    assert len(search(conn, "{ traceDuration > 0 }", START, END, limit=3, stats=stats)) == 3
    assert (stats.inspected_traces, stats.capped) == (3, False)
    query = {
        "q": ["{ traceDuration > 0 }"],
        "start": [str(START // 10**9)],
        "end": [str(END // 10**9 + 1)],
        "limit": ["99"],
    }
    _, reply = route(str(path), Request("/api/search", query, {}))
    body = json.loads(reply.body)
    assert reply.code == 200 and len(body["traces"]) == 5
    assert body["metrics"] == {"inspectedTraces": 5}
