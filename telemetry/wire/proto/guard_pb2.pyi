from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RankInfo(_message.Message):
    __slots__ = ("run_id", "engine", "dp_rank", "tp_rank", "pp_rank", "dp_size", "tp_size", "pp_size", "node", "pid", "runner", "dp_lockstep")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    RUNNER_FIELD_NUMBER: _ClassVar[int]
    DP_LOCKSTEP_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    engine: str
    dp_rank: int
    tp_rank: int
    pp_rank: int
    dp_size: int
    tp_size: int
    pp_size: int
    node: str
    pid: int
    runner: str
    dp_lockstep: bool
    def __init__(self, run_id: _Optional[str] = ..., engine: _Optional[str] = ..., dp_rank: _Optional[int] = ..., tp_rank: _Optional[int] = ..., pp_rank: _Optional[int] = ..., dp_size: _Optional[int] = ..., tp_size: _Optional[int] = ..., pp_size: _Optional[int] = ..., node: _Optional[str] = ..., pid: _Optional[int] = ..., runner: _Optional[str] = ..., dp_lockstep: bool = ...) -> None: ...

class WaveRecord(_message.Message):
    __slots__ = ("wave", "start_unix_nano", "execute_ns", "sample_ns", "sample_offset_ns", "num_reqs", "prefill_reqs", "decode_reqs", "prefill_tokens", "decode_tokens", "sampled_tokens", "dummy", "sampled", "recompute_tokens")
    WAVE_FIELD_NUMBER: _ClassVar[int]
    START_UNIX_NANO_FIELD_NUMBER: _ClassVar[int]
    EXECUTE_NS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_NS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_OFFSET_NS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_REQS_FIELD_NUMBER: _ClassVar[int]
    DECODE_REQS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DUMMY_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    wave: int
    start_unix_nano: int
    execute_ns: int
    sample_ns: int
    sample_offset_ns: int
    num_reqs: int
    prefill_reqs: int
    decode_reqs: int
    prefill_tokens: int
    decode_tokens: int
    sampled_tokens: int
    dummy: bool
    sampled: bool
    recompute_tokens: int
    def __init__(self, wave: _Optional[int] = ..., start_unix_nano: _Optional[int] = ..., execute_ns: _Optional[int] = ..., sample_ns: _Optional[int] = ..., sample_offset_ns: _Optional[int] = ..., num_reqs: _Optional[int] = ..., prefill_reqs: _Optional[int] = ..., decode_reqs: _Optional[int] = ..., prefill_tokens: _Optional[int] = ..., decode_tokens: _Optional[int] = ..., sampled_tokens: _Optional[int] = ..., dummy: bool = ..., sampled: bool = ..., recompute_tokens: _Optional[int] = ...) -> None: ...

