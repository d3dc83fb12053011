"""What the API answers straight from the store: the legacy `tags=` search, tag names, values.

The legacy search (`/api/search?tags=k=v ...&minDuration&maxDuration`) matches a trace when
one of its spans carries every tag (values as case-insensitive substrings, as Tempo's) and
lasts within the duration bounds. Candidates come from the block columns: the ranks the
rank-level tags allow, the blocks whose slowest step reaches `minDuration` (a rank span is the
longest span of its rank, so a shorter step cannot hold a long enough span), walking back from
the end of the range in windows that grow fourfold, newest first. Each candidate trace is then
built as `ascend-guard trace` builds it and checked span by span.
"""

from __future__ import annotations

import dataclasses
import sqlite3
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from telemetry import store
from telemetry.spans.builders import (
    COLLECTIVE_WAVE_SPAN_FIELDS,
    SLOW_CALL_FIELDS,
    SLOW_CALL_PREFIX,
    Span,
)
from telemetry.spans.query import load_trace
from telemetry.tempo_api import otlp
from telemetry.tempo_api.params import BadParameter
from telemetry.wire import schema
from telemetry.wire.trace_ids import format_trace_id, wave_trace_key

FIRST_WINDOW_NS = 2 * 10**9
MAX_TRACES_INSPECTED = 5000  # exact-pass cap per search (reported as inspectedTraces)
TAGS_WINDOW_NS = 3600 * 10**9  # tags and values without start/end: the last hour
# a table: one row per line, columns aligned (fmt: skip)
INTRINSIC_TAGS = (
    "duration", "event:name", "event:timeSinceStart", "instrumentation:name",
    "instrumentation:version", "kind", "link:spanID", "link:traceID", "name", "rootName",
    "rootServiceName", "span:duration", "span:id", "span:kind", "span:name", "span:parentID",
    "span:status", "span:statusMessage", "status", "statusMessage", "trace:duration",
    "trace:id", "trace:rootName", "trace:rootService", "traceDuration",
)  # fmt: skip
# rank coordinates a legacy tag may name, and the RankRow field it filters on
# a table: one row per line, columns aligned (fmt: skip)
_RANK_FIELDS = {
    schema.ATTR_RUN: "run_id", schema.ATTR_ENGINE: "engine", schema.ATTR_DP: "dp",
    schema.ATTR_TP: "tp", schema.ATTR_PP: "pp", schema.ATTR_NODE: "node", schema.ATTR_PID: "pid",
    "service.name": "engine", "host.name": "node",  # service.name: see schema.service_name
}  # fmt: skip


def span_attribute_keys() -> list[str]:
    """Every span attribute key the span builders emit (telemetry/spans/builders.py for waves,
    telemetry/store/requests.py for requests), from the schema."""
    from telemetry.spans.requests import REQUEST_ATTRIBUTE_KEYS  # it imports the query layer

    keys = set(REQUEST_ATTRIBUTE_KEYS)
    keys |= {
        schema.ATTR_RUN,
        schema.ATTR_ENGINE,
        schema.ATTR_WAVE,
        schema.ATTR_DP,
        schema.ATTR_TP,
        schema.ATTR_PP,
        schema.ATTR_NODE,
        schema.ATTR_PID,
        schema.attr("incident_type"),
    }
    keys |= {schema.attr(f) for f in schema.RANK_SPAN_FIELDS + schema.WAVE_SPAN_FIELDS}
    keys |= {schema.attr(f"collective.{f}") for f in schema.COLLECTIVE_STAT_FIELDS}
    # collective spans' per-wave aggregates and slow-call spans' fields
    keys |= {schema.attr(f"collective.{f}") for f in COLLECTIVE_WAVE_SPAN_FIELDS}
    keys |= {schema.attr(f"collective.{f}") for f in SLOW_CALL_FIELDS}
    return sorted(keys)


def tag_scopes() -> dict[str, list[str]]:
    return {
        "resource": sorted(otlp.RESOURCE_KEYS),
        "span": span_attribute_keys(),
        "intrinsic": list(INTRINSIC_TAGS),
    }


