"""OTLP/gRPC export of wave and request spans, off the ingest path, with a tail-sampling policy.

The writer hands every batch to `OtlpExporter.write`, which only queues it (bounded in bytes;
a full queue drops the batch's records, counted as stage `otlp_export`, reason `queue_full`).
The exporter's own thread waits `decision_delay_s` so that the other ranks' rows of a wave and
its incidents can arrive, then keeps a wave (all its ranks) when

- the wave has an incident or a hang verdict (`on_incident`, fed by the incident ledger): always,
- any rank's step took `slow_wave_s` or longer, or
- it is one of every `keep_one_in` of the rest (chosen from the wave number, so every rank and
  every sidecar keeps the same waves; 1 keeps every wave).

The wave root and this node's rank spans say why it was kept (`ascend_guard.kept_for`:
incident, slow or sampled), so a Collector's tail sampler downstream can keep a whole trace that
any node marked (deploy/otel/: a wave slow on one node is kept with every node's ranks). Kept waves'
spans are built with the same builder as `ascend-guard trace` (telemetry/spans/builders.py); wave
roots link to the request traces of the requests they ran, as the store has them.

Request traces (`requests`, on by default): when the store commits a request's finish, its trace
(telemetry/spans/requests.py: the request, a span per wave it ran in linked to that wave's trace,
its incidents) is built from the store after the same delay and exported whole.

Every span goes out under the resource of the rank (or, for a wave root and a request, the
replica) that made it (telemetry/export/resource.py), in requests of at most
`max_spans_per_request`. A failed request drops its records, counted (reason `export_failed`).
Defaults: `ExportSettings`.
"""

from __future__ import annotations

import collections
import dataclasses
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from urllib.parse import urlparse

import grpc
import structlog
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2
from prometheus_client import CollectorRegistry, Counter

from telemetry import store as store_api
from telemetry.export.resource import (
    ResourceKey,
    encoded_attributes,
    resource,
    resource_attributes,
)
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
from telemetry.spans.requests import build_trace, link_wave_spans
from telemetry.store import RankRow
from telemetry.store.requests import requests_of_trace
from telemetry.wire import schema
from telemetry.wire.collective_columns import columns_of, to_waves
from telemetry.wire.workload import NO_WORKLOAD, Workload

log = structlog.get_logger("ascend_guard.export")

SCOPE_VERSION = "1"

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
    requests: bool = True  # export each finished request's trace (needs the store)
    max_pending_requests: int = 100_000  # finished requests waiting; more are dropped, counted


def sampled(wave: int, keep_one_in: int) -> bool:
    """1 in `keep_one_in` waves, the same ones everywhere (a hash of the wave number)."""
    return keep_one_in <= 1 or ((wave * _GOLDEN) & _MASK64) % keep_one_in == 0


# field numbers of the attributes in OTLP's Span, Span.Event and Span.Link (trace.proto)
_SPAN_ATTRIBUTES, _EVENT_ATTRIBUTES, _LINK_ATTRIBUTES = 9, 3, 4


def to_otlp(span: Span) -> trace_pb2.Span:
    out = trace_pb2.Span(
        trace_id=span.trace_id.to_bytes(16, "big"),
        span_id=span.span_id.to_bytes(8, "big"),
        name=span.name,
        kind=trace_pb2.Span.SPAN_KIND_INTERNAL,
        start_time_unix_nano=span.start_ns,
        end_time_unix_nano=span.end_ns,
    )
    out.MergeFromString(encoded_attributes(_SPAN_ATTRIBUTES, span.attributes))
    if span.parent_id is not None:
        out.parent_span_id = span.parent_id.to_bytes(8, "big")
    if span.status == STATUS_ERROR:
        out.status.code = trace_pb2.Status.STATUS_CODE_ERROR
    for event in span.events:
        added = out.events.add(name=event["name"], time_unix_nano=event["time_ns"])
        added.MergeFromString(encoded_attributes(_EVENT_ATTRIBUTES, event["attributes"]))
    for link in span.links:
        added = out.links.add(
            trace_id=link["trace_id"].to_bytes(16, "big"),
            span_id=link["span_id"].to_bytes(8, "big"),
        )
        added.MergeFromString(encoded_attributes(_LINK_ATTRIBUTES, link.get("attributes", {})))
    return out


def _channel(endpoint: str) -> grpc.Channel:
    url = urlparse(endpoint if "://" in endpoint else f"http://{endpoint}")
    target = url.netloc or url.path
    if url.scheme == "https":
        return grpc.secure_channel(target, grpc.ssl_channel_credentials())
    return grpc.insecure_channel(target)


KEPT_FOR = schema.attr("kept_for")  # on wave roots and rank spans: incident | slow | sampled
INCIDENT, SLOW, SAMPLED = "incident", "slow", "sampled"

WorkloadOf = Callable[[str, int, int, int], Workload]  # (engine, dp, tp, pp) -> its workload


