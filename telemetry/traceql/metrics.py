"""TraceQL metrics over the store: `rate()`, `count_over_time()`, `quantile_over_time()` and
the other `*_over_time` functions, each with `by(...)`, as series for `/api/metrics/query_range`.

A span counts in the step its start falls in. Steps are aligned to multiples of `step_ns`;
a sample's time is its step's start. rate and count_over_time give every step of a series (0
where nothing matched); the others only steps with spans. Durations come out in seconds, as
Tempo gives them.

A query whose spanset is one `{ }` filter on span fields (the usual metrics query) is answered
from block columns without building a span; any other shape runs the search's exact pass on
each candidate trace. In the first shape, rate, count_over_time and
quantile_over_time(duration) read a wave block's stored duration histogram
(telemetry/store/block_summary.py) instead of its columns where the whole block answers alike: every
span of the phase on that rank matches the filter whatever its values (`{ name =
"execute_model" }`, `{ .tp = 1 }`), the `by()` labels are the rank's own, and the block lies
inside the range and inside one step. Only the blocks at the range's ends and those across a
step boundary are decoded. Counts stay exact; a quantile of a step that used a histogram is read
off the merged buckets and is within one bucket (block_summary.RELATIVE_WIDTH, 4.4 %) of the
exact value; a step whose spans were all decoded keeps the exact quantile (numpy's linear
interpolation). `{ }` alone is not read from histograms: incidents and collectives match it too
and are decoded as before.
"""

from __future__ import annotations

import dataclasses
import sqlite3

import numpy as np

from telemetry import store
from telemetry.store import block_summary
from telemetry.traceql import ast
from telemetry.traceql.columns import ABSENT, UNKNOWN, Prefixed, mask_of, maybe, value_of
from telemetry.traceql.evaluate import TraceView, run_pipeline
from telemetry.traceql.parser import TraceQLError, parse
from telemetry.traceql.plan import known_values, uses_trace_level
from telemetry.traceql.search import CandidatePass, _trace_id
from telemetry.traceql.source import (
    WAVE_KINDS,
    BlockCache,
    BlockTable,
    CollectiveTable,
    SpanTable,
    block_template,
    collective_blocks_in,
    incident_spans,
    load_trace_cached,
    slow_call_spans_in,
)

HISTOGRAM_LABEL = "__bucket"  # Tempo's label for histogram_over_time's buckets
MAX_STEPS = 11_000  # as Prometheus: more points than a panel can show is a mistake
_DURATION_FIELDS = (ast.Intrinsic("duration"), ast.Intrinsic("traceDuration"))


@dataclasses.dataclass
class Series:
    labels: dict[str, object]
    samples: list[tuple[int, float]]  # (step start in unix ns, value)


