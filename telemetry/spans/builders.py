"""Spans built on demand from stored rows: one builder for the CLI and the OTLP exporter.

Nothing stores spans. `ascend-guard trace` and `query` read wave blocks, collective blocks and
incidents from the store and call the functions here; the OTLP exporter calls the same
functions on the same rows (a batch's columns, before or after they reach the store), so both
produce the same spans with the same ids (telemetry/wire/trace_ids.py).

Span status: an incident span has status "error", and so do the rank span it hangs under and
its wave's root (`mark_errors`, applied where a whole trace is put together); every other span
is "unset". Span names: `wave`, `rank`, `execute_model`, `sample_tokens`, `collective:<op>` (a
rank's calls of one (op, group) in one wave, aggregated), `slow_call:<op>` (one call the worker
recorded as slow, under its (op, group)'s collective span), `incident:<type>`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from telemetry.store import RankRow
from telemetry.wire import schema
from telemetry.wire.proto import guard_pb2
from telemetry.wire.trace_ids import (
    format_span_id,
    format_trace_id,
    incident_span_id,
    phase_span_id,
    rank_span_id,
    wave_span_id,
    wave_trace_id,
)

STATUS_UNSET = "unset"
STATUS_ERROR = "error"
SLOW_CALL_PREFIX = "slow_call:"


@dataclasses.dataclass
class Span:
    trace_id: int
    span_id: int
    parent_id: int | None
    name: str
    start_ns: int
    end_ns: int
    run_id: str
    engine: str
    wave: int
    dp: int | None = None  # None: the wave root, which belongs to no one rank
    tp: int | None = None
    pp: int | None = None
    attributes: dict[str, Any] = dataclasses.field(default_factory=dict)
    events: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # span links: {"trace_id": int, "span_id": int, "attributes": {...}, "flags": int (OTLP
    # Span.Link.flags; optional)} (request traces)
    links: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    status: str = STATUS_UNSET  # STATUS_ERROR: an incident, or a rank / wave that raised one

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def trace_hex(self) -> str:
        return format_trace_id(self.trace_id)

    @property
    def span_hex(self) -> str:
        return format_span_id(self.span_id)

    @property
    def parent_hex(self) -> str | None:
        return format_span_id(self.parent_id) if self.parent_id is not None else None


def is_root_rank(rank: RankRow) -> bool:
    """The rank whose row also yields its replica's wave root span."""
    return rank.tp == 0 and rank.pp == 0


def rank_end_ns(cols: guard_pb2.WaveColumns, i: int) -> int:
    start = cols.start_unix_nano[i]
    end = start + cols.execute_ns[i]
    if cols.sampled[i]:
        end = max(end, start + cols.sample_offset_ns[i] + cols.sample_ns[i])
    return end


def wave_spans(
    rank: RankRow, cols: guard_pb2.WaveColumns, i: int, names: frozenset[str] | None = None
) -> list[Span]:
    """The spans of wave `i` of these columns on this rank (optionally only `names`)."""
    run_id, wave = rank.run_id, cols.wave[i]
    start = cols.start_unix_nano[i]
    end = rank_end_ns(cols, i)
    trace_id = wave_trace_id(run_id, wave, rank.dp)
    common = {schema.ATTR_RUN: run_id, schema.ATTR_ENGINE: rank.engine, schema.ATTR_WAVE: wave}
    coords = {schema.ATTR_DP: rank.dp, schema.ATTR_TP: rank.tp, schema.ATTR_PP: rank.pp}
    out: list[Span] = []
    root_id = wave_span_id(run_id, wave, rank.dp)

    def want(name: str) -> bool:
        return names is None or name in names

    if is_root_rank(rank) and want("wave"):
        attrs = {**common, **{key: _value(cols, f, i) for key, f in _WAVE_SPAN_KEYS}}
        out.append(
            Span(
                trace_id,
                root_id,
                None,
                "wave",
                start,
                end,
                run_id,
                rank.engine,
                wave,
                attributes=attrs,
            )
        )
    rank_id = rank_span_id(run_id, wave, rank.dp, rank.tp, rank.pp)
    where = (rank.dp, rank.tp, rank.pp)
    if want("rank"):
        attrs = {**common, **coords, schema.ATTR_NODE: rank.node, schema.ATTR_PID: rank.pid}
        attrs.update({key: _value(cols, f, i) for key, f in _RANK_SPAN_KEYS})
        out.append(
            Span(
                trace_id,
                rank_id,
                root_id,
                "rank",
                start,
                end,
                run_id,
                rank.engine,
                wave,
                *where,
                attributes=attrs,
            )
        )
    phase_attrs = {**common, **coords}
    if want("execute_model"):
        out.append(
            Span(
                trace_id,
                phase_span_id(run_id, wave, *where, "execute_model"),
                rank_id,
                "execute_model",
                start,
                start + cols.execute_ns[i],
                run_id,
                rank.engine,
                wave,
                *where,
                attributes=dict(phase_attrs),
            )
        )
    if cols.sampled[i] and want("sample_tokens"):
        sample_start = start + cols.sample_offset_ns[i]
        out.append(
            Span(
                trace_id,
                phase_span_id(run_id, wave, *where, "sample_tokens"),
                rank_id,
                "sample_tokens",
                sample_start,
                sample_start + cols.sample_ns[i],
                run_id,
                rank.engine,
                wave,
                *where,
                attributes=dict(phase_attrs),
            )
        )
    return out


