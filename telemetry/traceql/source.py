"""The store as TraceQL reads it: tables over wave blocks, collective and incident spans.

The one place that knows how collectives are stored is `rank_collective_spans` /
`collective_spans_in_range` below (issue 9c changes the storage; adapt here).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator

import numpy as np

from telemetry import schema, store
from telemetry.incidents import IncidentFilter, list_incidents
from telemetry.spans import Span, collective_spans, incident_span, wave_spans
from telemetry.traceql import ast, fields
from telemetry.traceql.columns import ABSENT

WAVE_KINDS = ("wave", "rank", "execute_model", "sample_tokens")
ALL_KINDS = (*WAVE_KINDS, "collective", "incident")
_WAVE_KEYS = {schema.attr(f): f for f in schema.WAVE_FIELDS}


# -- collectives: the one adapter -------------------------------------------------------------
def rank_collective_spans(conn: sqlite3.Connection, rank: store.RankRow, wave: int) -> list[Span]:
    """The collective spans of one rank in one wave."""
    out: list[Span] = []
    for cw in store.collective_waves(conn, rank.id, wave):
        out += collective_spans(rank, cw)
    return out


def collective_spans_in_range(
    conn: sqlite3.Connection, rank: store.RankRow, first_wave: int, last_wave: int
) -> Iterator[Span]:
    """The collective spans of one rank's waves first_wave..last_wave (blocks read once each,
    not a look-up per wave)."""
    rows = conn.execute(
        "SELECT columns FROM collective_blocks WHERE rank = ? AND last_wave >= ? "
        "AND first_wave <= ?",
        (rank.id, first_wave, last_wave),
    )
    for (blob,) in rows:
        for cw in store.decode_collectives(blob):
            if first_wave <= cw.wave <= last_wave:
                yield from collective_spans(rank, cw)


def wave_range(
    conn: sqlite3.Connection, rank_id: int, since_ns: int, until_ns: int
) -> tuple[int, int] | None:
    """The waves a rank ran in [since, until] by the blocks' own bounds (no block decoded)."""
    first, last = conn.execute(
        "SELECT MIN(first_wave), MAX(last_wave) FROM wave_blocks WHERE rank = ? "
        "AND end_ns >= ? AND start_ns <= ?",
        (rank_id, since_ns, until_ns),
    ).fetchone()
    return None if first is None else (first, last)


def incident_spans(conn: sqlite3.Connection, since_ns: int, until_ns: int) -> list[Span]:
    rows = list_incidents(conn, IncidentFilter(since_ns=since_ns, limit=10**9))
    return [incident_span(row) for row in rows if row["time_ns"] <= until_ns]


# -- tables -----------------------------------------------------------------------------------
def _trace_level(field) -> bool:
    return isinstance(field, ast.Intrinsic) and field.trace_level


class SpanTable:
    """Columns over built spans (a loaded trace, or spans with no block table)."""

    def __init__(self, spans: list[Span], trace: dict | None = None) -> None:
        self.spans = spans
        self.n = len(spans)
        self._trace = trace or {}
        self._nodes = {
            (s.dp, s.tp, s.pp): s.attributes.get(schema.ATTR_NODE)
            for s in spans
            if s.name == "rank"
        }
        self._cache: dict = {}

    def column(self, field):
        if field not in self._cache:
            self._cache[field] = self._column(field)
        return self._cache[field]

    def _column(self, field):
        spans = self.spans
        if isinstance(field, ast.Intrinsic):
            name = field.name
            if name == "name":
                return _pack([s.name for s in spans])
            if name == "duration":
                return np.fromiter((s.end_ns - s.start_ns for s in spans), np.int64, self.n), True
            if name == "status":
                return fields.SPAN_STATUS, True
            if name == "kind":
                return fields.SPAN_KIND, True
            if name == "statusMessage":
                return "", True
            if name == "rootServiceName":
                return fields.SERVICE_NAME, True
            value = self._trace.get(name)
            return (value, value is not None)
        key = fields.attribute_key(field.name)
        values: list = []
        if field.scope in (None, "span"):
            values = [fields.span_attributes(s).get(key, ABSENT) for s in spans]
        else:
            values = [ABSENT] * self.n
        if field.scope in (None, "resource"):
            for i, span in enumerate(spans):
                if values[i] is ABSENT:
                    values[i] = self._resource(span).get(field.name, ABSENT)
        return _pack(values)

    def _resource(self, span: Span) -> dict:
        node = span.attributes.get(schema.ATTR_NODE)
        if node is None:
            tp, pp = (span.tp, span.pp) if span.tp is not None else (0, 0)
            node = self._nodes.get((span.dp if span.dp is not None else 0, tp, pp))
        return fields.resource_attributes(node)