class _Collector:
    """Matched spans' (start, value) per group of `by()` labels, gathered a block at a time:
    a label that is one value over the block (a rank's coordinates) costs nothing per span."""

    def __init__(self, metric: ast.MetricsAggregate) -> None:
        self.metric = metric
        self.groups: dict[tuple, list[tuple[np.ndarray, np.ndarray]]] = {}
        # labels -> [(step indexes, [steps, BUCKETS] duration counts)] from block histograms
        self.histograms: dict[tuple, list[tuple[np.ndarray, np.ndarray]]] = {}

    def add_histograms(self, labels: tuple, steps: np.ndarray, blobs: list) -> None:
        """Stored block histograms, block i counted in step index steps[i]."""
        if not len(blobs):
            return
        unique, where = np.unique(steps, return_inverse=True)
        counts = block_summary.accumulate(blobs, where, len(unique))
        self.histograms.setdefault(labels, []).append((unique, counts))

    def add_matched(self, labels: tuple, starts: np.ndarray, durations_ns: np.ndarray) -> None:
        """Spans known to match, all with these by() labels (a kind whose block histograms
        stand for its spans, in a block that must be decoded): what `add` gives them, without
        evaluating the filter or the labels span by span."""
        if not len(starts):
            return
        field = self.metric.field
        values = np.zeros(len(starts)) if field is None else durations_ns / 1e9
        self.groups.setdefault(labels, []).append((starts, values))

    def _values(self, table, rows: np.ndarray) -> np.ndarray:
        n = len(rows)
        if self.metric.field is None:
            return np.zeros(n)
        values, present = value_of(self.metric.field, table)
        present = np.broadcast_to(present, (table.n,))[rows]
        if isinstance(values, np.ndarray) and values.dtype.kind in "iuf":
            out = values[rows].astype(float)
        elif not isinstance(values, np.ndarray):
            number = isinstance(values, (int, float, np.number)) and not isinstance(values, bool)
            out = np.full(n, float(values) if number else np.nan)
        else:
            out = np.array(
                [
                    float(v)
                    if isinstance(v, (int, float, np.number)) and not isinstance(v, bool)
                    else np.nan
                    for v in values[rows]
                ],
                float,
            )
        out[~present] = np.nan
        if self.metric.field in _DURATION_FIELDS:
            out /= 1e9
        return out

    def add(self, table, rows: np.ndarray, starts) -> None:
        if not len(rows):
            return
        n = len(rows)
        starts = starts[rows] if np.ndim(starts) else np.full(n, starts)
        values = self._values(table, rows)
        labels: list = []  # per by-field: one value for every row, or an array
        constant = True
        for field in self.metric.by:
            column, present = value_of(field, table)
            if not isinstance(column, np.ndarray) and np.ndim(present) == 0:
                labels.append(_plain(column) if present else None)
                continue
            constant = False
            column = np.broadcast_to(np.asarray(column, dtype=object), (table.n,))[rows]
            present = np.broadcast_to(present, (table.n,))[rows]
            labels.append([_plain(v) if p else None for v, p in zip(column, present, strict=True)])
        if constant:
            self.groups.setdefault(tuple(labels), []).append((starts, values))
            return
        keys = list(
            zip(*(lab if isinstance(lab, list) else [lab] * n for lab in labels), strict=True)
        )
        members: dict[tuple, list[int]] = {}
        for i, key in enumerate(keys):
            members.setdefault(key, []).append(i)
        for key, idx in members.items():
            self.groups.setdefault(key, []).append((starts[idx], values[idx]))

    def series(self, start_ns: int, end_ns: int, step_ns: int) -> list[Series]:
        metric = self.metric
        base = start_ns - start_ns % step_ns
        steps = (end_ns - base) // step_ns + 1
        out = []
        names = [str(f) for f in metric.by]
        keys = set(self.groups) | set(self.histograms)
        for group in sorted(keys, key=repr):
            parts = self.groups.get(group, [])
            labels = dict(zip(names, group, strict=True))
            b = (np.concatenate([p[0] for p in parts] or [[]]).astype(np.int64) - base) // step_ns
            v = np.concatenate([p[1] for p in parts] or [[]]).astype(float)
            hist = self._step_histograms(group)
            if metric.fn in ("rate", "count_over_time"):
                counts = np.bincount(b, minlength=steps)[:steps]
                for k, h in hist.items():
                    counts[k] += int(h.sum())
                scale = 1e9 / step_ns if metric.fn == "rate" else 1.0
                samples = [(base + k * step_ns, float(c) * scale) for k, c in enumerate(counts)]
                out.append(Series(labels, samples))
                continue
            keep = ~np.isnan(v)
            b, v = b[keep], v[keep]
            if metric.fn == "histogram_over_time":
                out += self._histogram(labels, b, v, base, step_ns)
                continue
            order = np.argsort(b, kind="stable")
            b, v = b[order], v[order]
            cuts = np.flatnonzero(np.diff(b)) + 1
            chunks = list(zip(np.split(b, cuts), np.split(v, cuts), strict=True)) if len(b) else []
            if metric.fn == "quantile_over_time":
                exact = {int(kb[0]): kv for kb, kv in chunks}
                for q in metric.quantiles:
                    samples = []
                    for k in sorted(set(exact) | set(hist)):
                        if k not in hist:
                            samples.append((base + k * step_ns, float(np.quantile(exact[k], q))))
                            continue
                        counts = hist[k].copy()
                        if k in exact:  # decoded spans of the step join the buckets
                            ns = exact[k] * 1e9
                            counts += np.bincount(
                                block_summary.bucket_of(ns), minlength=block_summary.BUCKETS
                            )
                        value = block_summary.quantile(counts, q) / 1e9
                        samples.append((base + k * step_ns, value))
                    out.append(Series({**labels, "p": q}, samples))
                continue
            reduce = {
                "min_over_time": np.min,
                "max_over_time": np.max,
                "avg_over_time": np.mean,
                "sum_over_time": np.sum,
            }[metric.fn]
            samples = [(base + int(kb[0]) * step_ns, float(reduce(kv))) for kb, kv in chunks]
            out.append(Series(labels, samples))
        return out

    def _histogram(
        self, labels: dict, steps: np.ndarray, values: np.ndarray, base: int, step_ns: int
    ):
        """histogram_over_time: per power-of-two bucket (Tempo's `__bucket` label: the bucket's
        upper bound, in seconds for durations), the count of each step that has spans. A value
        below 2 (ns, for durations) has no bucket, as in Tempo."""
        duration = self.metric.field in _DURATION_FIELDS
        raw = np.rint(values * 1e9) if duration else values
        by_bucket: dict[float, list[int]] = {}
        for step, value in zip(steps.tolist(), raw.tolist(), strict=True):
            if not value >= 2 or value != value or value == float("inf"):
                continue
            bucket = 1 << (int(value) - 1).bit_length()
            if int(value) != value and bucket == value:  # 2^k + a fraction: the next bucket up
                bucket <<= 1
            label = bucket / 1e9 if duration else float(bucket)
            by_bucket.setdefault(label, []).append(step)
        out = []
        for label in sorted(by_bucket):
            counts = np.bincount(np.array(by_bucket[label], np.int64))
            samples = [(base + k * step_ns, float(c)) for k, c in enumerate(counts) if c]
            out.append(Series({**labels, HISTOGRAM_LABEL: label}, samples))
        return out

    def _step_histograms(self, group: tuple) -> dict[int, np.ndarray]:
        out: dict[int, np.ndarray] = {}
        for unique, counts in self.histograms.get(group, []):
            for k, row in zip(unique.tolist(), counts, strict=True):
                if k in out:
                    out[k] = out[k] + row
                else:
                    out[k] = row
        return out


