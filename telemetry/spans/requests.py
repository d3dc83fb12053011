"""Request traces built on demand from stored request membership: one trace per vLLM request, a
`request` root span with a child per wave the request ran in, linked both ways with the wave
traces (deterministic ids: telemetry/wire/trace_ids.py).

A request that came with a W3C `traceparent` (a gateway's trace, which vLLM's own
`llm_request` span joins as a child) has its root span link to that trace and span
(`traceparent_link`): from the gateway's trace, vLLM's request span and ours share the trace
id, and ours leads on to the waves. The link's flags carry the header's trace flags and mark
the context remote, as OTLP defines them.
"""

from __future__ import annotations

import dataclasses
import re
import sqlite3
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from telemetry.spans.builders import Span, incident_span, rank_end_ns
from telemetry.store import blocks as store_blocks
from telemetry.store import codec as store_codec
from telemetry.store.requests import (
    RequestRow,
    find_requests,
    has_request_tables,
    request_blocks,
    requests_in_waves,
    requests_of_trace,
)
from telemetry.wire import schema
from telemetry.wire.request_columns import entries, flat_per_row
from telemetry.wire.trace_ids import (
    request_incident_span_id,
    request_span_id,
    request_wave_span_id,
    wave_span_id,
    wave_trace_id,
)
from telemetry.wire.traceparent import TraceParent

REQUEST_SPAN = "request"
ATTR_LINK = schema.attr("link")  # on the root's traceparent link: "traceparent"
# OTLP Span.Link.flags: bits 0-7 the W3C trace flags; 0x100 says whether the context is
# remote is known, 0x200 that it is (trace.proto SPAN_FLAGS_CONTEXT_*_MASK)
LINK_REMOTE = 0x100 | 0x200


ATTR_REQUEST = schema.attr("request_id")


# attribute keys of request spans (TraceQL's short names come from these: telemetry/traceql/fields.py)
# a table: one row per line, columns aligned (fmt: skip)
REQUEST_ATTRIBUTE_KEYS = (
    schema.ATTR_RUN, schema.ATTR_ENGINE, schema.ATTR_DP, schema.ATTR_WAVE, schema.ATTR_PP,
    ATTR_REQUEST,
    *(schema.attr(f"request.{name}") for name in (
        "waves", "prefill_waves", "scheduled_tokens", "sampled_tokens", "preemptions", "finished",
        "first_wave", "last_wave", "preempted", "recompute",
    )),
)  # fmt: skip


@dataclasses.dataclass
class RequestWave:
    """One wave one request ran in, on one PP stage."""

    wave: int
    pp: int
    scheduled: int
    sampled: int  # -1: not known (an async output not counted)
    preempted: bool
    kind: str = "decode"  # prefill | decode
    recompute: bool = False  # a prefill after a preemption
    start_ns: int = 0
    end_ns: int = 0


def request_waves(conn: sqlite3.Connection, request: RequestRow) -> list[RequestWave]:
    """The waves one request ran in (on its stage), in wave order, with prefill/decode told
    apart: waves up to and including the first that sampled are prefill, and again after
    each preemption (recompute)."""
    out: dict[int, RequestWave] = {}
    preempted_at: set[int] = set()
    last = request.finished_wave
    for cols in request_blocks(conn, request.rank, request.pid, request.first_wave, last):
        found = entries(cols)
        hit = np.flatnonzero(found.index == request.idx)
        for i in hit:
            wave = int(found.wave[i])
            if last is not None and wave >= last:
                continue
            out[wave] = RequestWave(
                wave, request.pp, int(found.scheduled[i]), int(found.sampled[i]), False
            )
        for wave, numbers in flat_per_row(cols, "preempted_count", "preempted_index"):
            if request.idx in numbers:
                preempted_at.add(wave)
    waves = [out[w] for w in sorted(out)]
    prefill, recompute = True, False
    marks = sorted(preempted_at)  # the wave a preemption was seen at (its own, or its resume)
    before = 0
    for item in waves:
        if any(before < mark <= item.wave for mark in marks):
            item.preempted = True  # the first wave back after it
            prefill, recompute = True, True
        before = item.wave
        item.kind = "prefill" if prefill else "decode"
        item.recompute = recompute and prefill
        if item.sampled > 0:
            prefill = recompute = False
    _wave_times(conn, request, waves)
    return waves


def _wave_times(conn: sqlite3.Connection, request: RequestRow, waves: list[RequestWave]) -> None:
    """Start and end of each wave on the request's rank (from its wave blocks)."""
    if not waves:
        return
    wanted = {w.wave: w for w in waves}
    lo, hi = waves[0].wave, waves[-1].wave
    for (blob,) in conn.execute(
        "SELECT columns FROM wave_blocks WHERE rank = ? AND first_wave <= ? AND last_wave >= ?",
        (request.rank, hi, lo),
    ):
        cols = store_codec.decode_waves(blob)
        for i, number in enumerate(cols.wave):
            item = wanted.get(number)
            if item is not None:
                item.start_ns = cols.start_unix_nano[i]
                item.end_ns = rank_end_ns(cols, i)


