"""Checks on every `Batch` before the sidecar uses it; each failure names the field."""

from __future__ import annotations

from telemetry.proto import guard_pb2

MAX_RANK = 65_535
MAX_TEXT = 128
MAX_WAVES_PER_BATCH = 100_000
MAX_DURATION_NS = 24 * 3600 * 10**9
MAX_INCIDENTS_PER_BATCH = 10_000
MAX_SUMMARY = 1024
MAX_EVIDENCE = 64 * 1024
MAX_INCIDENT_ID = 256
# unsigned wire integers that reach SQLite or span attributes (signed 64-bit) must fit in them
MAX_INT64 = 2**63 - 1
MAX_START_NS = MAX_INT64 - 4 * MAX_DURATION_NS  # start + its durations stays a 64-bit time
SEVERITIES = ("info", "warning", "error", "critical")
SUPPORTED_INCIDENT_SCHEMAS = (1,)


class InvalidBatch(ValueError):
    """A batch that parsed but makes no sense; the message says which field is wrong."""


def validate_batch(batch: guard_pb2.Batch) -> None:
    if not batch.HasField("rank"):
        raise InvalidBatch("batch.rank: missing; every batch must say which rank sent it")
    rank = batch.rank
    if not rank.run_id:
        raise InvalidBatch("rank.run_id: empty")
    for name in ("run_id", "engine", "node", "runner"):
        value = getattr(rank, name)
        if len(value) > MAX_TEXT:
            raise InvalidBatch(f"rank.{name}: {len(value)} characters, at most {MAX_TEXT}")
    for name in ("dp_rank", "tp_rank", "pp_rank", "dp_size", "tp_size", "pp_size"):
        value = getattr(rank, name)
        if value > MAX_RANK:
            raise InvalidBatch(f"rank.{name}: {value} exceeds {MAX_RANK}")
    for coord, size in (("dp", rank.dp_size), ("tp", rank.tp_size), ("pp", rank.pp_size)):
        value = getattr(rank, f"{coord}_rank")
        if size and value >= size:
            raise InvalidBatch(f"rank.{coord}_rank: {value} is not below {coord}_size {size}")
    if len(batch.waves) > MAX_WAVES_PER_BATCH:
        raise InvalidBatch(
            f"batch.waves: {len(batch.waves)} records, at most {MAX_WAVES_PER_BATCH}"
        )
    for index, wave in enumerate(batch.waves):
        if wave.wave == 0:
            raise InvalidBatch(f"waves[{index}].wave: must be 1 or more")
        if wave.wave > MAX_INT64:
            raise InvalidBatch(f"waves[{index}].wave: {wave.wave} exceeds {MAX_INT64}")
        for name in ("execute_ns", "sample_ns", "sample_offset_ns"):
            value = getattr(wave, name)
            if not 0 <= value <= MAX_DURATION_NS:
                raise InvalidBatch(
                    f"waves[{index}].{name}: {value} is outside [0, {MAX_DURATION_NS}]"
                )
        if not 0 < wave.start_unix_nano <= MAX_START_NS:
            raise InvalidBatch(
                f"waves[{index}].start_unix_nano: {wave.start_unix_nano} is not a time"
            )
    if batch.HasField("heartbeat") and batch.heartbeat.phase_age_ns < 0:
        raise InvalidBatch(f"heartbeat.phase_age_ns: {batch.heartbeat.phase_age_ns} is negative")
    if len(batch.incidents) > MAX_INCIDENTS_PER_BATCH:
        raise InvalidBatch(
            f"batch.incidents: {len(batch.incidents)} incidents, at most {MAX_INCIDENTS_PER_BATCH}"
        )
    for index, incident in enumerate(batch.incidents):
        _validate_incident(f"incidents[{index}]", incident)
    for index, cw in enumerate(batch.collective_waves):
        where = f"collective_waves[{index}]"
        _check_int64(where, cw, ("wave",))
        _check_duration(where, cw, ("wait_ns", "injected_delay_ns"))
        for j, stat in enumerate(cw.stats):
            _check_duration(f"{where}.stats[{j}]", stat, ("host_ns", "max_host_ns", "device_ns"))
        for j, call in enumerate(cw.slow_calls):
            _check_int64(f"{where}.slow_calls[{j}]", call, ("seq", "bytes"))
            _check_duration(f"{where}.slow_calls[{j}]", call, ("host_ns",))
    for name in batch.detector_hits_total:
        if not name or len(name) > MAX_TEXT:
            raise InvalidBatch(
                f"detector_hits_total: key {name[:40]!r} must be 1-{MAX_TEXT} characters"
            )
    for index, probe in enumerate(batch.probes):
        if not probe.name or len(probe.name) > MAX_TEXT:
            raise InvalidBatch(
                f"probes[{index}].name: {probe.name!r} must be 1-{MAX_TEXT} characters"
            )
        if probe.value != probe.value:
            raise InvalidBatch(f"probes[{index}].value: NaN")


def _check_duration(where: str, message, fields: tuple[str, ...]) -> None:
    for name in fields:
        value = getattr(message, name)
        if not 0 <= value <= MAX_DURATION_NS:
            raise InvalidBatch(f"{where}.{name}: {value} is outside [0, {MAX_DURATION_NS}]")


def _check_int64(where: str, message, fields: tuple[str, ...]) -> None:
    for name in fields:
        value = getattr(message, name)
        if value > MAX_INT64:
            raise InvalidBatch(f"{where}.{name}: {value} exceeds {MAX_INT64}")


def _validate_incident(where: str, incident: guard_pb2.Incident) -> None:
    _check_int64(where, incident, ("wave", "occurrence", "suppressed"))
    if incident.schema_version not in SUPPORTED_INCIDENT_SCHEMAS:
        raise InvalidBatch(
            f"{where}.schema_version: {incident.schema_version} is not supported "
            f"(supported: {', '.join(map(str, SUPPORTED_INCIDENT_SCHEMAS))})"
        )
    if not incident.id or len(incident.id) > MAX_INCIDENT_ID:
        raise InvalidBatch(f"{where}.id: {incident.id!r} must be 1-{MAX_INCIDENT_ID} characters")
    if not incident.type or len(incident.type) > MAX_TEXT:
        raise InvalidBatch(f"{where}.type: {incident.type!r} must be 1-{MAX_TEXT} characters")
    if incident.severity not in SEVERITIES:
        raise InvalidBatch(
            f"{where}.severity: {incident.severity!r} is not one of {', '.join(SEVERITIES)}"
        )
    if len(incident.summary) > MAX_SUMMARY:
        raise InvalidBatch(
            f"{where}.summary: {len(incident.summary)} characters, at most {MAX_SUMMARY}"
        )
    if len(incident.evidence_json) > MAX_EVIDENCE:
        raise InvalidBatch(
            f"{where}.evidence_json: {len(incident.evidence_json)} bytes, at most {MAX_EVIDENCE}"
        )
    if len(incident.request_id) > MAX_INCIDENT_ID:
        raise InvalidBatch(f"{where}.request_id: {len(incident.request_id)} characters, too long")