class WaveColumns(_message.Message):
    __slots__ = ("wave", "start_unix_nano", "execute_ns", "sample_ns", "sample_offset_ns", "num_reqs", "prefill_reqs", "decode_reqs", "prefill_tokens", "decode_tokens", "sampled_tokens", "dummy", "sampled", "recompute_tokens")
    WAVE_FIELD_NUMBER: _ClassVar[int]
    START_UNIX_NANO_FIELD_NUMBER: _ClassVar[int]
    EXECUTE_NS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_NS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_OFFSET_NS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_REQS_FIELD_NUMBER: _ClassVar[int]
    DECODE_REQS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DUMMY_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    wave: _containers.RepeatedScalarFieldContainer[int]
    start_unix_nano: _containers.RepeatedScalarFieldContainer[int]
    execute_ns: _containers.RepeatedScalarFieldContainer[int]
    sample_ns: _containers.RepeatedScalarFieldContainer[int]
    sample_offset_ns: _containers.RepeatedScalarFieldContainer[int]
    num_reqs: _containers.RepeatedScalarFieldContainer[int]
    prefill_reqs: _containers.RepeatedScalarFieldContainer[int]
    decode_reqs: _containers.RepeatedScalarFieldContainer[int]
    prefill_tokens: _containers.RepeatedScalarFieldContainer[int]
    decode_tokens: _containers.RepeatedScalarFieldContainer[int]
    sampled_tokens: _containers.RepeatedScalarFieldContainer[int]
    dummy: _containers.RepeatedScalarFieldContainer[bool]
    sampled: _containers.RepeatedScalarFieldContainer[bool]
    recompute_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, wave: _Optional[_Iterable[int]] = ..., start_unix_nano: _Optional[_Iterable[int]] = ..., execute_ns: _Optional[_Iterable[int]] = ..., sample_ns: _Optional[_Iterable[int]] = ..., sample_offset_ns: _Optional[_Iterable[int]] = ..., num_reqs: _Optional[_Iterable[int]] = ..., prefill_reqs: _Optional[_Iterable[int]] = ..., decode_reqs: _Optional[_Iterable[int]] = ..., prefill_tokens: _Optional[_Iterable[int]] = ..., decode_tokens: _Optional[_Iterable[int]] = ..., sampled_tokens: _Optional[_Iterable[int]] = ..., dummy: _Optional[_Iterable[bool]] = ..., sampled: _Optional[_Iterable[bool]] = ..., recompute_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("time_unix_nano", "last_wave", "phase", "phase_age_ns", "collective_op", "collective_group", "collective_seq", "collective_age_ns", "collective_backend", "collective_graph", "collective_graph_holds")
    TIME_UNIX_NANO_FIELD_NUMBER: _ClassVar[int]
    LAST_WAVE_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PHASE_AGE_NS_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_OP_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_GROUP_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_SEQ_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_AGE_NS_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_BACKEND_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_GRAPH_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_GRAPH_HOLDS_FIELD_NUMBER: _ClassVar[int]
    time_unix_nano: int
    last_wave: int
    phase: str
    phase_age_ns: int
    collective_op: str
    collective_group: str
    collective_seq: int
    collective_age_ns: int
    collective_backend: str
    collective_graph: str
    collective_graph_holds: str
    def __init__(self, time_unix_nano: _Optional[int] = ..., last_wave: _Optional[int] = ..., phase: _Optional[str] = ..., phase_age_ns: _Optional[int] = ..., collective_op: _Optional[str] = ..., collective_group: _Optional[str] = ..., collective_seq: _Optional[int] = ..., collective_age_ns: _Optional[int] = ..., collective_backend: _Optional[str] = ..., collective_graph: _Optional[str] = ..., collective_graph_holds: _Optional[str] = ...) -> None: ...

class CollectiveStat(_message.Message):
    __slots__ = ("op", "group", "backend", "dtype", "calls", "bytes", "host_ns", "max_host_ns", "first_seq", "last_seq", "device_ns", "replayed", "graph_counted")
    OP_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_NS_FIELD_NUMBER: _ClassVar[int]
    MAX_HOST_NS_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEQ_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NS_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    GRAPH_COUNTED_FIELD_NUMBER: _ClassVar[int]
    op: str
    group: str
    backend: str
    dtype: str
    calls: int
    bytes: int
    host_ns: int
    max_host_ns: int
    first_seq: int
    last_seq: int
    device_ns: int
    replayed: int
    graph_counted: int
    def __init__(self, op: _Optional[str] = ..., group: _Optional[str] = ..., backend: _Optional[str] = ..., dtype: _Optional[str] = ..., calls: _Optional[int] = ..., bytes: _Optional[int] = ..., host_ns: _Optional[int] = ..., max_host_ns: _Optional[int] = ..., first_seq: _Optional[int] = ..., last_seq: _Optional[int] = ..., device_ns: _Optional[int] = ..., replayed: _Optional[int] = ..., graph_counted: _Optional[int] = ...) -> None: ...

class CollectiveCall(_message.Message):
    __slots__ = ("op", "group", "backend", "dtype", "seq", "bytes", "start_unix_nano", "host_ns")
    OP_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    START_UNIX_NANO_FIELD_NUMBER: _ClassVar[int]
    HOST_NS_FIELD_NUMBER: _ClassVar[int]
    op: str
    group: str
    backend: str
    dtype: str
    seq: int
    bytes: int
    start_unix_nano: int
    host_ns: int
    def __init__(self, op: _Optional[str] = ..., group: _Optional[str] = ..., backend: _Optional[str] = ..., dtype: _Optional[str] = ..., seq: _Optional[int] = ..., bytes: _Optional[int] = ..., start_unix_nano: _Optional[int] = ..., host_ns: _Optional[int] = ...) -> None: ...

