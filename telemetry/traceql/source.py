"""The store as TraceQL reads it: tables over wave blocks, collective and incident spans.

The one place that knows how collectives are stored is the "collectives" section below
(`rank_collective_spans`, `collective_waves_in_range`, `CollectiveTable`, and
`BlockCache.collective_blocks`): it reads the wire-v3 collective columns through
`store.decode_collectives` and `collective_columns.to_waves` (`wave_records` for a search's
traces: the same fields without a message).
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from telemetry import store
from telemetry.spans.builders import (
    COLLECTIVE_WAVE_SPAN_FIELDS,
    STATUS_ERROR,
    STATUS_UNSET,
    Span,
    collective_spans,
    incident_span,
    slow_call_span,
    slow_call_spans,
    wave_spans,
)
from telemetry.spans.query import finish_wave_trace
from telemetry.store.incidents import IncidentFilter, list_incidents
from telemetry.traceql import ast, fields
from telemetry.traceql.columns import ABSENT, Coded
from telemetry.traceql.parser import TraceQLError
from telemetry.wire import schema
from telemetry.wire.collective_columns import to_waves, wave_records, wave_rows
from telemetry.wire.trace_ids import (
    format_trace_id,
    split_trace_id,
    wave_trace_id,
    wave_trace_key,
)

WAVE_KINDS = ("wave", "rank", "execute_model", "sample_tokens")
ALL_KINDS = (*WAVE_KINDS, "collective", "slow_call", "incident")
# intrinsics of a trace's tree, which only a whole trace answers
TREE_INTRINSICS = (*ast.NESTED_SET_INTRINSICS, "span:childCount")
_WAVE_KEYS = {schema.attr(f): f for f in schema.WAVE_FIELDS}


# -- collectives: the one adapter -------------------------------------------------------------
def rank_collective_spans(
    conn: sqlite3.Connection, rank: store.RankRow, wave: int, cache: BlockCache | None = None
) -> list[Span]:
    """The collective spans of one rank in one wave."""
    if cache is None:
        waves = store.collective_waves(conn, rank.id, wave)
    else:
        waves = [cw for cw in cache.collective_blocks(rank.id, wave) if cw.wave == wave]
    out: list[Span] = []
    for cw in waves:
        out += collective_spans(rank, cw)
        out += slow_call_spans(rank, cw)
    return out


def collective_waves_in_range(
    conn: sqlite3.Connection, rank_id: int, first_wave: int, last_wave: int
) -> Iterator[list]:
    """The stored collective records of one rank's waves first_wave..last_wave, a block at a
    time (each block read once, not a look-up per wave)."""
    for block in store.blocks_by_wave(
        conn, store.COLLECTIVE_BLOCKS, rank_id, first_wave, last_wave
    ):
        yield to_waves(store.block_columns(conn, block), range(first_wave, last_wave + 1))


def collective_blocks_in(
    conn: sqlite3.Connection,
    rank_ids: Iterable[int],
    lo: int,
    hi: int,
    min_ns: int | None = None,
) -> Iterator[tuple[int, list]]:
    """(rank id, `CollectiveColumns`) of the ranks' collective blocks that may hold a span
    starting in [lo, hi] lasting at least `min_ns` (blocks whose slowest (op, group) is
    shorter are not read)."""
    for block in store.blocks_by_time(
        conn, store.COLLECTIVE_BLOCKS, rank_ids, lo, hi, min_ns=min_ns
    ):
        yield block.rank, store.block_columns(conn, block)


class CollectiveTable:
    """The collective spans of some collective records as columns, one row per (wave, stat),
    without building them (the same values telemetry/spans/builders.py `collective_spans` gives:
    a unit test holds the two together)."""

    def __init__(self, rank: store.RankRow, waves: list | None = None, cols=None) -> None:
        """From `CollectiveWave` records, or straight from a block's `CollectiveColumns`
        (`cols`: numpy over the columns, no message per wave)."""
        self.rank = rank
        self._cols = cols
        self._cache: dict = {}
        if cols is None:
            self.rows = [(cw, stat) for cw in waves for stat in cw.stats]
            self.n = len(self.rows)
            self.start = np.fromiter(
                (cw.first_arrival_unix_nano for cw, _ in self.rows), np.int64, self.n
            )
            self.waves = np.fromiter((cw.wave for cw, _ in self.rows), np.int64, self.n)
        else:
            wave_index = np.array(cols.stats.wave_index, np.int64)
            # rows in the order to_waves gives them: by wave row, then stat
            self._order = np.argsort(wave_index, kind="stable")
            wave_index = wave_index[self._order]
            self.n = len(wave_index)
            self._wave_index = wave_index
            self.start = np.array(cols.first_arrival_unix_nano, np.int64)[wave_index]
            self.waves = np.array(cols.wave, np.int64)[wave_index]
        rank_values = {
            schema.ATTR_RUN: rank.run_id,
            schema.ATTR_ENGINE: rank.engine,
            schema.ATTR_DP: rank.dp,
            schema.ATTR_TP: rank.tp,
            schema.ATTR_PP: rank.pp,
        }
        self._constants = {
            k: v for k, v in rank_values.items() if k in fields.kind_keys()["collective"]
        }

    def _per_wave(self, name: str):
        """A per-wave aggregate (`COLLECTIVE_WAVE_SPAN_FIELDS`) on every stat row."""
        key = ("wave", name)
        if key not in self._cache:
            if self._cols is not None:
                values = np.array(getattr(self._cols, name), np.int64)[self._wave_index]
            else:
                values = np.fromiter((getattr(cw, name) for cw, _ in self.rows), np.int64, self.n)
            self._cache[key] = values
        return self._cache[key]

    def _stat(self, name: str):
        if name not in self._cache and self._cols is not None:
            stats = self._cols.stats
            if name in schema.COLLECTIVE_KEY_FIELDS:
                out = Coded([])
                out.levels = [getattr(k, name) for k in self._cols.keys]
                out.codes = np.array(stats.key, np.int64)[self._order]
            else:
                out = np.array(getattr(stats, name), np.int64)[self._order]
            self._cache[name] = out
        if name not in self._cache:
            values = [getattr(stat, name) for _, stat in self.rows]
            if values and isinstance(values[0], str):
                out = Coded(values)
            else:
                out = np.array(values, np.int64)
            self._cache[name] = out
        return self._cache[name]

    def column(self, field):
        if isinstance(field, ast.Intrinsic):
            name = field.name
            if name == "name":
                ops = self._stat("op")
                return Coded.relabel(
                    ops, [fields.COLLECTIVE_PREFIX + op for op in ops.levels]
                ), True
            if name == "duration":
                return self._stat("host_ns"), True
            if name == "trace:id":
                return trace_id_column(self.rank, self.waves), True
            return _span_constant(name, self.rank)
        key = fields.attribute_key(field.name)
        if field.scope in (None, "span"):
            stat = key.removeprefix(schema.attr("collective."))
            if stat != key and stat in schema.COLLECTIVE_STAT_FIELDS:
                return self._stat(stat), True
            if stat != key and stat in COLLECTIVE_WAVE_SPAN_FIELDS:
                return self._per_wave(stat), True
            if key == schema.ATTR_WAVE:
                return self.waves, True
            if key in self._constants:
                return self._constants[key], True
        if field.scope in (None, "resource"):
            value = fields.resource_attributes(self.rank.engine, self.rank.node).get(
                field.name, ABSENT
            )
            if value is not ABSENT:
                return value, True
        return None, False


def trace_id_column(rank: store.RankRow, waves: np.ndarray) -> Coded:
    """`trace:id` of rows of this rank's waves: one text per distinct wave."""
    key = wave_trace_key(rank.run_id, rank.dp)
    unique, inverse = np.unique(waves, return_inverse=True)
    out = Coded([])
    out.levels = [format_trace_id(key << 64 | int(w)) for w in unique]
    out.codes = inverse.astype(np.int64).reshape(-1)
    return out


