"""The exporter's OTLP bytes (telemetry/export/otlp_wire.py), decoded by opentelemetry-proto.

Independent sources: the protobuf runtime parses what the encoder writes (through a real
OTLP/gRPC receiver for the exporter's requests), and the expected spans are the ones the
span builders make (telemetry/spans/builders.py, the `ascend-guard trace` path), converted
with protobuf's own message API.
"""

from __future__ import annotations

import json
import time

import pytest
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2
from prometheus_client import CollectorRegistry

from telemetry.export import otlp_wire
from telemetry.export.otlp import KEPT_FOR, ExportSettings, OtlpExporter
from telemetry.export.resource import any_value
from telemetry.pipeline.writer import Drops
from telemetry.spans.builders import (
    STATUS_ERROR,
    Span,
    collective_spans,
    incident_span,
    mark_errors,
    slow_call_spans,
    wave_spans,
)
from telemetry.store import RankRow
from telemetry.wire.collective_columns import from_waves, to_waves
from telemetry.wire.proto import guard_pb2
from tests.support.otlp_receiver import otlp_receiver
from tests.support.request_sim import items_of

RUN, ENGINE = "run-wire", "eng"
WAVES = (1, 2, 3, 200)
INCIDENT_WAVE, INCIDENT_TP = 3, 1


@pytest.mark.parametrize(
    "value",
    [True, False, 0, 1, 127, 128, 16_383, 16_384, 2**63 - 1, 2**63, 2**64 + 5, -1, -(2**63),
     -(2**63) - 1, 0.0, -2.5, 1e300, "", "x", "ünïcode ✓", "a" * 300, [1, "b", True, 2.5], []],
)  # fmt: skip
def test_an_attribute_decodes_as_protobuf_builds_it(value) -> None:
    # field 9 of a Span is its attributes: the entry parses as one
    (kv,) = trace_pb2.Span.FromString(otlp_wire.attribute(9, "k.e.y", value)).attributes
    assert kv == common_pb2.KeyValue(key="k.e.y", value=any_value(value))
    # the per-key integer writer agrees, and leaves bools and out-of-range values to it
    entry = (
        otlp_wire._IntKey(9, "k.e.y")(value) if not isinstance(value, (str, list, float)) else None
    )
    if entry is not None:
        assert entry == otlp_wire.attribute(9, "k.e.y", value)


def _expected_message(span: Span) -> trace_pb2.Span:
    """The span as protobuf's message API builds it."""
    out = trace_pb2.Span(
        trace_id=span.trace_id.to_bytes(16, "big"),
        span_id=span.span_id.to_bytes(8, "big"),
        name=span.name,
        kind=trace_pb2.Span.SPAN_KIND_INTERNAL,
        start_time_unix_nano=span.start_ns,
        end_time_unix_nano=span.end_ns,
    )
    out.attributes.extend(_kvs(span.attributes))
    if span.parent_id is not None:
        out.parent_span_id = span.parent_id.to_bytes(8, "big")
    if span.status == STATUS_ERROR:
        out.status.code = trace_pb2.Status.STATUS_CODE_ERROR
    for event in span.events:
        added = out.events.add(name=event["name"], time_unix_nano=event["time_ns"])
        added.attributes.extend(_kvs(event["attributes"]))
    for link in span.links:
        added = out.links.add(
            trace_id=link["trace_id"].to_bytes(16, "big"),
            span_id=link["span_id"].to_bytes(8, "big"),
        )
        added.attributes.extend(_kvs(link.get("attributes", {})))
    return out


def _kvs(attrs: dict) -> list[common_pb2.KeyValue]:
    return [common_pb2.KeyValue(key=k, value=any_value(v)) for k, v in attrs.items()]