def _plain(value):
    return value.item() if isinstance(value, np.generic) else value


def _fast(query: ast.Query) -> bool:
    spanset = query.spanset
    return (
        not query.stages
        and isinstance(spanset, ast.SpansetFilter)
        and not uses_trace_level(spanset.expr)
        and not any(uses_trace_level(f) for f in query.metrics.by)
        and not (query.metrics.field is not None and uses_trace_level(query.metrics.field))
    )


def metrics_range(
    conn: sqlite3.Connection,
    query: str | ast.Query,
    start_ns: int,
    end_ns: int,
    step_ns: int,
    *,
    summaries: bool = True,
) -> list[Series]:
    """The series a TraceQL metrics query gives over [start_ns, end_ns] in steps of step_ns
    (`summaries=False`: decode every block, for exact quantiles)."""
    parsed = parse(query) if isinstance(query, str) else query
    if parsed.metrics is None:
        raise TraceQLError("not a metrics query: end it with | rate(), count_over_time(), ...")
    if step_ns <= 0:
        raise TraceQLError(f"step: {step_ns} ns must be positive")
    if end_ns < start_ns:
        raise TraceQLError("end is before start")
    if (end_ns - start_ns) // step_ns > MAX_STEPS:
        raise TraceQLError(f"step: more than {MAX_STEPS} steps; use a longer step")
    collector = _Collector(parsed.metrics)
    cache = BlockCache(conn)
    finder = CandidatePass(conn, parsed, cache)
    lo, hi = start_ns, end_ns + 1
    if _fast(parsed):
        base = start_ns - start_ns % step_ns
        _scan_fast(finder, collector, lo, hi, base, step_ns, summaries)
    else:
        finder.scan(lo, hi)
        for _, key, wave in finder.candidates(parsed):
            spans = load_trace_cached(conn, _trace_id(key, wave), cache)
            if not spans:
                continue
            spans = sorted(spans, key=lambda s: (s.start_ns, s.name))
            view = TraceView(spans, finder.nodes)
            sets, _ = run_pipeline(parsed, view)
            rows = sorted({r for members, _ in sets for r in members})
            rows = [r for r in rows if lo <= spans[r].start_ns < hi]
            if rows:
                table = view.sub_table(rows)
                starts = np.array([spans[r].start_ns for r in rows], np.int64)
                collector.add(table, np.arange(len(rows)), starts)
    return collector.series(start_ns, end_ns, step_ns)


# span kind -> the stored histogram of its durations (the wave root lasts what tp0's rank does)
_HISTOGRAM_OF = {
    "wave": "rank",
    "rank": "rank",
    "execute_model": "execute_model",
    "sample_tokens": "sample_tokens",
}


