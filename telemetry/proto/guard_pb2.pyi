from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers

DESCRIPTOR: _descriptor.FileDescriptor

class RankInfo(_message.Message):
    __slots__ = (
        "run_id",
        "engine",
        "dp_rank",
        "tp_rank",
        "pp_rank",
        "dp_size",
        "tp_size",
        "pp_size",
        "node",
        "pid",
        "runner",
    )
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
    def __init__(
        self,
        run_id: str | None = ...,
        engine: str | None = ...,
        dp_rank: int | None = ...,
        tp_rank: int | None = ...,
        pp_rank: int | None = ...,
        dp_size: int | None = ...,
        tp_size: int | None = ...,
        pp_size: int | None = ...,
        node: str | None = ...,
        pid: int | None = ...,
        runner: str | None = ...,
    ) -> None: ...

class WaveRecord(_message.Message):
    __slots__ = (
        "wave",
        "start_unix_nano",
        "execute_ns",
        "sample_ns",
        "sample_offset_ns",
        "num_reqs",
        "prefill_reqs",
        "decode_reqs",
        "prefill_tokens",
        "decode_tokens",
        "sampled_tokens",
        "dummy",
        "sampled",
    )
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
    def __init__(
        self,
        wave: int | None = ...,
        start_unix_nano: int | None = ...,
        execute_ns: int | None = ...,
        sample_ns: int | None = ...,
        sample_offset_ns: int | None = ...,
        num_reqs: int | None = ...,
        prefill_reqs: int | None = ...,
        decode_reqs: int | None = ...,
        prefill_tokens: int | None = ...,
        decode_tokens: int | None = ...,
        sampled_tokens: int | None = ...,
        dummy: bool | None = ...,
        sampled: bool | None = ...,
    ) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("time_unix_nano", "last_wave", "phase", "phase_age_ns")
    TIME_UNIX_NANO_FIELD_NUMBER: _ClassVar[int]
    LAST_WAVE_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PHASE_AGE_NS_FIELD_NUMBER: _ClassVar[int]
    time_unix_nano: int
    last_wave: int
    phase: str
    phase_age_ns: int
    def __init__(
        self,
        time_unix_nano: int | None = ...,
        last_wave: int | None = ...,
        phase: str | None = ...,
        phase_age_ns: int | None = ...,
    ) -> None: ...

class Batch(_message.Message):
    __slots__ = ("rank", "waves", "heartbeat", "dropped_total", "guard_errors_total", "seq")
    RANK_FIELD_NUMBER: _ClassVar[int]
    WAVES_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    DROPPED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    GUARD_ERRORS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    rank: RankInfo
    waves: _containers.RepeatedCompositeFieldContainer[WaveRecord]
    heartbeat: Heartbeat
    dropped_total: int
    guard_errors_total: int
    seq: int
    def __init__(
        self,
        rank: RankInfo | _Mapping | None = ...,
        waves: _Iterable[WaveRecord | _Mapping] | None = ...,
        heartbeat: Heartbeat | _Mapping | None = ...,
        dropped_total: int | None = ...,
        guard_errors_total: int | None = ...,
        seq: int | None = ...,
    ) -> None: ...

class Ack(_message.Message):
    __slots__ = ("batches", "waves")
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    WAVES_FIELD_NUMBER: _ClassVar[int]
    batches: int
    waves: int
    def __init__(self, batches: int | None = ..., waves: int | None = ...) -> None: ...