class OtlpExporter:
    """A `BatchSink` that exports tail-sampled wave spans and request traces over OTLP/gRPC."""

    stage = STAGE_EXPORT

    def __init__(
        self,
        settings: ExportSettings,
        drops: Drops,
        registry: CollectorRegistry,
        node: str,
        *,
        store_path: str | None = None,
        workload_of: WorkloadOf | None = None,
    ) -> None:
        self.settings = settings
        self._drops = drops
        self._node = node
        self._store_path = store_path
        self._conn = None  # the exporter thread's read-only store connection
        self._workload_of = workload_of or (lambda engine, dp, tp, pp: NO_WORKLOAD)
        self._slow_ns = int(settings.slow_wave_s * 1e9)
        self._lock = threading.Lock()
        self._pending: collections.deque[tuple[float, Item]] = collections.deque()
        self._pending_bytes = 0
        self._incidents: collections.deque[dict] = collections.deque(maxlen=10_000)
        # (run, wave) -> why it is kept: incident outranks slow
        self._marked: collections.OrderedDict[tuple[str, int], str] = collections.OrderedDict()
        # finished requests, (rank row, pid, idx), with the time the store committed them
        self._finished: collections.deque[tuple[float, tuple[int, int, int]]] = collections.deque()
        self._exported_traces: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._pids: dict[ResourceKey, int] = {}  # a rank's worker pid, from its batches
        self._resources: dict[tuple[ResourceKey, int, Workload], resource_pb2.Resource] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._channel = _channel(settings.endpoint)
        self._stub = trace_service_pb2_grpc.TraceServiceStub(self._channel)
        self.decisions = Counter(
            "ascend_guard_otlp_records",
            "Wave records (rank-waves) the OTLP exporter decided on: exported or sampled out.",
            ("decision",),
            registry=registry,
        )
        self.request_traces = Counter(
            "ascend_guard_otlp_request_traces",
            "Request traces the OTLP exporter handled: exported, or dropped (queue_full, "
            "not_found: pruned from the store before export, export_failed).",
            ("outcome",),
            registry=registry,
        )
        self.spans_exported = 0

    # -- writer thread ----------------------------------------------------------------------
    def write(self, items: Sequence[Item]) -> None:
        now = time.monotonic()
        for item in items:
            if not item.records and not len(columns_of(item.batch).wave):
                continue
            rank = item.source.rank
            key = (rank.run_id, item.source.engine, rank.dp_rank, rank.tp_rank, rank.pp_rank)
            self._pids[key] = rank.pid
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

    def on_requests_finished(self, finished: list[tuple[int, int, int]]) -> None:
        """The store committed these requests' finish (its writer thread): export their traces
        once the delay has passed."""
        now = time.monotonic()
        with self._lock:
            room = self.settings.max_pending_requests - len(self._finished)
            self._finished.extend((now, key) for key in finished[: max(room, 0)])
        if len(finished) > room:
            self.request_traces.labels("queue_full").inc(len(finished) - max(room, 0))

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
                self._mark(run_id, cols.wave[i], SLOW)

    def _mark(self, run_id: str, wave: int, why: str) -> None:
        with self._lock:
            if self._marked.get((run_id, wave)) != INCIDENT:
                self._marked[(run_id, wave)] = why
            self._marked.move_to_end((run_id, wave))
            while len(self._marked) > self.settings.max_marked_waves:
                self._marked.popitem(last=False)

    def on_incident(self, row: dict) -> None:
        """An incident was recorded (any thread): keep its wave, export its span."""
        if row["wave"]:
            self._mark(row["run_id"], row["wave"], INCIDENT)
            self._incidents.append(row)

    # -- exporter thread --------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ascend-guard-otlp", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.export_due(time.monotonic() - self.settings.decision_delay_s)
        self.export_due(float("inf"))
        self._close_store()

    def _close_store(self) -> None:
        if self._conn is not None:  # on the thread that opened it, as sqlite3 requires
            self._conn.close()
            self._conn = None

    def export_due(self, older_than: float) -> int:
        """Decide on and export what has waited long enough; return the spans sent."""
        due: list[Item] = []
        with self._lock:
            while self._pending and self._pending[0][0] <= older_than:
                _, item = self._pending.popleft()
                self._pending_bytes -= item.nbytes
                due.append(item)
            marked = dict(self._marked) if due else {}
            finished = []
            while self._finished and self._finished[0][0] <= older_than:
                finished.append(self._finished.popleft()[1])
        incidents = []
        while self._incidents:
            incidents.append(self._incidents.popleft())
        out: list[tuple[ResourceKey, Span]] = [
            (_incident_key(row), incident_span(row)) for row in incidents
        ]
        kept_records: list[int] = []  # records per request chunk, for counting failures
        roots: list[Span] = []
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
            key = (rank.run_id, rank.engine, rank.dp, rank.tp, rank.pp)
            replica = (rank.run_id, rank.engine, rank.dp, None, None)
            run_id, cols = rank.run_id, item.batch.wave_columns
            keep_waves = set()
            for i, wave in enumerate(cols.wave):
                why = marked.get((run_id, wave))
                if why is None and sampled(wave, self.settings.keep_one_in):
                    why = SAMPLED
                if why is None:
                    sampled_out += 1
                    continue
                keep_waves.add(wave)
                for span in wave_spans(rank, cols, i):
                    if span.parent_id is None:
                        span.attributes[KEPT_FOR] = why
                        roots.append(span)
                        out.append((replica, span))
                        continue
                    if span.name == "rank":  # this node's mark, where the root is another's
                        span.attributes[KEPT_FOR] = why
                    out.append((key, span))
                kept_records.append(len(out))
                kept += 1
            coll = columns_of(item.batch)
            keep_waves.update(w for w in coll.wave if (run_id, w) in marked)
            for cw in to_waves(coll, keep_waves):
                out += [(key, span) for span in collective_spans(rank, cw)]
                out += [(key, span) for span in slow_call_spans(rank, cw)]
        mark_errors([span for _, span in out])
        conn = self._store() if (roots or finished) else None
        if conn is not None and roots:
            link_wave_spans(conn, roots)
        traces = self._request_traces(conn, finished) if finished else []
        for request_key, spans in traces:
            out += [(request_key, span) for span in spans]
        if kept:
            self.decisions.labels("exported").inc(kept)
        if sampled_out:
            self.decisions.labels("sampled_out").inc(sampled_out)
        sent = self._send(out, kept_records)
        if traces:
            self.request_traces.labels("exported").inc(len(traces))
        return sent

    def _store(self) -> sqlite3.Connection | None:
        """The exporter thread's read-only store connection (None: no store yet, or none)."""
        if self._conn is None and self._store_path:
            try:
                self._conn = store_api.connect(self._store_path, readonly=True)
            except (OSError, sqlite3.Error) as exc:
                log.warning("otlp_store_unreadable", path=self._store_path, error=str(exc))
                return None
        return self._conn

    def _request_traces(
        self, conn: sqlite3.Connection | None, finished: list[tuple[int, int, int]]
    ) -> list[tuple[ResourceKey, list[Span]]]:
        """The traces of these finished requests (each trace once), under their replica."""
        if conn is None:
            self.request_traces.labels("not_found").inc(len(finished))
            return []
        built_traces: list[tuple[ResourceKey, list[Span]]] = []
        missing = 0
        for rank_row, pid, idx in finished:
            found = conn.execute(
                "SELECT trace_hi, trace_lo FROM requests WHERE rank = ? AND pid = ? AND idx = ?",
                (rank_row, pid, idx),
            ).fetchone()
            if found is None:
                missing += 1
                continue
            trace_id = (found[0] % 2**64) << 64 | (found[1] % 2**64)
            if trace_id in self._exported_traces:
                continue  # another PP stage's finish of the same request
            self._exported_traces[trace_id] = None
            while len(self._exported_traces) > self.settings.max_pending_requests:
                self._exported_traces.popitem(last=False)
            rows = requests_of_trace(conn, trace_id)
            built = build_trace(conn, rows) if rows else None
            if built is None:
                missing += 1
                continue
            head = built.requests[0]
            built_traces.append(((head.run_id, head.engine, head.dp, None, None), built.spans))
        if missing:
            self.request_traces.labels("not_found").inc(missing)
        return built_traces

    def _resource(self, key: ResourceKey) -> resource_pb2.Resource:
        run_id, engine, dp, tp, pp = key
        pid = self._pids.get(key, 0) if tp is not None else 0
        workload = self._workload_of(engine, dp, 0 if tp is None else tp, 0 if pp is None else pp)
        cache_key = (key, pid, workload)
        found = self._resources.get(cache_key)
        if found is None:
            if len(self._resources) > 4096:
                self._resources.clear()
            found = resource(resource_attributes(key, self._node, pid, workload))
            self._resources[cache_key] = found
        return found

    def _send(self, spans: list[tuple[ResourceKey, Span]], record_ends: list[int]) -> int:
        step = self.settings.max_spans_per_request
        sent = 0
        for begin in range(0, len(spans), step):
            chunk = spans[begin : begin + step]
            request = trace_service_pb2.ExportTraceServiceRequest()
            by_resource: dict[ResourceKey, list[Span]] = {}
            for key, span in chunk:
                by_resource.setdefault(key, []).append(span)
            for key, members in by_resource.items():
                rs = request.resource_spans.add(resource=self._resource(key))
                ss = rs.scope_spans.add()
                ss.scope.name = schema.SCOPE_NAME
                ss.scope.version = SCOPE_VERSION
                ss.spans.extend(to_otlp(span) for span in members)
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
            self._close_store()
        self._channel.close()


def _incident_key(row) -> ResourceKey:
    """An incident's rank (a sidecar's own incident, as a hang verdict: its replica)."""
    dp = row["dp"] if row["dp"] is not None else 0
    if row["tp"] is None:
        return (row["run_id"] or "", row["engine"] or "", dp, None, None)
    return (row["run_id"] or "", row["engine"] or "", dp, row["tp"], row["pp"])
