"""Incidents in the sidecar: deduplicated, counted, stored, and attached to the wave's trace.

Workers re-send incidents whose delivery they cannot be sure of (a stream that broke, a spool
replayed after an outage), so the ledger keys every incident by its id: the first copy is
counted in `ascend_guard_incidents_total`, stored in the `incidents` table of the trace store
(with the trace id of its wave), and handed to the listeners (the OTLP exporter, which keeps
the wave and sends an `incident` span built from the stored row, telemetry/spans/builders.py); later
copies are ignored. Hang verdicts are incidents too; the `hang_verdicts` view lists them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable

import structlog

from telemetry.store.files import connect
from telemetry.wire.labels import BoundedValues
from telemetry.wire.proto import guard_pb2
from telemetry.wire.trace_ids import format_trace_id, wave_trace_id

log = structlog.get_logger("ascend_guard.incidents")

INCIDENT_SCHEMA = """
CREATE TABLE IF NOT EXISTS incidents (
    id          TEXT PRIMARY KEY,
    schema      INTEGER NOT NULL,
    type        TEXT NOT NULL,
    severity    TEXT NOT NULL,
    run_id      TEXT,
    engine      TEXT,
    dp          INTEGER,
    tp          INTEGER,
    pp          INTEGER,
    node        TEXT,
    pid         INTEGER,
    wave        INTEGER,
    request_id  TEXT,
    time_ns     INTEGER NOT NULL,
    summary     TEXT,
    evidence    TEXT,
    actions     TEXT,
    occurrence  INTEGER,
    suppressed  INTEGER,
    trace_id    TEXT
);
CREATE INDEX IF NOT EXISTS incidents_time ON incidents (time_ns);
CREATE INDEX IF NOT EXISTS incidents_type ON incidents (type, time_ns);
CREATE INDEX IF NOT EXISTS incidents_request ON incidents (request_id);
CREATE INDEX IF NOT EXISTS incidents_wave ON incidents (run_id, wave);
CREATE VIEW IF NOT EXISTS hang_verdicts AS
    SELECT id, run_id, engine, dp, tp, pp, wave, time_ns, summary, evidence, trace_id
    FROM incidents WHERE type = 'hang_verdict';
