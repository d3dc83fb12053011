"""Caps, backoff and counting of one rank's incidents, on their way to the sidecar.

The `IncidentReporter` of the active processor applies the per-(type, request) cap and backoff
— every hit is still counted, and the count of hits skipped since the last report travels with
the next report — and hands each incident to the streamer, which never drops one (see
`guard/stream/streamer.py` and `guard/stream/spool.py`). Code outside the guard reports through the façade in
`guard/incidents.py`. The reporter is also a batch filler: each batch carries the cumulative
hits per type.
"""

from __future__ import annotations

import collections
import itertools
import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import structlog

from guard.config.runtime_guard import IncidentsConfig
from telemetry.wire.proto import guard_pb2

log = structlog.get_logger("ascend_guard.incidents")

INCIDENT_SCHEMA_VERSION = 1
SEVERITIES = ("info", "warning", "error", "critical")
MAX_EVIDENCE_BYTES = 16 * 1024
# (type, request) pairs remembered for caps; the oldest are forgotten beyond this
MAX_TRACKED_KEYS = 65_536

IncidentSink = Callable[[guard_pb2.Incident], None]
ProbeSink = Callable[[str, float, Mapping[str, str]], None]


def encode_evidence(evidence: Mapping[str, Any] | None) -> str:
    """Evidence as a JSON object, cut to MAX_EVIDENCE_BYTES (and then marked truncated)."""
    if not evidence:
        return "{}"
    text = json.dumps(evidence, default=str, sort_keys=True, separators=(",", ":"))
    if len(text) <= MAX_EVIDENCE_BYTES:
        return text
    return json.dumps({"truncated": True, "bytes": len(text), "head": text[:1024]})


class IncidentReporter:
    """Caps, backoff and counting of incidents for one rank; thread-safe."""

    def __init__(
        self,
        config: IncidentsConfig,
        *,
        run_id: str,
        current_wave: Callable[[], int],
        sink: IncidentSink,
    ) -> None:
        self.config = config
        self._run_id = run_id
        self._current_wave = current_wave
        self._sink = sink
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pid = os.getpid()
        # (type, request) -> [occurrences, occurrence of the next report, hits since last report]
        self._keys: collections.OrderedDict[tuple[str, str], list[int]] = collections.OrderedDict()
        # request -> the types it has keys of: a finished request is forgotten without a pass
        # over every key (the engine thread forgets each wave's finished requests)
        self._types_of: dict[str, list[str]] = {}
        self.hits: dict[str, int] = {}
        self.reported = 0

    def set_sink(self, sink: IncidentSink) -> None:
        self._sink = sink

    def reconfigure(self, config: IncidentsConfig) -> None:
        self.config = config

    def hits_snapshot(self) -> dict[str, int]:
        """Cumulative hits per type, copied under the lock (read from the streamer thread)."""
        with self._lock:
            return dict(self.hits)

    def fill_batch(self, batch: guard_pb2.Batch, with_heartbeat: bool) -> None:
        """Streamer thread: the cumulative hits per type ride on every batch."""
        hits = self.hits_snapshot()
        if hits:
            batch.detector_hits_total.update(hits)

    def report(
        self,
        type_: str,
        severity: str,
        summary: str,
        *,
        wave: int | None = None,
        request_id: str = "",
        evidence: Mapping[str, Any] | None = None,
        actions: Sequence[str] = ("report",),
        incident_id: str | None = None,
    ) -> guard_pb2.Incident | None:
        """Count one hit; return the incident handed to the sink, or None when it is held back."""
        if severity not in SEVERITIES:
            raise ValueError(f"severity {severity!r} is not one of {', '.join(SEVERITIES)}")
        with self._lock:
            self.hits[type_] = self.hits.get(type_, 0) + 1
            occurrence, suppressed = self._admit(type_, request_id)
            if occurrence is None:
                return None
            self.reported += 1
            number = next(self._ids)
        incident = guard_pb2.Incident(
            schema_version=INCIDENT_SCHEMA_VERSION,
            id=incident_id or f"{self._run_id}:{self._pid}:{number}",
            type=type_,
            severity=severity,
            wave=self._current_wave() if wave is None else wave,
            request_id=request_id,
            time_unix_nano=time.time_ns(),
            summary=summary,
            evidence_json=encode_evidence(evidence),
            actions=list(actions),
            occurrence=occurrence,
            suppressed=suppressed,
        )
        self._sink(incident)
        return incident

    def would_report(self, type_: str, request_id: str) -> bool:
        """Whether the next hit of (type, request) will be reported (to skip costly evidence)."""
        with self._lock:
            state = self._keys.get((type_, request_id))
            return state is None or state[0] + 1 >= state[1]

    def forget_requests(self, request_ids: Iterable[str]) -> None:
        """Finished requests' caps are no longer needed (one lookup each)."""
        types_of = self._types_of
        if not types_of:  # the usual wave: no request has a key
            return
        with self._lock:
            keys = self._keys
            for request_id in request_ids:
                for type_ in types_of.pop(request_id, ()):
                    del keys[(type_, request_id)]

    def _admit(self, type_: str, request_id: str) -> tuple[int | None, int]:
        key = (type_, request_id)
        state = self._keys.get(key)
        if state is None:
            state = self._keys[key] = [0, 1, 0]
            self._types_of.setdefault(request_id, []).append(type_)
            if len(self._keys) > MAX_TRACKED_KEYS:
                (old_type, old_request), _ = self._keys.popitem(last=False)
                types = self._types_of[old_request]
                types.remove(old_type)
                if not types:
                    del self._types_of[old_request]
        else:
            self._keys.move_to_end(key)
        state[0] += 1
        occurrence = state[0]
        if occurrence < state[1]:
            state[2] += 1
            return None, 0
        suppressed, state[2] = state[2], 0
        if occurrence < self.config.per_request_cap:
            state[1] = occurrence + 1
        else:  # capped: next report at occurrence * factor (12, 48, ... for cap 3, factor 4)
            state[1] = max(occurrence + 1, math.ceil(occurrence * self.config.backoff_factor))
        return occurrence, suppressed
