"""TraceQL search over the store: matched traces, newest first.

Two passes. The candidate pass finds, for each `{ }` filter, the traces (waves of one replica)
that hold at least one span matching it: it reads only the ranks, span kinds and blocks the
plan allows (telemetry/traceql/plan.py) and evaluates the filter over a block's columns without
building spans. The filters' trace sets are combined the way the spanset expression combines
them (`||` unites, `&&` and structural operators need both sides). The exact pass then builds
each candidate trace with the CLI's own builder (telemetry/spans/query.py `load_trace`) and runs the
whole query on its spans, newest first, until `limit` traces match. The candidate pass walks
back from `end_ns` in windows that grow fourfold, so a broad query stops after the first
window while a narrow one scans the range."""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import Iterable

import numpy as np

from telemetry import store
from telemetry.spans.builders import Span
from telemetry.traceql import ast
from telemetry.traceql import requests as request_traceql
from telemetry.traceql.columns import mask_of
from telemetry.traceql.evaluate import TraceMatch, match_trace
from telemetry.traceql.parser import TraceQLError, parse
from telemetry.traceql.plan import LeafPlan, leaves, plan_leaf, requirements
from telemetry.traceql.source import (
    WAVE_KINDS,
    BlockCache,
    BlockTable,
    CollectiveTable,
    SpanTable,
    block_template,
    error_waves,
    incident_spans,
    load_trace_cached,
    node_map,
    slow_call_spans_in,
)
from telemetry.wire.trace_ids import format_trace_id, wave_trace_key

DEFAULT_LIMIT = 20


DEFAULT_SPSS = 3


FIRST_WINDOW_NS = 2 * 10**9
# traces built and checked exactly per search, as the legacy tag search caps them; a search
# that reaches it answers what it found so far (`SearchStats.capped`)
MAX_TRACES_INSPECTED = 5000
# candidate traces whose blocks' blobs are read in one query before they are built (no more
# than the matches still wanted, so a narrow search reads no blob it does not use)
READ_AHEAD_TRACES = 8


@dataclasses.dataclass
class SearchStats:
    """What a search did, as Tempo's search metrics say it (`inspectedTraces`)."""

    inspected_traces: int = 0  # traces built and checked exactly
    capped: bool = False  # stopped at MAX_TRACES_INSPECTED: there may be more matches