def _value(cols: guard_pb2.WaveColumns, field: str, i: int):
    return getattr(cols, field)[i]


# per-wave collective aggregates each collective span carries (`ascend_guard.collective.<f>`):
# how long the rank waited in its collectives that wave, the fire drill's delay, calls dropped
COLLECTIVE_WAVE_SPAN_FIELDS = ("wait_ns", "injected_delay_ns", "slow_calls_dropped")
# (attribute key, field) of what the builders copy, made once: a query builds spans by the
# thousand
_WAVE_SPAN_KEYS = tuple((schema.attr(f), f) for f in schema.WAVE_SPAN_FIELDS)
_RANK_SPAN_KEYS = tuple((schema.attr(f), f) for f in schema.RANK_SPAN_FIELDS)
_STAT_KEYS = tuple((schema.attr(f"collective.{f}"), f) for f in schema.COLLECTIVE_STAT_FIELDS)
_WAVE_STAT_KEYS = tuple((schema.attr(f"collective.{f}"), f) for f in COLLECTIVE_WAVE_SPAN_FIELDS)


def collective_spans(rank: RankRow, cw: guard_pb2.CollectiveWave) -> list[Span]:
    """One span per (op, group) the rank ran in the wave, under its rank span. The calls of one
    wave are aggregated on the worker: the span starts at the wave's first collective and
    lasts the host time inside that (op, group)."""
    run_id, wave = rank.run_id, cw.wave
    trace_id = wave_trace_id(run_id, wave, rank.dp)
    parent = rank_span_id(run_id, wave, rank.dp, rank.tp, rank.pp)
    where = (rank.dp, rank.tp, rank.pp)
    out = []
    for stat in cw.stats:
        start = cw.first_arrival_unix_nano
        attrs = {
            schema.ATTR_RUN: run_id,
            schema.ATTR_ENGINE: rank.engine,
            schema.ATTR_WAVE: wave,
            schema.ATTR_DP: rank.dp,
            schema.ATTR_TP: rank.tp,
            schema.ATTR_PP: rank.pp,
            **{key: getattr(stat, f) for key, f in _STAT_KEYS},
            # the rank's wave as a whole, on each of its (op, group) spans
            **{key: getattr(cw, f) for key, f in _WAVE_STAT_KEYS},
        }
        span_id = phase_span_id(run_id, wave, *where, f"collective/{stat.op}/{stat.group}")
        out.append(
            Span(
                trace_id,
                span_id,
                parent,
                f"collective:{stat.op}",
                start,
                start + stat.host_ns,
                run_id,
                rank.engine,
                wave,
                *where,
                attributes=attrs,
            )
        )
    return out


def slow_call_spans(rank: RankRow, cw: guard_pb2.CollectiveWave) -> list[Span]:
    """One span per slow call the rank recorded in the wave (`slow_call:<op>`), under the
    collective span of its (op, group): it lasts that one call's host time."""
    run_id, wave = rank.run_id, cw.wave
    trace_id = wave_trace_id(run_id, wave, rank.dp)
    where = (rank.dp, rank.tp, rank.pp)
    out = []
    for call in cw.slow_calls:
        out.append(slow_call_span(rank, trace_id, wave, call, where))
    return out


