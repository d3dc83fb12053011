"""The store's writer: the pipeline's store sink, with retention by age and by size and the
restart gap. Runs on the pipeline's writer thread.

Retention: rows older than `retention_s` are deleted, and while the file's used pages
(page_count - freelist_count, times page_size: no COUNT(*) scan) exceed `max_bytes`, the oldest
minute is deleted; both delete whole time buckets of `BUCKET_NS`, oldest first. Freed pages are
reused by later inserts, so the file stays near the cap. The default cap holds the default 24 h
of a 16-rank node at 200 steps/s per rank (see DEFAULT_MAX_BYTES).

A write that fails (disk full, I/O error, corruption found later) is rolled back and its records
are counted as dropped with a reason; the store is then degraded (`ascend_guard_store_degraded`
1, one `store_degraded` log line) until a write succeeds again (`store_resumed`). Serving,
liveness and /metrics never wait on any of this.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from collections.abc import Sequence

import structlog

from telemetry.pipeline.writer import STAGE_STORE, Item
from telemetry.store.codec import (
    _INSERT_COLLECTIVE_BLOCK,
    _INSERT_WAVE_BLOCK,
    _signed,
    collective_block_row,
    wave_block_row,
)
from telemetry.store.files import connect, failure_reason
from telemetry.store.requests import RequestWriter
from telemetry.store.schema import _RETAINED
from telemetry.wire.collective_columns import columns_of
from telemetry.wire.proto import guard_pb2
from telemetry.wire.trace_ids import wave_trace_key

log = structlog.get_logger("ascend_guard.store")


DEFAULT_RETENTION_S = 24 * 3600.0


# 3,200 waves/s (16 ranks x 200 steps/s) x 86,400 s x ~50 B per wave with 2 collective stats
# (measured by bench/sidecar_ingest.py: ~17 B of wave columns, ~29 B of collectives, the rest
# SQLite's pages and keys) is about 13.8 GB (12.9 GiB) a day: 16 GiB holds the default 24 h
# with room for bursts, incidents and the WAL.
DEFAULT_MAX_BYTES = 16 * 1024**3


BUCKET_NS = 60 * 10**9
# the size cap is looked at after this many waves are stored (and on every timed prune)
SIZE_CHECK_WAVES = 1024


class Store:
    """The sidecar's writer into the store (a `BatchSink`); thread-safe."""

    stage = STAGE_STORE

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        retention_s: float = DEFAULT_RETENTION_S,
        max_bytes: int = DEFAULT_MAX_BYTES,
        prune_every_s: float = 30.0,
    ) -> None:
        self.path = str(path)
        self.retention_s = retention_s
        self.max_bytes = max_bytes
        self._prune_every_s = prune_every_s
        self._last_prune = time.monotonic()
        self._size_checked_at = 0  # stored_waves when the size was last looked at
        self._lock = threading.Lock()
        self._conn = connect(self.path)
        self._runs: dict[str, int] = {}
        self._ranks: dict[tuple, int] = {}
        self.stored_waves = 0
        self.ignored_waves = 0  # sent again: already stored
        # the write error path (write_started / write_failed / write_done, telemetry/pipeline/writer.py)
        self.degraded_reason = ""  # "" while writes succeed
        self.degraded_since = 0.0
        self.lost_while_degraded = 0
        self._counts_before_write = (0, 0)
        self.requests = RequestWriter()  # request membership (telemetry/store/requests.py)
        # waves missing between a rank's last stored wave and the first this process receives
        self.restart_gap_waves = 0
        self._gap_checked: set[tuple] = set()

    # -- dimensions -----------------------------------------------------------------------
    def _run_id(self, run_id: str) -> int:
        known = self._runs.get(run_id)
        if known is not None:
            return known
        conn = self._conn
        conn.execute("INSERT OR IGNORE INTO runs (run_id) VALUES (?)", (run_id,))
        (key,) = conn.execute("SELECT id FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        self._runs[run_id] = key
        return key

    def rank_id(self, rank: guard_pb2.RankInfo, engine: str) -> int:
        """The integer key of a rank (inserted on first sight). Call with the lock held."""
        key = (rank.run_id, engine, rank.dp_rank, rank.tp_rank, rank.pp_rank)
        known = self._ranks.get(key)
        if known is not None:
            return known
        run = self._run_id(rank.run_id)
        conn = self._conn
        conn.execute(
            "INSERT INTO ranks (run, engine, dp, tp, pp, dp_size, tp_size, pp_size, node, pid, "
            "runner, trace_key) VALUES (?,?,?,?,?,?,?,?,?,?,?,?) "
            "ON CONFLICT (run, engine, dp, tp, pp) DO UPDATE SET node = excluded.node, "
            "pid = excluded.pid, runner = excluded.runner",
            (
                run,
                engine,
                rank.dp_rank,
                rank.tp_rank,
                rank.pp_rank,
                rank.dp_size,
                rank.tp_size,
                rank.pp_size,
                rank.node,
                rank.pid,
                rank.runner,
                _signed(wave_trace_key(rank.run_id, rank.dp_rank)),
            ),
        )
        (rank_key,) = conn.execute(
            "SELECT id FROM ranks WHERE run = ? AND engine = ? AND dp = ? AND tp = ? AND pp = ?",
            (run, engine, rank.dp_rank, rank.tp_rank, rank.pp_rank),
        ).fetchone()
        self._ranks[key] = rank_key
        return rank_key

    # -- writes -----------------------------------------------------------------------------
    def write(self, items: Sequence[Item]) -> None:
        wave_rows, coll_rows, slow_rows = [], [], []
        with self._lock:
            for item in items:
                batch = item.batch
                cols = columns_of(batch)
                if batch.HasField("request_columns"):
                    rank_id = self.rank_id(item.source.rank, item.source.engine)
                    self.requests.collect(rank_id, item.source.rank, item.source.engine, batch)
                if not item.records and not len(cols.wave):
                    continue
                rank_id = self.rank_id(item.source.rank, item.source.engine)
                if item.records:
                    wave_rows.append(
                        wave_block_row(rank_id, batch.wave_columns, batch.dropped_total)
                    )
                if len(cols.wave):
                    coll_rows.append(collective_block_row(rank_id, cols))
                    numbers = cols.wave
                    for call, row in zip(cols.slow_calls, cols.slow_call_wave_index, strict=True):
                        slow_rows.append(
                            (
                                rank_id,
                                call.group,
                                call.seq,
                                numbers[row],
                                call.op,
                                call.backend,
                                call.dtype,
                                call.bytes,
                                call.start_unix_nano,
                                call.host_ns,
                            )
                        )
            if not (wave_rows or coll_rows or slow_rows or self.requests.pending()):
                self._conn.commit()
                return
            conn = self._conn
            with conn:
                for row in wave_rows:  # one block per batch: a few rows per write
                    if conn.execute(_INSERT_WAVE_BLOCK, row).rowcount:
                        self.stored_waves += row[5]
                    else:
                        self.ignored_waves += row[5]
                conn.executemany(_INSERT_COLLECTIVE_BLOCK, coll_rows)
                conn.executemany(
                    "INSERT OR IGNORE INTO slow_calls VALUES (?,?,?,?,?,?,?,?,?,?)", slow_rows
                )
                self.requests.flush(conn)
            self.requests.committed()
        # by age every prune_every_s; by size as soon as the cap is passed, so that the file
        # does not grow past its budget between two timed prunes
        if time.monotonic() - self._last_prune >= self._prune_every_s or self._over_budget():
            self.prune()

    # -- the write error path (called by the writer around `write`) ---------------------------
    def write_started(self, items: Sequence[Item] = ()) -> None:
        self._counts_before_write = (self.stored_waves, self.ignored_waves)
        for item in items:
            if item.records:
                self._check_restart_gap(item)

    def _check_restart_gap(self, item: Item) -> None:
        """Once per rank and process: count the waves between the last one the store holds and
        the first this sidecar receives that the worker has not counted as dropped. A sidecar
        that was killed loses what it had accepted and not yet written (the worker thinks it
        delivered it); this makes that loss seen. The worker's own drops in the gap (its buffer
        overflowing through a long outage, the batch in flight) are the growth of its cumulative
        drop count between the stored block and this batch: those are already in
        ascend_guard_records_dropped_total, and counting them here too would count them twice."""
        rank = item.source.rank
        key = (rank.run_id, item.source.engine, rank.dp_rank, rank.tp_rank, rank.pp_rank)
        if key in self._gap_checked:
            return
        self._gap_checked.add(key)
        try:
            with self._lock:
                # the block with the highest first wave, found through the (rank, first_wave)
                # index: no scan of the rank's day of blocks
                row = self._conn.execute(
                    "SELECT b.last_wave, b.dropped_before FROM ranks r JOIN runs u ON u.id = r.run "
                    "JOIN wave_blocks b ON b.rank = r.id WHERE u.run_id = ? AND r.engine = ? "
                    "AND r.dp = ? AND r.tp = ? AND r.pp = ? ORDER BY b.first_wave DESC LIMIT 1",
                    key,
                ).fetchone()
        except sqlite3.Error:
            return  # the write itself will find and count what is wrong
        if row is None:
            return
        last_stored, dropped_before = row
        first = min(item.batch.wave_columns.wave)
        if first <= last_stored + 1:
            return
        worker_dropped = 0  # a block written before the column existed (NULL): none known
        if dropped_before is not None:
            worker_dropped = max(0, item.batch.dropped_total - dropped_before)
        # a stored batch that the worker also counted (in flight at the kill) can make this
        # negative: then nothing is missing past what the worker counted
        gap = max(0, first - last_stored - 1 - worker_dropped)
        self.restart_gap_waves += gap
        # logged also when the worker counted every missing wave: the line says where the
        # restart left its hole in the rank's waves
        (log.warning if gap else log.info)(
            "store_restart_gap",
            engine=item.source.engine,
            dp=rank.dp_rank,
            tp=rank.tp_rank,
            pp=rank.pp_rank,
            last_stored_wave=last_stored,
            first_received_wave=first,
            missing_waves=gap,
            dropped_by_worker=worker_dropped,
            why=(
                "lost with a sidecar that stopped before writing them"
                if gap
                else "all dropped by the worker, and counted there"
            ),
        )

    def write_failed(self, exc: BaseException, records: int) -> str:
        """Roll back the failed write, enter the degraded state; return the drop reason."""
        reason = failure_reason(exc)
        with self._lock:
            with contextlib.suppress(sqlite3.Error):
                self._conn.rollback()
            # rows of a rolled-back transaction are gone: their keys must be looked up again
            self._runs.clear()
            self._ranks.clear()
            self.requests.discard()
            self.stored_waves, self.ignored_waves = self._counts_before_write
        if not self.degraded_reason:
            self.degraded_since = time.monotonic()
            log.error(
                "store_degraded",
                path=self.path,
                reason=reason,
                error=str(exc),
                action="records are counted as dropped (stage=store) until a write succeeds",
            )
        self.degraded_reason = reason
        self.lost_while_degraded += records
        return reason

    def write_done(self) -> None:
        if not self.degraded_reason:
            return
        log.warning(
            "store_resumed",
            path=self.path,
            reason=self.degraded_reason,
            lost_records=self.lost_while_degraded,
            degraded_s=round(time.monotonic() - self.degraded_since, 3),
        )
        self.degraded_reason = ""
        self.lost_while_degraded = 0

    # -- retention --------------------------------------------------------------------------
    def used_bytes(self) -> int:
        """Bytes of the file in use: (page_count - freelist_count) x page_size."""
        conn = self._conn
        (pages,) = conn.execute("PRAGMA page_count").fetchone()
        (free,) = conn.execute("PRAGMA freelist_count").fetchone()
        (size,) = conn.execute("PRAGMA page_size").fetchone()
        return (pages - free) * size

    def _over_budget(self) -> bool:
        """The file's used pages passed the cap; looked at once per SIZE_CHECK_WAVES waves
        stored (a few KiB past the cap at most), not on every write."""
        if self.stored_waves - self._size_checked_at < SIZE_CHECK_WAVES:
            return False
        self._size_checked_at = self.stored_waves
        try:
            return self.used_bytes() > self.max_bytes
        except sqlite3.Error:
            return False  # the write path reports store faults; the timed prune retries

    def _oldest_ns(self) -> int | None:
        oldest = [
            self._conn.execute(f"SELECT MIN({column}) FROM {table}").fetchone()[0]
            for table, column in _RETAINED
        ]
        oldest = [t for t in oldest if t is not None]
        return min(oldest) if oldest else None

    def _delete_before(self, cutoff_ns: int) -> int:
        removed = 0
        with self._conn:
            for table, column in _RETAINED:
                removed += self._conn.execute(
                    f"DELETE FROM {table} WHERE {column} < ?", (cutoff_ns,)
                ).rowcount
        return removed

    def prune(self, now_ns: int | None = None) -> int:
        """Delete by age, then by size, a time bucket at a time; return the rows removed."""
        self._last_prune = time.monotonic()
        cutoff = (now_ns if now_ns is not None else time.time_ns()) - int(self.retention_s * 1e9)
        removed = 0
        with self._lock:
            try:
                oldest = self._oldest_ns()
                while oldest is not None and oldest < cutoff:
                    removed += self._delete_before(min(cutoff, oldest + BUCKET_NS))
                    oldest = self._oldest_ns()
                while oldest is not None and self.used_bytes() > self.max_bytes:
                    removed += self._delete_before(oldest + BUCKET_NS)
                    oldest = self._oldest_ns()
            except sqlite3.Error as exc:  # a delete needs WAL space too; the next prune retries
                log.warning("store_prune_failed", reason=failure_reason(exc), error=str(exc))
        if removed:
            log.info("store_pruned", removed_rows=removed)
        return removed

    def close(self) -> None:
        with self._lock:
            self._conn.close()
