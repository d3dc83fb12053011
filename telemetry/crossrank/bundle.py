"""Evidence bundles: at each hang verdict, one bounded JSON file with what on-call needs to see
per rank of the replica (telemetry/crossrank/rank_evidence.py gathers it), named in the verdict's
incident and shown by `ascend-guard hangs --bundle ID`.

The hang checker calls `request` while it raises the verdict (its thread, under its lock): that
only names the bundle and queues the job (bounded: `max_pending`; a full queue drops the job,
counted). The bundle thread gathers and writes: every rank's ring and process view at once, the
stack signal and the flight-recorder trigger sent to all answering ranks together, then one wait
of at most `stack_timeout_s` for their answers.

Bounds: a bundle is cut to `max_bytes` (thread stacks other than the engine thread's go first,
then kernel stacks, then every stack; each cut counted); the folder keeps the newest
`max_files` bundles (older ones removed, counted). Bundles stay on this node: nothing here is
exported, and files are readable by the sidecar's user and group only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from telemetry.crossrank import rank_evidence
from telemetry.metrics.bundles import BundleMetrics
from telemetry.wire.liveness_record import RecordReader
from telemetry.wire.proto import guard_pb2

log = structlog.get_logger("ascend_guard.bundle")

FORMAT = "ascend-guard-bundle/1"
ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,119}$")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclasses.dataclass(frozen=True)
class BundleSettings:
    """Every bundle bound and its one default."""

    directory: str  # where bundles live (the sidecar's: paths.bundle_dir())
    collectives: int = 32  # the last N collectives per rank (the worker's ring holds 64)
    max_bytes: int = 256 * 1024  # one bundle at most
    max_files: int = 64  # bundles kept; the oldest go first
    max_pending: int = 4  # verdicts waiting for the bundle thread; more are dropped
    stack_timeout_s: float = 1.0  # how long the ranks get to answer the stack signal
    liveness_dir: str = ""  # the workers' liveness records ("": its default)


def bundle_path(directory: str, bundle_id: str) -> str:
    """The file of one bundle; the id is checked, so no id reaches outside `directory`."""
    if not ID_PATTERN.match(bundle_id):
        raise ValueError(f"bundle id {bundle_id!r}: letters, digits, '.', '_' and '-' only")
    return os.path.join(directory, f"bundle-{bundle_id}.json")


def read_bundle(directory: str, bundle_id: str) -> dict[str, Any]:
    """A written bundle (FileNotFoundError when there is none of that id)."""
    with open(bundle_path(directory, bundle_id), encoding="utf-8") as handle:
        return json.load(handle)


def list_bundles(directory: str) -> list[str]:
    """Ids of the bundles in `directory`, newest first."""
    try:
        names = [
            n for n in os.listdir(directory) if n.startswith("bundle-") and n.endswith(".json")
        ]
    except OSError:
        return []
    stamped = []
    for name in names:
        with contextlib.suppress(OSError):
            stamped.append((os.stat(os.path.join(directory, name)).st_mtime, name))
    return [name[len("bundle-") : -len(".json")] for _, name in sorted(stamped, reverse=True)]


@dataclasses.dataclass
class _Job:
    bundle_id: str
    path: str
    verdict: dict[str, Any]
    ranks: list[guard_pb2.RankInfo]
    asked_unix: float


class BundleWriter:
    def __init__(self, settings: BundleSettings, metrics: BundleMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=settings.max_pending)
        self._reader = RecordReader(settings.liveness_dir)  # its own maps: another thread's
        self._node = socket.gethostname()
        self._thread: threading.Thread | None = None

    # -- the hang checker's thread --------------------------------------------------------------
    def request(self, verdict: dict[str, Any], ranks: list[guard_pb2.RankInfo]) -> dict[str, Any]:
        """Name a bundle for this verdict and queue it; returns what the incident says of it."""
        engine = _UNSAFE.sub("_", str(verdict.get("engine", "")))[:40] or "engine"
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        bundle_id = f"{stamp}-{engine}-dp{verdict.get('dp', 0)}-{secrets.token_hex(3)}"
        path = bundle_path(self.settings.directory, bundle_id)
        copies = []
        for rank in ranks:
            copy = guard_pb2.RankInfo()
            copy.CopyFrom(rank)
            copies.append(copy)
        job = _Job(bundle_id, path, dict(verdict), copies, time.time())
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self.metrics.dropped.labels("queue_full").inc()
            return {"id": bundle_id, "written": False, "note": "dropped: bundle queue full"}
        return {"id": bundle_id, "path": path, "show": f"ascend-guard hangs --bundle {bundle_id}"}

    # -- the bundle thread ----------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="hang-bundles", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 3.0) -> None:
        if self._thread is None:
            return
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout)
        self._thread.join(timeout)
        self._reader.close()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self.write(job)
            except Exception:  # noqa: BLE001 - the sidecar keeps serving
                log.exception("bundle_failed", bundle=job.bundle_id)
                self.metrics.dropped.labels("write_failed").inc()

    def write(self, job: _Job) -> str | None:
        """Gather, bound, write and rotate; the path written (None: dropped, counted)."""
        bundle = self.gather(job)
        data = self._bounded(bundle)
        try:
            os.makedirs(self.settings.directory, mode=0o750, exist_ok=True)
            tmp = f"{job.path}.{os.getpid()}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            os.replace(tmp, job.path)
        except OSError as exc:
            log.warning("bundle_write_failed", bundle=job.bundle_id, error=str(exc))
            self.metrics.dropped.labels("write_failed").inc()
            return None
        self.metrics.written.inc()
        log.info("bundle_written", bundle=job.bundle_id, path=job.path, bytes=len(data))
        self._rotate()
        return job.path

    def gather(self, job: _Job) -> dict[str, Any]:
        s = self.settings
        roles = {
            **{(r["tp"], r["pp"]): "waiting" for r in job.verdict.get("waiting", [])},
            **{(r["tp"], r["pp"]): "stopped" for r in job.verdict.get("stopped", [])},
        }
        ranks, asks = [], []
        for rank in sorted(job.ranks, key=lambda r: (r.pp_rank, r.tp_rank)):
            entry: dict[str, Any] = {
                "dp": rank.dp_rank,
                "tp": rank.tp_rank,
                "pp": rank.pp_rank,
                "pid": rank.pid,
                "node": rank.node,
                "role": roles.get((rank.tp_rank, rank.pp_rank), "peer"),
            }
            ring, note = rank_evidence.ring_of(self._reader, rank, s.collectives)
            entry["collectives"] = {"entries": ring, "note": note}
            if rank.node and rank.node != self._node and not ring:
                why = f"on node {rank.node}: its sidecar holds its evidence"
                entry["process"] = {"state": "remote", "note": why}
                entry["stack"] = {"answered": False, "note": why}
                entry["flight_recorder"] = {"available": False, "note": why}
                ranks.append(entry)
                continue
            entry["process"] = rank_evidence.process_view(rank.pid)
            facts, why = rank_evidence.read_facts(
                rank_evidence.facts_path(self._reader, rank), rank.pid
            )
            ask, why_not = rank_evidence.ask_stack(
                facts, why, entry["process"].get("state", ""), rank.pid
            )
            entry["stack"] = {"answered": False, "note": why_not}
            entry["flight_recorder"] = rank_evidence.trigger_flight_recorder(facts, why)
            asks.append((entry, ask))
            ranks.append(entry)
        deadline = time.monotonic() + s.stack_timeout_s
        per_rank = max(4096, s.max_bytes // max(1, 2 * len(ranks)))
        for entry, ask in asks:
            if ask is not None:
                entry["stack"] = rank_evidence.collect_stack(ask, deadline, per_rank)
            rank_evidence.dump_state(entry["flight_recorder"])
        return {
            "format": FORMAT,
            "id": job.bundle_id,
            "node": self._node,
            "created_unix": time.time(),
            "verdict_asked_unix": job.asked_unix,
            "verdict": job.verdict,
            "settings": {
                "collectives": s.collectives,
                "stack_timeout_s": s.stack_timeout_s,
                "max_bytes": s.max_bytes,
            },
            "ranks": ranks,
            "cut": [],
        }

    def _bounded(self, bundle: dict[str, Any]) -> bytes:
        """The bundle as JSON of at most max_bytes: cut what matters least first."""
        limit = self.settings.max_bytes

        def encoded() -> bytes:
            return json.dumps(bundle, sort_keys=True, default=str).encode()

        data = encoded()
        cuts = (
            ("other threads' stacks", _per_rank(_keep_engine_thread)),
            ("kernel stacks", _per_rank(_drop_kernel_stacks)),
            ("every stack", _per_rank(_drop_stacks)),
            ("collectives past the latest 8", _per_rank(_short_ring)),
            ("the verdict's rank details", _short_verdict),
        )
        for what, cut in cuts:
            if len(data) <= limit:
                break
            cut(bundle)
            bundle["cut"].append(what)
            self.metrics.dropped.labels("cut_to_size").inc()
            data = encoded()
        return data

    def _rotate(self) -> None:
        ids = list_bundles(self.settings.directory)
        for old in ids[self.settings.max_files :]:
            with contextlib.suppress(OSError):
                os.unlink(bundle_path(self.settings.directory, old))
                self.metrics.dropped.labels("evicted").inc()


def _per_rank(cut: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def each(bundle: dict[str, Any]) -> None:
        for rank in bundle["ranks"]:
            cut(rank)

    return each


def _keep_engine_thread(rank: dict[str, Any]) -> None:
    threads = rank.get("stack", {}).get("threads")
    if threads:
        kept = [t for t in threads if t.get("engine")] or threads[:1]
        rank["stack"]["threads"] = kept
        rank["stack"]["threads_cut"] = len(threads) - len(kept)


def _drop_kernel_stacks(rank: dict[str, Any]) -> None:
    if rank.get("process", {}).pop("kernel_stack", None) is not None:
        rank["process"]["kernel_stack_note"] = "cut to fit the bundle's size"


def _drop_stacks(rank: dict[str, Any]) -> None:
    if rank.get("stack", {}).pop("threads", None) is not None:
        rank["stack"]["note"] = "cut to fit the bundle's size"


def _short_ring(rank: dict[str, Any]) -> None:
    entries = rank.get("collectives", {}).get("entries", [])
    if len(entries) > 8:
        rank["collectives"]["entries"] = entries[-8:]


def _short_verdict(bundle: dict[str, Any]) -> None:
    verdict = bundle["verdict"]
    for key in ("stopped", "waiting"):
        verdict[key] = [{k: r.get(k) for k in ("tp", "pp", "pid")} for r in verdict.get(key, [])]