# -- candidate sets: trace keys (replica key, wave) with the earliest matching start ------------
class Candidates:
    def __init__(self) -> None:
        self._parts: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
        self._final: dict[int, tuple[np.ndarray, np.ndarray]] | None = None

    def add(self, key: int, waves: np.ndarray, starts: np.ndarray) -> None:
        if len(waves):
            self._parts.setdefault(key, []).append((waves, starts))
            self._final = None

    def final(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """key -> (sorted unique waves, earliest start of each)."""
        if self._final is None:
            out = {}
            for key, parts in self._parts.items():
                waves = np.concatenate([p[0] for p in parts])
                starts = np.concatenate([p[1] for p in parts])
                order = np.lexsort((starts, waves))
                waves, starts = waves[order], starts[order]
                unique, first = np.unique(waves, return_index=True)
                out[key] = (unique, starts[first])
            self._final = out
        return self._final


def _combine(a, b, both: bool):
    out = {}
    for key in (set(a) & set(b)) if both else (set(a) | set(b)):
        if key not in a or key not in b:
            out[key] = a.get(key) or b.get(key)
            continue
        (wa, sa), (wb, sb) = a[key], b[key]
        if both:
            waves, ia, ib = np.intersect1d(wa, wb, assume_unique=True, return_indices=True)
            out[key] = (waves, np.minimum(sa[ia], sb[ib]))
        else:
            waves = np.union1d(wa, wb)
            starts = np.full(len(waves), np.iinfo(np.int64).max)
            for w, s in ((wa, sa), (wb, sb)):
                idx = np.searchsorted(waves, w)
                starts[idx] = np.minimum(starts[idx], s)
            out[key] = (waves, starts)
    return out


def _needed(expr: ast.SpansetExpr, sets: dict[int, Candidates]):
    """The traces that can satisfy the spanset expression, from each filter's trace set."""
    if isinstance(expr, ast.SpansetFilter):
        return sets[id(expr)].final()
    if isinstance(expr, ast.SubPipeline):
        return _needed(expr.spanset, sets)
    if expr.op in ast.NEGATED_OPS:  # the right side's spans that do not relate: the right's
        return _needed(expr.right, sets)
    left, right = _needed(expr.left, sets), _needed(expr.right, sets)
    return _combine(left, right, both=expr.op != "||")


class CandidatePass:
    """Finds each filter's traces window by window (the windows must not overlap)."""

    def __init__(
        self, conn: sqlite3.Connection, query: ast.Query, cache: BlockCache | None = None
    ) -> None:
        self.conn = conn
        self.cache = cache if cache is not None else BlockCache(conn)  # shared with the exact pass
        self.ranks = {r.id: r for r in store.ranks(conn)}
        self.keys = {r.id: wave_trace_key(r.run_id, r.dp) for r in self.ranks.values()}
        self.nodes = node_map(self.ranks.values())
        self.required = requirements(query)
        self.plans = [
            plan_leaf(leaf, list(self.ranks.values()))
            for expr in self.required
            for leaf in leaves(expr)
        ]
        self.sets = {id(p.leaf): Candidates() for p in self.plans}
        self.blocks_read = 0

    def scan(self, lo: int, hi: int) -> None:
        """Add the matches among spans starting in [lo, hi)."""
        self._scan_waves(lo, hi)
        self._scan_collectives(lo, hi)
        self._scan_slow_calls(lo, hi)
        self._scan_incidents(lo, hi)

    def _scan_waves(self, lo: int, hi: int) -> None:
        wanted: dict[int, list[LeafPlan]] = {}
        bounds = []
        for plan in self.plans:
            has = [rid for rid, kinds in plan.kinds.items() if kinds & set(WAVE_KINDS)]
            for rid in has:
                wanted.setdefault(rid, []).append(plan)
            if has:
                bounds.append(plan.min_step_ns)
        if not wanted:
            return
        min_step = None if None in bounds else min(bounds)
        error_only = all(p.error_only for plans in wanted.values() for p in plans)
        blocks = store.blocks_by_time(
            self.conn, store.WAVE_BLOCKS, list(wanted), lo, hi, min_ns=min_step
        )
        if error_only:  # only blocks whose waves raised an incident: one look-up per rank
            blocks = self._with_errors(list(blocks))
        for block in blocks:
            rank_id = block.rank
            rank = self.ranks[rank_id]
            cols = self.cache.wave_columns(block.rowid)
            self.blocks_read += 1
            for kind in WAVE_KINDS:
                plans = [p for p in wanted[rank_id] if kind in p.kinds[rank_id]]
                if not plans:
                    continue
                template = block_template(rank, cols, kind)
                if template is None:
                    continue
                table = BlockTable(rank, cols, kind, template, self.conn)
                in_window = table.exists & (table.start >= lo) & (table.start < hi)
                for plan in plans:
                    rows = np.flatnonzero(mask_of(plan.expr, table) & in_window)
                    if len(rows):
                        waves = table.array("wave")[rows]
                        self.sets[id(plan.leaf)].add(self.keys[rank_id], waves, table.start[rows])

    def _with_errors(self, blocks: list) -> list:
        by_rank: dict[int, list] = {}
        for block in blocks:
            by_rank.setdefault(block.rank, []).append(block)
        out = []
        for rank_id, own in by_rank.items():
            first = min(b.first_wave for b in own)
            last = max(b.last_wave for b in own)
            bad = np.array(sorted(error_waves(self.conn, self.ranks[rank_id], "wave", first, last)))
            if not len(bad):
                continue
            for b in own:  # a wave with an incident in the block's wave range
                i = np.searchsorted(bad, b.first_wave)
                if i < len(bad) and bad[i] <= b.last_wave:
                    out.append(b)
        return out

    def _add_spans(self, spans: list[Span], plans: Iterable[LeafPlan], lo: int, hi: int) -> None:
        spans = [s for s in spans if lo <= s.start_ns < hi]
        if not spans:
            return
        table = SpanTable(spans, nodes=self.nodes)
        for plan in plans:
            rows = np.flatnonzero(mask_of(plan.expr, table))
            by_key: dict[int, list[int]] = {}
            for i in rows:
                span = spans[i]
                by_key.setdefault(span.trace_id >> 64, []).append(i)
            for key, idx in by_key.items():
                waves = np.array([spans[i].wave for i in idx], np.int64)
                starts = np.array([spans[i].start_ns for i in idx], np.int64)
                self.sets[id(plan.leaf)].add(key, waves, starts)

    def _scan_collectives(self, lo: int, hi: int) -> None:
        for rank_id, rank in self.ranks.items():
            plans = [p for p in self.plans if "collective" in p.kinds.get(rank_id, ())]
            if not plans:
                continue
            bounds = [p.min_step_ns for p in plans]
            min_ns = None if None in bounds else min(bounds)
            for block in store.blocks_by_time(
                self.conn, store.COLLECTIVE_BLOCKS, (rank_id,), lo, hi - 1, min_ns=min_ns
            ):
                cols = self.cache.collective_columns(block.rowid)
                self.blocks_read += 1
                table = CollectiveTable(rank, cols=cols)
                in_window = (table.start >= lo) & (table.start < hi)
                for plan in plans:
                    rows = np.flatnonzero(mask_of(plan.expr, table) & in_window)
                    if len(rows):
                        self.sets[id(plan.leaf)].add(
                            self.keys[rank_id], table.waves[rows], table.start[rows]
                        )

    def _scan_slow_calls(self, lo: int, hi: int) -> None:
        plans = [p for p in self.plans if any("slow_call" in k for k in p.kinds.values())]
        if not plans:
            return
        ids = {rid for p in plans for rid, kinds in p.kinds.items() if "slow_call" in kinds}
        ranks = {rid: self.ranks[rid] for rid in ids}
        self._add_spans(slow_call_spans_in(self.conn, ranks, lo, hi - 1), plans, lo, hi)

    def _scan_incidents(self, lo: int, hi: int) -> None:
        plans = [p for p in self.plans if p.incidents]
        if plans:
            self._add_spans(incident_spans(self.conn, lo, hi - 1), plans, lo, hi)

    def candidates(self, query: ast.Query) -> list[tuple[int, int, int]]:
        """(start, replica key, wave) of every trace that may match, newest first."""
        needed = _needed(self.required[0], self.sets)
        for expr in self.required[1:]:
            needed = _combine(needed, _needed(expr, self.sets), both=True)
        out = []
        for key, (waves, starts) in needed.items():
            out += zip(starts.tolist(), [key] * len(waves), waves.tolist(), strict=False)
        out.sort(reverse=True)
        return out


def windows(start_ns: int, end_ns: int, first_ns: int = FIRST_WINDOW_NS):
    """[lo, hi) windows from end_ns back to start_ns, each four times the one before."""
    hi, width = end_ns + 1, first_ns
    while hi > start_ns:
        lo = max(start_ns, hi - width)
        yield lo, hi
        hi, width = lo, width * 4


def _trace_id(key: int, wave: int) -> str:
    return format_trace_id(key << 64 | wave)


def search(
    conn: sqlite3.Connection,
    query: str | ast.Query,
    start_ns: int,
    end_ns: int,
    limit: int = DEFAULT_LIMIT,
    spans_per_spanset: int | None = DEFAULT_SPSS,
    stats: SearchStats | None = None,
) -> list[TraceMatch]:
    """The traces in [start_ns, end_ns] that match a TraceQL search, newest first, at most
    `limit`; each spanset keeps `spans_per_spanset` spans (None: all). At most
    MAX_TRACES_INSPECTED wave traces are built and checked; `stats`, when given, is filled in
    (traces inspected, and whether the cap stopped the search)."""
    stats = stats if stats is not None else SearchStats()
    parsed = parse(query) if isinstance(query, str) else query
    if parsed.metrics is not None:
        raise TraceQLError(f"{parsed.metrics.fn}() is a metrics query; use metrics_range")
    if end_ns < start_ns:
        raise TraceQLError("end is before start")
    if limit < 1:
        raise TraceQLError(f"limit: {limit} must be 1 or more")
    cache = BlockCache(conn)
    finder = CandidatePass(conn, parsed, cache)
    done: set[tuple[int, int]] = set()
    # request traces (telemetry/traceql/requests.py), when the query names request spans
    out: list[TraceMatch] = request_traceql.search(
        conn, parsed, start_ns, end_ns, limit, spans_per_spanset, finder.nodes
    )
    for lo, hi in windows(start_ns, end_ns):
        finder.scan(lo, hi)
        pending = [(key, wave) for _, key, wave in finder.candidates(parsed)]
        pending = [trace for trace in dict.fromkeys(pending) if trace not in done]
        for i, (key, wave) in enumerate(pending):
            if len(done) >= MAX_TRACES_INSPECTED:
                stats.capped = True
                return _newest_first(out)[:limit]
            if i % READ_AHEAD_TRACES == 0:  # the blobs of the next traces, a query per table
                _read_ahead(cache, pending[i : i + min(READ_AHEAD_TRACES, limit - len(out))])
            done.add((key, wave))
            stats.inspected_traces = len(done)
            trace_id = _trace_id(key, wave)
            spans = load_trace_cached(conn, trace_id, cache)
            found = match_trace(parsed, spans, trace_id, spans_per_spanset, finder.nodes)
            if found is not None:
                out.append(found)
                if len(out) >= limit:
                    return _newest_first(out)[:limit]
    return _newest_first(out)[:limit]


def _read_ahead(cache: BlockCache, traces: list[tuple[int, int]]) -> None:
    by_key: dict[int, list[int]] = {}
    for key, wave in traces:
        by_key.setdefault(key, []).append(wave)
    for key, waves in by_key.items():
        cache.read_ahead((rank.id for rank in cache.ranks_of_trace_key(key)), waves)


def _newest_first(matches: list[TraceMatch]) -> list[TraceMatch]:
    return sorted(matches, key=lambda m: m.start_ns, reverse=True)