# -- legacy search --------------------------------------------------------------------------
@dataclasses.dataclass
class Hit:
    """One matched trace, in the shape the API writes (shared with the TraceQL adapter)."""

    trace_id: str
    root_name: str | None
    start_ns: int
    duration_ns: int
    spansets: list[tuple[list[tuple[Span, dict[str, Any]]], int, dict[str, Any]]]
    # each spanset: ([(span, its attributes to show)], matched before the cap, set attributes)
    root_service: str | None = None  # the root span's service.name (None: no root here)


@dataclasses.dataclass
class Result:
    hits: list[Hit]
    inspected_traces: int = 0
    inspected_bytes: int = 0


def _resolve(key: str) -> str:
    """A legacy tag's attribute key: `name`, a resource key, a full or short span key."""
    if key in ("name", "status") or key in otlp.RESOURCE_KEYS:
        return key
    full = key if key.startswith(schema.PREFIX) else schema.attr(key)
    if full in span_attribute_keys():
        return full
    known = ", ".join(
        [
            "name",
            *otlp.RESOURCE_KEYS,
            *(k.removeprefix(schema.PREFIX) for k in span_attribute_keys()),
        ]
    )
    raise BadParameter("tags", f"unknown tag {key!r}; known tags: {known}")


def _text_match(value: Any, wanted: str) -> bool:
    return wanted.lower() in str(value).lower()


def legacy_search(
    conn: sqlite3.Connection,
    tags: list[tuple[str, str]],
    *,
    min_ns: int | None,
    max_ns: int | None,
    start_ns: int | None,
    end_ns: int | None,
    limit: int,
    spss: int,
) -> Result:
    wanted = [(_resolve(k), v) for k, v in tags]
    rank_rows = store.ranks(conn)
    for key, value in wanted:
        field = _RANK_FIELDS.get(key)
        if key == "service.name":  # the engine, or the project's name for a rank with none
            rank_rows = [r for r in rank_rows if _text_match(schema.service_name(r.engine), value)]
        elif field:
            rank_rows = [r for r in rank_rows if _text_match(getattr(r, field), value)]
    ranks = {r.id: r for r in rank_rows}
    result = Result([])
    done: set[tuple[int, int]] = set()
    for candidates in _windows(conn, ranks, start_ns, end_ns, min_ns, result):
        for _, key, wave in candidates:
            if (key, wave) in done:
                continue
            done.add((key, wave))
            if result.inspected_traces >= MAX_TRACES_INSPECTED:
                return _newest_first(result)
            result.inspected_traces += 1
            text = format_trace_id(key << 64 | wave)
            hit = _match(load_trace(conn, text), text, wanted, min_ns, max_ns, spss)
            if hit is not None:
                result.hits.append(hit)
                if len(result.hits) >= limit:
                    return _newest_first(result)
    return _newest_first(result)


def _newest_first(result: Result) -> Result:
    result.hits.sort(key=lambda h: h.start_ns, reverse=True)
    return result


def _windows(conn, ranks, start_ns, end_ns, min_ns, result) -> Iterator[list[tuple[int, int, int]]]:
    """Per window, newest first: (start, trace key, wave) of the waves that may match. The
    walk starts at the newest stored wave, so a broad search reads one small window."""
    if not ranks:
        return
    bounds = store.time_bounds(conn, list(ranks))
    if bounds is None:
        return
    oldest, newest = bounds
    lo_bound = max(start_ns or 0, oldest)
    hi = min(end_ns, newest) if end_ns is not None else newest
    keys = {rank_id: wave_trace_key(r.run_id, r.dp) for rank_id, r in ranks.items()}
    width = FIRST_WINDOW_NS
    while hi >= lo_bound:
        lo = max(lo_bound, hi - width)
        found: list[tuple[int, int, int]] = []
        for rank_id, cols in store.wave_blocks(
            conn, list(ranks), since_ns=lo, until_ns=hi, min_step_ns=min_ns
        ):
            result.inspected_bytes += cols.ByteSize()
            starts = np.array(cols.start_unix_nano, np.int64)
            ok = (starts >= lo) & (starts <= hi)
            if min_ns:
                ok &= _rank_durations(cols, starts) >= min_ns
            key, waves = keys[rank_id], cols.wave
            found += [(int(starts[i]), key, waves[i]) for i in np.flatnonzero(ok)]
        found.sort(reverse=True)
        yield found
        hi, width = lo - 1, width * 4


