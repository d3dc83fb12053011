"""OTLP trace messages written as protobuf wire bytes, without a message object per span.

The exporter sends `ExportTraceServiceRequest` bytes made here (opentelemetry-proto's
trace.proto, trace_service.proto; field numbers below). Two writers:

- `encode_span`: any built `Span` (request traces, incident spans, slow calls);
- `RankWaves`: the spans of one rank's batch straight from its wave and collective columns
  (wave root, rank, execute_model, sample_tokens, collective:<op>): the same names, ids, times
  and attributes as telemetry/spans/builders.py makes, with no `Span` per span. A unit test
  decodes both with opentelemetry-proto and compares them with the builders' spans.

Attribute values follow `resource.any_value`: bool, int64 (a larger integer as a string),
double, array, and anything else as a string. Attribute entries that repeat (run, engine, rank
coordinates, collective keys) are encoded once.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Any

from telemetry.spans.builders import (
    _RANK_SPAN_KEYS,
    _STAT_KEYS,
    _WAVE_SPAN_KEYS,
    _WAVE_STAT_KEYS,
    STATUS_ERROR,
    Span,
    is_root_rank,
    slow_call_span,
)
from telemetry.store import RankRow
from telemetry.wire import schema
from telemetry.wire.protobuf_fields import length_delimited, varint
from telemetry.wire.trace_ids import phase_span_id, rank_span_id, wave_span_id, wave_trace_key

# field numbers (trace.proto: Span, Span.Event, Span.Link, Status; common.proto: KeyValue,
# AnyValue; trace_service.proto: ExportTraceServiceRequest; ResourceSpans, ScopeSpans)
SPAN_ATTRIBUTES, EVENT_ATTRIBUTES, LINK_ATTRIBUTES = 9, 3, 4
_SPAN_EVENTS, _SPAN_LINKS, _SPAN_STATUS = 11, 13, 15
_REQUEST_RESOURCE_SPANS = 1
_RS_RESOURCE, _RS_SCOPE_SPANS = 1, 2
_SS_SCOPE, _SS_SPANS = 1, 2
_SCOPE_NAME, _SCOPE_VERSION = 1, 2

_SPAN_TAG = b"\x12"  # ScopeSpans.spans (2)
_KIND_INTERNAL = b"\x30\x01"  # kind (6) = SPAN_KIND_INTERNAL
_STATUS_ERROR = length_delimited(_SPAN_STATUS, b"\x18\x02")  # Status.code (3) = ERROR
_START, _END = b"\x39", b"\x41"  # start (7), end (8): fixed64
_EVENT_TIME = b"\x09"  # Event.time_unix_nano (1): fixed64
_LINK_FLAGS = b"\x35"  # Link.flags (6): fixed32
_INT64_MIN, _INT64_END = -(2**63), 2**63
_fixed64 = struct.Struct("<Q").pack
_fixed32 = struct.Struct("<I").pack
_double = struct.Struct("<d").pack


def _tag(field: int) -> bytes:
    return varint(field << 3 | 2)


def _string(field: int, text: str) -> bytes:
    return length_delimited(field, text.encode())


def any_value(value: Any) -> bytes:
    """An AnyValue's bytes (as `resource.any_value` builds the message)."""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"  # bool_value (2)
    if isinstance(value, int):
        if 0 <= value < _INT64_END:
            return b"\x18" + varint(value)  # int_value (3)
        if _INT64_MIN <= value < 0:
            return b"\x18" + varint(value + 2**64)  # two's complement, 10 bytes
        return _string(1, str(value))  # OTLP integers are int64
    if isinstance(value, float):
        return b"\x21" + _double(value)  # double_value (4)
    if isinstance(value, (list, tuple)):
        values = b"".join(length_delimited(1, any_value(v)) for v in value)
        return length_delimited(5, values)  # array_value (5): ArrayValue.values (1)
    return _string(1, str(value))  # string_value (1)


def _key_part(key: str) -> bytes:
    return _string(1, key)  # KeyValue.key (1)


def _entry(tag: bytes, key_part: bytes, value: bytes) -> bytes:
    """One KeyValue in field `tag` of its holder: key, then value (2)."""
    kv = key_part + b"\x12" + varint(len(value)) + value
    return tag + varint(len(kv)) + kv


_ENCODED: dict[tuple, bytes] = {}  # (field, key, type, value) -> one encoded attribute entry
_MAX_ENCODED = 200_000
_TAGS = {f: _tag(f) for f in (SPAN_ATTRIBUTES, EVENT_ATTRIBUTES, LINK_ATTRIBUTES)}