class CollectiveWave(_message.Message):
    __slots__ = ("wave", "first_arrival_unix_nano", "wait_ns", "stats", "slow_calls", "slow_calls_dropped", "injected_delay_ns", "replay_device_ns")
    WAVE_FIELD_NUMBER: _ClassVar[int]
    FIRST_ARRIVAL_UNIX_NANO_FIELD_NUMBER: _ClassVar[int]
    WAIT_NS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    SLOW_CALLS_FIELD_NUMBER: _ClassVar[int]
    SLOW_CALLS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    INJECTED_DELAY_NS_FIELD_NUMBER: _ClassVar[int]
    REPLAY_DEVICE_NS_FIELD_NUMBER: _ClassVar[int]
    wave: int
    first_arrival_unix_nano: int
    wait_ns: int
    stats: _containers.RepeatedCompositeFieldContainer[CollectiveStat]
    slow_calls: _containers.RepeatedCompositeFieldContainer[CollectiveCall]
    slow_calls_dropped: int
    injected_delay_ns: int
    replay_device_ns: int
    def __init__(self, wave: _Optional[int] = ..., first_arrival_unix_nano: _Optional[int] = ..., wait_ns: _Optional[int] = ..., stats: _Optional[_Iterable[_Union[CollectiveStat, _Mapping]]] = ..., slow_calls: _Optional[_Iterable[_Union[CollectiveCall, _Mapping]]] = ..., slow_calls_dropped: _Optional[int] = ..., injected_delay_ns: _Optional[int] = ..., replay_device_ns: _Optional[int] = ...) -> None: ...

class CollectiveKey(_message.Message):
    __slots__ = ("op", "group", "backend", "dtype")
    OP_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    op: str
    group: str
    backend: str
    dtype: str
    def __init__(self, op: _Optional[str] = ..., group: _Optional[str] = ..., backend: _Optional[str] = ..., dtype: _Optional[str] = ...) -> None: ...

class CollectiveStatColumns(_message.Message):
    __slots__ = ("wave_index", "key", "calls", "bytes", "host_ns", "max_host_ns", "first_seq", "last_seq", "device_ns", "replayed", "graph_counted")
    WAVE_INDEX_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_NS_FIELD_NUMBER: _ClassVar[int]
    MAX_HOST_NS_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEQ_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NS_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    GRAPH_COUNTED_FIELD_NUMBER: _ClassVar[int]
    wave_index: _containers.RepeatedScalarFieldContainer[int]
    key: _containers.RepeatedScalarFieldContainer[int]
    calls: _containers.RepeatedScalarFieldContainer[int]
    bytes: _containers.RepeatedScalarFieldContainer[int]
    host_ns: _containers.RepeatedScalarFieldContainer[int]
    max_host_ns: _containers.RepeatedScalarFieldContainer[int]
    first_seq: _containers.RepeatedScalarFieldContainer[int]
    last_seq: _containers.RepeatedScalarFieldContainer[int]
    device_ns: _containers.RepeatedScalarFieldContainer[int]
    replayed: _containers.RepeatedScalarFieldContainer[int]
    graph_counted: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, wave_index: _Optional[_Iterable[int]] = ..., key: _Optional[_Iterable[int]] = ..., calls: _Optional[_Iterable[int]] = ..., bytes: _Optional[_Iterable[int]] = ..., host_ns: _Optional[_Iterable[int]] = ..., max_host_ns: _Optional[_Iterable[int]] = ..., first_seq: _Optional[_Iterable[int]] = ..., last_seq: _Optional[_Iterable[int]] = ..., device_ns: _Optional[_Iterable[int]] = ..., replayed: _Optional[_Iterable[int]] = ..., graph_counted: _Optional[_Iterable[int]] = ...) -> None: ...

