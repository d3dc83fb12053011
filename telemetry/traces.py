"""OpenTelemetry traces of waves: one trace per wave of one replica, one span per rank.

A replica is one DP engine (`telemetry.replica`): its own scheduler, its own wave numbering.
Trace and span ids are derived from (run id, wave, dp) and the rank, not drawn at random, so
the spans of one wave built by different sidecars on different nodes join into one trace in
any OTel backend, and wave N of dp0 and wave N of dp1 are different traces:

    wave                      (emitted by the sidecar that hosts the replica's tp0 pp0)
    └─ rank                   one per rank: execute_model entry .. sample_tokens exit
       ├─ execute_model
       └─ sample_tokens

DP engines in lockstep (MoE with EP: one DP group, idle ranks run dummy batches) still get a
trace per replica, because nothing guarantees that wave N is the same step on every DP rank
(each counts its own steps, dummies included). Instead each replica's wave span carries span
links to the wave spans of wave N of the other DP ranks (`lockstep_links`): a trace view
steps from one replica's wave to its peers' in one click, and a link to a wave a peer never
reported is harmless. Independent DP engines (dense models) are not linked.
"""

from __future__ import annotations

import hashlib
import threading

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags

from telemetry import store as attrs
from telemetry.proto import guard_pb2


def _digest(text: str, size: int) -> int:
    value = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=size).digest(), "big")
    return value or 1  # zero is the invalid id in OTel


# The one home of id derivation: every span id below is a function of these inputs only.
def wave_trace_id(run_id: str, wave: int, dp: int) -> int:
    """The trace id of one replica's wave: the same in every process that knows run id, wave
    and DP rank."""
    return _digest(f"ascend-guard/wave/{run_id}/dp{dp}/{wave}", 16)


def wave_span_id(run_id: str, wave: int, dp: int) -> int:
    return _digest(f"ascend-guard/wave-span/{run_id}/dp{dp}/{wave}", 8)


def rank_span_id(run_id: str, wave: int, dp: int, tp: int, pp: int) -> int:
    return _digest(f"ascend-guard/rank-span/{run_id}/{wave}/{dp}/{tp}/{pp}", 8)


def lockstep_links(run_id: str, wave: int, dp: int, dp_size: int) -> list[tuple[int, int, int]]:
    """(trace id, wave span id, dp) of wave `wave` of every other DP rank, for a replica whose
    DP engines step in lockstep."""
    return [
        (wave_trace_id(run_id, wave, other), wave_span_id(run_id, wave, other), other)
        for other in range(dp_size)
        if other != dp
    ]


def format_trace_id(trace_id: int) -> str:
    return format(trace_id, "032x")