@dataclasses.dataclass
class RequestTrace:
    """One request's trace: its stages' rows, the waves it ran in, and its spans."""

    trace_id: int
    requests: list[RequestRow]
    waves: list[RequestWave]
    spans: list[Span]

    @property
    def request_id(self) -> str:
        return self.requests[0].request_id

    def sampled_tokens(self) -> int:
        """Tokens sampled for the request (last PP stage), unknown waves left out."""
        last = max((w.pp for w in self.waves), default=0)
        return sum(w.sampled for w in self.waves if w.pp == last and w.sampled > 0)

    def scheduled_tokens(self) -> int:
        first = min((w.pp for w in self.waves), default=0)
        return sum(w.scheduled for w in self.waves if w.pp == first)


def build_trace(conn: sqlite3.Connection, rows: Sequence[RequestRow]) -> RequestTrace | None:
    """The trace of one request from its stages' rows (all with one trace id)."""
    if not rows:
        return None
    rows = sorted(rows, key=lambda r: r.pp)
    head = rows[0]
    trace_id = head.trace_id
    waves: list[RequestWave] = []
    for row in rows:
        waves += request_waves(conn, row)
    waves.sort(key=lambda w: (w.wave, w.pp))
    starts = [w.start_ns for w in waves if w.start_ns] or [head.start_ns]
    ends = [w.end_ns for w in waves if w.end_ns]
    finished = [r.end_ns for r in rows if r.end_ns]
    start = min(starts)
    end = max([*ends, *finished, start])
    root_id = request_span_id(trace_id)
    common = {
        schema.ATTR_RUN: head.run_id,
        schema.ATTR_ENGINE: head.engine,
        schema.ATTR_DP: head.dp,
        ATTR_REQUEST: head.request_id,
    }
    last_pp = max((w.pp for w in waves), default=0)
    first_pp = min((w.pp for w in waves), default=0)
    root_attrs = {
        **common,
        schema.attr("request.waves"): len({w.wave for w in waves}),
        schema.attr("request.prefill_waves"): sum(
            1 for w in waves if w.kind == "prefill" and w.pp == first_pp
        ),
        schema.attr("request.scheduled_tokens"): sum(
            w.scheduled for w in waves if w.pp == first_pp
        ),
        schema.attr("request.sampled_tokens"): sum(
            w.sampled for w in waves if w.pp == last_pp and w.sampled > 0
        ),
        schema.attr("request.preemptions"): sum(
            1 for w in waves if w.preempted and w.pp == first_pp
        ),
        schema.attr("request.finished"): all(r.finished_wave is not None for r in rows),
    }
    if waves:
        root_attrs[schema.attr("request.first_wave")] = waves[0].wave
        root_attrs[schema.attr("request.last_wave")] = waves[-1].wave
    parent = next((r.traceparent for r in rows if r.traceparent is not None), None)
    spans = [
        Span(
            trace_id,
            root_id,
            None,
            REQUEST_SPAN,
            start,
            end,
            head.run_id,
            head.engine,
            waves[0].wave if waves else head.first_wave,
            head.dp,
            attributes=root_attrs,
            links=[] if parent is None else [traceparent_link(parent)],
        )
    ]
    for item in waves:
        attrs = {
            **common,
            schema.ATTR_WAVE: item.wave,
            schema.ATTR_PP: item.pp,
            schema.attr("request.scheduled_tokens"): item.scheduled,
            schema.attr("request.preempted"): item.preempted,
            schema.attr("request.recompute"): item.recompute,
        }
        if item.sampled >= 0:
            attrs[schema.attr("request.sampled_tokens")] = item.sampled
        link = {
            "trace_id": wave_trace_id(head.run_id, item.wave, head.dp),
            "span_id": wave_span_id(head.run_id, item.wave, head.dp),
            "attributes": {schema.ATTR_WAVE: item.wave},
        }
        spans.append(
            Span(
                trace_id,
                request_wave_span_id(trace_id, item.wave, item.pp),
                root_id,
                item.kind,
                item.start_ns or start,
                item.end_ns or item.start_ns or start,
                head.run_id,
                head.engine,
                item.wave,
                head.dp,
                None,
                item.pp,
                attributes=attrs,
                links=[link],
            )
        )
    for incident in _incidents(conn, head):
        span = incident_span(incident)
        span.trace_id = trace_id
        span.span_id = request_incident_span_id(trace_id, incident["id"])
        span.parent_id = root_id
        span.attributes[ATTR_REQUEST] = head.request_id
        span.links = [
            {
                "trace_id": wave_trace_id(head.run_id, span.wave, head.dp),
                "span_id": wave_span_id(head.run_id, span.wave, head.dp),
            }
        ]
        spans.append(span)
    spans.sort(key=lambda s: (s.start_ns, s.name != REQUEST_SPAN, s.name))
    return RequestTrace(trace_id, list(rows), waves, spans)