def slow_call_span(rank: RankRow, trace_id: int, wave: int, call, where: tuple) -> Span:
    """The span of one slow call (`call` has CollectiveCall's fields: a message or a row)."""
    run_id = rank.run_id
    parent = phase_span_id(run_id, wave, *where, f"collective/{call.op}/{call.group}")
    attrs = {
        schema.ATTR_RUN: run_id,
        schema.ATTR_ENGINE: rank.engine,
        schema.ATTR_WAVE: wave,
        schema.ATTR_DP: rank.dp,
        schema.ATTR_TP: rank.tp,
        schema.ATTR_PP: rank.pp,
        **{key: getattr(call, f) for key, f in _SLOW_CALL_KEYS},
    }
    return Span(
        trace_id,
        slow_call_span_id(run_id, wave, where, call.op, call.group, call.seq),
        parent,
        f"{SLOW_CALL_PREFIX}{call.op}",
        call.start_unix_nano,
        call.start_unix_nano + call.host_ns,
        run_id,
        rank.engine,
        wave,
        *where,
        attributes=attrs,
    )


def slow_call_span_id(run_id: str, wave: int, where: tuple, op: str, group: str, seq: int) -> int:
    """The span id of one slow call; `where` is (dp, tp, pp)."""
    return phase_span_id(run_id, wave, *where, f"slow_call/{op}/{group}/{seq}")


# a slow call's attributes (as `ascend_guard.collective.<field>`); its time is the span's own
SLOW_CALL_FIELDS = ("op", "group", "backend", "dtype", "seq", "bytes")
_SLOW_CALL_KEYS = tuple((schema.attr(f"collective.{f}"), f) for f in SLOW_CALL_FIELDS)


def mark_errors(spans: list[Span]) -> list[Span]:
    """Give the rank span an incident hangs under, and its wave root, status error (in place;
    the incident spans have it already)."""
    parents = {s.parent_id for s in spans if s.status == STATUS_ERROR and s.parent_id}
    if not parents:
        return spans
    traces = {s.trace_id for s in spans if s.status == STATUS_ERROR}
    for span in spans:
        if span.span_id in parents or (span.parent_id is None and span.trace_id in traces):
            span.status = STATUS_ERROR
    return spans


def incident_span(row) -> Span:
    """The `incident:<type>` span of a stored incident row (telemetry/store/incidents.py), with the
    incident as a span event, under the rank span of its wave (the wave span for incidents the
    sidecar raised itself)."""
    run_id, wave = row["run_id"] or "", row["wave"] or 0
    has_rank = row["tp"] is not None
    dp = row["dp"] if row["dp"] is not None else 0
    trace_id = wave_trace_id(run_id, wave, dp)
    parent = (
        rank_span_id(run_id, wave, row["dp"], row["tp"], row["pp"])
        if has_rank
        else wave_span_id(run_id, wave, dp)
    )
    attrs: dict[str, Any] = {
        schema.ATTR_RUN: run_id,
        schema.ATTR_ENGINE: row["engine"],
        schema.ATTR_WAVE: wave,
        schema.attr("incident_type"): row["type"],
    }
    if has_rank:
        attrs.update(
            {schema.ATTR_DP: row["dp"], schema.ATTR_TP: row["tp"], schema.ATTR_PP: row["pp"]}
        )
    event = {
        "incident.id": row["id"],
        "incident.type": row["type"],
        "incident.severity": row["severity"],
        "incident.request_id": row["request_id"] or "",
        "incident.summary": row["summary"] or "",
        "incident.evidence": row["evidence"] or "",
        "incident.actions": json.loads(row["actions"] or "[]"),
        "incident.occurrence": row["occurrence"] or 0,
    }
    at = row["time_ns"]
    dims = (row["dp"], row["tp"], row["pp"]) if has_rank else (None, None, None)
    return Span(
        trace_id,
        incident_span_id(row["id"]),
        parent,
        f"incident:{row['type']}",
        at,
        at,
        run_id,
        row["engine"] or "",
        wave,
        *dims,
        attributes=attrs,
        events=[{"name": "incident", "time_ns": at, "attributes": event}],
        status=STATUS_ERROR,
    )
