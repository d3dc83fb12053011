"""TraceQL search and metrics over a store written by the real writer sink and incident ledger.

Every expected answer comes from how the fixture built the waves (which ranks and waves were
slowed), and the generic checks compare against spans built one trace at a time with the CLI's
`load_trace` and filtered by plain Python predicates written here.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from telemetry import store as store_mod
from telemetry.spans.builders import wave_spans
from telemetry.spans.query import load_trace
from telemetry.traceql import TraceQLError, metrics_range, parse, search
from telemetry.traceql.columns import value_of
from telemetry.traceql.plan import plan_leaf
from telemetry.traceql.search import CandidatePass
from telemetry.traceql.source import BlockTable, SpanTable, block_template
from telemetry.wire.trace_ids import format_trace_id, wave_trace_id
from tests.support.trace_store import (
    MS,
    add_incident,
    batch_item,
    collective_wave,
    rank_info,
    wave_record,
    write_store,
)

WAVES = 24
PER_BATCH = 4
STEP_NS = 100 * MS
SLOW_TP1 = {3, 7}  # tp1's all_reduce takes 60 ms
SLOW_TP0 = {11}  # tp0's all_reduce takes 55 ms
BASE = time.time_ns() - 3600 * 10**9
START, END = BASE, BASE + (WAVES + 2) * STEP_NS


def _start(wave: int) -> int:
    return BASE + wave * STEP_NS


def _all_reduce_ns(tp: int, wave: int) -> int:
    if tp == 1 and wave in SLOW_TP1:
        return 60 * MS
    if tp == 0 and wave in SLOW_TP0:
        return 55 * MS
    return 1 * MS


def _execute_ns(tp: int, wave: int) -> int:
    return _all_reduce_ns(tp, wave) + 4 * MS + tp * 100_000


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    path = tmp_path_factory.mktemp("traceql") / "store.db"
    items = []
    for tp in (0, 1):
        rank = rank_info(tp)
        for first in range(1, WAVES + 1, PER_BATCH):
            numbers = range(first, first + PER_BATCH)
            waves = [wave_record(n, _start(n), _execute_ns(tp, n), reqs=1 + n % 3) for n in numbers]
            colls = [collective_wave(n, _start(n) + MS, _all_reduce_ns(tp, n)) for n in numbers]
            items.append(batch_item(rank, waves, colls))
    write_store(path, items)
    add_incident(
        path, rank_info(1), wave=5, at=_start(5) + 2 * MS, request_id="req-42", kind="nan_logits"
    )
    return path


@pytest.fixture
def conn(path):
    conn = store_mod.connect(path, readonly=True)
    yield conn
    conn.close()


def _tid(wave: int) -> str:
    return format_trace_id(wave_trace_id("run-t", wave, 0))


def _waves(matches) -> set[int]:
    by_id = {_tid(n): n for n in range(1, WAVES + 1)}
    return {by_id[m.trace_id] for m in matches}


def _all_spans(conn):
    return {n: load_trace(conn, _tid(n)) for n in range(1, WAVES + 1)}


# -- the on-call questions ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "query",
    [
        '{ .tp = 1 && name = "collective:all_reduce" && duration > 50ms }',
        '{ span.tp = 1 && span.op = "all_reduce" && duration > 50ms }',
        '{ .ascend_guard.tp = 1 && .collective.op = "all_reduce" && span:duration >= 50ms }',
        '{ name = "rank" && .tp = 1 } > { .op = "all_reduce" && duration > 50ms }',
        '{ name = "wave" } >> { .tp = 1 && .op = "all_reduce" && duration > 0.05s }',
        '{ name = "execute_model" && .tp = 1 } ~ { .op = "all_reduce" && duration > 50000us }',
    ],
)
def test_the_waves_where_tp1s_all_reduce_took_over_50ms(conn, query):
    matches = search(conn, query, START, END)
    assert _waves(matches) == SLOW_TP1
    for match in matches:
        (spanset,) = match.spansets
        (span,) = spanset.spans  # structural operators return the right-hand spans
        assert span.name == "collective:all_reduce" and span.tp == 1
        assert span.duration_ns == 60 * MS
        assert match.root_name == "wave"


def test_any_rank_finds_both_slow_ranks_and_newest_first(conn):
    matches = search(conn, '{ .op = "all_reduce" && duration > 50ms }', START, END)
    assert [_waves([m]).pop() for m in matches] == sorted(SLOW_TP1 | SLOW_TP0, reverse=True)
    assert matches[0].start_ns == _start(11)


def test_or_and_and_between_spansets(conn):
    slow1 = '{ .tp = 1 && .op = "all_reduce" && duration > 50ms }'
    slow0 = '{ .tp = 0 && .op = "all_reduce" && duration > 50ms }'
    assert _waves(search(conn, f"{slow1} || {slow0}", START, END)) == SLOW_TP1 | SLOW_TP0
    assert _waves(search(conn, f"{slow1} && {slow0}", START, END)) == set()
    both = search(conn, f'{slow1} && {{ name = "wave" }}', START, END)
    assert _waves(both) == SLOW_TP1
    assert sorted(s.name for s in both[0].spansets[0].spans) == ["collective:all_reduce", "wave"]


def test_or_inside_a_filter_and_regex(conn):
    q = '{ (.tp = 1 && .op =~ "all_.*" && duration > 50ms) || name = "incident:nan_logits" }'
    assert _waves(search(conn, q, START, END)) == SLOW_TP1 | {5}
    assert _waves(search(conn, '{ name !~ "(wave|rank|execute_model|sample_tokens|collective:.*)" }', START, END)) == {5}  # fmt: skip


def test_incident_by_request_id(conn):
    (match,) = search(conn, '{ .request = "req-42" }', START, END)
    assert _waves([match]) == {5}
    (span,) = match.spans
    assert span.name == "incident:nan_logits" and span.tp == 1


def test_count_and_avg_pipelines(conn):
    ranks = search(conn, '{ name = "rank" } | count() > 1', START, END, limit=100)
    assert _waves(ranks) == set(range(1, WAVES + 1))
    assert all(m.spansets[0].attributes == {"count()": 2} for m in ranks)
    assert search(conn, '{ name = "rank" } | count() > 2', START, END) == []
    slow = search(conn, '{ name = "execute_model" } | avg(duration) > 30ms', START, END)
    assert _waves(slow) == SLOW_TP1 | SLOW_TP0
    (m11,) = [m for m in slow if m.trace_id == _tid(11)]
    avg = m11.spansets[0].attributes["avg(duration)"]
    assert avg == pytest.approx((_execute_ns(0, 11) + _execute_ns(1, 11)) / 2)


def test_by_splits_spansets_and_select_fetches(conn):
    q = '{ name = "execute_model" } | by(.tp) | select(.num_reqs, .node)'
    (match,) = search(conn, q, _start(7), _start(7))
    assert sorted(ss.attributes["by(.tp)"] for ss in match.spansets) == [0, 1]
    for ss in match.spansets:
        (span,) = ss.spans
        assert span.tp == ss.attributes["by(.tp)"]
    fetched = {str(f) for f in match.fetched}
    assert fetched == {".tp", ".num_reqs", ".node"}
    assert match.span_attributes(match.spansets[0].spans[0]) == {"ascend_guard.tp": 0}
    assert search(conn, '{ name = "rank" } | by(.tp) | count() > 1', START, END) == []


def test_limit_and_spans_per_spanset(conn):
    matches = search(conn, "{ }", START, END, limit=5, spans_per_spanset=2)
    assert _waves(matches) == set(range(WAVES - 4, WAVES + 1))
    for match in matches:
        (ss,) = match.spansets
        assert (
            len(ss.spans) == 2 and ss.matched == 1 + 2 * 5
        )  # wave + 2 x (rank, 2 phases, 2 colls)
    everything = search(conn, "{}", START, END, limit=100, spans_per_spanset=None)
    assert len(everything) == WAVES


def test_time_range_bounds_the_search(conn):
    q = '{ .op = "all_reduce" && duration > 50ms }'
    assert _waves(search(conn, q, _start(5), _start(20))) == {7, 11}
    assert search(conn, q, _start(12), _start(20)) == []


def test_trace_level_intrinsics(conn):
    long = search(conn, '{ traceDuration > 60ms && rootName = "wave" }', START, END, limit=50)
    assert _waves(long) == SLOW_TP1 | SLOW_TP0
    assert search(conn, '{ rootName = "rank" }', START, END) == []
    kept = search(conn, '{ !(traceDuration > 60ms) && name = "wave" }', START, END, limit=50)
    assert _waves(kept) == set(range(1, WAVES + 1)) - SLOW_TP1 - SLOW_TP0


def test_resource_and_status_fields(conn):
    # the service is the engine, as the OTLP export names it (telemetry/export/resource.py)
    assert len(search(conn, '{ resource.service.name = "eng" }', START, END, limit=50)) == WAVES
    assert search(conn, '{ resource.service.name = "ascend-guard" }', START, END) == []
    namespace = '{ resource.service.namespace = "ascend-guard" && name = "wave" }'
    assert len(search(conn, namespace, START, END, limit=50)) == WAVES
    roots = search(conn, '{ rootServiceName = "eng" }', START, END, limit=50)
    assert len(roots) == WAVES and {m.root_service for m in roots} == {"eng"}
    assert search(conn, '{ rootServiceName = "ascend-guard" }', START, END) == []
    assert (
        len(search(conn, '{ resource.host.name = "node0" && .tp = 1 }', START, END, limit=50))
        == WAVES
    )
    # the incident of wave 5, the rank span it hangs under (tp1) and the wave root
    (errors,) = search(conn, "{ status = error }", START, END, spans_per_spanset=None)
    assert _waves([errors]) == {5}
    assert sorted((s.name, s.tp) for s in errors.spans) == [
        ("incident:nan_logits", 1), ("rank", 1), ("wave", None)
    ]  # fmt: skip
    assert len(search(conn, "{ kind = internal && status = unset }", START, END, limit=50)) == WAVES
    assert search(conn, '{ .no_such_attribute = "x" }', START, END) == []
    assert len(search(conn, "{ .no_such_attribute = nil }", START, END, limit=50)) == WAVES


_PREDICATES = {
    '{ .tp = 1 && name = "execute_model" && duration > 4200us }': lambda s: (
        s.tp == 1 and s.name == "execute_model" and s.duration_ns > 4_200_000
    ),
    '{ .num_reqs >= 2 && name = "rank" }': lambda s: (
        s.name == "rank" and s.attributes["ascend_guard.num_reqs"] >= 2
    ),
    "{ .bytes = 1024 || .calls > 3 }": lambda s: (
        s.name.startswith("collective:")
        and (
            s.attributes["ascend_guard.collective.bytes"] == 1024
            or s.attributes["ascend_guard.collective.calls"] > 3
        )
    ),
    "{ .wave > 20 && .tp != 0 }": lambda s: s.wave > 20 and s.tp is not None and s.tp != 0,
    '{ name =~ "sample_.*" && .wave < 3 }': lambda s: s.name == "sample_tokens" and s.wave < 3,
    '{ .dummy = false && name = "wave" }': lambda s: s.name == "wave",
}


@pytest.mark.parametrize("query", sorted(_PREDICATES))
def test_search_agrees_with_brute_force_over_every_trace(conn, query):
    predicate = _PREDICATES[query]
    expected = {}
    for wave, spans in _all_spans(conn).items():
        hits = sorted(s.span_id for s in spans if predicate(s))
        if hits:
            expected[_tid(wave)] = hits
    got = {
        m.trace_id: sorted(s.span_id for s in m.spans)
        for m in search(conn, query, START, END, limit=1000, spans_per_spanset=None)
    }
    assert got == expected and expected


# -- pruning -----------------------------------------------------------------------------------


def test_rank_coordinates_and_kinds_prune_before_decoding(conn):
    ranks = store_mod.ranks(conn)
    tp1 = next(r for r in ranks if r.tp == 1)
    plan = plan_leaf(parse("{ .tp = 1 }").spanset, ranks)
    assert set(plan.kinds) == {tp1.id}
    assert plan.kinds[tp1.id] == {
        "rank", "execute_model", "sample_tokens", "collective", "slow_call"
    }  # fmt: skip
    plan = plan_leaf(parse('{ .op = "all_reduce" }').spanset, ranks)
    assert all(kinds == {"collective", "slow_call"} for kinds in plan.kinds.values())
    assert not plan.incidents
    plan = plan_leaf(parse('{ name = "wave" }').spanset, ranks)
    assert all(kinds == {"wave"} for kinds in plan.kinds.values())
    plan = plan_leaf(parse('{ .engine = "other" }').spanset, ranks)
    assert plan.kinds == {}


def test_slowest_step_prunes_wave_blocks(conn):
    def blocks(query):
        finder = CandidatePass(conn, parse(query))
        finder.scan(START, END)
        return finder.blocks_read

    assert blocks('{ name = "rank" }') == 2 * WAVES // PER_BATCH
    assert blocks('{ name = "rank" && .tp = 1 }') == WAVES // PER_BATCH
    # slow steps are in waves 3, 7 (blocks 1-4, 5-8 of tp1) and 11 (block 9-12 of tp0)
    assert blocks('{ name = "execute_model" && duration > 50ms }') == 3
    assert blocks('{ name = "execute_model" && duration > 1s }') == 0


def test_block_tables_agree_with_the_span_builder(conn):
    """The columns a block filter reads are the built spans' own values, field by field."""
    ranks = {r.id: r for r in store_mod.ranks(conn)}
    fields = [parse(f"{{ {f} != nil }}").spanset.expr.left for f in
              ["name", "duration", ".tp", ".dp", ".pp", ".wave", ".num_reqs", ".run",
               ".engine", ".node", ".pid", ".dummy", ".prefill_tokens", ".sampled_tokens",
               "resource.host.name", "resource.service.name", ".op"]]  # fmt: skip
    for rank_id, cols in store_mod.wave_blocks(conn, list(ranks)):
        rank = ranks[rank_id]
        every = [s for i in range(len(cols.wave)) for s in wave_spans(rank, cols, i)]
        built = SpanTable(every)  # all kinds: a wave span's host is its rank span's node
        for kind in ("wave", "rank", "execute_model", "sample_tokens"):
            template = block_template(rank, cols, kind)
            idx = [i for i, s in enumerate(every) if s.name == kind]
            if template is None:
                assert not idx
                continue
            block = BlockTable(rank, cols, kind, template)
            rows = np.flatnonzero(block.exists)
            assert list(block.start[rows]) == [every[i].start_ns for i in idx]
            assert list((block.end - block.start)[rows]) == [every[i].duration_ns for i in idx]
            for field in fields:
                bv, bp = value_of(field, block)
                sv, sp = value_of(field, built)
                bp = np.broadcast_to(bp, (block.n,))[rows]
                sp = np.broadcast_to(sp, (built.n,))[idx]
                assert list(bp) == list(sp), (kind, field)
                bv = np.broadcast_to(np.asarray(bv, dtype=object), (block.n,))[rows]
                sv = np.broadcast_to(np.asarray(sv, dtype=object), (built.n,))[idx]
                assert [v for v, p in zip(bv, bp, strict=True) if p] == [
                    v for v, p in zip(sv, sp, strict=True) if p
                ], (kind, field)