def traceparent_link(parent: TraceParent) -> dict[str, Any]:
    """The root span's link to the trace and span a request's traceparent names."""
    return {
        "trace_id": parent.trace_id,
        "span_id": parent.span_id,
        "flags": (parent.flags & 0xFF) | LINK_REMOTE,
        "attributes": {ATTR_LINK: "traceparent"},
    }


def _incidents(conn: sqlite3.Connection, request: RequestRow) -> list[sqlite3.Row]:
    try:
        return conn.execute(
            "SELECT * FROM incidents WHERE request_id = ? AND run_id = ? AND engine = ? "
            "AND (dp = ? OR dp IS NULL) ORDER BY time_ns",
            (request.request_id, request.run_id, request.engine, request.dp),
        ).fetchall()
    except sqlite3.OperationalError:
        return []


def group_by_trace(rows: Iterable[RequestRow]) -> list[list[RequestRow]]:
    groups: dict[int, list[RequestRow]] = {}
    for row in rows:
        groups.setdefault(row.trace_id, []).append(row)
    return list(groups.values())


def load_request_trace(conn: sqlite3.Connection, trace_id: str) -> list[Span]:
    """Every span of one request trace by id ([] when no request has that id)."""
    text = trace_id.strip().lower()
    if not re.fullmatch(r"[0-9a-f]{32}", text):
        return []
    built = build_trace(conn, requests_of_trace(conn, int(text, 16)))
    return built.spans if built is not None else []


def request_traces(
    conn: sqlite3.Connection, text: str, *, run_id: str | None = None, engine: str | None = None
) -> list[RequestTrace]:
    """The traces of the requests a user's id names (see `find_requests`), newest first."""
    out = []
    for group in group_by_trace(find_requests(conn, text, run_id=run_id, engine=engine)):
        built = build_trace(conn, requests_of_trace(conn, group[0].trace_id))
        if built is not None:
            out.append(built)
    return out


# -- wave spans link to their requests ------------------------------------------------------------
MAX_LINKS = 1024  # links added to one wave span


def link_wave_spans(conn: sqlite3.Connection, spans: list[Span]) -> None:
    """Add to each `wave` root span links to the request traces of the requests it ran."""
    roots = [s for s in spans if s.name == "wave" and s.parent_id is None]
    found = wave_links(conn, [(s.trace_id, s.wave) for s in roots])
    for span in roots:
        span.links.extend(found.get(span.trace_id, ()))


def wave_links(conn: sqlite3.Connection, roots: list[tuple[int, int]]) -> dict[int, list[dict]]:
    """The links of wave roots, given as (trace id, wave), to the request traces of the
    requests each ran: {trace id: links}, only roots that ran a request.

    Roots are taken by replica (the high half of their trace id, which the replica's ranks
    keep), and each replica's request blocks over the roots' waves are read once."""
    out: dict[int, list[dict]] = {}
    if not roots or not has_request_tables(conn):
        return out
    replicas: dict[int, list[tuple[int, int]]] = {}
    for trace_id, wave in roots:
        replicas.setdefault(trace_id >> 64, []).append((trace_id, wave))
    for trace_key, members in replicas.items():
        first, last = min(w for _, w in members), max(w for _, w in members)
        ran: dict[int, list[tuple[int, str]]] = {}
        for rank in store_blocks.ranks_of_trace_key(conn, trace_key):
            if rank.tp != 0:  # membership comes from each stage's tp0 rank
                continue
            for wave, found in requests_in_waves(conn, rank.id, first, last).items():
                ran.setdefault(wave, []).extend(found)
        for trace_id, wave in members:
            seen: set[int] = set()
            links = []
            for trace, req_id in ran.get(wave, ()):
                if trace in seen or len(seen) >= MAX_LINKS:
                    continue
                seen.add(trace)
                links.append(
                    {
                        "trace_id": trace,
                        "span_id": request_span_id(trace),
                        "attributes": {ATTR_REQUEST: req_id},
                    }
                )
            if links:
                out[trace_id] = links
    return out


def spans_in_range(
    conn: sqlite3.Connection, start_ns: int, end_ns: int, request_id: str | None, limit: int
) -> Iterable[list[Span]]:
    """Request traces (their spans) whose request started in [start_ns, end_ns], newest
    first; only `request_id`'s (exact) when given. For TraceQL (telemetry/traceql/search.py)."""
    if not has_request_tables(conn):
        return
    where = "q.start_ns >= ? AND q.start_ns <= ?"
    params: list[Any] = [start_ns, end_ns]
    if request_id is not None:
        where += " AND q.request_id = ?"
        params.append(request_id)
    rows = conn.execute(
        f"SELECT DISTINCT q.trace_hi, q.trace_lo FROM requests q WHERE {where} "
        "ORDER BY q.start_ns DESC LIMIT ?",
        (*params, limit),
    ).fetchall()
    for hi, lo in rows:
        built = build_trace(conn, requests_of_trace(conn, (hi % 2**64) << 64 | (lo % 2**64)))
        if built is not None:
            yield built.spans
