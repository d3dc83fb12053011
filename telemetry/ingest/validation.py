"""Checks on every `Batch` before the sidecar uses it; each failure names the field and value.

Everything that reaches the store and the spans has passed here, so no writer can fail on a
value (an integer SQLite cannot hold, a string too long to keep): a bad record is refused with
its stream, and never spoils a batch of other ranks' records. Wave columns are checked per
column against the ranges in `telemetry/wire/schema.py` (derived from the proto), as numpy
comparisons over the packed values rather than a Python loop per record; collective columns
(wire v3) the same way. A v2 batch's `collective_waves` messages are checked as messages (the
error names `collective_waves[i]...`) and then moved into columns.
"""

from __future__ import annotations

import numpy as np
from google.protobuf.descriptor import FieldDescriptor

from telemetry.wire.collective_columns import columns_of
from telemetry.wire.proto import guard_pb2
from telemetry.wire.schema import (
    COLLECTIVE_STAT_COLUMNS,
    COLLECTIVE_WAVE_COLUMNS,
    INT64_MAX,
    MAX_DURATION_NS,
    WAVE_FIELDS,
    WAVE_RANGES,
    InvalidBatch,
)

MAX_RANK = 65_535
MAX_TEXT = 128
MAX_WAVES_PER_BATCH = 100_000
MAX_COLLECTIVE_WAVES_PER_BATCH = 100_000
MAX_STATS_PER_WAVE = 1024
MAX_COLLECTIVE_KEYS = 4096  # distinct (op, group, backend, dtype) in one batch
MAX_PROBES_PER_BATCH = 10_000
MAX_INCIDENTS_PER_BATCH = 10_000
MAX_SUMMARY = 1024
MAX_EVIDENCE = 64 * 1024
MAX_INCIDENT_ID = 256
SEVERITIES = ("info", "warning", "error", "critical")
SUPPORTED_INCIDENT_SCHEMAS = (1,)


def validate_batch(
    batch: guard_pb2.Batch,
    *,
    rank_known: bool = False,
    v1: bool = False,
    dropped: list[tuple[str, str]] | None = None,
) -> int:
    """Check one batch; return its number of wave records. `rank_known`: an earlier batch of
    the stream named the rank (wire v2 sends it once). `v1`: name fields as `waves[i].x`.
    `dropped`: a bad incident or probe reading is removed from the batch and noted there as
    (`incident` | `probe`, what is wrong) instead of refusing the whole batch (each stands on
    its own; nothing else refers to it). Without it, any bad item refuses the batch."""
    if batch.HasField("rank"):
        _validate_rank(batch.rank)
    elif not rank_known:
        raise InvalidBatch(
            "batch.rank: missing; the first batch of a stream must say which rank sent it"
        )
    waves = _validate_waves(batch.wave_columns, v1)
    if batch.HasField("heartbeat"):
        _validate_heartbeat(batch.heartbeat)
    for name in ("dropped_total", "guard_errors_total", "seq"):
        value = getattr(batch, name)
        if value > INT64_MAX:
            raise InvalidBatch(f"batch.{name}: {value} exceeds {INT64_MAX}")
    if batch.collective_waves:  # wire v2: messages, checked as such, then made columns
        if len(batch.collective_waves) > MAX_COLLECTIVE_WAVES_PER_BATCH:
            raise InvalidBatch(
                f"batch.collective_waves: {len(batch.collective_waves)} records, "
                f"at most {MAX_COLLECTIVE_WAVES_PER_BATCH}"
            )
        for index, cw in enumerate(batch.collective_waves):
            _validate_collective_wave(f"collective_waves[{index}]", cw)
        columns_of(batch)
    if batch.HasField("collective_columns"):
        _validate_collective_columns(batch.collective_columns)
    if len(batch.incidents) > MAX_INCIDENTS_PER_BATCH:
        raise InvalidBatch(
            f"batch.incidents: {len(batch.incidents)} incidents, at most {MAX_INCIDENTS_PER_BATCH}"
        )
    _check_each(batch.incidents, "incident", _validate_incident, dropped)
    if len(batch.probes) > MAX_PROBES_PER_BATCH:
        raise InvalidBatch(
            f"batch.probes: {len(batch.probes)} readings, at most {MAX_PROBES_PER_BATCH}"
        )
    _check_each(batch.probes, "probe", _validate_probe, dropped)
    if batch.HasField("request_columns"):
        _check_requests(batch, dropped)
    for type_, total in batch.detector_hits_total.items():
        if not type_ or len(type_) > MAX_TEXT or total > INT64_MAX:
            raise InvalidBatch(f"detector_hits_total[{_short(type_)}]: {total} not storable")
    return waves