def _span_constant(name: str, rank: store.RankRow):
    """Intrinsics with one value on every span a block of this rank holds. The planner replaces
    the ones only a built trace knows (ast.EXACT_INTRINSICS) before a block is read; the root's
    service is the replica's engine, which its ranks share."""
    if name == "status":
        return fields.SPAN_STATUS, True
    if name == "kind":
        return fields.SPAN_KIND, True
    if name == "statusMessage":
        return "", True
    if name == "rootServiceName":
        return schema.service_name(rank.engine), True
    if name == "instrumentation:name":
        return fields.INSTRUMENTATION_NAME, True
    return None, False  # events and links: spans read from blocks have none


class BlockCache:
    """Decoded wave and collective blocks, kept for one search: neighbouring traces share their
    blocks, so each is decoded once however many of its waves are loaded. Each rank's blocks
    are found through a `store.BlockDirectory`, so loading trace after trace, newest first,
    costs a block query per page of blocks rather than per trace."""

    def __init__(self, conn: sqlite3.Connection, size: int = 256) -> None:
        self.conn = conn
        self._size = size
        self._waves: dict[int, tuple] = {}
        self._collectives: dict[int, tuple] = {}
        self._directories: dict[tuple[str, int], store.BlockDirectory] = {}
        self._held: dict[tuple[str, int, int], list[int]] = {}  # (table, rank, wave) -> rowids
        self._blobs: dict[tuple[str, int], bytes] = {}  # read ahead, not decoded yet
        self._trace_ranks: dict[int, list[store.RankRow]] = {}

    def _keep(self, cache: dict, key: int, value):
        if len(cache) >= self._size:
            cache.pop(next(iter(cache)))
        cache[key] = value
        return value

    def ranks_of_trace_key(self, key: int) -> list[store.RankRow]:
        """The ranks of one replica's traces (looked up once per search)."""
        ranks = self._trace_ranks.get(key)
        if ranks is None:
            ranks = self._trace_ranks[key] = store.ranks_of_trace_key(self.conn, key)
        return ranks

    def _holding(self, table: str, rank_id: int, wave: int) -> list[int]:
        """Row ids of the rank's blocks holding `wave` (telemetry/store/blocks.py's block walk),
        kept: a trace asks once when its blobs are read ahead and once when it is built."""
        held = self._held.get((table, rank_id, wave))
        if held is None:
            directory = self._directories.get((table, rank_id))
            if directory is None:
                directory = store.BlockDirectory(self.conn, table, rank_id)
                self._directories[(table, rank_id)] = directory
            held = [b.rowid for b in directory.blocks_by_wave(wave, wave)]
            if len(self._held) >= 4 * self._size:
                self._held.clear()
            self._held[(table, rank_id, wave)] = held
        return held

    def _blob(self, table: str, rowid: int) -> bytes:
        blob = self._blobs.pop((table, rowid), None)
        if blob is None:
            (blob,) = self.conn.execute(
                f"SELECT columns FROM {table} WHERE rowid = ?", (rowid,)
            ).fetchone()
        return blob

    @staticmethod
    def _decode_wave_block(blob: bytes) -> tuple:
        cols = store.decode_waves(blob)
        return cols, np.array(cols.wave, np.uint64)

    def _wave_block(self, rowid: int) -> tuple:
        block = self._waves.get(rowid)
        if block is None:
            blob = self._blob(store.WAVE_BLOCKS, rowid)
            block = self._keep(self._waves, rowid, self._decode_wave_block(blob))
        return block

    def read_ahead(self, rank_ids: Iterable[int], waves: Iterable[int]) -> None:
        """Read the blobs of the ranks' blocks holding `waves` that are not here yet, in one
        query per table (a trace's blocks: two a rank; several traces' at once) rather than
        one a block. They are decoded when first used, so a trace read ahead and then not
        built costs its blob reads only."""
        rank_ids, waves = list(rank_ids), list(waves)
        for table, cache in (
            (store.WAVE_BLOCKS, self._waves),
            (store.COLLECTIVE_BLOCKS, self._collectives),
        ):
            missing = list(
                dict.fromkeys(
                    rowid
                    for wave in waves
                    for rank_id in rank_ids
                    for rowid in self._holding(table, rank_id, wave)
                    if rowid not in cache and (table, rowid) not in self._blobs
                )
            )
            if len(self._blobs) + len(missing) > 2 * self._size:
                self._blobs.clear()
            if missing:
                marks = ",".join("?" * len(missing))
                found = self.conn.execute(
                    f"SELECT rowid, columns FROM {table} WHERE rowid IN ({marks})", missing
                ).fetchall()
                for rowid, blob in found:
                    self._blobs[(table, rowid)] = blob

    def wave_columns(self, rowid: int):
        """A wave block's decoded columns (the candidate pass reads its blocks through here,
        so the traces it finds are built from blocks already decoded)."""
        return self._wave_block(rowid)[0]

    def _collective_block(self, rowid: int) -> tuple:
        block = self._collectives.get(rowid)
        if block is None:
            cols = store.decode_collectives(self._blob(store.COLLECTIVE_BLOCKS, rowid))
            block = self._keep(self._collectives, rowid, (cols, None))
        return block

    def collective_columns(self, rowid: int):
        """A collective block's decoded columns."""
        return self._collective_block(rowid)[0]

    def wave_rows(self, rank_id: int, wave: int) -> list[tuple]:
        """(columns, row) of each row of `wave` in the rank's blocks that hold it."""
        out = []
        for rowid in self._holding(store.WAVE_BLOCKS, rank_id, wave):
            cols, numbers = self._wave_block(rowid)
            out += [(cols, i) for i in np.flatnonzero(numbers == wave).tolist()]
        return out

    def collective_blocks(self, rank_id: int, wave: int) -> list:
        """The rank's collective records of `wave` (each block decoded once, its records
        made for the waves asked for only, as `collective_columns.WaveRecord`s: the fields
        of `CollectiveWave` messages without making one)."""
        out: list = []
        for rowid in self._holding(store.COLLECTIVE_BLOCKS, rank_id, wave):
            cols, rows_of = self._collective_block(rowid)
            if rows_of is None:  # the block's row look-ups, made once for all its waves
                rows_of = wave_rows(cols)
                self._collectives[rowid] = (cols, rows_of)
            out += wave_records(cols, wave, rows_of)
        return out


