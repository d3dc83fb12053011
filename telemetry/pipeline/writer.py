"""The sidecar's record path after ingest: a queue bounded in bytes, a writer thread, sinks.

    gRPC handler (parse, validate, liveness, hang state, alignment)
        └─ BoundedQueue.put   never blocks: a full queue refuses the batch, counted
              └─ Writer thread ─┬─ metrics sink   (per-batch aggregates, telemetry/metrics/waves.py)
                                ├─ store sink     (typed tables, telemetry/store/writer.py)
                                └─ export sink    (OTLP, tail-sampled, telemetry/export/otlp.py)

A sink is anything with `write(items)` and `close()` (`BatchSink`); the writer hands each one
every batch in order and isolates their failures: a sink that raises loses that write (counted
by stage and reason), the others and the next batches go on. Liveness never waits here. A sink
may also follow its own health (`SinkHealth`, the store's degraded state): the writer tells it
when a write starts, fails (the sink names the drop reason) and succeeds.

Every place that sheds records counts them in `ascend_guard_pipeline_dropped_records_total`
by `stage` and `reason`, so that sent = stored + counted drops.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Sequence
from typing import Protocol

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from telemetry.pipeline.ratelimit import RateLimitedLog
from telemetry.wire.proto import guard_pb2

log = structlog.get_logger("ascend_guard.pipeline")

# stages and reasons of `ascend_guard_pipeline_dropped_records_total`
STAGE_WORKER = "worker_buffer"  # the rank's own buffer (full, or lost with a broken stream)
STAGE_INGEST = "ingest"  # refused at validation
STAGE_QUEUE = "sidecar_queue"  # the queue between ingest and the writer was full
STAGE_STORE = "store"  # the store could not write
STAGE_EXPORT = "otlp_export"  # the OTLP exporter's queue was full, or the receiver failed
DEFAULT_QUEUE_BYTES = 64 * 1024 * 1024


@dataclasses.dataclass(slots=True)
class RankSource:
    """One rank's stream, as the sidecar names it."""

    rank: guard_pb2.RankInfo
    engine: str  # bounded label value
    labels: tuple[str, str, str, str]  # engine, dp, tp, pp
    process: tuple  # run, engine, dp, tp, pp, pid: one worker process


@dataclasses.dataclass(slots=True)
class Item:
    """One validated batch on its way to the sinks."""

    source: RankSource
    batch: guard_pb2.Batch
    nbytes: int
    records: int  # wave records in it


class BatchSink(Protocol):
    """What the writer feeds. `write` runs on the writer thread only."""

    stage: str

    def write(self, items: Sequence[Item]) -> None: ...

    def close(self) -> None: ...


class SinkHealth(Protocol):
    """Optional hooks of a sink that tracks its own health (telemetry/store/writer.py's `Store`)."""

    def write_started(self, items: Sequence[Item]) -> None: ...

    def write_failed(self, exc: BaseException, records: int) -> str:
        """Undo what the failed write left behind; return the drop reason (a fixed set)."""
        ...

    def write_done(self) -> None: ...