def _check_each(entries, kind: str, check, dropped: list[tuple[str, str]] | None) -> None:
    """Run `check(where, entry)` on each entry; with `dropped`, remove the bad ones."""
    bad: list[int] = []
    for index, entry in enumerate(entries):
        try:
            check(f"{kind}s[{index}]", entry)
        except InvalidBatch as exc:
            if dropped is None:
                raise
            bad.append(index)
            dropped.append((kind, str(exc)))
    for index in reversed(bad):
        del entries[index]


def _check_requests(batch: guard_pb2.Batch, dropped: list[tuple[str, str]] | None) -> None:
    """Request membership stands on its own: with `dropped`, bad columns go alone."""
    from telemetry.wire.request_columns import validate_request_columns

    try:
        validate_request_columns(batch.request_columns)
    except InvalidBatch as exc:
        if dropped is None:
            raise
        batch.ClearField("request_columns")
        dropped.append(("requests", str(exc)))


def _validate_probe(where: str, probe: guard_pb2.ProbeValue) -> None:
    if not probe.name or len(probe.name) > MAX_TEXT:
        raise InvalidBatch(f"{where}.name: {_short(probe.name)} must be 1-{MAX_TEXT} characters")
    if probe.value != probe.value:
        raise InvalidBatch(f"{where}.value: NaN")
    for key, value in probe.labels.items():
        if len(key) > MAX_TEXT or len(value) > MAX_TEXT:
            raise InvalidBatch(f"{where}.labels[{_short(key)}]: longer than {MAX_TEXT} characters")


def _short(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _validate_rank(rank: guard_pb2.RankInfo) -> None:
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


_UNSIGNED_WAVE_FIELDS = {
    f.name
    for f in guard_pb2.WaveRecord.DESCRIPTOR.fields
    if f.type in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_UINT32)
}
# columns whose proto type already bounds them to what the store holds need no check
_CHECKED = tuple(
    (name, lo, hi, np.uint64 if name in _UNSIGNED_WAVE_FIELDS else np.int64)
    for name, (lo, hi) in WAVE_RANGES.items()
    if (lo, hi) not in ((0, 2**32 - 1), (0, 1))
)


def _validate_waves(cols: guard_pb2.WaveColumns, v1: bool) -> int:
    n = len(cols.wave)
    if n > MAX_WAVES_PER_BATCH:
        raise InvalidBatch(f"batch.waves: {n} records, at most {MAX_WAVES_PER_BATCH}")
    if not n:
        for name in WAVE_FIELDS:
            if len(getattr(cols, name)):
                raise InvalidBatch(f"wave_columns.{name}: values without a wave column")
        return 0
    for name in WAVE_FIELDS:
        if len(getattr(cols, name)) != n:
            raise InvalidBatch(
                f"wave_columns.{name}: {len(getattr(cols, name))} values, wave has {n}"
            )
    for name, lo, hi, kind in _CHECKED:
        values = np.array(getattr(cols, name), dtype=kind)
        bad = np.flatnonzero((values < lo) | (values > hi))
        if not bad.size:
            continue
        index = int(bad[0])
        value = int(values[index])
        where = f"waves[{index}].{name}" if v1 else f"wave_columns.{name}[{index}]"
        if name == "wave" and value == 0:
            raise InvalidBatch(f"{where}: must be 1 or more")
        if name == "start_unix_nano":
            raise InvalidBatch(f"{where}: {value} is not a time")
        raise InvalidBatch(f"{where}: {value} is outside [{lo}, {hi}]")
    return n


