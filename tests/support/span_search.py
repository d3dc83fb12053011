"""A second, row-by-row search of stored spans by the filter flags: the oracle the TraceQL search
and the span list are checked against in tests (production answers the flags with TraceQL).
"""

from __future__ import annotations

import dataclasses
import heapq
import sqlite3

import numpy as np

from telemetry import store
from telemetry.cli.args import SORT_KEYS
from telemetry.spans.builders import (
    Span,
    is_root_rank,
    wave_spans,
)
from telemetry.spans.query import QueryError
from telemetry.wire.schema import WAVE_SPAN_NAMES


@dataclasses.dataclass
class SpanQuery:
    since_ns: int | None = None
    until_ns: int | None = None
    min_duration_ns: int | None = None
    rank: dict[str, int] = dataclasses.field(default_factory=dict)
    name: str | None = None
    run_id: str | None = None
    engine: str | None = None
    wave: int | None = None
    sort: str = "duration"
    limit: int = 20

    def validate(self) -> None:
        if self.name is not None and self.name not in WAVE_SPAN_NAMES:
            raise QueryError(
                f"--name: {self.name!r} is not a span name; one of {', '.join(WAVE_SPAN_NAMES)}"
            )
        if self.sort not in SORT_KEYS:
            raise QueryError(f"--sort: {self.sort!r}; one of {', '.join(SORT_KEYS)}")
        if self.limit < 1:
            raise QueryError(f"--limit: {self.limit} must be 1 or more")
        if (
            self.since_ns is not None
            and self.until_ns is not None
            and self.since_ns > self.until_ns
        ):
            raise QueryError("--since is later than --until")


def _rank_filter(query: SpanQuery) -> tuple[str, list]:
    where, params = [], []
    for coord, value in query.rank.items():
        where.append(f"ranks.{coord} = ?")
        params.append(value)
    if query.run_id is not None:
        where.append("runs.run_id = ?")
        params.append(query.run_id)
    if query.engine is not None:
        where.append("ranks.engine = ?")
        params.append(query.engine)
    return " AND ".join(where), params


def _candidates(rank: store.RankRow, cols, names: tuple[str, ...], query: SpanQuery):
    """(sort key, name, index) of the waves in one block whose spans match the query."""
    n = len(cols.wave)
    start = np.array(cols.start_unix_nano, np.int64)
    execute = np.array(cols.execute_ns, np.int64)
    sample = np.array(cols.sample_ns, np.int64)
    offset = np.array(cols.sample_offset_ns, np.int64)
    sampled = np.array(cols.sampled, bool)
    wave = np.array(cols.wave, np.int64)
    end = np.where(sampled, np.maximum(start + execute, start + offset + sample), start + execute)
    for name in names:
        if name in ("rank", "wave"):
            if name == "wave" and (query.rank or not is_root_rank(rank)):
                continue
            span_start, duration, ok = start, end - start, np.ones(n, bool)
        elif name == "execute_model":
            span_start, duration, ok = start, execute, np.ones(n, bool)
        else:
            span_start, duration, ok = start + offset, sample, sampled.copy()
        if query.since_ns is not None:
            ok &= span_start >= query.since_ns
        if query.until_ns is not None:
            ok &= span_start <= query.until_ns
        if query.min_duration_ns is not None:
            ok &= duration >= query.min_duration_ns
        if query.wave is not None:
            ok &= wave == query.wave
        key = {"duration": duration, "start": span_start, "wave": wave}[query.sort]
        for i in np.flatnonzero(ok)[np.argsort(-key[ok], kind="stable")][: query.limit]:
            yield int(key[i]), name, int(i)


def search(conn: sqlite3.Connection, query: SpanQuery) -> list[Span]:
    """The spans that match, best first by `query.sort`, at most `query.limit`."""
    query.validate()
    where, params = _rank_filter(query)
    ranks = {r.id: r for r in store.ranks(conn, where, params)}
    names = (query.name,) if query.name else WAVE_SPAN_NAMES
    best: list[tuple] = []  # min-heap of (key, tiebreak, rank id, name, index, cols)
    counter = 0
    for rank_id, cols in store.wave_blocks(
        conn,
        list(ranks),
        since_ns=query.since_ns,
        until_ns=query.until_ns,
        min_step_ns=query.min_duration_ns,
        wave=query.wave,
    ):
        for key, name, index in _candidates(ranks[rank_id], cols, names, query):
            counter += 1
            entry = (key, -counter, rank_id, name, index, cols)
            if len(best) < query.limit:
                heapq.heappush(best, entry)
            elif entry[:2] > best[0][:2]:
                heapq.heapreplace(best, entry)
    out = []
    for _, _, rank_id, name, index, cols in sorted(best, key=lambda e: e[:2], reverse=True):
        (span,) = wave_spans(ranks[rank_id], cols, index, frozenset((name,)))
        out.append(span)
    return out