# -- metrics -----------------------------------------------------------------------------------


def test_count_over_time_and_rate_by_rank(conn):
    step = 4 * STEP_NS
    series = metrics_range(conn, '{ name = "execute_model" } | count_over_time() by (.tp)', START, END, step)  # fmt: skip
    assert [s.labels for s in series] == [{".tp": 0}, {".tp": 1}]
    for s in series:
        assert sum(v for _, v in s.samples) == WAVES
        base = START - START % step
        for t, v in s.samples:
            expected = sum(1 for n in range(1, WAVES + 1) if t <= _start(n) < t + step)
            assert v == expected and (t - base) % step == 0
    (rate,) = metrics_range(conn, '{ .op = "all_reduce" } | rate()', START, END, step)
    assert rate.labels == {}
    per_step = [v * step / 1e9 for _, v in rate.samples]
    assert sum(per_step) == pytest.approx(2 * WAVES)


def test_quantile_over_time_matches_numpy_on_the_built_spans(conn):
    step = 8 * STEP_NS
    q = '{ name = "collective:all_reduce" } | quantile_over_time(duration, .99, 0.5) by (.tp)'
    series = metrics_range(conn, q, START, END, step)
    assert sorted((s.labels[".tp"], s.labels["p"]) for s in series) == [
        (0, 0.5), (0, 0.99), (1, 0.5), (1, 0.99)
    ]  # fmt: skip
    spans = [s for ss in _all_spans(conn).values() for s in ss if s.name == "collective:all_reduce"]
    base = START - START % step
    for s in series:
        for t, value in s.samples:
            durations = [
                x.duration_ns / 1e9
                for x in spans
                if x.tp == s.labels[".tp"] and t <= x.start_ns < t + step
            ]
            assert value == pytest.approx(np.quantile(durations, s.labels["p"]))
            assert (t - base) % step == 0
    # the step holding tp1's slow wave 3 has a p99 near its 60 ms, tp0's the same step not
    for tp, slow in ((1, True), (0, False)):
        (p99,) = [s for s in series if s.labels == {".tp": tp, "p": 0.99}]
        (value,) = [v for t, v in p99.samples if t <= _start(3) + MS < t + step]
        assert (value > 0.05) is slow


