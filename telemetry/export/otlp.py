"""OTLP/gRPC export of wave spans, off the ingest path, with a tail-sampling policy.

The writer hands every batch to `OtlpExporter.write`, which only queues it (bounded in bytes;
a full queue drops the batch's records, counted as stage `otlp_export`, reason `queue_full`).
The exporter's own thread waits `decision_delay_s` so that the other ranks' rows of a wave and
its incidents can arrive, then keeps a wave (all its ranks) when

- any rank's step took `slow_wave_s` or longer,
- the wave has an incident or a hang verdict (`on_incident`, fed by the incident ledger), or
- it is one of every `keep_one_in` of the rest (chosen from the wave number, so every rank and
  every sidecar keeps the same waves),

builds the kept waves' spans with the same builder as `ascend-guard trace` (telemetry/spans/builders.py)
and sends them in requests of at most `max_spans_per_request`. A failed request drops its
records, counted (reason `export_failed`). Defaults: `ExportSettings`.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Sequence
from urllib.parse import urlparse

import grpc
import structlog
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2
from prometheus_client import CollectorRegistry, Counter

from telemetry.pipeline.writer import STAGE_EXPORT, Drops, Item
from telemetry.spans.builders import (
    STATUS_ERROR,
    Span,
    collective_spans,
    incident_span,
    mark_errors,
    rank_end_ns,
    slow_call_spans,
    wave_spans,
)
from telemetry.store import RankRow
from telemetry.wire.collective_columns import columns_of, to_waves

log = structlog.get_logger("ascend_guard.export")

_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = 2**64 - 1


@dataclasses.dataclass(frozen=True)
class ExportSettings:
    """Tail sampling and queue limits of the OTLP exporter (CLI flags read their defaults here)."""

    endpoint: str
    slow_wave_s: float = 0.1  # keep every wave with a step at least this long
    keep_one_in: int = 100  # and 1 in N of the rest (1: keep every wave)
    decision_delay_s: float = 1.0  # wait for the other ranks' rows and incidents of a wave
    max_queue_bytes: int = 32 * 1024 * 1024
    max_spans_per_request: int = 2048
    timeout_s: float = 10.0
    max_marked_waves: int = 100_000  # waves remembered as slow / with an incident


def sampled(wave: int, keep_one_in: int) -> bool:
    """1 in `keep_one_in` waves, the same ones everywhere (a hash of the wave number)."""
    return keep_one_in <= 1 or ((wave * _GOLDEN) & _MASK64) % keep_one_in == 0


def _any_value(value) -> common_pb2.AnyValue:
    if isinstance(value, bool):
        return common_pb2.AnyValue(bool_value=value)
    if isinstance(value, int):
        if -(2**63) <= value < 2**63:
            return common_pb2.AnyValue(int_value=value)
        return common_pb2.AnyValue(string_value=str(value))  # OTLP integers are int64
    if isinstance(value, float):
        return common_pb2.AnyValue(double_value=value)
    if isinstance(value, (list, tuple)):
        return common_pb2.AnyValue(
            array_value=common_pb2.ArrayValue(values=[_any_value(v) for v in value])
        )
    return common_pb2.AnyValue(string_value=str(value))


def _attributes(attrs: dict) -> list[common_pb2.KeyValue]:
    return [common_pb2.KeyValue(key=k, value=_any_value(v)) for k, v in attrs.items()]


def to_otlp(span: Span) -> trace_pb2.Span:
    out = trace_pb2.Span(
        trace_id=span.trace_id.to_bytes(16, "big"),
        span_id=span.span_id.to_bytes(8, "big"),
        name=span.name,
        kind=trace_pb2.Span.SPAN_KIND_INTERNAL,
        start_time_unix_nano=span.start_ns,
        end_time_unix_nano=span.end_ns,
        attributes=_attributes(span.attributes),
    )
    if span.parent_id is not None:
        out.parent_span_id = span.parent_id.to_bytes(8, "big")
    if span.status == STATUS_ERROR:
        out.status.code = trace_pb2.Status.STATUS_CODE_ERROR
    for event in span.events:
        out.events.add(
            name=event["name"],
            time_unix_nano=event["time_ns"],
            attributes=_attributes(event["attributes"]),
        )
    for link in span.links:
        out.links.add(
            trace_id=link["trace_id"].to_bytes(16, "big"),
            span_id=link["span_id"].to_bytes(8, "big"),
            attributes=_attributes(link.get("attributes", {})),
        )
    return out


def _channel(endpoint: str) -> grpc.Channel:
    url = urlparse(endpoint if "://" in endpoint else f"http://{endpoint}")
    target = url.netloc or url.path
    if url.scheme == "https":
        return grpc.secure_channel(target, grpc.ssl_channel_credentials())
    return grpc.insecure_channel(target)


class OtlpExporter:
    """A `BatchSink` that exports tail-sampled wave spans over OTLP/gRPC."""

    stage = STAGE_EXPORT

    def __init__(
        self, settings: ExportSettings, drops: Drops, registry: CollectorRegistry, node: str
    ) -> None:
        self.settings = settings
        self._drops = drops
        self._slow_ns = int(settings.slow_wave_s * 1e9)
        self._lock = threading.Lock()
        self._pending: collections.deque[tuple[float, Item]] = collections.deque()
        self._pending_bytes = 0
        self._incidents: collections.deque[dict] = collections.deque(maxlen=10_000)
        self._marked: collections.OrderedDict[tuple[str, int], None] = collections.OrderedDict()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._channel = _channel(settings.endpoint)
        self._stub = trace_service_pb2_grpc.TraceServiceStub(self._channel)
        self._resource = resource_pb2.Resource(
            attributes=_attributes({"service.name": "ascend-guard", "host.name": node})
        )
        self.decisions = Counter(
            "ascend_guard_otlp_records",
            "Wave records (rank-waves) the OTLP exporter decided on: exported or sampled out.",
            ("decision",),
            registry=registry,
        )
        self.spans_exported = 0

    # -- writer thread ----------------------------------------------------------------------
    def write(self, items: Sequence[Item]) -> None:
        now = time.monotonic()
        for item in items:
            if not item.records and not len(columns_of(item.batch).wave):
                continue
            self._mark_slow(item)
            with self._lock:
                if self._pending_bytes + item.nbytes > self.settings.max_queue_bytes:
                    full = True
                else:
                    full = False
                    self._pending.append((now, item))
                    self._pending_bytes += item.nbytes
            if full:
                self._drops.add(STAGE_EXPORT, "queue_full", item.records)

    def _mark_slow(self, item: Item) -> None:
        cols = item.batch.wave_columns
        if not item.records:
            return
        execute, sample = cols.execute_ns, cols.sample_ns
        if max(execute) + max(sample) < self._slow_ns:
            return  # no wave of this batch can be slow
        run_id = item.source.rank.run_id
        for i in range(len(cols.wave)):
            if rank_end_ns(cols, i) - cols.start_unix_nano[i] >= self._slow_ns:
                self._mark(run_id, cols.wave[i])

    def _mark(self, run_id: str, wave: int) -> None:
        with self._lock:
            self._marked[(run_id, wave)] = None
            self._marked.move_to_end((run_id, wave))
            while len(self._marked) > self.settings.max_marked_waves:
                self._marked.popitem(last=False)

    def on_incident(self, row: dict) -> None:
        """An incident was recorded (any thread): keep its wave, export its span."""
        if row["wave"]:
            self._mark(row["run_id"], row["wave"])
            self._incidents.append(row)

    # -- exporter thread --------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ascend-guard-otlp", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.export_due(time.monotonic() - self.settings.decision_delay_s)
        self.export_due(float("inf"))

    def export_due(self, older_than: float) -> int:
        """Decide on and export what has waited long enough; return the spans sent."""
        due: list[Item] = []
        with self._lock:
            while self._pending and self._pending[0][0] <= older_than:
                _, item = self._pending.popleft()
                self._pending_bytes -= item.nbytes
                due.append(item)
            marked = set(self._marked) if due else set()
        incidents = []
        while self._incidents:
            incidents.append(self._incidents.popleft())
        spans: list[Span] = [incident_span(row) for row in incidents]
        kept_records: list[int] = []  # records per request chunk, for counting failures
        kept = sampled_out = 0
        for item in due:
            source = item.source
            rank = RankRow(
                0,
                source.rank.run_id,
                source.engine,
                source.rank.dp_rank,
                source.rank.tp_rank,
                source.rank.pp_rank,
                source.rank.node,
                source.rank.pid,
            )
            run_id, cols = rank.run_id, item.batch.wave_columns
            keep_waves = set()
            for i, wave in enumerate(cols.wave):
                if (run_id, wave) in marked or sampled(wave, self.settings.keep_one_in):
                    keep_waves.add(wave)
                    spans += wave_spans(rank, cols, i)
                    kept_records.append(len(spans))
                    kept += 1
                else:
                    sampled_out += 1
            coll = columns_of(item.batch)
            keep_waves.update(w for w in coll.wave if (run_id, w) in marked)
            for cw in to_waves(coll, keep_waves):
                spans += collective_spans(rank, cw)
                spans += slow_call_spans(rank, cw)
        mark_errors(spans)
        if kept:
            self.decisions.labels("exported").inc(kept)
        if sampled_out:
            self.decisions.labels("sampled_out").inc(sampled_out)
        return self._send(spans, kept_records)

    def _send(self, spans: list[Span], record_ends: list[int]) -> int:
        step = self.settings.max_spans_per_request
        sent = 0
        for begin in range(0, len(spans), step):
            chunk = spans[begin : begin + step]
            request = trace_service_pb2.ExportTraceServiceRequest()
            rs = request.resource_spans.add(resource=self._resource)
            ss = rs.scope_spans.add()
            ss.scope.name = "ascend_guard.sidecar"
            ss.spans.extend(to_otlp(span) for span in chunk)
            try:
                self._stub.Export(request, timeout=self.settings.timeout_s)
                sent += len(chunk)
            except grpc.RpcError as exc:
                # records whose spans ended in this chunk are lost
                lost = sum(1 for end in record_ends if begin < end <= begin + step)
                self._drops.add(STAGE_EXPORT, "export_failed", lost)
                log.warning("otlp_export_failed", spans=len(chunk), code=str(exc.code()))
        self.spans_exported += sent
        return sent

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.settings.timeout_s + 5)
        else:
            self.export_due(float("inf"))
        self._channel.close()
