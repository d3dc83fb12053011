"""Worker side of the stream: a bounded buffer drained by a background thread over gRPC.

The engine thread only appends a tuple to a deque (`offer`), which never blocks. A daemon
thread turns buffered records into protobuf batches and feeds them into one long-lived gRPC
client stream to the sidecar, adds a heartbeat about once a second, and reconnects with
exponential backoff when the sidecar is away. While it is away records wait in the buffer; once
the buffer is full the oldest are dropped and counted, and the cumulative drop count travels
with every later batch so the sidecar can export it.

What a batch carries besides waves and incidents comes from its batch fillers, one protocol
(`BatchFiller`): the processor (heartbeat, error count, detector readings), the incident
reporter (hit counts), the collectives observer. The streamer is built with them at start-up;
`start(rank)` names the rank once the first wave knows it. Records, incidents and probe
readings offered before that simply wait in the buffers.

"The streamer thread", here and across the guard, means the thread that runs the batch
generator (`_batches`) and with it every batch filler: gRPC's own request thread, which pulls
the generator for the stream (it shows as `Thread-N (_run)` from `grpc._cython.cygrpc`). The
streamer's own thread (`ascend-guard-streamer`) connects, waits on the stream and reconnects.
Either holds the GIL while it runs Python, so the fillers' work is not free for the engine.

Incidents take another road, because none may be lost: they wait in their own queue, the ones
sent on a stream that breaks are sent again on the next one, and while the sidecar is away they
go to an on-disk spool (`guard/stream/spool.py`). The sidecar deduplicates them by id.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple, Protocol

import grpc
import structlog

from guard.stream.spool import IncidentSpool
from telemetry.wire import workload
from telemetry.wire.proto import guard_pb2, guard_pb2_grpc
from telemetry.wire.schema import WAVE_FIELDS, WIRE_VERSION
from telemetry.wire.transport import ClientSecurity

log = structlog.get_logger("ascend_guard.streamer")

# incidents per batch, and how many sent on one stream are kept for re-sending if it breaks
INCIDENTS_PER_BATCH = 256
RESEND_WINDOW = 4096
ProbeKey = tuple[str, tuple[tuple[str, str], ...]]


class WaveTuple(NamedTuple):
    """What the hot path records per wave; turned into a `WaveRecord` on the streamer thread."""

    wave: int
    start_unix_nano: int
    execute_ns: int
    sample_ns: int
    sample_offset_ns: int
    num_reqs: int
    prefill_reqs: int
    decode_reqs: int
    prefill_tokens: int
    decode_tokens: int
    sampled_tokens: int
    dummy: bool
    sampled: bool
    recompute_tokens: int = 0


# the wire's column order is the proto's (schema.WAVE_FIELDS); WaveTuple must match it
if WaveTuple._fields != WAVE_FIELDS:  # pragma: no cover - caught by every test run
    raise ImportError(f"WaveTuple fields {WaveTuple._fields} differ from WaveRecord {WAVE_FIELDS}")


class HeartbeatState(NamedTuple):
    last_wave: int
    phase: str
    phase_age_ns: int

    def fill(self, batch: guard_pb2.Batch) -> None:
        heartbeat = batch.heartbeat
        heartbeat.last_wave = self.last_wave
        heartbeat.phase = self.phase
        heartbeat.phase_age_ns = self.phase_age_ns


class BatchFiller(Protocol):
    """Adds its fields to each batch, on the streamer thread; must not block."""

    def fill_batch(self, batch: guard_pb2.Batch, with_heartbeat: bool) -> None: ...


class Streamer:
    """Ships records of one rank to the sidecar without ever blocking the caller."""

    def __init__(
        self,
        address: str,
        rank: guard_pb2.RankInfo | None = None,
        *,
        buffer_size: int,
        batch_max: int,
        flush_interval_s: float,
        heartbeat_interval_s: float,
        max_backoff_s: float,
        fillers: Sequence[BatchFiller] = (),
        spool: IncidentSpool | None = None,
        security: ClientSecurity | None = None,
        progress: Callable[[], int] | None = None,
    ) -> None:
        self._address = address
        # the rank's wave count, when its waves go another way (the wave ring): a batch is
        # still made each flush interval in which it moved, for what the fillers add per wave
        self._progress = progress
        self._rank = rank if rank is not None else guard_pb2.RankInfo()
        self._buffer: collections.deque[WaveTuple] = collections.deque()
        self._buffer_size = buffer_size
        self._batch_max = batch_max
        self._flush_interval_s = flush_interval_s
        self._heartbeat_interval_s = heartbeat_interval_s
        self._max_backoff_s = max_backoff_s
        self.fillers: list[BatchFiller] = list(fillers)
        self._spool = spool
        self._incidents: collections.deque[guard_pb2.Incident] = collections.deque()
        self._unconfirmed: collections.deque[guard_pb2.Incident] = collections.deque(
            maxlen=RESEND_WINDOW
        )
        self._probes: dict[ProbeKey, float] = {}
        self._probes_lock = threading.Lock()
        self.incidents_sent = 0
        self.incidents_spooled = 0
        self._security = security  # TLS and/or bearer token (telemetry/wire/transport.py)
        # the device this rank opened and the model it serves (guard/stream/placement.py), set
        # before `start`; sent with the Kubernetes workload on every stream
        self.device = ""
        self.model_name = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seq = 0
        self._stream_first_seq = 1  # seq of the current stream's first batch (carries the rank)
        self.dropped = 0
        self.sent_waves = 0
        self.connected = False
        self.connects = 0

    # -- engine thread ------------------------------------------------------------------------
    def offer(self, record: WaveTuple) -> None:
        """Queue one record; drop (and count) the oldest when the buffer is full."""
        buffer = self._buffer
        if len(buffer) >= self._buffer_size:
            try:  # noqa: SIM105 - hot path: cheaper than contextlib.suppress
                buffer.popleft()
            except IndexError:
                pass
            self.dropped += 1
        buffer.append(record)

    def offer_incident(self, incident: guard_pb2.Incident) -> None:
        """Queue an incident (any thread). Incidents are never dropped."""
        self._incidents.append(incident)

    def offer_probe(self, name: str, value: float, labels: dict[str, str]) -> None:
        """Set the latest reading of a probe (any thread); sent with the next batch."""
        with self._probes_lock:
            self._probes[(name, tuple(sorted(labels.items())))] = value

    @property
    def pending_incidents(self) -> int:
        return len(self._incidents)

    # -- lifecycle ----------------------------------------------------------------------------
    def start(
        self, rank: guard_pb2.RankInfo | None = None, spool: IncidentSpool | None = None
    ) -> None:
        """Start sending, as `rank` (when not given at construction)."""
        if rank is not None:
            self._rank = rank
        if spool is not None:
            self._spool = spool
        self._thread = threading.Thread(target=self._run, name="ascend-guard-streamer", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Flush what is buffered (best effort, bounded by timeout) and stop the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._spill()  # whatever could not be sent waits on disk

    def _spill(self) -> None:
        """Move pending incidents to the spool (streamer thread, or after it stopped)."""
        if self._spool is None or not self._incidents:
            return
        pending = []
        while self._incidents:
            try:
                pending.append(self._incidents.popleft())
            except IndexError:
                break
        try:
            written = self._spool.append(pending)
        except OSError as exc:
            written = 0
            log.warning("incident_spool_failed", path=str(self._spool.path), error=str(exc))
        self.incidents_spooled += written
        # what did not fit stays in memory, in order
        self._incidents.extendleft(reversed(pending[written:]))

    def _unspool(self) -> None:
        if self._spool is None:
            return
        try:
            spooled = self._spool.take()
        except OSError as exc:
            log.warning("incident_spool_unreadable", path=str(self._spool.path), error=str(exc))
            return
        if spooled:
            log.info("incident_spool_replayed", incidents=len(spooled))
            self._incidents.extendleft(reversed(spooled))

    # -- streamer thread ----------------------------------------------------------------------
    def _run(self) -> None:
        backoff = 0.05
        while not self._stop.is_set():
            security = self._security
            channel = (
                grpc.insecure_channel(self._address)
                if security is None
                else security.channel(self._address)
            )
            try:
                grpc.channel_ready_future(channel).result(timeout=max(backoff, 0.5))
            except grpc.FutureTimeoutError:
                channel.close()
                self._spill()
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self._max_backoff_s)
                continue
            stub = guard_pb2_grpc.GuardIngestStub(channel)
            self.connected = True
            self.connects += 1
            log.info("sidecar_connected", address=self._address, connects=self.connects)
            self._unspool()
            self._unconfirmed.clear()
            in_flight = _InFlight()
            try:
                stub.Stream(
                    self._batches(in_flight),
                    metadata=self._metadata(security),
                )
                backoff = 0.05
            except grpc.RpcError as exc:
                # The last batch handed to gRPC when the stream broke may or may not have
                # arrived; count it as dropped rather than pretend it was delivered.
                self.dropped += in_flight.close()
                self._requeue_unconfirmed()
                log.warning(
                    "sidecar_stream_lost",
                    address=self._address,
                    code=str(exc.code()) if hasattr(exc, "code") else "",
                    details=exc.details() if hasattr(exc, "details") else str(exc),
                )
            except Exception:  # noqa: BLE001 - telemetry must never take the worker down
                self._requeue_unconfirmed()
                log.exception("sidecar_stream_error")
            finally:
                in_flight.close()
                self.connected = False
                channel.close()
            self._stop.wait(backoff)
            backoff = min(backoff * 2, self._max_backoff_s)

    def _metadata(self, security: ClientSecurity | None) -> tuple[tuple[str, str], ...] | None:
        """The stream's gRPC metadata: the bearer token, if any, the Kubernetes workload this
        worker runs in (from the Downward API env), its device and its model
        (telemetry/wire/workload.py)."""
        pairs = (security.metadata() if security is not None else None) or ()
        where = workload.from_env()._replace(device=self.device, model_name=self.model_name)
        return (*pairs, *workload.stream_metadata(where)) or None

    def _requeue_unconfirmed(self) -> None:
        """Incidents sent on a stream that broke may not have arrived: send them again."""
        unconfirmed = list(self._unconfirmed)
        self._unconfirmed.clear()
        self._incidents.extendleft(reversed(unconfirmed))

    def _batches(self, in_flight: _InFlight) -> Iterator[guard_pb2.Batch]:
        last_heartbeat = 0.0
        first = True
        progress = self._progress
        moved_to = progress() if progress is not None else 0
        self._stream_first_seq = self._seq + 1
        while True:
            stopping = self._stop.is_set()
            now = time.monotonic()
            with in_flight.lock:
                if in_flight.closed:
                    return
                records = self._drain()
                in_flight.records = len(records)
            incidents = self._drain_incidents()
            heartbeat_due = first or now - last_heartbeat >= self._heartbeat_interval_s
            moved = False
            if progress is not None and progress() != moved_to:
                moved, moved_to = True, progress()
            if records or incidents or self._probes or heartbeat_due or stopping or moved:
                batch = self._make_batch(records, heartbeat_due)
                batch.incidents.extend(incidents)
                self._add_probes(batch)
                if heartbeat_due:
                    last_heartbeat = now
                first = False
                # counted as unconfirmed before the hand-over: if the stream breaks from here
                # on, they are sent again
                self._unconfirmed.extend(incidents)
                yield batch
                self.sent_waves += len(records)
                self.incidents_sent += len(incidents)
            if stopping and not self._buffer and not self._incidents:
                return
            if not self._buffer or len(self._buffer) < self._batch_max:
                self._stop.wait(self._flush_interval_s)

    def _drain_incidents(self) -> list[guard_pb2.Incident]:
        out: list[guard_pb2.Incident] = []
        queue = self._incidents
        while queue and len(out) < INCIDENTS_PER_BATCH:
            try:
                out.append(queue.popleft())
            except IndexError:
                break
        return out

    def _add_probes(self, batch: guard_pb2.Batch) -> None:
        if not self._probes:
            return
        with self._probes_lock:
            probes, self._probes = self._probes, {}
        for (name, labels), value in probes.items():
            batch.probes.add(name=name, labels=dict(labels), value=value)

    def _drain(self) -> list[WaveTuple]:
        out: list[WaveTuple] = []
        buffer = self._buffer
        for _ in range(min(len(buffer), self._batch_max)):
            try:
                out.append(buffer.popleft())
            except IndexError:
                break
        return out

    def _make_batch(self, records: list[WaveTuple], with_heartbeat: bool) -> guard_pb2.Batch:
        self._seq += 1
        batch = guard_pb2.Batch(
            dropped_total=self.dropped, seq=self._seq, wire_version=WIRE_VERSION
        )
        if self._seq == self._stream_first_seq:  # rank identity once per stream
            batch.rank.CopyFrom(self._rank)
        if records:
            # one extend per column (wire v2) instead of one message per wave
            cols = batch.wave_columns
            for name, values in zip(WAVE_FIELDS, zip(*records, strict=True), strict=True):
                getattr(cols, name).extend(values)
        if with_heartbeat:
            batch.heartbeat.time_unix_nano = time.time_ns()
        for filler in self.fillers:
            try:
                filler.fill_batch(batch, with_heartbeat)
            except Exception:  # noqa: BLE001 - a filler must not break the stream
                log.exception("batch_filler_failed", filler=type(filler).__name__)
        return batch


class _InFlight:
    """The records of the batch last handed to gRPC, and whether its stream has ended.

    Shared by the gRPC thread pulling batches and the streamer thread that sees the stream
    fail; the lock makes "drain the buffer" and "the stream is closed" exclusive, so no record
    is taken from the buffer for a stream that is already gone.
    """

    __slots__ = ("closed", "lock", "records")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.records = 0
        self.closed = False

    def close(self) -> int:
        """Mark the stream ended; return how many records may have been lost with it."""
        with self.lock:
            if self.closed:
                return 0
            self.closed = True
            return self.records