def trace_spans(conn: sqlite3.Connection, trace_id: str) -> list[Span]:
    """Every span of one trace by id (what telemetry/spans/query.py `load_trace` returns; it reads
    each rank's block down the (rank, first_wave) key instead of scanning older blocks)."""
    text = trace_id.strip().lower()
    if not re.fullmatch(r"[0-9a-f]{32}", text):
        raise TraceQLError(f"trace id: {text!r} is not 32 hex digits")
    return load_trace_cached(conn, text, BlockCache(conn, size=64))


def load_trace_cached(conn: sqlite3.Connection, trace_id: str, cache: BlockCache) -> list[Span]:
    """Every span of one wave trace, as telemetry/spans/query.py `load_trace` builds them (same
    builders, same filters; a unit test compares the two), with blocks shared through `cache`."""
    text = trace_id.strip().lower()
    key, wave = split_trace_id(int(text, 16))
    spans: list[Span] = []
    runs = set()
    ranks = cache.ranks_of_trace_key(key)
    cache.read_ahead((rank.id for rank in ranks), (wave,))
    for rank in ranks:
        runs.add(rank.run_id)
        for cols, row in cache.wave_rows(rank.id, wave):
            spans += wave_spans(rank, cols, row)
        spans += rank_collective_spans(conn, rank, wave, cache)
    return finish_wave_trace(conn, spans, runs, wave, text)