class CollectiveColumns(_message.Message):
    __slots__ = ("wave", "first_arrival_unix_nano", "wait_ns", "stats", "slow_calls", "slow_calls_dropped", "injected_delay_ns", "replay_device_ns", "keys", "slow_call_wave_index")
    WAVE_FIELD_NUMBER: _ClassVar[int]
    FIRST_ARRIVAL_UNIX_NANO_FIELD_NUMBER: _ClassVar[int]
    WAIT_NS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    SLOW_CALLS_FIELD_NUMBER: _ClassVar[int]
    SLOW_CALLS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    INJECTED_DELAY_NS_FIELD_NUMBER: _ClassVar[int]
    REPLAY_DEVICE_NS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SLOW_CALL_WAVE_INDEX_FIELD_NUMBER: _ClassVar[int]
    wave: _containers.RepeatedScalarFieldContainer[int]
    first_arrival_unix_nano: _containers.RepeatedScalarFieldContainer[int]
    wait_ns: _containers.RepeatedScalarFieldContainer[int]
    stats: CollectiveStatColumns
    slow_calls: _containers.RepeatedCompositeFieldContainer[CollectiveCall]
    slow_calls_dropped: _containers.RepeatedScalarFieldContainer[int]
    injected_delay_ns: _containers.RepeatedScalarFieldContainer[int]
    replay_device_ns: _containers.RepeatedScalarFieldContainer[int]
    keys: _containers.RepeatedCompositeFieldContainer[CollectiveKey]
    slow_call_wave_index: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, wave: _Optional[_Iterable[int]] = ..., first_arrival_unix_nano: _Optional[_Iterable[int]] = ..., wait_ns: _Optional[_Iterable[int]] = ..., stats: _Optional[_Union[CollectiveStatColumns, _Mapping]] = ..., slow_calls: _Optional[_Iterable[_Union[CollectiveCall, _Mapping]]] = ..., slow_calls_dropped: _Optional[_Iterable[int]] = ..., injected_delay_ns: _Optional[_Iterable[int]] = ..., replay_device_ns: _Optional[_Iterable[int]] = ..., keys: _Optional[_Iterable[_Union[CollectiveKey, _Mapping]]] = ..., slow_call_wave_index: _Optional[_Iterable[int]] = ...) -> None: ...

class Incident(_message.Message):
    __slots__ = ("schema_version", "id", "type", "severity", "wave", "request_id", "time_unix_nano", "summary", "evidence_json", "actions", "occurrence", "suppressed")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    SEVERITY_FIELD_NUMBER: _ClassVar[int]
    WAVE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TIME_UNIX_NANO_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_JSON_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    OCCURRENCE_FIELD_NUMBER: _ClassVar[int]
    SUPPRESSED_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    id: str
    type: str
    severity: str
    wave: int
    request_id: str
    time_unix_nano: int
    summary: str
    evidence_json: str
    actions: _containers.RepeatedScalarFieldContainer[str]
    occurrence: int
    suppressed: int
    def __init__(self, schema_version: _Optional[int] = ..., id: _Optional[str] = ..., type: _Optional[str] = ..., severity: _Optional[str] = ..., wave: _Optional[int] = ..., request_id: _Optional[str] = ..., time_unix_nano: _Optional[int] = ..., summary: _Optional[str] = ..., evidence_json: _Optional[str] = ..., actions: _Optional[_Iterable[str]] = ..., occurrence: _Optional[int] = ..., suppressed: _Optional[int] = ...) -> None: ...

class ProbeValue(_message.Message):
    __slots__ = ("name", "labels", "value")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    name: str
    labels: _containers.ScalarMap[str, str]
    value: float
    def __init__(self, name: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., value: _Optional[float] = ...) -> None: ...