def _pack(values: list):
    """A list of values (ABSENT where missing) -> (values array, present array)."""
    present = np.fromiter((v is not ABSENT for v in values), bool, len(values))
    real = [v for v in values if v is not ABSENT]
    filler = None
    if real and all(isinstance(v, bool) for v in real):
        dtype, filler = bool, False
    elif real and all(isinstance(v, int) and not isinstance(v, bool) for v in real):
        dtype, filler = np.int64, 0
    elif real and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in real):
        dtype, filler = np.float64, 0.0
    if filler is not None:
        try:
            return np.array([filler if v is ABSENT else v for v in values], dtype), present
        except OverflowError:
            pass
    out = np.empty(len(values), object)
    out[:] = [None if v is ABSENT else v for v in values]
    return out, present


class BlockTable:
    """The spans of one kind (wave, rank, execute_model, sample_tokens) of one stored block,
    as columns, without building them. Attribute keys and constant values come from a span the
    builder made for the block's first wave (so this follows telemetry/spans.py)."""

    def __init__(self, rank: store.RankRow, cols, kind: str, template: Span) -> None:
        self.rank, self.cols, self.kind = rank, cols, kind
        self.n = len(cols.wave)
        self._template = template
        self._arrays: dict[str, np.ndarray] = {}
        start = self.array("start_unix_nano")
        if kind == "execute_model":
            self.start, self.end = start, start + self.array("execute_ns")
        elif kind == "sample_tokens":
            self.start = start + self.array("sample_offset_ns")
            self.end = self.start + self.array("sample_ns")
        else:  # wave and rank: execute_model entry .. the later phase's end
            execute_end = start + self.array("execute_ns")
            sample_end = start + self.array("sample_offset_ns") + self.array("sample_ns")
            sampled = self.array("sampled")
            self.start = start
            self.end = np.where(sampled, np.maximum(execute_end, sample_end), execute_end)
        # rows that are spans of this kind at all
        self.exists = self.array("sampled") if kind == "sample_tokens" else np.ones(self.n, bool)

    def array(self, name: str) -> np.ndarray:
        if name not in self._arrays:
            column = getattr(self.cols, name)
            dtype = bool if name in ("sampled", "dummy") else np.int64
            self._arrays[name] = np.fromiter(column, dtype, self.n)
        return self._arrays[name]

    def column(self, field):
        if isinstance(field, ast.Intrinsic):
            name = field.name
            if name == "name":
                return self.kind, True
            if name == "duration":
                return self.end - self.start, True
            if name == "status":
                return fields.SPAN_STATUS, True
            if name == "kind":
                return fields.SPAN_KIND, True
            if name == "statusMessage":
                return "", True
            if name == "rootServiceName":
                return fields.SERVICE_NAME, True
            raise ValueError(f"trace-level {name} is not known per block")  # planner relaxes it
        key = fields.attribute_key(field.name)
        if field.scope in (None, "span") and key in self._template.attributes:
            wave_field = _WAVE_KEYS.get(key)
            if wave_field is not None:
                return self.array(wave_field), True
            return self._template.attributes[key], True
        if field.scope in (None, "resource"):
            value = fields.resource_attributes(self.rank.node).get(field.name, ABSENT)
            if value is not ABSENT:
                return value, True
        return None, False

    def spans(self, rows: np.ndarray) -> list[Span]:
        wanted = frozenset((self.kind,))
        out: list[Span] = []
        for i in rows:
            out += wave_spans(self.rank, self.cols, int(i), wanted)
        return out


def block_template(rank: store.RankRow, cols, kind: str) -> Span | None:
    """A span of `kind` the builder makes from this block (None: the block has none)."""
    if kind == "sample_tokens":
        hits = [i for i, s in enumerate(cols.sampled) if s]
        if not hits:
            return None
        index = hits[0]
    else:
        index = 0
    built = wave_spans(rank, cols, index, frozenset((kind,)))
    return built[0] if built else None


def wave_blocks_in(
    conn: sqlite3.Connection,
    rank_ids: list[int],
    since_ns: int,
    until_ns: int,
    min_step_ns: int | None,
) -> Iterator[tuple[int, object]]:
    yield from store.wave_blocks(
        conn, rank_ids, since_ns=since_ns, until_ns=until_ns, min_step_ns=min_step_ns
    )