def slow_call_spans_in(
    conn: sqlite3.Connection, ranks: dict[int, store.RankRow], lo: int, hi: int
) -> list[Span]:
    """The `slow_call:<op>` spans of these ranks (id -> rank) starting in [lo, hi]."""
    out: list[Span] = []
    for row in store.slow_calls_in(conn, list(ranks), lo, hi):
        rank = ranks[row.rank]
        trace_id = wave_trace_id(rank.run_id, row.wave, rank.dp)
        out.append(slow_call_span(rank, trace_id, row.wave, row, (rank.dp, rank.tp, rank.pp)))
    return out


def error_waves(conn: sqlite3.Connection, rank: store.RankRow, kind: str, first: int, last: int):
    """Waves first..last whose `kind` span ("rank" or "wave") of this rank has status error:
    an incident raised on that rank in that wave (for the wave root: on any rank of its
    replica, or by the sidecar)."""
    try:
        rows = conn.execute(
            "SELECT wave, dp, tp, pp FROM incidents WHERE run_id = ? AND wave BETWEEN ? AND ?",
            (rank.run_id, first, last),
        ).fetchall()
    except sqlite3.OperationalError:  # a store without the incident ledger
        return set()
    if kind == "wave":
        return {w for w, dp, _, _ in rows if (dp if dp is not None else 0) == rank.dp}
    return {w for w, dp, tp, pp in rows if (dp, tp, pp) == (rank.dp, rank.tp, rank.pp)}


