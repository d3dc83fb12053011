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
spans are written as OTLP bytes straight from the batch's columns (telemetry/export/otlp_wire.py:
the names, ids, times and attributes `ascend-guard trace` builds with telemetry/spans/builders.py,
without a span object each); wave roots link to the request traces of the requests they ran, as
the store has them. An incident's span has status error, and so have the rank span it hangs under
and its wave's root, also when they go out in a later round than the incident (the exporter
remembers the last `max_marked_waves` incidents' spans).

Request traces (`requests`, on by default): when the store commits a request's finish, its trace
(telemetry/spans/requests.py: the request, a span per wave it ran in linked to that wave's trace,
its incidents) is built from the store after the same delay and exported whole. A request that
came with a W3C `traceparent` has its root link to that trace and span.

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
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.trace.v1 import trace_pb2
from prometheus_client import CollectorRegistry, Counter

from telemetry import store as store_api
from telemetry.export import otlp_wire
from telemetry.export.resource import ResourceKey, resource, resource_attributes
from telemetry.pipeline.writer import STAGE_EXPORT, Drops, Item
from telemetry.spans.builders import (
    Span,
    incident_span,
    mark_errors,
    rank_end_ns,
)
from telemetry.spans.requests import build_trace, wave_links
from telemetry.store import RankRow
from telemetry.store.requests import requests_of_trace
from telemetry.wire import schema
from telemetry.wire.collective_columns import columns_of
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


def to_otlp(span: Span) -> trace_pb2.Span:
    """A built span as an OTLP Span message (parsed from the exporter's own bytes)."""
    return trace_pb2.Span.FromString(otlp_wire.encode_span(span))


def _channel(endpoint: str) -> grpc.Channel:
    url = urlparse(endpoint if "://" in endpoint else f"http://{endpoint}")
    target = url.netloc or url.path
    if url.scheme == "https":
        return grpc.secure_channel(target, grpc.ssl_channel_credentials())
    return grpc.insecure_channel(target)