def _summary_labels(plan, metric: ast.MetricsAggregate, kind: str, rank) -> tuple | None:
    """The by() labels every span of `kind` on `rank` has, if its block histograms can stand
    for its spans (every such span matches, the labels are the rank's own); else None."""
    if metric.fn not in ("rate", "count_over_time", "quantile_over_time"):
        return None
    if metric.fn == "quantile_over_time" and metric.field != ast.Intrinsic("duration"):
        return None
    if plan.expr is None:  # `{ }`: cheap to decode, and nothing to gain
        return None
    known = known_values(kind, rank)
    if maybe(plan.expr, known) is not True:
        return None
    labels = []
    for field in metric.by:
        value = known(field)
        if value is UNKNOWN or isinstance(value, Prefixed):
            return None
        labels.append(None if value is ABSENT else value)
    return tuple(labels)


def _scan_fast(
    finder: CandidatePass,
    collector: _Collector,
    lo: int,
    hi: int,
    base: int,
    step_ns: int,
    summaries: bool = True,
) -> None:
    (plan,) = finder.plans
    conn = finder.conn
    wave_ranks = [rid for rid, kinds in plan.kinds.items() if kinds & set(WAVE_KINDS)]
    for rank_id in wave_ranks:
        rank = finder.ranks[rank_id]
        kinds = [k for k in WAVE_KINDS if k in plan.kinds[rank_id]]
        read: dict[str, set[int]] = {}  # kind -> rowids answered from histograms
        matched: dict[str, tuple] = {}  # kind -> by() labels: its every span matches
        starting: set[int] = set()  # rowids of the blocks that start in the range
        for kind in kinds:
            labels = _summary_labels(plan, collector.metric, kind, rank) if summaries else None
            if labels is None:
                continue
            matched[kind] = labels
            found = store.wave_histograms(conn, (rank_id,), _HISTOGRAM_OF[kind], lo, hi)
            first_step = (found.start_ns - base) // step_ns
            whole = (
                np.array([b is not None for b in found.blobs], bool)
                & (found.end_ns < hi)
                & (first_step == (found.end_ns - base) // step_ns)
            )
            rows = np.flatnonzero(whole)
            collector.add_histograms(labels, first_step[rows], [found.blobs[i] for i in rows])
            read[kind] = set(found.rowid[rows].tolist())
            starting |= set(found.rowid.tolist())
        if read and len(read) == len(kinds):
            # every kind from histograms: decode only the blocks starting in the range that
            # one did not cover (across a step or the range's end, no histogram), and those
            # that began before the range
            wanted = set().union(*(starting - r for r in read.values()))
            blocks = list(store.blocks_by_time(conn, store.WAVE_BLOCKS, (rank_id,), lo, lo - 1))
            blocks += store.blocks_by_rowid(conn, store.WAVE_BLOCKS, sorted(wanted))
        else:
            blocks = store.blocks_by_time(
                conn, store.WAVE_BLOCKS, (rank_id,), lo, hi - 1, min_ns=plan.min_step_ns
            )
        for block in blocks:
            left = [k for k in kinds if block.rowid not in read.get(k, ())]
            if not left:
                continue
            cols = store.block_columns(conn, block)
            for kind in left:
                if kind in matched:  # no filter or label to evaluate: starts and durations
                    table = BlockTable(rank, cols, kind)
                    keep = table.exists & (table.start >= lo) & (table.start < hi)
                    starts = table.start[keep]
                    collector.add_matched(matched[kind], starts, table.end[keep] - starts)
                    continue
                template = block_template(rank, cols, kind)
                if template is None:
                    continue
                table = BlockTable(rank, cols, kind, template, conn)
                keep = mask_of(plan.expr, table) & table.exists
                keep &= (table.start >= lo) & (table.start < hi)
                collector.add(table, np.flatnonzero(keep), table.start)
    for rank_id, kinds in plan.kinds.items():
        if "collective" in kinds:
            for _, cols in collective_blocks_in(conn, (rank_id,), lo, hi - 1, plan.min_step_ns):
                table = CollectiveTable(finder.ranks[rank_id], cols=cols)
                keep = mask_of(plan.expr, table) & (table.start >= lo) & (table.start < hi)
                collector.add(table, np.flatnonzero(keep), table.start)
    slow = {rid: finder.ranks[rid] for rid, kinds in plan.kinds.items() if "slow_call" in kinds}
    spans = slow_call_spans_in(conn, slow, lo, hi - 1) if slow else []
    spans += incident_spans(conn, lo, hi - 1) if plan.incidents else []
    spans = [s for s in spans if lo <= s.start_ns < hi]
    if spans:
        table = SpanTable(spans, nodes=finder.nodes)
        starts = np.array([s.start_ns for s in spans], np.int64)
        collector.add(table, np.flatnonzero(mask_of(plan.expr, table)), starts)
