"""gRPC ingest: one long-lived client stream per worker rank; the first half of the record path.

Messages are parsed here rather than by gRPC's generated handler, so a malformed or oversized
message is answered with a status that says what was wrong (INVALID_ARGUMENT or
RESOURCE_EXHAUSTED), counted in `ascend_guard_ingest_rejected_total`, logged at a bounded
rate, and only that stream ends; the sidecar keeps serving every other one.

A valid batch updates what must not wait (liveness, heartbeats, hang state, cross-rank
alignment, incidents) and is then put on the bounded queue to the writer
(telemetry/pipeline/writer.py), which feeds metrics, the store and the OTLP exporter.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol

import grpc
import structlog
from google.protobuf.message import DecodeError

from telemetry.crossrank.view import CrossRankView
from telemetry.ingest.validation import validate_batch
from telemetry.metrics.waves import SidecarMetrics
from telemetry.metrics.workload import RankKey, WorkloadBook
from telemetry.pipeline.ratelimit import RateLimitedLog
from telemetry.pipeline.writer import STAGE_INGEST, BoundedQueue, Drops, Item, RankSource
from telemetry.store.incidents import IncidentLedger
from telemetry.wire import workload
from telemetry.wire.labels import EngineLabels
from telemetry.wire.proto import guard_pb2
from telemetry.wire.schema import InvalidBatch
from telemetry.wire.wave_columns import to_columns
from telemetry.wire.workload import NO_WORKLOAD, Workload

log = structlog.get_logger("ascend_guard.ingest")

SERVICE = "ascend_guard.v1.GuardIngest"
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024


class _Refused:
    """What the deserializer hands over instead of a Batch when the bytes are unusable."""

    __slots__ = ("code", "message", "reason")

    def __init__(self, code: grpc.StatusCode, reason: str, message: str) -> None:
        self.code = code
        self.reason = reason
        self.message = message


def _closed_by_worker(context: grpc.ServicerContext, settle_s: float = 0.2) -> bool:
    """Whether the request stream ended because the worker closed it. A connection that gRPC
    closed (a ping unanswered, a broken socket) also ends the loop, and the RPC turns inactive
    (cancelled) only a moment later: so wait that moment before calling it a goodbye."""
    deadline = time.monotonic() + settle_s
    while context.is_active():
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.01)
    return False


class RankView:
    """What the sidecar knows of one rank's stream right now (for logs and the CLI)."""

    __slots__ = ("batches", "engine", "last_wave", "rank", "source", "waves", "workload")

    def __init__(
        self, rank: guard_pb2.RankInfo, engine: str, workload: Workload = NO_WORKLOAD
    ) -> None:
        self.rank = rank
        self.engine = engine
        self.workload = workload  # the Kubernetes pod the worker named (telemetry/wire/workload.py)
        labels = (engine, str(rank.dp_rank), str(rank.tp_rank), str(rank.pp_rank))
        process = (rank.run_id, engine, rank.dp_rank, rank.tp_rank, rank.pp_rank, rank.pid)
        self.source = RankSource(rank, engine, labels, process)
        self.batches = 0
        self.waves = 0
        self.last_wave = 0


def _stream_workload(context: grpc.ServicerContext) -> Workload:
    """The Kubernetes workload the stream's metadata names (none from an in-process caller
    without metadata)."""
    metadata = getattr(context, "invocation_metadata", None)
    return workload.from_metadata(metadata() if metadata is not None else None)


def _rank_key(view: RankView) -> RankKey:
    rank = view.rank
    return (view.engine, rank.dp_rank, rank.tp_rank, rank.pp_rank)


class RingHooks(Protocol):
    def attach(self, view: RankView) -> None: ...

    def detach(self, view: RankView) -> None: ...

    def drain(self, view: RankView) -> None: ...


