"""The span list (telemetry/traceql/span_list.py) that `ascend-guard query`'s filter flags and
`--spans` run, and the flags' mapping onto TraceQL.

Two independent oracles: the flag search that `query` ran before it went through TraceQL
(telemetry/spans/query.py `search`, numpy over the wave columns), and a brute-force pass over every
span the builder makes (each stored trace loaded whole), filtered by Python predicates.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time

import pytest

from telemetry import store as store_mod
from telemetry.cli.args import parse_rank
from telemetry.cli.commands.query import flags_to_traceql
from telemetry.spans.query import load_trace
from telemetry.traceql import TraceQLError
from telemetry.traceql.span_list import top_spans
from telemetry.wire.trace_ids import format_trace_id, wave_trace_id
from tests.support.span_search import SpanQuery, search
from tests.support.trace_store import (
    MS,
    add_incident,
    batch_item,
    collective_wave,
    rank_info,
    wave_record,
    write_store,
)

NOW = time.time_ns()
BASE = NOW - 300 * 10**9
WAVES = range(1, 41)


@pytest.fixture(scope="module")
def store_path(tmp_path_factory) -> str:
    """4 TP ranks x 40 waves, durations drawn at random (seeded, no two alike), collectives
    on every wave, two incidents."""
    path = tmp_path_factory.mktemp("span-list") / "store.db"
    rng = random.Random(12)
    items = []
    used: set[int] = set()

    def draw(lo: int, hi: int) -> int:
        while True:
            value = rng.randrange(lo, hi)
            if value not in used:
                used.add(value)
                return value

    for tp in range(4):
        waves, colls = [], []
        for n in WAVES:
            start = BASE + n * 200 * MS + tp * 1000
            waves.append(wave_record(n, start, draw(MS, 90 * MS), sample_ns=draw(10**5, MS)))
            colls.append(collective_wave(n, start + 10**5, draw(10**5, 70 * MS)))
        # two batches per rank: blocks that split the waves
        items.append(batch_item(rank_info(tp, tp_size=4), waves[:25], colls[:25]))
        items.append(batch_item(rank_info(tp, tp_size=4), waves[25:], colls[25:]))
    write_store(path, items)
    add_incident(
        path,
        rank_info(2, tp_size=4),
        wave=9,
        at=BASE + 9 * 200 * MS + 5 * MS,
        request_id="req-9",
        kind="logits_finite",
    )
    add_incident(
        path,
        rank_info(0, tp_size=4),
        wave=30,
        at=BASE + 30 * 200 * MS + 7 * MS,
        request_id="req-30",
        kind="token_repeat",
    )
    return str(path)


@pytest.fixture(scope="module")
def every_span(store_path):
    conn = store_mod.connect(store_path, readonly=True)
    spans = []
    for n in WAVES:
        spans += load_trace(conn, format_trace_id(wave_trace_id("run-t", n, 0)))
    return spans


def _key(span, sort: str) -> int:
    return {"duration": span.duration_ns, "start": span.start_ns, "wave": span.wave}[sort]


def _brute(spans, keep, sort: str, limit: int, start_ns: int = 0, end_ns: int = 2**63):
    hits = [s for s in spans if keep(s) and start_ns <= s.start_ns <= end_ns]
    hits.sort(key=lambda s: (_key(s, sort), s.start_ns), reverse=True)
    return hits[:limit]


FILTERS = [
    ("{ }", lambda s: True),
    ('{ .tp = 1 && name = "execute_model" }', lambda s: s.tp == 1 and s.name == "execute_model"),
    (
        '{ .op = "all_reduce" && duration > 30ms }',
        lambda s: s.name == "collective:all_reduce" and s.duration_ns > 30 * MS,
    ),
    ("{ duration >= 50ms || .wave = 3 }", lambda s: s.duration_ns >= 50 * MS or s.wave == 3),
    ('{ name =~ "incident:.*" }', lambda s: s.name.startswith("incident:")),
    ('{ .request = "req-9" }', lambda s: s.name == "incident:logits_finite"),
    (
        "{ .tp > 1 && duration < 2ms }",
        lambda s: s.tp is not None and s.tp > 1 and s.duration_ns < 2 * MS,
    ),
]


@pytest.mark.parametrize(("query", "keep"), FILTERS, ids=[q for q, _ in FILTERS])
@pytest.mark.parametrize("sort", ["duration", "start", "wave"])
def test_top_spans_equal_a_brute_force_pass_over_every_span(
    store_path, every_span, query, keep, sort
):
    conn = store_mod.connect(store_path, readonly=True)
    for limit in (1, 7, 10_000):
        got = top_spans(conn, query, BASE, NOW, sort, limit)
        want = _brute(every_span, keep, sort, limit)
        assert [(_key(s, sort), s.start_ns) for s in got] == [
            (_key(s, sort), s.start_ns) for s in want
        ], (query, sort, limit)
        if limit == 10_000:  # every match: the very same spans, field by field
            key = lambda s: (s.trace_id, s.span_id)  # noqa: E731
            assert sorted(got, key=key) == sorted(want, key=key)
            assert got, f"{query} matches nothing: the test would prove nothing"


def test_the_window_bounds_span_starts(store_path, every_span):
    conn = store_mod.connect(store_path, readonly=True)
    lo, hi = BASE + 10 * 200 * MS, BASE + 20 * 200 * MS + 500
    got = top_spans(conn, "{ }", lo, hi, "start", 10_000)
    want = _brute(every_span, lambda s: True, "start", 10_000, lo, hi)
    assert [s.start_ns for s in got] == [s.start_ns for s in want]
    assert {s.span_id for s in got} == {s.span_id for s in want}
    assert {s.wave for s in got} == set(range(10, 21))
    assert {s.tp for s in got if s.wave == 20} == {0, None}  # tp1-3 start after hi


@pytest.mark.parametrize(
    "query", ["{ .tp = 1 } >> { }", "{ } | count() > 1", "{ } | rate()", '{ rootName = "wave" }']
)
def test_only_one_plain_filter_makes_a_span_list(store_path, query):
    conn = store_mod.connect(store_path, readonly=True)
    with pytest.raises(TraceQLError):
        top_spans(conn, query, BASE, NOW)


def _flags(**given) -> argparse.Namespace:
    base = {
        "name": None,
        "rank": None,
        "run_id": None,
        "engine": None,
        "wave": None,
        "min_duration": None,
    }
    return argparse.Namespace(**{**base, **given})


FLAG_CASES = [
    {},
    {"name": "rank"},
    {"rank": "tp=1"},
    {"rank": "0/2/0", "name": "execute_model"},
    {"min_duration": "50ms"},
    {"min_duration": "0.5ms", "name": "sample_tokens"},
    {"wave": 7},
    {"wave": 7, "name": "wave"},
    {"run_id": "run-t", "engine": "eng", "rank": "dp=0,tp=3"},
    {"run_id": "other"},
    {"engine": 'we"ird\\'},
]


@pytest.mark.parametrize("given", FLAG_CASES, ids=[str(c) for c in FLAG_CASES])
@pytest.mark.parametrize("sort", ["duration", "start", "wave"])
def test_the_flags_as_traceql_find_what_the_old_flag_search_found(store_path, given, sort):
    """The flags' TraceQL filter, through the span list, against telemetry/spans/query.py's own flag
    search: the same spans, in the same order of the sort key."""
    from telemetry.cli.args import parse_duration_ns

    conn = store_mod.connect(store_path, readonly=True)
    text = flags_to_traceql(_flags(**given))
    old = SpanQuery(
        since_ns=BASE,
        until_ns=NOW,
        sort=sort,
        limit=10_000,
        name=given.get("name"),
        rank=parse_rank(given["rank"]) if given.get("rank") else {},
        run_id=given.get("run_id"),
        engine=given.get("engine"),
        wave=given.get("wave"),
        min_duration_ns=parse_duration_ns(given["min_duration"], "x")
        if given.get("min_duration")
        else None,
    )
    want = search(conn, old)
    for limit in (3, 10_000):
        got = top_spans(conn, text, BASE, NOW, sort, limit)
        assert [_key(s, sort) for s in got] == [_key(s, sort) for s in want[:limit]], text
    key = lambda s: (s.trace_id, s.span_id)  # noqa: E731
    # the old flag search leaves every status unset; the span list reads it (an incident's
    # rank and wave are "error"), so the fields are compared without it
    plain = lambda spans: [dataclasses.replace(s, status="unset") for s in spans]  # noqa: E731
    assert plain(sorted(got, key=key)) == plain(sorted(want, key=key)), text
    assert {s.wave for s in got if s.status == "error"} <= {9, 30}, text
    if given.get("run_id") != "other" and given.get("engine", "eng") == "eng":
        assert got, f"{text} found nothing: the case proves nothing"


def test_the_flags_traceql_text():
    assert flags_to_traceql(_flags(rank="tp=1", min_duration="50ms", name="rank")) == (
        '{ name = "rank" && .tp = 1 && duration >= 50ms }'
    )
    assert flags_to_traceql(_flags(wave=3, min_duration="1.5s")) == (
        '{ (name = "wave" || name = "rank" || name = "execute_model" || name = "sample_tokens") '
        "&& .wave = 3 && duration >= 1500ms }"
    )
    assert '.engine = "a\\"b"' in flags_to_traceql(_flags(engine='a"b'))