def test_metrics_of_a_structural_query_run_the_exact_pass(conn):
    step = 6 * STEP_NS
    direct = metrics_range(conn, '{ name = "execute_model" } | count_over_time()', START, END, step)
    nested = metrics_range(conn, '{ name = "rank" } > { name = "execute_model" } | count_over_time()', START, END, step)  # fmt: skip
    assert direct == nested and sum(v for _, v in direct[0].samples) == 2 * WAVES
    slow = metrics_range(conn, "{ traceDuration > 60ms } | count_over_time()", START, END, step)
    per_trace_spans = 1 + 2 * 5 + 0  # wave + per rank: rank, execute, sample, 2 collectives
    assert sum(v for _, v in slow[0].samples) == 3 * per_trace_spans


def test_wrong_query_shapes_are_errors(conn):
    with pytest.raises(TraceQLError, match="metrics query"):
        search(conn, "{ } | rate()", START, END)
    with pytest.raises(TraceQLError, match="not a metrics query"):
        metrics_range(conn, "{ }", START, END, STEP_NS)
    with pytest.raises(TraceQLError, match="step"):
        metrics_range(conn, "{ } | rate()", START, END, 0)
    with pytest.raises(TraceQLError, match="limit"):
        search(conn, "{ }", START, END, limit=0)