def attribute(field: int, key: str, value: Any) -> bytes:
    """One attribute as an entry of repeated KeyValue field `field`; cached, as most values
    repeat (run, engine, rank coordinates, op, group)."""
    cache_key = None if isinstance(value, list) else (field, key, type(value), value)
    entry = _ENCODED.get(cache_key) if cache_key is not None else None
    if entry is None:
        entry = _entry(_TAGS.get(field) or _tag(field), _key_part(key), any_value(value))
        if cache_key is not None:
            if len(_ENCODED) >= _MAX_ENCODED:
                _ENCODED.clear()
            _ENCODED[cache_key] = entry
    return entry


def attributes(field: int, attrs: dict[str, Any]) -> bytes:
    return b"".join([attribute(field, key, value) for key, value in attrs.items()])


class _IntKey:
    """An integer attribute whose value changes from span to span (wave number, calls, ...):
    its entry is made from the key's encoded part, and cached for small values."""

    __slots__ = ("key", "tag", "key_part", "cache")

    def __init__(self, field: int, key: str) -> None:
        self.key, self.tag, self.key_part = key, _tag(field), _key_part(key)
        self.cache: dict[int, bytes] = {}

    def __call__(self, value: int) -> bytes:
        if type(value) is not int:  # a bool goes as bool_value (and hashes as 0 or 1)
            return attribute(SPAN_ATTRIBUTES, self.key, value)
        entry = self.cache.get(value)
        if entry is None:
            if not 0 <= value < _INT64_END:
                return attribute(SPAN_ATTRIBUTES, self.key, value)
            payload = b"\x18" + varint(value)
            kv = self.key_part + b"\x12" + bytes((len(payload),)) + payload
            entry = self.tag + varint(len(kv)) + kv
            if value < _CACHED_BELOW:
                self.cache[value] = entry
        return entry


# integer values cached: small ones (counts, tokens, flags) repeat from wave to wave; times,
# durations and sequence numbers do not
_CACHED_BELOW = 1 << 14


def span_message(
    trace_id: bytes,
    span_id: int,
    parent_id: int | None,
    name: bytes,
    start_ns: int,
    end_ns: int,
    rest: bytes,
) -> bytes:
    """One Span message: `name` is its encoded name field, `rest` its encoded attributes,
    events, links and status."""
    return b"".join(
        (
            b"\x0a\x10",  # trace_id (1)
            trace_id,
            b"\x12\x08",  # span_id (2)
            span_id.to_bytes(8, "big"),
            b"" if parent_id is None else b"\x22\x08" + parent_id.to_bytes(8, "big"),  # (4)
            name,
            _KIND_INTERNAL,
            _START,
            _fixed64(start_ns),
            _END,
            _fixed64(end_ns),
            rest,
        )
    )


_NAMES: dict[str, bytes] = {}


def _name(name: str) -> bytes:
    found = _NAMES.get(name)
    if found is None:
        if len(_NAMES) > 4096:
            _NAMES.clear()
        found = _NAMES[name] = _string(5, name)  # Span.name (5)
    return found


_LINKS: dict[tuple, bytes] = {}  # a request's link repeats in every wave it ran in


def link(trace_id: int, span_id: int, attrs: dict[str, Any], flags: int = 0) -> bytes:
    """A Span.Link; `flags` (its W3C trace flags and remote bits) written when not 0."""
    cache_key = (trace_id, span_id, flags, *attrs.items())
    found = _LINKS.get(cache_key)
    if found is None:
        body = (
            b"\x0a\x10"
            + trace_id.to_bytes(16, "big")
            + b"\x12\x08"
            + span_id.to_bytes(8, "big")
            + attributes(LINK_ATTRIBUTES, attrs)
        )
        if flags:
            body += _LINK_FLAGS + _fixed32(flags)
        found = length_delimited(_SPAN_LINKS, body)
        if len(_LINKS) >= 65536:
            _LINKS.clear()
        _LINKS[cache_key] = found
    return found


def links(found: Iterable[dict]) -> bytes:
    return b"".join(
        [
            link(x["trace_id"], x["span_id"], x.get("attributes", {}), x.get("flags", 0))
            for x in found
        ]
    )


def encode_span(span: Span) -> bytes:
    """A built span as a Span message."""
    rest = [attributes(SPAN_ATTRIBUTES, span.attributes)]
    for event in span.events:
        body = (
            _EVENT_TIME
            + _fixed64(event["time_ns"])
            + _string(2, event["name"])
            + attributes(EVENT_ATTRIBUTES, event["attributes"])
        )
        rest.append(length_delimited(_SPAN_EVENTS, body))
    rest.append(links(span.links))
    if span.status == STATUS_ERROR:
        rest.append(_STATUS_ERROR)
    return span_message(
        span.trace_id.to_bytes(16, "big"),
        span.span_id,
        span.parent_id,
        _name(span.name),
        span.start_ns,
        span.end_ns,
        b"".join(rest),
    )