def incident_spans(conn: sqlite3.Connection, since_ns: int, until_ns: int) -> list[Span]:
    rows = list_incidents(conn, IncidentFilter(since_ns=since_ns, limit=10**9))
    return [incident_span(row) for row in rows if row["time_ns"] <= until_ns]


# -- tables -----------------------------------------------------------------------------------
def _trace_level(field) -> bool:
    return isinstance(field, ast.Intrinsic) and field.trace_level


class SpanTable:
    """Columns over built spans (a loaded trace, or spans with no block table)."""

    def __init__(
        self,
        spans: list[Span],
        trace: dict | None = None,
        nodes: dict | None = None,
        per_span: Callable[[], dict[str, list]] | None = None,
    ) -> None:
        self.spans = spans
        self.n = len(spans)
        self._trace = trace or {}
        # intrinsics of the trace's tree, one value per span, made on first use
        # (telemetry/traceql/evaluate.py `TraceView`); none for spans of no one trace
        self._per_span = per_span
        # (run, engine, dp, tp, pp) -> node: the store's ranks, else the rank spans at hand
        self._nodes = (
            nodes
            if nodes is not None
            else {
                _rank_key(s, s.tp, s.pp): s.attributes.get(schema.ATTR_NODE)
                for s in spans
                if s.name == "rank"
            }
        )
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
                return Coded([s.status for s in spans]), True
            if name == "kind":
                return fields.SPAN_KIND, True
            if name == "statusMessage":
                return "", True
            if name == "rootServiceName":
                if "rootServiceName" in self._trace:  # a built trace: its root's (nil: none)
                    value = self._trace["rootServiceName"]
                    return value, value is not None
                return _pack([fields.service_name(s) for s in spans])
            if name in TREE_INTRINSICS:
                tree = self._per_span() if self._per_span is not None else {}
                return _pack(tree[name]) if name in tree else (None, False)
            if name in _SPAN_INTRINSICS:
                return _pack([_SPAN_INTRINSICS[name](s) for s in spans])
            value = self._trace.get(name)
            return (value, value is not None)
        if field.scope in ("event", "link", "instrumentation"):
            return _pack([_scoped_attribute(s, field) for s in spans])
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
        if node is None:  # the wave root is tp0 pp0's
            tp, pp = (span.tp, span.pp) if span.tp is not None else (0, 0)
            node = self._nodes.get(_rank_key(span, tp, pp))
        return fields.resource_attributes(span.engine, node)


def _first(items: list) -> dict | None:
    return items[0] if items else None


def _event_name(span: Span):
    event = _first(span.events)
    return event.get("name", ABSENT) if event else ABSENT


def _event_offset(span: Span):
    event = _first(span.events)
    return event["time_ns"] - span.start_ns if event and "time_ns" in event else ABSENT


def _link_id(key: str, digits: int):
    def read(span: Span):
        link = _first(span.links)
        return f"{link[key]:0{digits}x}" if link and link.get(key) is not None else ABSENT

    return read