def _validate_heartbeat(hb: guard_pb2.Heartbeat) -> None:
    if hb.phase_age_ns < 0:
        raise InvalidBatch(f"heartbeat.phase_age_ns: {hb.phase_age_ns} is negative")
    if hb.last_wave > INT64_MAX or hb.collective_seq > INT64_MAX:
        raise InvalidBatch(
            f"heartbeat: last_wave {hb.last_wave} / collective_seq {hb.collective_seq} "
            f"exceed {INT64_MAX}"
        )
    # a captured graph's list of collectives is a sentence, the rest are names
    limits = {"collective_graph_holds": MAX_SUMMARY}
    for name in (
        "phase",
        "collective_op",
        "collective_group",
        "collective_backend",
        "collective_graph",
        "collective_graph_holds",
    ):
        value = getattr(hb, name)
        limit = limits.get(name, MAX_TEXT)
        if len(value) > limit:
            raise InvalidBatch(f"heartbeat.{name}: {len(value)} characters, at most {limit}")


def _validate_collective_wave(where: str, cw: guard_pb2.CollectiveWave) -> None:
    # Integers here are stored as sent (the store keeps the proto's uint64, metrics are
    # floats, spans clamp to OTLP's int64); only the wave number keys a row.
    if not 1 <= cw.wave <= INT64_MAX:
        raise InvalidBatch(f"{where}.wave: {cw.wave} is outside [1, {INT64_MAX}]")
    # durations are never negative nor longer than a day (they become span ends and metrics)
    _check_duration(where, cw, ("wait_ns", "injected_delay_ns"))
    for j, stat in enumerate(cw.stats):
        _check_duration(f"{where}.stats[{j}]", stat, ("host_ns", "max_host_ns", "device_ns"))
    for j, call in enumerate(cw.slow_calls):
        _check_int64(f"{where}.slow_calls[{j}]", call, ("seq", "bytes"))
        _check_duration(f"{where}.slow_calls[{j}]", call, ("host_ns",))
    if cw.ByteSize() <= MAX_TEXT:
        return  # no string inside can be longer than the whole record: the common case
    if len(cw.stats) > MAX_STATS_PER_WAVE:
        raise InvalidBatch(f"{where}.stats: {len(cw.stats)} entries, at most {MAX_STATS_PER_WAVE}")
    for kind, entries in (("stats", cw.stats), ("slow_calls", cw.slow_calls)):
        for index, entry in enumerate(entries):
            if entry.ByteSize() <= MAX_TEXT:
                continue
            for name in ("op", "group", "backend", "dtype"):
                value = getattr(entry, name)
                if len(value) > MAX_TEXT:
                    raise InvalidBatch(
                        f"{where}.{kind}[{index}].{name}: {len(value)} characters "
                        f"({_short(value)}), at most {MAX_TEXT}"
                    )


# per-wave and per-stat columns that hold durations: never negative nor longer than a day
# (they become span ends and metrics)
_WAVE_DURATIONS = ("wait_ns", "injected_delay_ns")
_STAT_DURATIONS = ("host_ns", "max_host_ns", "device_ns")


def _first_outside(where: str, values: np.ndarray, lo: int, hi: int) -> None:
    bad = np.flatnonzero((values < lo) | (values > hi))
    if bad.size:
        index = int(bad[0])
        raise InvalidBatch(f"{where}[{index}]: {int(values[index])} is outside [{lo}, {hi}]")