def test_collective_tables_agree_with_the_span_builder(conn):
    from telemetry.spans.builders import collective_spans
    from telemetry.traceql.source import (
        CollectiveTable,
        collective_blocks_in,
        collective_waves_in_range,
        node_map,
    )

    fields = [parse(f"{{ {f} != nil }}").spanset.expr.left for f in
              ["name", "duration", ".tp", ".dp", ".pp", ".wave", ".run", ".engine", ".op",
               ".group", ".bytes", ".calls", ".host_ns", ".max_host_ns", ".first_seq",
               ".last_seq", ".device_ns", ".replayed", ".backend", ".dtype", ".num_reqs",
               ".wait_ns", ".injected_delay_ns", ".slow_calls_dropped",
               "resource.host.name", "resource.service.name"]]  # fmt: skip
    checked = 0
    blocks = {
        rank.id: list(collective_blocks_in(conn, [rank.id], START, END))
        for rank in store_mod.ranks(conn)
    }
    for rank in store_mod.ranks(conn):
        for records in collective_waves_in_range(conn, rank.id, 1, WAVES):
            spans = [s for cw in records for s in collective_spans(rank, cw)]
            nodes = node_map(store_mod.ranks(conn))
            # from the block's columns (as searches read them) and from records, the same
            (cols,) = [c for _, c in blocks[rank.id] if records[0].wave in c.wave]
            for table in (CollectiveTable(rank, records), CollectiveTable(rank, cols=cols)):
                _same_columns(table, SpanTable(spans, nodes=nodes), spans, fields)
            checked += len(spans)
    assert checked == 2 * 2 * WAVES