class RequestColumns(_message.Message):
    __slots__ = ("name_index", "name_request_id", "wave", "members", "same_members", "req_index", "scheduled_each", "scheduled_count", "scheduled_index", "scheduled_tokens", "sampled", "sampled_each", "sampled_count", "sampled_index", "sampled_tokens", "finished_count", "finished_index", "preempted_count", "preempted_index", "dropped_rows_total", "dropped_names_total", "traceparent_index", "traceparent")
    NAME_INDEX_FIELD_NUMBER: _ClassVar[int]
    NAME_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WAVE_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    SAME_MEMBERS_FIELD_NUMBER: _ClassVar[int]
    REQ_INDEX_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_EACH_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_COUNT_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_INDEX_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_EACH_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_COUNT_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_INDEX_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_COUNT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_INDEX_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_COUNT_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_INDEX_FIELD_NUMBER: _ClassVar[int]
    DROPPED_ROWS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DROPPED_NAMES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_INDEX_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    name_index: _containers.RepeatedScalarFieldContainer[int]
    name_request_id: _containers.RepeatedScalarFieldContainer[str]
    wave: _containers.RepeatedScalarFieldContainer[int]
    members: _containers.RepeatedScalarFieldContainer[int]
    same_members: _containers.RepeatedScalarFieldContainer[bool]
    req_index: _containers.RepeatedScalarFieldContainer[int]
    scheduled_each: _containers.RepeatedScalarFieldContainer[int]
    scheduled_count: _containers.RepeatedScalarFieldContainer[int]
    scheduled_index: _containers.RepeatedScalarFieldContainer[int]
    scheduled_tokens: _containers.RepeatedScalarFieldContainer[int]
    sampled: _containers.RepeatedScalarFieldContainer[bool]
    sampled_each: _containers.RepeatedScalarFieldContainer[int]
    sampled_count: _containers.RepeatedScalarFieldContainer[int]
    sampled_index: _containers.RepeatedScalarFieldContainer[int]
    sampled_tokens: _containers.RepeatedScalarFieldContainer[int]
    finished_count: _containers.RepeatedScalarFieldContainer[int]
    finished_index: _containers.RepeatedScalarFieldContainer[int]
    preempted_count: _containers.RepeatedScalarFieldContainer[int]
    preempted_index: _containers.RepeatedScalarFieldContainer[int]
    dropped_rows_total: int
    dropped_names_total: int
    traceparent_index: _containers.RepeatedScalarFieldContainer[int]
    traceparent: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name_index: _Optional[_Iterable[int]] = ..., name_request_id: _Optional[_Iterable[str]] = ..., wave: _Optional[_Iterable[int]] = ..., members: _Optional[_Iterable[int]] = ..., same_members: _Optional[_Iterable[bool]] = ..., req_index: _Optional[_Iterable[int]] = ..., scheduled_each: _Optional[_Iterable[int]] = ..., scheduled_count: _Optional[_Iterable[int]] = ..., scheduled_index: _Optional[_Iterable[int]] = ..., scheduled_tokens: _Optional[_Iterable[int]] = ..., sampled: _Optional[_Iterable[bool]] = ..., sampled_each: _Optional[_Iterable[int]] = ..., sampled_count: _Optional[_Iterable[int]] = ..., sampled_index: _Optional[_Iterable[int]] = ..., sampled_tokens: _Optional[_Iterable[int]] = ..., finished_count: _Optional[_Iterable[int]] = ..., finished_index: _Optional[_Iterable[int]] = ..., preempted_count: _Optional[_Iterable[int]] = ..., preempted_index: _Optional[_Iterable[int]] = ..., dropped_rows_total: _Optional[int] = ..., dropped_names_total: _Optional[int] = ..., traceparent_index: _Optional[_Iterable[int]] = ..., traceparent: _Optional[_Iterable[str]] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("rank", "waves", "heartbeat", "dropped_total", "guard_errors_total", "seq", "incidents", "detector_hits_total", "probes", "collective_waves", "wire_version", "wave_columns", "collective_columns", "request_columns")
    class DetectorHitsTotalEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RANK_FIELD_NUMBER: _ClassVar[int]
    WAVES_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    DROPPED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    GUARD_ERRORS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    INCIDENTS_FIELD_NUMBER: _ClassVar[int]
    DETECTOR_HITS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PROBES_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_WAVES_FIELD_NUMBER: _ClassVar[int]
    WIRE_VERSION_FIELD_NUMBER: _ClassVar[int]
    WAVE_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    rank: RankInfo
    waves: _containers.RepeatedCompositeFieldContainer[WaveRecord]
    heartbeat: Heartbeat
    dropped_total: int
    guard_errors_total: int
    seq: int
    incidents: _containers.RepeatedCompositeFieldContainer[Incident]
    detector_hits_total: _containers.ScalarMap[str, int]
    probes: _containers.RepeatedCompositeFieldContainer[ProbeValue]
    collective_waves: _containers.RepeatedCompositeFieldContainer[CollectiveWave]
    wire_version: int
    wave_columns: WaveColumns
    collective_columns: CollectiveColumns
    request_columns: RequestColumns
    def __init__(self, rank: _Optional[_Union[RankInfo, _Mapping]] = ..., waves: _Optional[_Iterable[_Union[WaveRecord, _Mapping]]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., dropped_total: _Optional[int] = ..., guard_errors_total: _Optional[int] = ..., seq: _Optional[int] = ..., incidents: _Optional[_Iterable[_Union[Incident, _Mapping]]] = ..., detector_hits_total: _Optional[_Mapping[str, int]] = ..., probes: _Optional[_Iterable[_Union[ProbeValue, _Mapping]]] = ..., collective_waves: _Optional[_Iterable[_Union[CollectiveWave, _Mapping]]] = ..., wire_version: _Optional[int] = ..., wave_columns: _Optional[_Union[WaveColumns, _Mapping]] = ..., collective_columns: _Optional[_Union[CollectiveColumns, _Mapping]] = ..., request_columns: _Optional[_Union[RequestColumns, _Mapping]] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("batches", "waves")
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    WAVES_FIELD_NUMBER: _ClassVar[int]
    batches: int
    waves: int
    def __init__(self, batches: _Optional[int] = ..., waves: _Optional[int] = ...) -> None: ...