class Drops:
    """Counts shed records by stage and reason (and keeps the totals for tests and benches)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.counter = Counter(
            "ascend_guard_pipeline_dropped_records",
            "Wave records shed on their way to the store, by the stage that shed them and why.",
            ("stage", "reason"),
            registry=registry,
        )
        self._lock = threading.Lock()
        self.totals: dict[tuple[str, str], int] = collections.Counter()
        self._last_log = 0.0
        self._unlogged = 0

    def add(self, stage: str, reason: str, records: int) -> None:
        if records <= 0:
            return
        self.counter.labels(stage, reason).inc(records)
        with self._lock:
            self.totals[(stage, reason)] += records
            now = time.monotonic()
            if now - self._last_log < 1.0:  # at most one line a second
                self._unlogged += records
                return
            self._last_log, unlogged, self._unlogged = now, self._unlogged, 0
        log.warning(
            "records_dropped",
            stage=stage,
            reason=reason,
            records=records,
            also_since_last_line=unlogged,
        )

    def total(self, stage: str | None = None) -> int:
        with self._lock:
            return sum(v for (s, _), v in self.totals.items() if stage is None or s == stage)


class BoundedQueue:
    """Batches waiting for the writer, at most `max_bytes` of them; `put` never blocks."""

    def __init__(self, max_bytes: int, drops: Drops, registry: CollectorRegistry) -> None:
        self.max_bytes = max_bytes
        self._drops = drops
        self._items: collections.deque[Item] = collections.deque()
        self._bytes = 0
        self._cond = threading.Condition()
        self.peak_bytes = 0
        self.unfinished = 0  # put, and not yet written by every sink
        self._gauge = Gauge(
            "ascend_guard_pipeline_queue_bytes",
            "Bytes of validated batches waiting for the sidecar's writer.",
            registry=registry,
        )
        self._gauge.set_function(lambda: self._bytes)

    def put(self, item: Item) -> bool:
        with self._cond:
            if self._bytes + item.nbytes > self.max_bytes and self._items:
                full = True
            else:
                full = False
                self._items.append(item)
                self.unfinished += 1
                self._bytes += item.nbytes
                self.peak_bytes = max(self.peak_bytes, self._bytes)
                self._cond.notify()
        if full:
            self._drops.add(STAGE_QUEUE, "full", item.records)
        return not full

    def take(self, timeout: float, max_items: int = 512) -> list[Item]:
        with self._cond:
            if not self._items:
                self._cond.wait(timeout)
            out: list[Item] = []
            items = self._items
            while items and len(out) < max_items:
                item = items.popleft()
                self._bytes -= item.nbytes
                out.append(item)
            return out

    def done(self, count: int) -> None:
        with self._cond:
            self.unfinished -= count

    def __len__(self) -> int:
        return len(self._items)


class Writer:
    """The one thread that feeds every sink, in batch order."""

    def __init__(self, queue: BoundedQueue, sinks: Sequence[BatchSink], drops: Drops) -> None:
        self.queue = queue
        self.sinks = list(sinks)
        self.drops = drops
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.batches = 0
        self.records = 0
        # a sink that fails every write (a full disk) would otherwise log at the write rate
        self._failure_log = RateLimitedLog(log.error, burst=5, window_s=60.0)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ascend-guard-writer", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Write what is queued (bounded by timeout), then close the sinks."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        for sink in self.sinks:
            try:
                sink.close()
            except Exception:  # noqa: BLE001 - closing one sink must not keep others open
                log.exception("sink_close_failed", stage=sink.stage)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until the queue is empty and the writer idle (tests, benches, shutdown)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.queue.unfinished:
                return True
            time.sleep(0.01)
        return False

    def _run(self) -> None:
        while True:
            items = self.queue.take(0.2)
            if not items:
                if self._stop.is_set():
                    return
                continue
            try:
                self.write(items)
            finally:
                self.queue.done(len(items))

    def write(self, items: Sequence[Item]) -> None:
        records = sum(item.records for item in items)
        for sink in self.sinks:
            started = getattr(sink, "write_started", None)
            if started is not None:
                try:
                    started(items)
                except Exception:  # noqa: BLE001 - a hook must not cost the write
                    log.exception("sink_start_hook_failed", stage=sink.stage)
            try:
                sink.write(items)
            except Exception as exc:  # noqa: BLE001 - one sink's failure loses only its write
                failed = getattr(sink, "write_failed", None)
                reason = type(exc).__name__
                if failed is not None:
                    try:
                        reason = failed(exc, records)
                    except Exception:  # noqa: BLE001 - the drop is counted regardless
                        log.exception("sink_failure_hook_failed", stage=sink.stage)
                self.drops.add(sink.stage, reason, records)
                self._failure_log(
                    "sink_write_failed",
                    kind=f"{sink.stage}:{reason}",
                    stage=sink.stage,
                    reason=reason,
                    batches=len(items),
                    error=f"{type(exc).__name__}: {exc}",
                )
            else:
                done = getattr(sink, "write_done", None)
                if done is not None:
                    done()
        self.batches += len(items)
        self.records += records