def scope(name: str, version: str) -> bytes:
    """The ScopeSpans.scope field."""
    return length_delimited(
        _SS_SCOPE, _string(_SCOPE_NAME, name) + _string(_SCOPE_VERSION, version)
    )


def resource_spans(resource: bytes, scope_field: bytes, spans: Iterable[bytes]) -> bytes:
    """One ExportTraceServiceRequest.resource_spans entry: `resource` is a serialized Resource,
    `spans` Span messages."""
    scope_spans = scope_field + b"".join([_SPAN_TAG + varint(len(s)) + s for s in spans])
    body = length_delimited(_RS_RESOURCE, resource) + length_delimited(_RS_SCOPE_SPANS, scope_spans)
    return length_delimited(_REQUEST_RESOURCE_SPANS, body)


# -- a rank's wave spans from its columns ------------------------------------------------------
_WAVE = _IntKey(SPAN_ATTRIBUTES, schema.ATTR_WAVE)
_WAVE_ONLY = tuple((_IntKey(SPAN_ATTRIBUTES, k), f) for k, f in _WAVE_SPAN_KEYS)
_RANK_ONLY = tuple((_IntKey(SPAN_ATTRIBUTES, k), f) for k, f in _RANK_SPAN_KEYS)
_STAT_INT_KEYS = tuple(
    (_IntKey(SPAN_ATTRIBUTES, k), f)
    for k, f in _STAT_KEYS
    if f not in ("op", "group", "backend", "dtype")
)
_STAT_STR_KEYS = tuple((k, f) for k, f in _STAT_KEYS if f in ("op", "group", "backend", "dtype"))
_WAVE_STAT_INT_KEYS = tuple((_IntKey(SPAN_ATTRIBUTES, k), f) for k, f in _WAVE_STAT_KEYS)
_NAME_WAVE, _NAME_RANK = _string(5, "wave"), _string(5, "rank")
_NAME_EXECUTE, _NAME_SAMPLE = _string(5, "execute_model"), _string(5, "sample_tokens")


def _column(cols, field: str) -> list:
    return list(getattr(cols, field))