KEPT_FOR = schema.attr("kept_for")  # on wave roots and rank spans: incident | slow | sampled
INCIDENT, SLOW, SAMPLED = "incident", "slow", "sampled"
_KEPT_FOR = {
    why: otlp_wire.attribute(otlp_wire.SPAN_ATTRIBUTES, KEPT_FOR, why)
    for why in (INCIDENT, SLOW, SAMPLED)
}
# the gRPC method the request bytes go to (TraceService.Export)
_EXPORT = "/{}/Export".format(
    trace_service_pb2.DESCRIPTOR.services_by_name["TraceService"].full_name
)

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
        self._resources: dict[tuple[ResourceKey, int, Workload], bytes] = {}
        self._encoders: dict[RankRow, otlp_wire.RankWaves] = {}
        # what recent incidents hang under (rank span ids) and their traces: those spans go
        # out with status error, also when the incident was exported in an earlier round
        self._error_spans: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._error_traces: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._scope = otlp_wire.scope(schema.SCOPE_NAME, SCOPE_VERSION)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._channel = _channel(settings.endpoint)
        self._export = self._channel.unary_unary(
            _EXPORT,
            request_serializer=None,  # the request is already its bytes
            response_deserializer=trace_service_pb2.ExportTraceServiceResponse.FromString,
        )
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
        incident_spans = [incident_span(row) for row in incidents]
        self._remember_errors(incident_spans)
        errors = (set(self._error_spans), set(self._error_traces)) if self._error_spans else None
        out: list[tuple[ResourceKey, bytes]] = [
            (_incident_key(row), otlp_wire.encode_span(span))
            for row, span in zip(incidents, incident_spans, strict=True)
        ]
        # the decision: which rows of each batch are kept, and why
        plans = []
        roots: list[tuple[int, int]] = []  # (trace id, wave) of the kept wave roots
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
            encoder = self._encoder(rank)
            run_id, cols = rank.run_id, item.batch.wave_columns
            rows: list[tuple[int, bytes]] = []
            keep_waves = set()
            for i, wave in enumerate(cols.wave):
                why = marked.get((run_id, wave))
                if why is None and sampled(wave, self.settings.keep_one_in):
                    why = SAMPLED
                if why is None:
                    continue
                rows.append((i, _KEPT_FOR[why]))
                keep_waves.add(wave)
                if encoder.root:
                    roots.append((encoder.trace_base | wave, wave))
            kept += len(rows)
            sampled_out += len(cols.wave) - len(rows)
            coll = columns_of(item.batch)
            keep_waves.update(w for w in coll.wave if (run_id, w) in marked)
            plans.append((rank, encoder, cols, rows, coll, keep_waves))
        conn = self._store() if (roots or finished) else None
        links_of: dict[int, bytes] = {}
        if conn is not None and roots:
            found = wave_links(conn, roots)
            links_of = {trace: otlp_wire.links(links) for trace, links in found.items()}
        kept_records: list[int] = []  # where each kept record's spans end in `out`
        no_errors: set[int] = set()
        for rank, encoder, cols, rows, coll, keep_waves in plans:
            key = (rank.run_id, rank.engine, rank.dp, rank.tp, rank.pp)
            replica = (rank.run_id, rank.engine, rank.dp, None, None)
            error_spans, error_traces = errors or (no_errors, no_errors)
            for root, spans in encoder.waves(cols, rows, links_of, error_spans, error_traces):
                if root is not None:
                    out.append((replica, root))
                out += [(key, span) for span in spans]
                kept_records.append(len(out))
            if keep_waves:
                for spans in encoder.collectives(coll, keep_waves):
                    out += [(key, span) for span in spans]
        traces = self._request_traces(conn, finished) if finished else []
        for request_key, spans in traces:
            out += [(request_key, otlp_wire.encode_span(span)) for span in mark_errors(spans)]
        if kept:
            self.decisions.labels("exported").inc(kept)
        if sampled_out:
            self.decisions.labels("sampled_out").inc(sampled_out)
        sent = self._send(out, kept_records)
        if traces:
            self.request_traces.labels("exported").inc(len(traces))
        return sent

    def _encoder(self, rank: RankRow) -> otlp_wire.RankWaves:
        found = self._encoders.get(rank)
        if found is None:
            if len(self._encoders) > 4096:
                self._encoders.clear()
            found = self._encoders[rank] = otlp_wire.RankWaves(rank)
        return found

    def _remember_errors(self, incidents: list[Span]) -> None:
        """The spans an incident marks as errors (`mark_errors`): the rank span it hangs under
        and its wave's root."""
        limit = self.settings.max_marked_waves
        for span in incidents:
            for ids, value in (
                (self._error_spans, span.parent_id),
                (self._error_traces, span.trace_id),
            ):
                if value is None:
                    continue
                ids[value] = None
                ids.move_to_end(value)
                while len(ids) > limit:
                    ids.popitem(last=False)

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

    def _resource(self, key: ResourceKey) -> bytes:
        """The serialized Resource of these spans' rank (or replica)."""
        run_id, engine, dp, tp, pp = key
        pid = self._pids.get(key, 0) if tp is not None else 0
        workload = self._workload_of(engine, dp, 0 if tp is None else tp, 0 if pp is None else pp)
        cache_key = (key, pid, workload)
        found = self._resources.get(cache_key)
        if found is None:
            if len(self._resources) > 4096:
                self._resources.clear()
            attrs = resource_attributes(key, self._node, pid, workload)
            found = resource(attrs).SerializeToString()
            self._resources[cache_key] = found
        return found

    def _send(self, spans: list[tuple[ResourceKey, bytes]], record_ends: list[int]) -> int:
        step = self.settings.max_spans_per_request
        sent = 0
        for begin in range(0, len(spans), step):
            chunk = spans[begin : begin + step]
            by_resource: dict[ResourceKey, list[bytes]] = {}
            for key, span in chunk:
                by_resource.setdefault(key, []).append(span)
            request = b"".join(
                [
                    otlp_wire.resource_spans(self._resource(key), self._scope, members)
                    for key, members in by_resource.items()
                ]
            )
            try:
                self._export(request, timeout=self.settings.timeout_s)
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