def _same_columns(table, built, spans, fields):
    assert list(table.start) == [s.start_ns for s in spans]
    assert list(table.waves) == [s.wave for s in spans]
    for field in fields:
        tv, tp = value_of(field, table)
        sv, sp = value_of(field, built)
        tp = np.broadcast_to(tp, (table.n,))
        assert list(tp) == list(np.broadcast_to(sp, (built.n,))), field
        tv = np.broadcast_to(np.asarray(tv, dtype=object), (table.n,))
        sv = np.broadcast_to(np.asarray(sv, dtype=object), (built.n,))
        assert [v for v, p in zip(tv, tp, strict=True) if p] == [
            v for v, p in zip(sv, tp, strict=True) if p
        ], field


def test_cached_trace_loading_builds_what_load_trace_builds(conn):
    from telemetry.traceql.source import BlockCache, load_trace_cached

    cache = BlockCache(conn, size=2)  # small: blocks are dropped and read again
    for wave in [*range(1, WAVES + 1), 5, 1, WAVES]:
        expected = load_trace(conn, _tid(wave))
        assert load_trace_cached(conn, _tid(wave), cache) == expected
        assert len(expected) == 11 + (wave == 5)  # the incident of wave 5


def test_block_walk_finds_exactly_the_overlapping_blocks(tmp_path):
    """Walking back from the window's end (telemetry/store/blocks.py `blocks_by_time`) reads the same
    blocks as the plain (full scan) overlap filter, and the walk by waves (`blocks_by_wave`)
    the same as the plain wave filter, for ranks that run throughout, start late or stop
    early."""
    import random

    blocks_by_time, blocks_by_wave = store_mod.blocks_by_time, store_mod.blocks_by_wave
    wave_range = store_mod.wave_range

    path = tmp_path / "walk.db"
    items = []
    for tp, waves in ((0, range(1, 61)), (1, range(20, 31)), (2, range(45, 61))):
        for first in range(waves.start, waves.stop, 3):
            numbers = range(first, min(first + 3, waves.stop))
            items.append(
                batch_item(
                    rank_info(tp, tp_size=3),
                    [wave_record(n, _start(n), _execute_ns(0, n)) for n in numbers],
                )
            )
    write_store(path, items)
    conn = store_mod.connect(path, readonly=True)
    ids = [r.id for r in store_mod.ranks(conn)]
    rng = random.Random(5)
    for _ in range(200):
        lo = _start(rng.randrange(-5, 66)) + rng.randrange(-STEP_NS, STEP_NS)
        hi = lo + rng.randrange(0, 30 * STEP_NS)
        want = rng.sample(ids, rng.randrange(1, 4))
        got = sorted(b.rowid for b in blocks_by_time(conn, "wave_blocks", want, lo, hi))
        expected = [
            rowid
            for (rowid,) in conn.execute(
                f"SELECT rowid FROM wave_blocks WHERE rank IN ({','.join('?' * len(want))}) "
                "AND end_ns >= ? AND start_ns <= ? ORDER BY rowid",
                (*want, lo, hi),
            )
        ]
        assert got == expected, (lo, hi, want)
        for rank_id in want:
            bounds = conn.execute(
                "SELECT MIN(first_wave), MAX(last_wave) FROM wave_blocks WHERE rank = ? "
                "AND end_ns >= ? AND start_ns <= ?",
                (rank_id, lo, hi),
            ).fetchone()
            assert wave_range(conn, rank_id, lo, hi) == (
                None if bounds[0] is None else tuple(bounds)
            )
            first = rng.randrange(-5, 66)
            last = first + rng.randrange(0, 10)
            got = sorted(b.rowid for b in blocks_by_wave(conn, "wave_blocks", rank_id, first, last))
            expected = [
                rowid
                for (rowid,) in conn.execute(
                    "SELECT rowid FROM wave_blocks WHERE rank = ? AND last_wave >= ? "
                    "AND first_wave <= ? ORDER BY rowid",
                    (rank_id, first, last),
                )
            ]
            assert got == expected, (rank_id, first, last)
    conn.close()


