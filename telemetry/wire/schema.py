"""One home for the names of a wave: derived from the proto, used by every other module.

`WaveRecord` in guard.proto is the schema of a wave. The wire columns (`WaveColumns`), the
worker's `WaveTuple` order, validation ranges, the stored blocks, span attributes and CLI
columns all come from the tables below, which are read off the proto descriptors, so a field
added to the proto reaches every one of them (a unit test checks they agree).
"""

from __future__ import annotations

from google.protobuf.descriptor import FieldDescriptor

from telemetry.wire.proto import guard_pb2

WIRE_VERSION = 3

# field names in field-number order
WAVE_FIELDS: tuple[str, ...] = tuple(
    f.name for f in sorted(guard_pb2.WaveRecord.DESCRIPTOR.fields, key=lambda f: f.number)
)
COLLECTIVE_STAT_FIELDS: tuple[str, ...] = tuple(
    f.name for f in sorted(guard_pb2.CollectiveStat.DESCRIPTOR.fields, key=lambda f: f.number)
)
RANK_FIELDS: tuple[str, ...] = tuple(
    f.name for f in sorted(guard_pb2.RankInfo.DESCRIPTOR.fields, key=lambda f: f.number)
)

# collective aggregates as columns (wire v3, `CollectiveColumns`): the per-wave scalars of
# CollectiveWave, the numeric fields of CollectiveStat, and its strings (a per-batch key)
COLLECTIVE_WAVE_COLUMNS: tuple[str, ...] = tuple(
    f.name
    for f in sorted(guard_pb2.CollectiveWave.DESCRIPTOR.fields, key=lambda f: f.number)
    if f.type != FieldDescriptor.TYPE_MESSAGE
)
COLLECTIVE_KEY_FIELDS: tuple[str, ...] = tuple(
    f.name for f in sorted(guard_pb2.CollectiveKey.DESCRIPTOR.fields, key=lambda f: f.number)
)
COLLECTIVE_STAT_COLUMNS: tuple[str, ...] = tuple(
    name for name in COLLECTIVE_STAT_FIELDS if name not in COLLECTIVE_KEY_FIELDS
)

# the column index of each wave field, for code that reads columns by position
WAVE_INDEX = {name: i for i, name in enumerate(WAVE_FIELDS)}

# value range of each proto scalar type as the store and spans can hold it (SQLite and OTLP
# integers are signed 64-bit, so a uint64 above 2^63 - 1 cannot be stored: refused at
# validation instead)
INT64_MAX = 2**63 - 1
_TYPE_RANGE = {
    FieldDescriptor.TYPE_UINT64: (0, INT64_MAX),
    FieldDescriptor.TYPE_INT64: (-(2**63), INT64_MAX),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_BOOL: (0, 1),
}
MAX_DURATION_NS = 24 * 3600 * 10**9
# narrower ranges where the field's meaning says so
_WAVE_RANGE_OVERRIDES = {
    "wave": (1, INT64_MAX),
    # start + its durations stays a 64-bit time
    "start_unix_nano": (1, INT64_MAX - 4 * MAX_DURATION_NS),
    "execute_ns": (0, MAX_DURATION_NS),
    "sample_ns": (0, MAX_DURATION_NS),
    "sample_offset_ns": (0, MAX_DURATION_NS),
}
WAVE_RANGES: dict[str, tuple[int, int]] = {
    f.name: _WAVE_RANGE_OVERRIDES.get(f.name, _TYPE_RANGE[f.type])
    for f in guard_pb2.WaveRecord.DESCRIPTOR.fields
}

# the instrumentation scope of every span the sidecar builds (OTLP export, the query API's
# traces, TraceQL's instrumentation:name)
SCOPE_NAME = "ascend_guard.sidecar"

# the OTel service of a rank's spans, one convention for the OTLP export, the query API's traces
# and TraceQL (`resource.service.name`, `rootServiceName`): the engine label (the model server)
# is `service.name`, this project the `service.namespace`
SERVICE_NAMESPACE = "ascend-guard"


def service_name(engine: str | None) -> str:
    """`service.name` of the spans of a rank (or replica) with this engine label: the label,
    else the project's name (a span of no engine: the sidecar's own)."""
    return engine or SERVICE_NAMESPACE


# -- span attribute names (semantic conventions of this project) -----------------------------
PREFIX = "ascend_guard."


def attr(name: str) -> str:
    """The span attribute that carries wave field or rank coordinate `name`."""
    return PREFIX + name


ATTR_RUN = attr("run_id")
ATTR_ENGINE = attr("engine")
ATTR_WAVE = attr("wave")
ATTR_DP = attr("dp")
ATTR_TP = attr("tp")
ATTR_PP = attr("pp")
ATTR_NODE = attr("node")
ATTR_PID = attr("pid")
# wave fields shown on the rank span (and as CLI detail), in schema order
RANK_SPAN_FIELDS = (
    "num_reqs",
    "prefill_tokens",
    "decode_tokens",
    "recompute_tokens",
    "sampled_tokens",
    "dummy",
)
WAVE_SPAN_FIELDS = ("num_reqs", "dummy")
# the spans every stored wave has (`query --name` searches these), then the other kinds
WAVE_SPAN_NAMES = ("wave", "rank", "execute_model", "sample_tokens")
SPAN_NAMES = (*WAVE_SPAN_NAMES, "collective", "incident")


class InvalidBatch(ValueError):
    """A batch that parsed but makes no sense; the message says which field is wrong."""