def test_a_built_span_with_events_and_links_decodes_as_protobuf_builds_it() -> None:
    span = Span(
        trace_id=2**128 - 1,
        span_id=1,
        parent_id=2**64 - 1,
        name="incident:ünï",
        start_ns=2**63 - 1,
        end_ns=2**63 - 1,
        run_id=RUN,
        engine=ENGINE,
        wave=7,
        attributes={"a": 1, "b": "two", "c": [1, 2], "d": False, "e": -5, "f": 0.25},
        events=[
            {"name": "incident", "time_ns": 5, "attributes": {"x": "y", "n": 2**70}},
            {"name": "empty", "time_ns": 0, "attributes": {}},
        ],
        links=[
            {
                "trace_id": 3 << 64 | 9,
                "span_id": 11,
                "attributes": {"ascend_guard.request_id": "r"},
            },
            {"trace_id": 4, "span_id": 12},
        ],
        status=STATUS_ERROR,
    )
    assert trace_pb2.Span.FromString(otlp_wire.encode_span(span)) == _expected_message(span)
    span.status, span.parent_id, span.events, span.links = "unset", None, [], []
    assert trace_pb2.Span.FromString(otlp_wire.encode_span(span)) == _expected_message(span)


def _rank(tp: int) -> guard_pb2.RankInfo:
    return guard_pb2.RankInfo(run_id=RUN, engine=ENGINE, dp_rank=0, dp_size=1, tp_rank=tp,
                              tp_size=2, pp_size=1, node="node-w", pid=4000 + tp)  # fmt: skip


def _batch(tp: int) -> guard_pb2.Batch:
    """Four waves of a rank: one not sampled, one a dummy, values past the small-value cache
    and a varint's first bytes; collectives with two keys, and one slow call on tp1."""
    batch = guard_pb2.Batch(rank=_rank(tp), wire_version=3)
    cols = batch.wave_columns
    waves = []
    for n, wave in enumerate(WAVES):
        start = 1_700_000_000_000_000_000 + wave * 5_000_000
        sampled = wave != 2
        cols.wave.append(wave)
        cols.start_unix_nano.append(start)
        cols.execute_ns.append(3_000_000 + 1000 * n + tp)
        cols.sample_ns.append(400_000 if sampled else 0)
        cols.sample_offset_ns.append(3_100_000 if sampled else 0)
        cols.num_reqs.append((0, 1, 20_000, 300)[n])
        cols.prefill_reqs.append(n)
        cols.decode_reqs.append(1)
        cols.prefill_tokens.append((0, 127, 128, 70_000)[n])
        cols.decode_tokens.append(n * 3)
        cols.sampled_tokens.append(n if sampled else 0)
        cols.dummy.append(wave == 3)
        cols.sampled.append(sampled)
        cols.recompute_tokens.append(0)
        cw = guard_pb2.CollectiveWave(
            wave=wave,
            first_arrival_unix_nano=start + 1_000_000,
            wait_ns=50_000 + n,
            slow_calls_dropped=n % 2,
            injected_delay_ns=0 if n else 2_000_000_000,
        )
        cw.stats.add(op="all_reduce", group="tp", backend="hccl", dtype="bfloat16", calls=2,
                     bytes=16_384, host_ns=40_000 + n, max_host_ns=30_000, first_seq=3 * wave,
                     last_seq=3 * wave + 1, device_ns=0, replayed=1, graph_counted=0)  # fmt: skip
        if wave != 200:
            cw.stats.add(op="all_gather", group="tp", backend="hccl", dtype="float32", calls=1,
                         bytes=2**40, host_ns=10_000, max_host_ns=10_000, first_seq=3 * wave + 2,
                         last_seq=3 * wave + 2, device_ns=9_999_999)  # fmt: skip
        if tp == 1 and wave == 2:
            cw.slow_calls.add(op="all_reduce", group="tp", backend="hccl", dtype="bfloat16",
                              seq=6, bytes=8192, start_unix_nano=start + 1_100_000,
                              host_ns=60_000_000)  # fmt: skip
        waves.append(cw)
    from_waves(waves, batch.collective_columns)
    return batch