def test_block_directory_answers_what_the_wave_walk_answers(tmp_path):
    """`store.BlockDirectory` (a search's kept, paged walk down one rank's blocks) gives the
    blocks `blocks_by_wave` gives, in the same order, for look-ups that mostly walk back and
    sometimes jump up, over more blocks than its first pages hold and with batches sent again
    cut differently (blocks that overlap)."""
    import random

    rng = random.Random(11)
    path = tmp_path / "directory.db"
    info = rank_info(0, tp_size=1)
    cuts = [range(first, first + 3) for first in range(1, 301, 3)]
    starts = {c.start for c in cuts}
    for _ in range(40):  # sent again, cut differently: a new first wave, 2..9 waves long
        first = rng.choice([w for w in range(2, 300) if w not in starts])
        starts.add(first)
        cuts.append(range(first, min(first + rng.randrange(2, 10), 301)))
    write_store(
        path,
        [batch_item(info, [wave_record(n, _start(n), _execute_ns(0, n)) for n in c]) for c in cuts],
    )
    conn = store_mod.connect(path, readonly=True)
    (rank_id,) = [r.id for r in store_mod.ranks(conn)]
    found = 0
    for table in ("wave_blocks", "collective_blocks"):
        directory = store_mod.BlockDirectory(conn, table, rank_id)
        wave = 305
        for _ in range(400):
            wave = rng.randrange(wave, 320) if rng.random() < 0.05 else wave - rng.randrange(0, 9)
            if wave < -3:
                wave = 305
            first, last = wave - rng.randrange(0, 4), wave
            want = list(store_mod.blocks_by_wave(conn, table, rank_id, first, last))
            assert directory.blocks_by_wave(first, last) == want, (table, first, last)
            found += len(want)
    assert found > 400  # most look-ups hold blocks (two or more where batches overlap)
    conn.close()


def test_trace_spans_by_id(conn):
    from telemetry.traceql import trace_spans

    assert trace_spans(conn, _tid(5).upper()) == load_trace(conn, _tid(5))
    assert trace_spans(conn, "0" * 31 + "1") == []
    with pytest.raises(TraceQLError, match="trace id"):
        trace_spans(conn, "xyz")