"""
COLUMNS = (
    "id",
    "schema",
    "type",
    "severity",
    "run_id",
    "engine",
    "dp",
    "tp",
    "pp",
    "node",
    "pid",
    "wave",
    "request_id",
    "time_ns",
    "summary",
    "evidence",
    "actions",
    "occurrence",
    "suppressed",
    "trace_id",
)
IncidentListener = Callable[[dict], None]


def open_incident_table(path: str | os.PathLike) -> sqlite3.Connection:
    conn = connect(path)
    conn.executescript(INCIDENT_SCHEMA)
    return conn


VERDICT = "hang_verdict"  # raised by the sidecar's hang detector (telemetry/crossrank/hangs.py)
RECOVERY = "hang_recovered"
CLOSED_VERDICT = "hang_closed"  # a verdict whose named ranks' processes are all gone
EXIT = "rank_exited"  # a local rank's process ended (its own incident)
SIDECAR_TYPES = (VERDICT, RECOVERY, CLOSED_VERDICT, EXIT)  # incidents the sidecar raises itself


class IncidentLedger:
    """The sidecar's one entry for incidents from workers and from its own analyses."""

    def __init__(
        self,
        store_path: str,
        *,
        counter=None,
        listeners: list[IncidentListener] | None = None,
        retention_s: float = 7 * 24 * 3600,
    ) -> None:
        self._conn = open_incident_table(store_path)
        self._lock = threading.Lock()
        self._counter = counter  # Counter with labels engine, dp, tp, pp, type, severity
        # the type label comes from the wire: bounded (the sidecar's own types always fit)
        self._type_label = BoundedValues()
        for own in SIDECAR_TYPES:
            self._type_label(own)
        self.listeners = list(listeners or [])
        self.retention_s = retention_s
        self._last_prune = 0.0
        self.accepted = 0
        self.duplicates = 0

    def add(
        self, engine: str, rank: guard_pb2.RankInfo | None, incident: guard_pb2.Incident
    ) -> bool:
        """Record an incident once; False when this id was seen before."""
        run_id = rank.run_id if rank is not None else ""
        dp = rank.dp_rank if rank is not None else 0
        # an incident not tied to a wave (wave 0) is in its run's wave-0 trace (telemetry/spans/builders.py)
        trace_id = format_trace_id(wave_trace_id(run_id, incident.wave, dp))
        # a table: one row per line, columns aligned (fmt: skip)
        row = (
            incident.id, incident.schema_version, incident.type, incident.severity,
            rank.run_id if rank is not None else "", engine,
            rank.dp_rank if rank is not None else None, rank.tp_rank if rank is not None else None,
            rank.pp_rank if rank is not None else None, rank.node if rank is not None else "",
            rank.pid if rank is not None else None, incident.wave, incident.request_id,
            incident.time_unix_nano or time.time_ns(), incident.summary, incident.evidence_json,
            json.dumps(list(incident.actions)), incident.occurrence, incident.suppressed, trace_id,
        )  # fmt: skip
        with self._lock, self._conn:
            inserted = self._conn.execute(
                "INSERT OR IGNORE INTO incidents VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                row,
            ).rowcount
        if not inserted:
            self.duplicates += 1
            return False
        self.accepted += 1
        if self._counter is not None:
            dims = (
                (str(rank.dp_rank), str(rank.tp_rank), str(rank.pp_rank))
                if rank is not None
                else ("", "", "")
            )
            self._counter.labels(
                engine, *dims, self._type_label(incident.type), incident.severity
            ).inc()
        if self.listeners:
            record = dict(zip(COLUMNS, row, strict=True))
            for listener in self.listeners:
                try:
                    listener(record)
                except Exception:  # noqa: BLE001 - a listener must not lose the incident
                    log.exception("incident_listener_failed", id=incident.id)
        log.info(
            "incident",
            id=incident.id,
            type=incident.type,
            severity=incident.severity,
            engine=engine,
            wave=incident.wave,
            request_id=incident.request_id,
            summary=incident.summary,
        )
        if time.monotonic() - self._last_prune > 60:
            self.prune()
        return True

    def prune(self) -> int:
        self._last_prune = time.monotonic()
        cutoff = time.time_ns() - int(self.retention_s * 1e9)
        with self._lock, self._conn:
            return self._conn.execute("DELETE FROM incidents WHERE time_ns < ?", (cutoff,)).rowcount

    def close(self) -> None:
        with self._lock:
            self._conn.close()


@dataclasses.dataclass
class IncidentFilter:
    since_ns: int
    type: str | None = None
    request_id: str | None = None
    run_id: str | None = None
    engine: str | None = None
    severity: str | None = None
    limit: int = 50


def list_incidents(conn: sqlite3.Connection, flt: IncidentFilter) -> list[sqlite3.Row]:
    """Newest first. `request_id` matches a prefix, since the engine may suffix API ids."""
    try:
        conn.execute("SELECT 1 FROM incidents LIMIT 1")
    except sqlite3.OperationalError:
        return []  # a store written before incidents existed
    where, params = ["time_ns >= ?"], [flt.since_ns]
    for column, value in (
        ("type", flt.type),
        ("run_id", flt.run_id),
        ("engine", flt.engine),
        ("severity", flt.severity),
    ):
        if value:
            where.append(f"{column} = ?")
            params.append(value)
    if flt.request_id:
        where.append("request_id LIKE ? ESCAPE '\\'")
        escaped = flt.request_id.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        params.append(escaped + "%")
    sql = f"SELECT * FROM incidents WHERE {' AND '.join(where)} ORDER BY time_ns DESC LIMIT ?"
    return conn.execute(sql, (*params, flt.limit)).fetchall()


def incidents_of_wave(conn: sqlite3.Connection, run_id: str, wave: int) -> list[sqlite3.Row]:
    try:
        return conn.execute(
            "SELECT * FROM incidents WHERE run_id = ? AND wave = ? ORDER BY time_ns", (run_id, wave)
        ).fetchall()
    except sqlite3.OperationalError:
        return []