def _incident_row() -> dict:
    return {
        "id": "inc-1", "type": "logits_finite", "severity": "error", "run_id": RUN,
        "engine": ENGINE, "wave": INCIDENT_WAVE, "dp": 0, "tp": INCIDENT_TP, "pp": 0,
        "request_id": "req-9", "summary": "nan", "evidence": "{}", "actions": json.dumps(["a"]),
        "occurrence": 1, "time_ns": 1_700_000_000_020_000_000,
    }  # fmt: skip


def _builders_spans(batches: list[guard_pb2.Batch]) -> list[Span]:
    """What `ascend-guard trace` builds for the same rows, marked as the exporter marks them."""
    out = [incident_span(_incident_row())]
    for batch in batches:
        r = batch.rank
        rank = RankRow(0, RUN, ENGINE, r.dp_rank, r.tp_rank, r.pp_rank, r.node, r.pid)
        cols = batch.wave_columns
        for i, wave in enumerate(cols.wave):
            why = "incident" if wave == INCIDENT_WAVE else "sampled"
            for span in wave_spans(rank, cols, i):
                if span.name in ("wave", "rank"):
                    span.attributes[KEPT_FOR] = why
                out.append(span)
        for cw in to_waves(batch.collective_columns):
            out += collective_spans(rank, cw) + slow_call_spans(rank, cw)
    return mark_errors(out)


def test_the_exporters_requests_decode_as_the_builders_spans() -> None:
    """Through a real OTLP/gRPC receiver: every span the exporter writes from the columns is
    the builders' span, field for field; the incident, sent a round before its wave, still
    makes its rank span and wave root errors."""
    batches = [_batch(0), _batch(1)]
    items = [item for batch in batches for item in items_of([batch], ENGINE)]  # one rank each
    with otlp_receiver() as (servicer, port):
        settings = ExportSettings(f"http://127.0.0.1:{port}", keep_one_in=1, decision_delay_s=0)
        exporter = OtlpExporter(settings, Drops(CollectorRegistry()), CollectorRegistry(), "node-w")
        exporter.on_incident(_incident_row())
        assert exporter.export_due(float("inf")) == 1  # the incident, alone
        exporter.write(items)
        sent = exporter.export_due(float("inf"))
        exporter.close()
        deadline = time.monotonic() + 10
        while len(servicer.snapshot()) < sent + 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        with servicer.lock:
            pairs = list(zip(servicer.spans, servicer.resources, strict=True))
    expected = {
        s.span_id.to_bytes(8, "big"): _expected_message(s) for s in _builders_spans(batches)
    }
    got = {span.span_id: span for span, _ in pairs}
    assert len(got) == len(pairs)  # no span twice
    assert set(got) == set(expected)
    for span_id, message in expected.items():
        assert got[span_id] == message, message.name
    names = sorted(m.name for m in got.values())
    assert names.count("slow_call:all_reduce") == 1 and names.count("wave") == len(WAVES)
    errors = {(m.name, _tp(m)) for m in got.values() if m.status.code == 2}
    assert errors == {("incident:logits_finite", 1), ("rank", 1), ("wave", None)}
    # resources: a rank's spans under the rank (its pid), a wave root under the replica
    for span, res in pairs:
        attrs = {kv.key: kv.value for kv in res.attributes}
        if span.name == "wave":
            assert "ascend_guard.tp" not in attrs and "process.pid" not in attrs
        else:
            assert attrs["ascend_guard.tp"].int_value == _tp(span)
            if not span.name.startswith("incident:"):
                assert attrs["process.pid"].int_value == 4000 + _tp(span)
        assert attrs["service.name"].string_value == ENGINE


def _tp(span: trace_pb2.Span) -> int | None:
    for kv in span.attributes:
        if kv.key == "ascend_guard.tp":
            return kv.value.int_value
    return None
