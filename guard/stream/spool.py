"""A worker's on-disk spool of incidents that could not reach the sidecar yet.

While the sidecar is away, the streamer thread moves pending incidents here (one file per run
and worker process, one base64-encoded `Incident` per line) so they survive a long outage without
growing the worker's memory; when a stream is up again they are read back, re-sent, and the file
is removed. The sidecar deduplicates by incident id, so an incident sent twice is stored once.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path

import structlog

from telemetry.wire.proto import guard_pb2

log = structlog.get_logger("ascend_guard.spool")


def default_spool_dir() -> str:
    from telemetry.wire import paths

    return paths.spool_dir()


class IncidentSpool:
    """Append-only file of incidents; `take()` reads everything back and removes the file."""

    def __init__(self, directory: str, run_id: str, pid: int, max_bytes: int) -> None:
        self.path = Path(directory or default_spool_dir()) / f"incidents-{run_id}-{pid}.spool"
        self.max_bytes = max_bytes
        self.size = 0

    def append(self, incidents: list[guard_pb2.Incident]) -> int:
        """Write as many as fit under max_bytes; return how many were written."""
        if not incidents:
            return 0
        lines = []
        size = self.size
        for incident in incidents:
            line = base64.b64encode(incident.SerializeToString()) + b"\n"
            if size + len(line) > self.max_bytes:
                break
            lines.append(line)
            size += len(line)
        if not lines:
            return 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "ab") as handle:
            handle.writelines(lines)
            handle.flush()
            os.fsync(handle.fileno())
        self.size = size
        return len(lines)

    def take(self) -> list[guard_pb2.Incident]:
        """Everything spooled so far, oldest first; the file is removed."""
        if not self.path.exists():
            return []
        incidents = []
        with open(self.path, "rb") as handle:
            for number, line in enumerate(handle, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    incident = guard_pb2.Incident()
                    incident.ParseFromString(base64.b64decode(line))
                except Exception:  # noqa: BLE001 - a torn last line after a crash
                    log.warning("spool_line_unreadable", path=str(self.path), line=number)
                    continue
                incidents.append(incident)
        self.path.unlink(missing_ok=True)
        self.size = 0
        return incidents