def _rank_durations(cols, starts: np.ndarray) -> np.ndarray:
    """Rank span durations of a block (telemetry/spans/builders.py `rank_end_ns`, column-wise)."""
    execute = starts + np.array(cols.execute_ns, np.int64)
    sample = starts + np.array(cols.sample_offset_ns, np.int64) + np.array(cols.sample_ns, np.int64)
    ends = np.where(np.array(cols.sampled, bool), np.maximum(execute, sample), execute)
    return ends - starts


def _match(spans, trace_id, wanted, min_ns, max_ns, spss) -> Hit | None:
    if not spans:
        return None
    res = otlp.resources(spans)
    matched: list[tuple[Span, dict[str, Any]]] = []
    for span in spans:
        seen = {
            **res[otlp.rank_key(span)],
            **span.attributes,
            "name": span.name,
            "status": span.status,
        }
        if min_ns is not None and span.duration_ns < min_ns:
            continue
        if max_ns is not None and span.duration_ns > max_ns:
            continue
        if all(key in seen and _text_match(seen[key], value) for key, value in wanted):
            shown = {k: seen[k] for k, _ in wanted if k in span.attributes}
            matched.append((span, shown))
    if not matched:
        return None
    root = next((s for s in spans if s.parent_id is None and s.name == "wave"), None)
    start = min(s.start_ns for s in spans)
    end = max(s.end_ns for s in spans)
    return Hit(
        trace_id,
        root.name if root else None,
        start,
        end - start,
        [(matched[:spss], len(matched), {})],
        schema.service_name(root.engine) if root else None,
    )


# -- tag values -----------------------------------------------------------------------------
def _window(start_ns: int | None, end_ns: int | None) -> tuple[int, int]:
    hi = end_ns if end_ns is not None else time.time_ns() + 60 * 10**9
    return (start_ns if start_ns is not None else hi - TAGS_WINDOW_NS), hi


def _recent_ranks(conn, start_ns, end_ns) -> list[store.RankRow]:
    lo, hi = _window(start_ns, end_ns)
    return [
        r
        for r in store.ranks(conn)
        if any(
            next(store.blocks_by_time(conn, table, (r.id,), lo, hi), None)
            for table in (store.WAVE_BLOCKS, store.COLLECTIVE_BLOCKS)
        )
    ]


def _collective_values(conn, ranks, start_ns, end_ns, field: str, blocks: int = 64) -> set:
    lo, hi = _window(start_ns, end_ns)
    ids = [r.id for r in ranks]
    if not ids:
        return set()
    out = set()
    for (blob,) in conn.execute(
        f"SELECT columns FROM collective_blocks WHERE rank IN ({','.join('?' * len(ids))}) "
        "AND start_ns >= ? AND start_ns <= ? ORDER BY start_ns DESC LIMIT ?",
        [*ids, lo, hi, blocks],
    ):
        # a block's columns list each (op, group, backend, dtype) it holds once
        out.update(getattr(key, field) for key in store.decode_collectives(blob).keys)
    return out


def _slow_call_ops(conn, start_ns, end_ns) -> set[str]:
    """The ops of the slow calls that started in the window (slow-call spans' names)."""
    lo, hi = _window(start_ns, end_ns)
    try:
        rows = conn.execute(
            "SELECT DISTINCT op FROM slow_calls WHERE start_ns >= ? AND start_ns <= ?", (lo, hi)
        ).fetchall()
    except sqlite3.OperationalError:  # a store older than the slow-call table
        return set()
    return {row[0] for row in rows}