def _validate_collective_columns(cols: guard_pb2.CollectiveColumns) -> None:
    """Wire v3 collective columns: equal lengths, indexes in range, values storable."""
    where = "collective_columns"
    n = len(cols.wave)
    if n > MAX_COLLECTIVE_WAVES_PER_BATCH:
        raise InvalidBatch(f"{where}.wave: {n} records, at most {MAX_COLLECTIVE_WAVES_PER_BATCH}")
    for name in COLLECTIVE_WAVE_COLUMNS:
        if len(getattr(cols, name)) != n:
            raise InvalidBatch(f"{where}.{name}: {len(getattr(cols, name))} values, wave has {n}")
    stats = cols.stats
    m = len(stats.wave_index)
    for name in ("key", *COLLECTIVE_STAT_COLUMNS):
        if len(getattr(stats, name)) != m:
            raise InvalidBatch(
                f"{where}.stats.{name}: {len(getattr(stats, name))} values, wave_index has {m}"
            )
    if len(cols.slow_call_wave_index) != len(cols.slow_calls):
        raise InvalidBatch(
            f"{where}.slow_call_wave_index: {len(cols.slow_call_wave_index)} values, "
            f"slow_calls has {len(cols.slow_calls)}"
        )
    if len(cols.keys) > MAX_COLLECTIVE_KEYS:
        raise InvalidBatch(f"{where}.keys: {len(cols.keys)} entries, at most {MAX_COLLECTIVE_KEYS}")
    if not n:
        if m or cols.slow_calls:
            raise InvalidBatch(f"{where}: stats or slow calls without a wave column")
        return
    _first_outside(f"{where}.wave", np.array(cols.wave, dtype=np.uint64), 1, INT64_MAX)
    for name in _WAVE_DURATIONS:
        values = np.array(getattr(cols, name), dtype=np.int64)
        _first_outside(f"{where}.{name}", values, 0, MAX_DURATION_NS)
    if m:
        wave_index = np.array(stats.wave_index, dtype=np.int64)
        _first_outside(f"{where}.stats.wave_index", wave_index, 0, n - 1)
        _first_outside(
            f"{where}.stats.key", np.array(stats.key, dtype=np.int64), 0, len(cols.keys) - 1
        )
        per_wave = int(np.bincount(wave_index).max())
        if per_wave > MAX_STATS_PER_WAVE:
            raise InvalidBatch(
                f"{where}.stats: {per_wave} entries in one wave, at most {MAX_STATS_PER_WAVE}"
            )
        for name in _STAT_DURATIONS:
            values = np.array(getattr(stats, name), dtype=np.int64)
            _first_outside(f"{where}.stats.{name}", values, 0, MAX_DURATION_NS)
    for index, key in enumerate(cols.keys):
        if key.ByteSize() > MAX_TEXT:
            _check_text(f"{where}.keys[{index}]", key)
    if cols.slow_calls:
        _first_outside(
            f"{where}.slow_call_wave_index",
            np.array(cols.slow_call_wave_index, dtype=np.int64),
            0,
            n - 1,
        )
        for j, call in enumerate(cols.slow_calls):
            _check_int64(f"{where}.slow_calls[{j}]", call, ("seq", "bytes"))
            _check_duration(f"{where}.slow_calls[{j}]", call, ("host_ns",))
            if call.ByteSize() > MAX_TEXT:
                _check_text(f"{where}.slow_calls[{j}]", call)


def _check_text(where: str, entry) -> None:
    for name in ("op", "group", "backend", "dtype"):
        value = getattr(entry, name)
        if len(value) > MAX_TEXT:
            raise InvalidBatch(
                f"{where}.{name}: {len(value)} characters ({_short(value)}), at most {MAX_TEXT}"
            )


def _check_duration(where: str, message, fields: tuple[str, ...]) -> None:
    for name in fields:
        value = getattr(message, name)
        if not 0 <= value <= MAX_DURATION_NS:
            raise InvalidBatch(f"{where}.{name}: {value} is outside [0, {MAX_DURATION_NS}]")


def _check_int64(where: str, message, fields: tuple[str, ...]) -> None:
    for name in fields:
        value = getattr(message, name)
        if value > INT64_MAX:
            raise InvalidBatch(f"{where}.{name}: {value} exceeds {INT64_MAX}")


def _validate_incident(where: str, incident: guard_pb2.Incident) -> None:
    if incident.schema_version not in SUPPORTED_INCIDENT_SCHEMAS:
        raise InvalidBatch(
            f"{where}.schema_version: {incident.schema_version} is not supported "
            f"(supported: {', '.join(map(str, SUPPORTED_INCIDENT_SCHEMAS))})"
        )
    if not incident.id or len(incident.id) > MAX_INCIDENT_ID:
        raise InvalidBatch(f"{where}.id: {incident.id!r} must be 1-{MAX_INCIDENT_ID} characters")
    if not incident.type or len(incident.type) > MAX_TEXT:
        raise InvalidBatch(f"{where}.type: {incident.type!r} must be 1-{MAX_TEXT} characters")
    if incident.wave > INT64_MAX:
        raise InvalidBatch(f"{where}.wave: {incident.wave} exceeds {INT64_MAX}")
    if incident.occurrence > INT64_MAX or incident.suppressed > INT64_MAX:
        raise InvalidBatch(f"{where}.occurrence/suppressed: exceed {INT64_MAX}")
    if len(incident.actions) > 64 or any(len(a) > MAX_SUMMARY for a in incident.actions):
        raise InvalidBatch(f"{where}.actions: at most 64 of at most {MAX_SUMMARY} characters")
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
