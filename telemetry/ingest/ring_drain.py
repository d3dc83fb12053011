"""The sidecar drains the wave rings of the ranks on its node (telemetry/wire/wave_ring.py).

A worker with the guard's `wave_ring` on writes its waves into a shared-memory ring beside its
liveness record instead of handing them to its gRPC streamer thread; everything else (rank
identity, heartbeats, incidents, probes, collectives, request membership) still arrives on its
gRPC stream. When that stream registers the rank, the drainer opens the rank's ring (it must
belong to the streaming process: pid and start time); a thread then drains every open ring each
`poll_s`, turns what it took into the same columnar `Batch` (wave columns) that gRPC ingest
produces, validates it like any batch, and hands it to `IngestService.ingest`, so liveness,
cross-rank alignment, the queue, metrics, the store and the exporter see one path.

Accounting: a ring batch carries the ring's cumulative loss (records overwritten before they
were read, torn slots, records the writer dropped) as its `dropped_total`, which the metrics
and the store read as the worker's own drops, as they do on the gRPC path (the worker's gRPC
buffer stays empty in ring mode, so its count stays 0 and the two never mix). When the stream
ends the drainer takes what is left, counts a record begun and never committed (a worker killed
mid-write) as torn, and lets the ring go. A reader that attaches late (the worker started
first, or this sidecar restarted) counts the records the ring no longer holds as dropped: never
a loss without a count, but after a restart it may count records its predecessor stored. A ring whose layout this sidecar does not know is
refused, logged with the reason, and the records its header says were written are counted as
dropped at ingest (`ring_layout`), so the accounting closes even then.
"""

from __future__ import annotations

import threading

import structlog

from telemetry.ingest.service import IngestService, RankView
from telemetry.ingest.validation import validate_batch
from telemetry.pipeline.ratelimit import RateLimitedLog
from telemetry.pipeline.writer import STAGE_INGEST
from telemetry.wire import liveness_record
from telemetry.wire.proto import guard_pb2
from telemetry.wire.schema import WAVE_FIELDS, WIRE_VERSION, InvalidBatch
from telemetry.wire.wave_ring import (
    FIXED_BYTES,
    RingLayoutError,
    RingReader,
    header_of,
    ring_path,
)

log = structlog.get_logger("ascend_guard.ring_drain")

DEFAULT_POLL_S = 0.02
# most records in one ring batch (a ring lapped far behind is drained in several)
BATCH_MAX = 8192


class _Refused:
    """A ring this sidecar will not read: what its header says was written is counted."""

    __slots__ = ("counted", "path")

    def __init__(self, path: str) -> None:
        self.path = path
        self.counted = 0


class RingDrainer:
    """Drains the rings of the streams `ingest` has registered; its own thread."""

    def __init__(
        self, ingest: IngestService, directory: str = "", poll_s: float = DEFAULT_POLL_S
    ) -> None:
        self.ingest = ingest
        self.directory = directory or liveness_record.DEFAULT_DIR
        self.poll_s = poll_s
        self._lock = threading.Lock()
        self._rings: dict[int, tuple[RankView, RingReader | _Refused]] = {}  # id(view) ->
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._log = RateLimitedLog(log.warning)
        self.drained = 0  # records handed to ingest
        self.refused = 0  # records counted at a refused ring

    # -- the ingest service's hooks (gRPC threads) ---------------------------------------------
    def attach(self, view: RankView) -> None:
        """The rank's stream registered: open its ring, if it writes one."""
        rank = view.rank
        path = ring_path(self.directory, rank.run_id, rank.dp_rank, rank.pp_rank, rank.tp_rank)
        try:
            reader: RingReader | _Refused = RingReader.open(path, pid=rank.pid)
        except RingLayoutError as exc:
            self._log("ring_refused", "layout", path=path, error=str(exc))
            self.ingest.metrics.rejected.labels("ring_layout").inc()
            reader = _Refused(path)
        except OSError:
            return  # no ring: this rank streams its waves over gRPC
        if isinstance(reader, RingReader):
            stat = liveness_record.proc_stat(rank.pid)
            if stat is None or (reader.start_ticks and stat[1] != reader.start_ticks):
                reader.close()  # a ring of an earlier process that had this pid
                return
        with self._lock:
            self._rings[id(view)] = (view, reader)
        log.info("ring_attached", path=path, dp=rank.dp_rank, tp=rank.tp_rank, pp=rank.pp_rank)

    def detach(self, view: RankView) -> None:
        """The rank's stream ended: take what is left, count a write left half done."""
        with self._lock:
            held = self._rings.pop(id(view), None)
            if held is None:
                return
            reader = held[1]
            if isinstance(reader, RingReader):
                self._drain_one(view, reader)
                if reader.finish():
                    self._drain_one(view, reader, final=True)  # carries the torn count
                log.info(
                    "ring_detached",
                    path=reader.path,
                    read=reader.read,
                    overwritten=reader.overwritten,
                    torn=reader.torn,
                    writer_dropped=reader.writer_dropped,
                )
                reader.close()
            else:
                self._count_refused(reader)

    def drain(self, view: RankView) -> None:
        """Take what `view`'s ring holds now (before its stream's heartbeat is ingested)."""
        with self._lock:
            held = self._rings.get(id(view))
            if held is not None and isinstance(held[1], RingReader):
                self._drain_one(view, held[1])

    # -- the drain thread ----------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name="ascend-guard-ring-drain", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        self.drain_all()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.drain_all()
            except Exception:  # noqa: BLE001 - the drain must go on
                log.exception("ring_drain_failed")

    def drain_all(self) -> int:
        """One pass over every open ring; returns the records handed to ingest."""
        total = 0
        with self._lock:
            for view, reader in list(self._rings.values()):
                if isinstance(reader, RingReader):
                    total += self._drain_one(view, reader)
                else:
                    self._count_refused(reader)
        return total

    def _count_refused(self, refused: _Refused) -> None:
        try:
            written = header_of(refused.path)["committed"]
        except (OSError, ValueError, IndexError):
            return
        if written > refused.counted:
            self.ingest.drops.add(STAGE_INGEST, "ring_layout", written - refused.counted)
            self.refused += written - refused.counted
            refused.counted = written

    def _drain_one(self, view: RankView, reader: RingReader, final: bool = False) -> int:
        total = 0
        while True:
            drained = reader.drain(BATCH_MAX)
            records = len(drained)
            if not records and not final:
                return total
            final = False
            batch = guard_pb2.Batch(wire_version=WIRE_VERSION, dropped_total=reader.lost)
            batch.rank.CopyFrom(view.rank)
            fields = drained.fields
            cols = batch.wave_columns
            for name in WAVE_FIELDS:
                getattr(cols, name).extend(fields[name].tolist())
            try:
                validate_batch(batch)
            except InvalidBatch as exc:
                self.ingest.drops.add(STAGE_INGEST, "invalid", records)
                self.ingest.metrics.rejected.labels("invalid").inc()
                self._log("ring_batch_refused", "invalid", path=reader.path, detail=str(exc)[:500])
                continue
            self.ingest.ingest(view, batch, records, records * FIXED_BYTES)
            self.drained += records
            total += records
            if records < BATCH_MAX:
                return total