def _request_span_names(conn, start_ns, end_ns) -> set[str]:
    """The request traces' span names, when a request started in the window."""
    from telemetry.spans import requests as request_spans  # it imports the query layer
    from telemetry.store.requests import has_request_tables

    lo, hi = _window(start_ns, end_ns)
    if not has_request_tables(conn):
        return set()
    found = conn.execute(
        "SELECT 1 FROM requests WHERE start_ns >= ? AND start_ns <= ? LIMIT 1", (lo, hi)
    ).fetchone()
    return {request_spans.REQUEST_SPAN, "prefill", "decode"} if found else set()


def _incident_types(conn, start_ns, end_ns) -> set[str]:
    lo, hi = _window(start_ns, end_ns)
    try:
        rows = conn.execute(
            "SELECT DISTINCT type FROM incidents WHERE time_ns >= ? AND time_ns <= ?", (lo, hi)
        ).fetchall()
    except sqlite3.OperationalError:  # no incident recorded yet: no table
        return set()
    return {row[0] for row in rows}


def tag_values(
    conn: sqlite3.Connection, tag: str, start_ns: int | None, end_ns: int | None
) -> list[tuple[str, Any]]:
    """(type, value) pairs of a TraceQL identifier (`resource.host.name`, `.tp`, `name`,
    `span.ascend_guard.engine`...); an identifier with no known values gets none."""
    if tag in ("status", "span:status"):
        # incidents, and the rank and wave spans that raised them, are errors
        errors = [("keyword", "error")] if _incident_types(conn, start_ns, end_ns) else []
        return errors + [("keyword", "unset")]
    if tag in ("kind", "span:kind"):
        return [("keyword", "internal")]
    ranks = _recent_ranks(conn, start_ns, end_ns)
    if tag in ("name", "span:name", "rootName", "trace:rootName"):
        if tag in ("rootName", "trace:rootName"):
            return [("string", "wave")] if ranks else []
        names = set(schema.WAVE_SPAN_NAMES) if ranks else set()
        names |= {
            f"collective:{op}" for op in _collective_values(conn, ranks, start_ns, end_ns, "op")
        }
        names |= {f"{SLOW_CALL_PREFIX}{op}" for op in _slow_call_ops(conn, start_ns, end_ns)}
        names |= {f"incident:{t}" for t in _incident_types(conn, start_ns, end_ns)}
        names |= _request_span_names(conn, start_ns, end_ns)
        return [("string", n) for n in sorted(names)]
    if tag in ("rootServiceName", "trace:rootService"):
        return [("string", v) for v in sorted({schema.service_name(r.engine) for r in ranks})]
    scope, _, name = tag.partition(".")
    if scope not in ("", "span", "resource"):
        return []
    values: set = set()
    if scope in ("", "resource"):
        values |= _resource_values(ranks, name)
    if scope in ("", "span"):
        values |= _span_values(conn, ranks, start_ns, end_ns, name)
    return [("int" if isinstance(v, int) else "string", v) for v in sorted(values, key=str)]


def _resource_values(ranks: list[store.RankRow], name: str) -> set:
    if not ranks:
        return set()
    if name == "service.name":
        return {schema.service_name(r.engine) for r in ranks}
    if name == "service.namespace":
        return {schema.SERVICE_NAMESPACE}
    if name == "host.name":
        return {r.node for r in ranks if r.node}
    if name == "service.instance.id":
        return {otlp.instance_id((r.engine, r.dp, r.tp, r.pp)) for r in ranks} | {
            otlp.instance_id((r.engine, r.dp, None, None)) for r in ranks
        }
    return set()


def _span_values(conn, ranks, start_ns, end_ns, name: str) -> set:
    key = name if name.startswith(schema.PREFIX) else schema.attr(name)
    field = _RANK_FIELDS.get(key)
    if field:
        return {getattr(r, field) for r in ranks}
    if key == schema.attr("incident_type"):
        return _incident_types(conn, start_ns, end_ns)
    for stat in ("op", "group", "backend", "dtype"):
        if key == schema.attr(f"collective.{stat}"):
            return _collective_values(conn, ranks, start_ns, end_ns, stat)
    return set()  # numbers of every wave (num_reqs, bytes, ...): too many to list