class PresetIdGenerator(IdGenerator):
    """Hands out ids set just before a span starts (per thread); random ones otherwise."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._random = RandomIdGenerator()

    def preset(self, *, trace_id: int | None = None, span_id: int | None = None) -> None:
        self._local.trace_id = trace_id
        self._local.span_id = span_id

    def generate_trace_id(self) -> int:
        value = getattr(self._local, "trace_id", None)
        if value is not None:
            self._local.trace_id = None
            return value
        return self._random.generate_trace_id()

    def generate_span_id(self) -> int:
        value = getattr(self._local, "span_id", None)
        if value is not None:
            self._local.span_id = None
            return value
        return self._random.generate_span_id()


def build_provider(
    exporters: list[SpanExporter], node: str
) -> tuple[TracerProvider, PresetIdGenerator]:
    ids = PresetIdGenerator()
    provider = TracerProvider(
        resource=Resource.create({"service.name": "ascend-guard", "host.name": node}),
        id_generator=ids,
    )
    for exporter in exporters:
        provider.add_span_processor(
            BatchSpanProcessor(
                exporter,
                max_queue_size=65536,
                max_export_batch_size=2048,
                schedule_delay_millis=500,
            )
        )
    return provider, ids


def incident_span_id(incident_id: str) -> int:
    return _digest(f"ascend-guard/incident/{incident_id}", 8)


class WaveTracer:
    """Builds the spans of each wave record as it arrives."""

    def __init__(self, provider: TracerProvider, ids: PresetIdGenerator) -> None:
        self._tracer = provider.get_tracer("ascend_guard.sidecar")
        self._ids = ids

    def record(self, rank: guard_pb2.RankInfo, engine: str, wave: guard_pb2.WaveRecord) -> None:
        run_id, number = rank.run_id, wave.wave
        dp, tp, pp = rank.dp_rank, rank.tp_rank, rank.pp_rank
        start = wave.start_unix_nano
        execute_end = start + wave.execute_ns
        end = (
            max(execute_end, start + wave.sample_offset_ns + wave.sample_ns)
            if wave.sampled
            else execute_end
        )
        trace_id = wave_trace_id(run_id, number, dp)
        common = {
            attrs.ATTR_RUN: run_id,
            attrs.ATTR_ENGINE: engine,
            attrs.ATTR_WAVE: number,
        }
        tracer, ids = self._tracer, self._ids
        wave_span = wave_span_id(run_id, number, dp)
        if tp == 0 and pp == 0:
            ids.preset(trace_id=trace_id, span_id=wave_span)
            root = tracer.start_span(
                "wave",
                kind=SpanKind.INTERNAL,
                start_time=start,
                attributes={
                    **common,
                    attrs.ATTR_DP: dp,
                    "ascend_guard.num_reqs": wave.num_reqs,
                    "ascend_guard.dummy": wave.dummy,
                },
                links=self._lockstep(rank, number),
            )
            root.end(end)
        parent = SpanContext(
            trace_id, wave_span, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED)
        )
        ids.preset(span_id=rank_span_id(run_id, number, dp, tp, pp))
        rank_attrs = {
            **common,
            attrs.ATTR_DP: dp,
            attrs.ATTR_TP: tp,
            attrs.ATTR_PP: pp,
            "ascend_guard.node": rank.node,
            "ascend_guard.pid": rank.pid,
            "ascend_guard.num_reqs": wave.num_reqs,
            "ascend_guard.prefill_tokens": wave.prefill_tokens,
            "ascend_guard.decode_tokens": wave.decode_tokens,
            "ascend_guard.recompute_tokens": wave.recompute_tokens,
            "ascend_guard.sampled_tokens": wave.sampled_tokens,
            "ascend_guard.dummy": wave.dummy,
        }
        rank_span = tracer.start_span(
            "rank", context=trace.set_span_in_context(NonRecordingSpan(parent)), start_time=start,
            attributes=rank_attrs,
        )  # fmt: skip
        phase_ctx = trace.set_span_in_context(rank_span)
        phase_attrs = {**common, attrs.ATTR_DP: dp, attrs.ATTR_TP: tp, attrs.ATTR_PP: pp}
        tracer.start_span(
            "execute_model", context=phase_ctx, start_time=start, attributes=phase_attrs
        ).end(execute_end)
        if wave.sampled:
            sample_start = start + wave.sample_offset_ns
            tracer.start_span(
                "sample_tokens", context=phase_ctx, start_time=sample_start, attributes=phase_attrs
            ).end(sample_start + wave.sample_ns)
        rank_span.end(end)

    @staticmethod
    def _lockstep(rank: guard_pb2.RankInfo, wave: int) -> list[trace.Link]:
        if not rank.dp_lockstep or rank.dp_size <= 1:
            return []
        flags = TraceFlags(TraceFlags.SAMPLED)
        return [
            trace.Link(
                SpanContext(trace_id, span_id, is_remote=True, trace_flags=flags),
                {"ascend_guard.link": "dp_lockstep", attrs.ATTR_DP: other},
            )
            for trace_id, span_id, other in lockstep_links(
                rank.run_id, wave, rank.dp_rank, rank.dp_size
            )
        ]

    def record_incident(
        self, rank: guard_pb2.RankInfo | None, engine: str, incident: guard_pb2.Incident
    ) -> str:
        """An `incident` span, with the incident as a span event, in its wave's trace.

        Its parent is the rank span of that wave (the wave span for sidecar-born incidents),
        which may already be stored: ids are derived, so the link holds whatever the order.
        Returns the trace id as hex.
        """
        run_id = rank.run_id if rank is not None else ""
        dp = rank.dp_rank if rank is not None else 0
        trace_id = wave_trace_id(run_id, incident.wave, dp)
        parent_id = (
            rank_span_id(run_id, incident.wave, dp, rank.tp_rank, rank.pp_rank)
            if rank is not None
            else wave_span_id(run_id, incident.wave, dp)
        )
        parent = SpanContext(
            trace_id, parent_id, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED)
        )
        common = {attrs.ATTR_RUN: run_id, attrs.ATTR_ENGINE: engine, attrs.ATTR_WAVE: incident.wave}
        if rank is not None:
            common.update(
                {
                    attrs.ATTR_DP: rank.dp_rank,
                    attrs.ATTR_TP: rank.tp_rank,
                    attrs.ATTR_PP: rank.pp_rank,
                }
            )
        event = {
            "incident.id": incident.id,
            "incident.type": incident.type,
            "incident.severity": incident.severity,
            "incident.request_id": incident.request_id,
            "incident.summary": incident.summary,
            "incident.evidence": incident.evidence_json,
            "incident.actions": list(incident.actions),
            "incident.occurrence": incident.occurrence,
        }
        at = incident.time_unix_nano
        self._ids.preset(span_id=incident_span_id(incident.id))
        span = self._tracer.start_span(
            f"incident:{incident.type}", context=trace.set_span_in_context(NonRecordingSpan(parent)),
            start_time=at, attributes={**common, "ascend_guard.incident_type": incident.type},
        )  # fmt: skip
        span.add_event("incident", attributes=event, timestamp=at)
        span.end(at)
        return format_trace_id(trace_id)
