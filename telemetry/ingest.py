"""gRPC ingest: one long-lived client stream per worker rank.

Messages are parsed here rather than by gRPC's generated handler, so a malformed or oversized
message is answered with a status that says what was wrong (INVALID_ARGUMENT or
RESOURCE_EXHAUSTED), counted in `ascend_guard_ingest_rejected_total`, and only that stream
ends; the sidecar keeps serving every other one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import grpc
import structlog
from google.protobuf.message import DecodeError

from telemetry.crossrank import CrossRankView
from telemetry.incidents import IncidentLedger
from telemetry.labels import EngineLabels
from telemetry.metrics import SidecarMetrics
from telemetry.proto import guard_pb2
from telemetry.ratelimit import RateLimitedLog
from telemetry.traces import WaveTracer
from telemetry.validation import InvalidBatch, validate_batch

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


class RankView:
    """What the sidecar knows of one rank's stream right now (for logs and the CLI)."""

    __slots__ = ("batches", "engine", "last_wave", "rank", "waves")

    def __init__(self, rank: guard_pb2.RankInfo, engine: str) -> None:
        self.rank = rank
        self.engine = engine
        self.batches = 0
        self.waves = 0
        self.last_wave = 0


class IngestService:
    """Receives batches, validates them, and feeds metrics and traces."""

    def __init__(
        self,
        metrics: SidecarMetrics,
        tracer: WaveTracer | None,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        engines: EngineLabels | None = None,
        on_batch: Callable[[guard_pb2.Batch], None] | None = None,
        incidents: IncidentLedger | None = None,
        cross_rank: CrossRankView | None = None,
    ) -> None:
        self.metrics = metrics
        self.tracer = tracer
        self.max_message_bytes = max_message_bytes
        self.engines = engines or EngineLabels()
        self._on_batch = on_batch
        self.incidents = incidents
        self.cross_rank = cross_rank  # collectives, skew, hang verdicts (telemetry/crossrank.py)
        # engine membership (telemetry/roster.py): told when an engine's first stream opens
        # and when its last one ends (clean: the worker closed it)
        self.on_engine_joined: Callable[[str], None] | None = None
        self.on_engine_idle: Callable[[str, bool], None] | None = None
        # refuses a stream whose engine label another live run holds (why, or None)
        self.check_engine: Callable[[str, guard_pb2.RankInfo], str | None] | None = None
        self._lock = threading.Lock()
        self._refusal_log = RateLimitedLog(log.warning)
        # a client that opens streams in a loop must not flood the log either
        self._stream_log = RateLimitedLog(log.info, burst=100)
        self.streams: dict[int, RankView] = {}
        self._next_stream = 0

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

    def _deserialize(self, data: bytes) -> guard_pb2.Batch | _Refused:
        if len(data) > self.max_message_bytes:
            return _Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED, "oversized",
                f"message of {len(data)} bytes exceeds the sidecar's limit of {self.max_message_bytes} bytes",
            )  # fmt: skip
        batch = guard_pb2.Batch()
        try:
            batch.ParseFromString(data)
        except DecodeError as exc:
            return _Refused(
                grpc.StatusCode.INVALID_ARGUMENT, "malformed", f"not a Batch message: {exc}"
            )
        return batch

    # -- the RPC ----------------------------------------------------------------------------
    def stream(
        self, requests: Iterator[guard_pb2.Batch | _Refused], context: grpc.ServicerContext
    ) -> guard_pb2.Ack:
        with self._lock:
            self._next_stream += 1
            stream_id = self._next_stream
        view: RankView | None = None
        batches = waves = 0
        clean = False
        try:
            for batch in requests:
                if isinstance(batch, _Refused):
                    self._refuse(context, batch.code, batch.reason, batch.message)
                try:
                    validate_batch(batch)
                except InvalidBatch as exc:
                    self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "invalid", str(exc))
                if view is None:
                    problem = self.check_engine and self.check_engine(
                        self.engines.label(batch.rank.engine or "default"), batch.rank
                    )
                    if problem:
                        self._refuse(
                            context, grpc.StatusCode.FAILED_PRECONDITION, "engine_in_use", problem
                        )
                    view = self._register(stream_id, batch.rank)
                self._ingest(view, batch)
                batches += 1
                waves += len(batch.waves)
            # the worker closed its stream; a dropped connection may also end the loop, but
            # then the RPC is no longer active
            clean = context.is_active()
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

    def _register(self, stream_id: int, rank: guard_pb2.RankInfo) -> RankView:
        engine = self.engines.label(rank.engine or "default")
        view = RankView(guard_pb2.RankInfo(), engine)
        view.rank.CopyFrom(rank)
        with self._lock:
            self.streams[stream_id] = view
        self.metrics.ranks_connected.labels(engine, str(rank.dp_rank)).inc()
        if self.on_engine_joined is not None:
            self.on_engine_joined(engine)
        self._stream_log(
            "rank_connected", "connected", engine=engine, run_id=rank.run_id, dp=rank.dp_rank, tp=rank.tp_rank, pp=rank.pp_rank,
            node=rank.node, pid=rank.pid, runner=rank.runner,
        )  # fmt: skip
        return view

    def _unregister(self, stream_id: int, view: RankView, clean: bool = True) -> None:
        with self._lock:
            self.streams.pop(stream_id, None)
            last = not any(v.engine == view.engine for v in self.streams.values())
        self.metrics.ranks_connected.labels(view.engine, str(view.rank.dp_rank)).dec()
        if self.cross_rank is not None:
            self.cross_rank.rank_gone(view.engine, view.rank)
        rank = view.rank
        self._stream_log(
            "rank_disconnected", "disconnected", engine=view.engine, dp=rank.dp_rank, tp=rank.tp_rank, pp=rank.pp_rank,
            waves=view.waves, last_wave=view.last_wave, clean=clean,
        )  # fmt: skip
        if last and self.on_engine_idle is not None:
            self.on_engine_idle(view.engine, clean)

    def _ingest(self, view: RankView, batch: guard_pb2.Batch) -> None:
        rank = batch.rank
        engine = self.engines.label(rank.engine or "default")
        labels = (engine, str(rank.dp_rank), str(rank.tp_rank), str(rank.pp_rank))
        source = (rank.run_id, engine, rank.dp_rank, rank.tp_rank, rank.pp_rank, rank.pid)
        if self.cross_rank is not None:  # first: liveness must not wait for the span work
            self.cross_rank.observe(engine, batch)
        self.metrics.observe_batch(labels, batch, source)
        if self.tracer is not None:
            for wave in batch.waves:
                self.tracer.record(rank, engine, wave)
        if self.incidents is not None:
            for incident in batch.incidents:
                self.incidents.add(engine, rank, incident)
        for probe in batch.probes:
            if not self.metrics.observe_probe(labels, probe, source):
                self.metrics.rejected.labels("unknown_probe").inc()
        view.batches += 1
        view.waves += len(batch.waves)
        if batch.waves:
            view.last_wave = max(view.last_wave, max(w.wave for w in batch.waves))
        if self._on_batch is not None:
            self._on_batch(batch)