class IngestService:
    """Receives batches, validates them, updates liveness, and queues them for the writer."""

    def __init__(
        self,
        metrics: SidecarMetrics,
        queue: BoundedQueue | None,
        drops: Drops,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        engines: EngineLabels | None = None,
        incidents: IncidentLedger | None = None,
        cross_rank: CrossRankView | None = None,
    ) -> None:
        self.metrics = metrics
        self.queue = queue
        self.drops = drops
        self.max_message_bytes = max_message_bytes
        self.engines = engines or EngineLabels()
        self.incidents = incidents
        self.cross_rank = (
            cross_rank  # collectives, skew, hang verdicts (telemetry/crossrank/view.py)
        )
        # engine membership (telemetry/crossrank/roster.py): told when an engine's first stream opens
        # and when its last one ends (clean: the worker closed it)
        self.on_engine_joined: Callable[[str], None] | None = None
        self.on_engine_idle: Callable[[str, bool], None] | None = None
        # refuses a stream whose engine label another live run holds (why, or None)
        self.check_engine: Callable[[str, guard_pb2.RankInfo], str | None] | None = None
        # the wave rings of this node's ranks (telemetry/ingest/ring_drain.py): told when a
        # rank's stream registers and when it ends, before anything else hears of the end
        self.rings: RingHooks | None = None
        self._lock = threading.Lock()
        self._refusal_log = RateLimitedLog(log.warning)
        # a client that opens streams in a loop must not flood the log either
        self._stream_log = RateLimitedLog(log.info, burst=100)
        self.streams: dict[int, RankView] = {}
        # the Kubernetes workload of each rank (ascend_guard_rank_workload_info)
        self.workloads = WorkloadBook()
        self._next_stream = 0
        self.received_records = 0

    def connected(self) -> list[tuple[str, guard_pb2.RankInfo]]:
        """(engine, rank) of every stream open right now."""
        with self._lock:
            return [(v.engine, v.rank) for v in self.streams.values()]

    # -- gRPC plumbing ----------------------------------------------------------------------
    def handler(self) -> grpc.GenericRpcHandler:
        method = grpc.stream_unary_rpc_method_handler(
            self.stream,
            request_deserializer=self._deserialize,
            response_serializer=guard_pb2.Ack.SerializeToString,
        )
        return grpc.method_handlers_generic_handler(SERVICE, {"Stream": method})

    def _deserialize(self, data: bytes) -> tuple[guard_pb2.Batch, int] | _Refused:
        if len(data) > self.max_message_bytes:
            return _Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "oversized",
                f"message of {len(data)} bytes exceeds the sidecar's limit of "
                f"{self.max_message_bytes} bytes",
            )
        batch = guard_pb2.Batch()
        try:
            batch.ParseFromString(data)
        except DecodeError as exc:
            # includes strings that are not UTF-8: protobuf refuses them while parsing
            return _Refused(
                grpc.StatusCode.INVALID_ARGUMENT, "malformed", f"not a Batch message: {exc}"
            )
        return batch, len(data)

    # -- the RPC ----------------------------------------------------------------------------
    def stream(
        self,
        requests: Iterator[tuple[guard_pb2.Batch, int] | _Refused],
        context: grpc.ServicerContext,
    ) -> guard_pb2.Ack:
        with self._lock:
            self._next_stream += 1
            stream_id = self._next_stream
        view: RankView | None = None
        batches = waves = 0
        clean = False
        try:
            for message in requests:
                if isinstance(message, _Refused):
                    self._refuse(context, message.code, message.reason, message.message)
                batch, nbytes = message
                v1 = bool(batch.waves)
                if v1:
                    to_columns(batch)
                dropped: list[tuple[str, str]] = []
                try:
                    records = validate_batch(
                        batch, rank_known=view is not None, v1=v1, dropped=dropped
                    )
                    if view is not None and batch.HasField("rank") and batch.rank != view.rank:
                        raise InvalidBatch(
                            "batch.rank: differs from the rank this stream named first; "
                            "one stream carries one rank"
                        )
                except InvalidBatch as exc:
                    self.drops.add(STAGE_INGEST, "invalid", len(batch.wave_columns.wave))
                    self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "invalid", str(exc))
                for kind, problem in dropped:  # the rest of the batch goes on
                    self._drop_item(context, kind, problem)
                if view is None:
                    problem = self.check_engine and self.check_engine(
                        self.engines.label(batch.rank.engine or "default"), batch.rank
                    )
                    if problem:
                        self._refuse(
                            context, grpc.StatusCode.FAILED_PRECONDITION, "engine_in_use", problem
                        )
                    view = self._register(stream_id, batch.rank, _stream_workload(context))
                elif not batch.HasField("rank"):
                    batch.rank.CopyFrom(view.rank)  # wire v2: named once per stream
                if self.rings is not None and batch.HasField("heartbeat"):
                    # the waves the rank wrote before this heartbeat arrive before it, as on
                    # the gRPC path, where they travel in the same or an earlier batch
                    self.rings.drain(view)
                self.ingest(view, batch, records, nbytes)
                batches += 1
                waves += records
            clean = _closed_by_worker(context)
        finally:
            if view is not None:
                self._unregister(stream_id, view, clean)
        return guard_pb2.Ack(batches=batches, waves=waves)

    def _refuse(
        self, context: grpc.ServicerContext, code: grpc.StatusCode, reason: str, message: str
    ) -> None:
        self.metrics.rejected.labels(reason).inc()  # every refusal counted; a few logged
        self._refusal_log(
            "ingest_refused", reason, reason=reason, detail=message[:500], peer=context.peer()
        )
        context.abort(code, message)

    def _drop_item(self, context: grpc.ServicerContext, kind: str, problem: str) -> None:
        """One bad incident or probe reading dropped from an otherwise valid batch."""
        reason = f"invalid_{kind}"
        self.metrics.rejected.labels(reason).inc()
        self._refusal_log(
            "ingest_item_dropped", reason, reason=reason, detail=problem[:500], peer=context.peer()
        )

    def _register(
        self, stream_id: int, rank: guard_pb2.RankInfo, where: Workload = NO_WORKLOAD
    ) -> RankView:
        engine = self.engines.label(rank.engine or "default")
        own = guard_pb2.RankInfo()
        own.CopyFrom(rank)
        view = RankView(own, engine, where)
        with self._lock:
            self.streams[stream_id] = view
        if self.rings is not None:
            self.rings.attach(view)
        self.workloads.opened(_rank_key(view), where)
        self.metrics.ranks_connected.labels(engine, str(rank.dp_rank)).inc()
        if self.on_engine_joined is not None:
            self.on_engine_joined(engine)
        self._stream_log(
            "rank_connected",
            "connected",
            engine=engine,
            run_id=rank.run_id,
            dp=rank.dp_rank,
            tp=rank.tp_rank,
            pp=rank.pp_rank,
            node=rank.node,
            pid=rank.pid,
            runner=rank.runner,
            namespace=where.namespace,
            pod=where.pod,
            device=where.device,
            model_name=where.model_name,
        )
        return view

    def _unregister(self, stream_id: int, view: RankView, clean: bool = True) -> None:
        if self.rings is not None:  # its last waves first: they are not a rank that is gone
            self.rings.detach(view)
        with self._lock:
            self.streams.pop(stream_id, None)
            last = not any(v.engine == view.engine for v in self.streams.values())
        self.metrics.ranks_connected.labels(view.engine, str(view.rank.dp_rank)).dec()
        self.workloads.closed(_rank_key(view))
        if self.cross_rank is not None:
            self.cross_rank.rank_gone(view.engine, view.rank, clean)
        rank = view.rank
        self._stream_log(
            "rank_disconnected",
            "disconnected",
            engine=view.engine,
            dp=rank.dp_rank,
            tp=rank.tp_rank,
            pp=rank.pp_rank,
            waves=view.waves,
            last_wave=view.last_wave,
            clean=clean,
        )
        if last and self.on_engine_idle is not None:
            self.on_engine_idle(view.engine, clean)

    def ingest(self, view: RankView, batch: guard_pb2.Batch, records: int, nbytes: int) -> None:
        """A validated batch of `view`'s rank (from its stream, or drained from its ring):
        liveness first, then the queue to the writer."""
        source = view.source
        engine = source.engine
        if self.cross_rank is not None:  # first: liveness must not wait for anything else
            self.cross_rank.observe(engine, batch)
        if batch.HasField("heartbeat"):
            self.metrics.observe_heartbeat(source.labels, batch.heartbeat.time_unix_nano)
        if self.incidents is not None:
            for incident in batch.incidents:
                self.incidents.add(engine, batch.rank, incident)
        for probe in batch.probes:
            if not self.metrics.observe_probe(source.labels, probe, source.process):
                self.metrics.rejected.labels("unknown_probe").inc()
        view.batches += 1
        if records:
            view.waves += records
            view.last_wave = max(view.last_wave, max(batch.wave_columns.wave))
        if records:
            with self._lock:
                self.received_records += records
        if self.queue is not None:
            self.queue.put(Item(source, batch, nbytes, records))