# intrinsics read off one built span. A span's events and links are read at their first (an
# incident span has one event; a wave root links to its requests): nil where it has none.
_SPAN_INTRINSICS = {
    "span:id": lambda s: s.span_hex,
    "trace:id": lambda s: s.trace_hex,
    "span:parentID": lambda s: f"{s.parent_id:016x}" if s.parent_id is not None else ABSENT,
    "event:name": _event_name,
    "event:timeSinceStart": _event_offset,
    "link:traceID": _link_id("trace_id", 32),
    "link:spanID": _link_id("span_id", 16),
    "instrumentation:name": lambda s: fields.INSTRUMENTATION_NAME,
    "instrumentation:version": lambda s: ABSENT,
}


def _scoped_attribute(span: Span, field: ast.Attribute):
    """`event.x`, `link.x` (the span's first event's or link's attribute), `instrumentation.x`
    (none: the scope carries no attributes)."""
    if field.scope == "event":
        item = _first(span.events)
    elif field.scope == "link":
        item = _first(span.links)
    else:
        item = None
    return item.get("attributes", {}).get(field.name, ABSENT) if item else ABSENT


def _rank_key(span: Span, tp, pp) -> tuple:
    return (span.run_id, span.engine, span.dp if span.dp is not None else 0, tp, pp)


def node_map(ranks) -> dict:
    """(run, engine, dp, tp, pp) -> node of the store's ranks, for `resource.host.name`."""
    return {(r.run_id, r.engine, r.dp, r.tp, r.pp): r.node for r in ranks}


def _pack(values: list):
    """A list of values (ABSENT where missing) -> (values, present array): a numpy array of
    numbers or bools, `Coded` strings, else objects."""
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
    if real and all(isinstance(v, str) for v in real):  # names, ops, ids: compared once each
        return Coded([None if v is ABSENT else v for v in values]), present
    out = np.empty(len(values), object)
    out[:] = [None if v is ABSENT else v for v in values]
    return out, present


class BlockTable:
    """The spans of one kind (wave, rank, execute_model, sample_tokens) of one stored block,
    as columns, without building them. Attribute keys and constant values come from a span the
    builder made for the block's first wave (so this follows telemetry/spans/builders.py); without that
    template the table gives only the spans' starts, ends and which rows are spans."""

    def __init__(
        self,
        rank: store.RankRow,
        cols,
        kind: str,
        template: Span | None = None,
        conn: sqlite3.Connection | None = None,
    ) -> None:
        self.rank, self.cols, self.kind = rank, cols, kind
        self.conn = conn  # where incidents are looked up for `status` (None: unset)
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
            self._arrays[name] = np.array(column, dtype)  # 4x np.fromiter on a repeated field
        return self._arrays[name]

    def column(self, field):
        if isinstance(field, ast.Intrinsic):
            name = field.name
            if name == "name":
                return self.kind, True
            if name == "duration":
                return self.end - self.start, True
            if name == "trace:id":
                return trace_id_column(self.rank, self.array("wave")), True
            if name == "status" and self.kind in ("wave", "rank") and self.conn is not None:
                waves = self.array("wave")
                bad = error_waves(
                    self.conn, self.rank, self.kind, int(waves.min()), int(waves.max())
                )
                if bad:
                    errors = np.isin(waves, list(bad))
                    return Coded([STATUS_ERROR if e else STATUS_UNSET for e in errors]), True
            return _span_constant(name, self.rank)
        key = fields.attribute_key(field.name)
        if field.scope in (None, "span") and key in self._template.attributes:
            wave_field = _WAVE_KEYS.get(key)
            if wave_field is not None:
                return self.array(wave_field), True
            return self._template.attributes[key], True
        if field.scope in (None, "resource"):
            value = fields.resource_attributes(self.rank.engine, self.rank.node).get(
                field.name, ABSENT
            )
            if value is not ABSENT:
                return value, True
        return None, False

    def spans(self, rows: np.ndarray) -> list[Span]:
        wanted = frozenset((self.kind,))
        out: list[Span] = []
        for i in rows:
            out += wave_spans(self.rank, self.cols, int(i), wanted)
        if out and self.kind in ("wave", "rank") and self.conn is not None:
            waves = [span.wave for span in out]
            bad = error_waves(self.conn, self.rank, self.kind, min(waves), max(waves))
            for span in out:
                if span.wave in bad:
                    span.status = STATUS_ERROR
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