class RankWaves:
    """Encodes a rank's kept waves from its batch's columns (one instance per rank: what does
    not change from wave to wave is encoded once)."""

    def __init__(self, rank: RankRow) -> None:
        self.rank = rank
        self.root = is_root_rank(rank)
        # a wave's trace id is this (the replica's key) << 64 | wave
        self.trace_base = wave_trace_key(rank.run_id, rank.dp) << 64
        self.trace_key = self.trace_base.to_bytes(16, "big")[:8]
        a = SPAN_ATTRIBUTES
        self.run_engine = attribute(a, schema.ATTR_RUN, rank.run_id) + attribute(
            a, schema.ATTR_ENGINE, rank.engine
        )
        self.coords = b"".join(
            attribute(a, k, v)
            for k, v in (
                (schema.ATTR_DP, rank.dp),
                (schema.ATTR_TP, rank.tp),
                (schema.ATTR_PP, rank.pp),
            )
        )
        self.node_pid = attribute(a, schema.ATTR_NODE, rank.node) + attribute(
            a, schema.ATTR_PID, rank.pid
        )

    def waves(
        self,
        cols,
        kept: list[tuple[int, bytes]],
        links_of: dict[int, bytes],
        error_spans: set[int],
        error_traces: set[int],
    ) -> list[tuple[bytes | None, list[bytes]]]:
        """The Span messages of rows `kept` ((row, encoded kept_for attribute)) of `cols`
        (WaveColumns), a (wave root or None, this rank's spans) per row. `links_of`: a root's
        encoded links by its trace id; a root whose trace holds an incident, and a rank span
        an incident hangs under, have status error."""
        out: list[tuple[bytes | None, list[bytes]]] = []
        if not kept:
            return out
        rank = self.rank
        run_id, dp, tp, pp = rank.run_id, rank.dp, rank.tp, rank.pp
        wave_col, start_col = cols.wave, cols.start_unix_nano
        execute_col, sample_col = cols.execute_ns, cols.sample_ns
        offset_col, sampled_col = cols.sample_offset_ns, cols.sampled
        rank_cols = [(key, getattr(cols, f)) for key, f in _RANK_ONLY]
        wave_cols = [(key, getattr(cols, f)) for key, f in _WAVE_ONLY]
        trace_key = self.trace_base
        common, coords, node_pid = self.run_engine, self.coords, self.node_pid
        for i, kept_for in kept:
            wave = wave_col[i]
            start = start_col[i]
            execute_end = start + execute_col[i]
            sampled = sampled_col[i]
            end = execute_end
            if sampled:
                sample_start = start + offset_col[i]
                sample_end = sample_start + sample_col[i]
                end = max(end, sample_end)
            trace = self.trace_key + wave.to_bytes(8, "big")
            wave_attr = common + _WAVE(wave)
            root_id = wave_span_id(run_id, wave, dp)
            root = None
            if self.root:
                rest = [wave_attr]
                rest += [key(col[i]) for key, col in wave_cols]
                rest.append(kept_for)
                rest.append(links_of.get(trace_key | wave, b""))
                if trace_key | wave in error_traces:
                    rest.append(_STATUS_ERROR)
                root = span_message(trace, root_id, None, _NAME_WAVE, start, end, b"".join(rest))
            rank_id = rank_span_id(run_id, wave, dp, tp, pp)
            phase = wave_attr + coords
            rest = [phase, node_pid]
            rest += [key(col[i]) for key, col in rank_cols]
            rest.append(kept_for)
            if rank_id in error_spans:
                rest.append(_STATUS_ERROR)
            spans = [span_message(trace, rank_id, root_id, _NAME_RANK, start, end, b"".join(rest))]
            spans.append(
                span_message(
                    trace,
                    phase_span_id(run_id, wave, dp, tp, pp, "execute_model"),
                    rank_id,
                    _NAME_EXECUTE,
                    start,
                    execute_end,
                    phase,
                )
            )
            if sampled:
                spans.append(
                    span_message(
                        trace,
                        phase_span_id(run_id, wave, dp, tp, pp, "sample_tokens"),
                        rank_id,
                        _NAME_SAMPLE,
                        sample_start,
                        sample_end,
                        phase,
                    )
                )
            out.append((root, spans))
        return out

    def collectives(self, cols, waves: set[int]) -> list[list[bytes]]:
        """The collective:<op> and slow_call:<op> spans of `cols` (CollectiveColumns) in
        `waves`, one list per collective row."""
        wave_col = cols.wave
        rows = [r for r, w in enumerate(wave_col) if w in waves]
        if not rows:
            return []
        rank = self.rank
        run_id, dp, tp, pp = rank.run_id, rank.dp, rank.tp, rank.pp
        where = (dp, tp, pp)
        stats = cols.stats
        by_row: dict[int, list[int]] = {}
        wanted = set(rows)
        for j, r in enumerate(stats.wave_index):
            if r in wanted:
                by_row.setdefault(r, []).append(j)
        slow_by_row: dict[int, list[int]] = {}
        if cols.slow_calls:
            for j, r in enumerate(cols.slow_call_wave_index):
                if r in wanted:
                    slow_by_row.setdefault(r, []).append(j)
        stat_cols = [(key, getattr(stats, f)) for key, f in _STAT_INT_KEYS] if by_row else []
        host_col = stats.host_ns
        key_col = stats.key
        keys: dict[int, tuple[bytes, bytes, str]] = {}  # key -> (name, attrs, span id text)
        wave_stat_cols = [(key, getattr(cols, f)) for key, f in _WAVE_STAT_INT_KEYS]
        first_col = cols.first_arrival_unix_nano
        out = []
        for r in rows:
            wave = wave_col[r]
            spans = []
            trace = self.trace_key + wave.to_bytes(8, "big")
            parent = rank_span_id(run_id, wave, dp, tp, pp)
            start = first_col[r]
            head = self.run_engine + _WAVE(wave) + self.coords
            tail = b"".join([key(col[r]) for key, col in wave_stat_cols])
            for j in by_row.get(r, ()):
                k = key_col[j]
                found = keys.get(k)
                if found is None:
                    ck = cols.keys[k]
                    strings = b"".join(
                        attribute(SPAN_ATTRIBUTES, key, getattr(ck, f)) for key, f in _STAT_STR_KEYS
                    )
                    found = keys[k] = (
                        _name(f"collective:{ck.op}"),
                        strings,
                        f"collective/{ck.op}/{ck.group}",
                    )
                name, strings, id_text = found
                attrs = b"".join([head, strings, *[key(col[j]) for key, col in stat_cols], tail])
                spans.append(
                    span_message(
                        trace,
                        phase_span_id(run_id, wave, *where, id_text),
                        parent,
                        name,
                        start,
                        start + host_col[j],
                        attrs,
                    )
                )
            for j in slow_by_row.get(r, ()):
                call = cols.slow_calls[j]
                spans.append(
                    encode_span(
                        slow_call_span(rank, int.from_bytes(trace, "big"), wave, call, where)
                    )
                )
            out.append(spans)
        return out
