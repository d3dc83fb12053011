"""The step/sample decorators: pure pass-through with the guard off, wave accounting with it on."""

from __future__ import annotations

import inspect
import time
from types import SimpleNamespace

import pytest

from guard import decorators
from guard.config.runtime_guard import GuardConfig, parse_config
from guard.decorators import (
    install,
    is_guarded,
    runtime_guard_sample_tokens,
    runtime_guard_step,
    unwrap,
)
from guard.processor import GuardProcessor
from guard.stream.streamer import WaveTuple
from telemetry.wire.proto import guard_pb2


@pytest.fixture(autouse=True)
def _guard_off_after():
    install(None)
    yield
    install(None)


class Boom(RuntimeError):
    pass


def bare_execute_model(self, scheduler_output, intermediate_tensors=None, *, dummy_run=False):
    """The bare step."""
    self.calls.append(("execute_model", scheduler_output, intermediate_tensors, dummy_run))
    if isinstance(self.execute_result, BaseException):
        raise self.execute_result
    if self.execute_sleep:
        time.sleep(self.execute_sleep)
    self.phase_seen.append(_phase())
    return self.execute_result


def bare_sample_tokens(self, grammar_output):
    """The bare sample."""
    self.calls.append(("sample_tokens", grammar_output))
    if isinstance(self.sample_result, BaseException):
        raise self.sample_result
    if self.sample_sleep:
        time.sleep(self.sample_sleep)
    self.phase_seen.append(_phase())
    return self.sample_result


def _phase():
    processor = decorators.active_processor()
    return processor.heartbeat().phase if processor is not None else None


class Runner:
    def __init__(self, execute_result=None, sample_result=None):
        self.calls = []
        self.phase_seen = []
        self.execute_result = execute_result
        self.sample_result = sample_result
        self.execute_sleep = 0.0
        self.sample_sleep = 0.0

    execute_model = runtime_guard_step(bare_execute_model)
    sample_tokens = runtime_guard_sample_tokens(bare_sample_tokens)


class BareRunner(Runner):
    execute_model = bare_execute_model
    sample_tokens = bare_sample_tokens


# -- guard on: a real processor with a fake streamer ----------------------------------------


class FakeStreamer:
    """Built by the processor at start-up; named its rank when the first wave starts it."""

    def __init__(self, address, **kwargs):
        self.address = address
        self.rank = None
        self.kwargs = kwargs
        self.records: list[WaveTuple] = []
        self.started = self.stopped = False
        self.fail_offer = False

    def start(self, rank, spool=None):
        self.rank = rank
        self.started = True

    def offer_probe(self, name, value, labels):
        pass

    def offer_incident(self, incident):
        pass

    def stop(self):
        self.stopped = True

    def offer(self, record):
        if self.fail_offer:
            raise OSError("streamer broke")
        self.records.append(record)


RANK = guard_pb2.RankInfo(run_id="r1", engine="e", tp_size=1, dp_size=1, pp_size=1)


class Guard:
    """A real GuardProcessor, installed, whose streamer is a FakeStreamer."""

    def __init__(self, describe_rank=None, config=None):
        self.streamers: list[FakeStreamer] = []
        self.described = []

        def describe(runner):
            self.described.append(runner)
            return RANK

        def factory(address, **kwargs):
            streamer = FakeStreamer(address, **kwargs)
            self.streamers.append(streamer)
            return streamer

        self.config = config or GuardConfig(sidecar="localhost:1", buffer_size=64, batch_max=8)
        self.processor = GuardProcessor(self.config, describe_rank or describe, factory)
        install(self.processor)

    @property
    def records(self) -> list[WaveTuple]:
        return [r for s in self.streamers for r in s.records]

    @property
    def started(self) -> list[FakeStreamer]:
        return [s for s in self.streamers if s.started]


@pytest.fixture
def guard():
    return Guard()


def sched(**tokens):
    """A SchedulerOutput-like object with new requests for each name=token count."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=k, prompt_token_ids=[0] * v) for k, v in tokens.items()],
        scheduled_cached_reqs=None, num_scheduled_tokens=dict(tokens),
        total_num_scheduled_tokens=sum(tokens.values()), finished_req_ids=set(),
    )  # fmt: skip


class Output:
    def __init__(self, ids):
        self.sampled_token_ids = ids


# -- guard off ------------------------------------------------------------------------------


def test_guard_off_returns_the_very_same_object():
    result, sampled = object(), object()
    runner = Runner(execute_result=result, sample_result=sampled)
    bare = BareRunner(execute_result=result, sample_result=sampled)
    assert runner.execute_model("so") is bare.execute_model("so") is result
    assert runner.sample_tokens("g") is bare.sample_tokens("g") is sampled
    assert runner.calls == bare.calls


def test_guard_off_passes_args_and_kwargs_unchanged():
    runner = Runner()
    so, tensors, grammar = object(), object(), object()
    runner.execute_model(so, intermediate_tensors=tensors, dummy_run=True)
    runner.execute_model(so, tensors)
    runner.sample_tokens(grammar_output=grammar)
    assert runner.calls[0] == ("execute_model", so, tensors, True)
    assert runner.calls[0][1] is so and runner.calls[0][2] is tensors
    assert runner.calls[1] == ("execute_model", so, tensors, False)
    assert runner.calls[2][1] is grammar


def test_guard_off_raises_the_same_exception():
    error = Boom("step failed")
    runner = Runner(execute_result=error, sample_result=ValueError("s"))
    with pytest.raises(Boom) as info:
        runner.execute_model("so")
    assert info.value is error
    with pytest.raises(ValueError, match="^s$"):
        runner.sample_tokens(None)


def test_guard_off_calls_no_processor():
    guard = Guard()
    install(None)
    runner = Runner(execute_result=Output([[1]]), sample_result=Output([[1]]))
    for _ in range(3):
        runner.execute_model(sched(a=1))
        runner.sample_tokens(None)
    assert guard.processor.wave == 0
    assert guard.started == [] and guard.described == []
    assert runner.phase_seen == [None] * 6


def test_decorating_twice_wraps_once():
    once = runtime_guard_step(bare_execute_model)
    assert runtime_guard_step(once) is once
    sample_once = runtime_guard_sample_tokens(bare_sample_tokens)
    assert runtime_guard_sample_tokens(sample_once) is sample_once
    assert unwrap(runtime_guard_step(once)) is bare_execute_model


def test_unwrap_gives_the_bare_function():
    assert unwrap(Runner.execute_model) is bare_execute_model
    assert unwrap(Runner.sample_tokens) is bare_sample_tokens
    assert unwrap(bare_execute_model) is bare_execute_model  # not wrapped: itself
    assert is_guarded(Runner.execute_model) and is_guarded(Runner.sample_tokens)
    assert not is_guarded(bare_execute_model)


@pytest.mark.parametrize(
    ("wrapped", "bare"),
    [(Runner.execute_model, bare_execute_model), (Runner.sample_tokens, bare_sample_tokens)],
)
def test_wraps_keeps_name_doc_and_signature(wrapped, bare):
    assert wrapped is not bare
    assert wrapped.__name__ == bare.__name__
    assert wrapped.__qualname__ == bare.__qualname__
    assert wrapped.__doc__ == bare.__doc__
    assert wrapped.__module__ == bare.__module__
    assert wrapped.__wrapped__ is bare
    assert inspect.signature(wrapped) == inspect.signature(bare)


def test_wraps_keeps_signature_of_a_method_with_annotations():
    def execute_model(self, scheduler_output: int, intermediate_tensors: str | None = None) -> int:
        return scheduler_output

    wrapped = runtime_guard_step(execute_model)
    assert inspect.signature(wrapped) == inspect.signature(execute_model)
    bound = inspect.signature(wrapped).bind(object(), 1, intermediate_tensors=None)
    assert bound.arguments["scheduler_output"] == 1
    with pytest.raises(TypeError):
        inspect.signature(wrapped).bind(object(), 1, unknown=2)


# -- guard on -------------------------------------------------------------------------------


def test_guard_on_result_is_the_bare_result(guard):
    executed, sampled = None, Output([[1]])
    runner = Runner(execute_result=executed, sample_result=sampled)
    assert runner.execute_model(sched(a=3)) is None
    assert runner.sample_tokens(None) is sampled
    direct = Runner(execute_result=object())
    out = direct.execute_model(sched(a=1))
    assert out is direct.execute_result


def test_guard_on_starts_one_streamer_with_the_config(guard):
    runner = Runner(sample_result=Output([[1]]))
    for _ in range(3):
        runner.execute_model(sched(a=1))
        runner.sample_tokens(None)
    assert len(guard.streamers) == 1
    streamer = guard.streamers[0]
    assert streamer.started and not streamer.stopped
    assert guard.described == [runner]
    assert streamer.address == "localhost:1"
    assert streamer.rank is RANK
    assert streamer.kwargs["buffer_size"] == 64
    assert streamer.kwargs["batch_max"] == 8
    assert streamer.kwargs["flush_interval_s"] == pytest.approx(0.05)
    # one batch-filler protocol: the processor fills heartbeat and error count
    fillers = streamer.kwargs["fillers"]
    batch = guard_pb2.Batch()
    for filler in fillers:
        filler.fill_batch(batch, True)
    assert batch.heartbeat.last_wave == 3
    guard.processor.errors.total = 7
    batch = guard_pb2.Batch()
    for filler in fillers:
        filler.fill_batch(batch, False)
    assert batch.guard_errors_total == 7


def test_guard_on_exceptions_propagate(guard):
    error = Boom("device lost")
    runner = Runner(execute_result=error)
    with pytest.raises(Boom) as info:
        runner.execute_model(sched(a=1))
    assert info.value is error
    assert guard.records == []
    sample_error = ValueError("bad grammar")
    runner.execute_result, runner.sample_result = None, sample_error
    runner.execute_model(sched(a=1))
    with pytest.raises(ValueError) as sinfo:
        runner.sample_tokens(None)
    assert sinfo.value is sample_error
    # the engine carries on: the next step works and is numbered after the failed ones
    runner.sample_result = Output([[5]])
    runner.execute_model(sched(a=1))
    runner.sample_tokens(None)
    assert guard.processor.errors.total == 0
    assert [r.wave for r in guard.records][-1] == 3
    assert guard.processor.heartbeat().phase == "idle"


def test_waves_increase_by_one_per_execute_model(guard):
    runner = Runner(sample_result=Output([[1]]))
    for _ in range(5):
        runner.execute_model(sched(a=1))
        runner.sample_tokens(None)
    assert [r.wave for r in guard.records] == [1, 2, 3, 4, 5]
    assert guard.processor.wave == 5


def test_sample_phase_fills_timing_and_sampled_tokens(guard):
    runner = Runner(sample_result=Output([[1], [2, 3], []]))
    runner.execute_sleep = 0.003
    runner.sample_sleep = 0.002
    before = time.time_ns()
    runner.execute_model(sched(a=5, b=1, c=2))
    runner.sample_tokens(None)
    (record,) = guard.records
    assert record.sampled is True
    assert record.sampled_tokens == 3
    assert record.sample_ns >= 2_000_000
    assert record.execute_ns >= 3_000_000
    assert record.sample_offset_ns >= record.execute_ns
    assert before <= record.start_unix_nano <= time.time_ns()
    assert (record.num_reqs, record.prefill_reqs, record.prefill_tokens) == (3, 3, 8)
    assert record.dummy is False
    assert runner.phase_seen == ["execute_model", "sample_tokens"]


def test_execute_model_with_output_emits_at_once_unsampled(guard):
    output = Output([[7, 8]])
    runner = Runner(execute_result=output, sample_result=Output([[1]]))
    assert runner.execute_model(sched(a=2)) is output
    (record,) = guard.records
    assert record.wave == 1
    assert record.sampled is False
    assert record.sampled_tokens == 2
    assert record.sample_ns == 0
    # no wave is open: a sample call now finishes nothing
    runner.sample_tokens(None)
    assert len(guard.records) == 1


def test_open_wave_is_emitted_at_the_next_execute(guard):
    runner = Runner(sample_result=Output([[1], [1]]))
    runner.execute_model(sched(a=1))  # never sampled (e.g. a non-last PP stage)
    assert guard.records == []
    runner.execute_model(sched(a=1))
    (first,) = guard.records
    assert (first.wave, first.sampled, first.sampled_tokens, first.sample_ns) == (1, False, 0, 0)
    runner.sample_tokens(None)
    assert [(r.wave, r.sampled, r.sampled_tokens) for r in guard.records] == [
        (1, False, 0),
        (2, True, 2),
    ]


def test_close_emits_the_open_wave_and_stops_the_streamer(guard):
    runner = Runner()
    runner.execute_model(sched(a=1))
    guard.processor.close()
    assert [(r.wave, r.sampled) for r in guard.records] == [(1, False)]
    assert guard.streamers[0].stopped


def test_dummy_run_and_empty_schedule_are_dummy_waves(guard):
    runner = Runner(execute_result=Output([]))
    runner.execute_model(sched(a=4), dummy_run=True)
    runner.execute_model(sched())
    runner.execute_model(sched(a=4))
    assert [(r.dummy, r.num_reqs) for r in guard.records] == [(True, 0), (True, 0), (False, 1)]


class AsyncOutput:
    def __init__(self, result):
        self._result = result
        self.calls = 0

    def get_output(self):
        self.calls += 1
        return self._result


def test_async_output_counted_when_get_output_is_called(guard):
    resolved = Output([[1, 2], [3], [4]])
    pending = AsyncOutput(resolved)
    runner = Runner(sample_result=pending)
    runner.execute_model(sched(a=1, b=1, c=1))
    assert runner.sample_tokens(None) is pending
    assert guard.records == []  # nothing resolved yet: no sync forced
    assert pending.calls == 0
    assert pending.get_output() is resolved
    assert pending.calls == 1
    (record,) = guard.records
    assert (record.wave, record.sampled, record.sampled_tokens) == (1, True, 4)
    assert record.sample_ns > 0


def test_reentrant_override_counts_one_wave(guard):
    class Sub(Runner):
        @runtime_guard_step
        def execute_model(self, scheduler_output, intermediate_tensors=None):
            self.calls.append(("sub",))
            return super().execute_model(scheduler_output, intermediate_tensors)

        @runtime_guard_sample_tokens
        def sample_tokens(self, grammar_output):
            return super().sample_tokens(grammar_output)

    runner = Sub(sample_result=Output([[1], [2]]))
    for _ in range(2):
        assert runner.execute_model(sched(a=1, b=1)) is None
        assert runner.sample_tokens(None) is runner.sample_result
    assert [c[0] for c in runner.calls] == ["sub", "execute_model", "sample_tokens"] * 2
    assert [(r.wave, r.sampled_tokens) for r in guard.records] == [(1, 2), (2, 2)]


def test_error_in_describe_rank_is_counted_and_result_returned():
    calls = []

    def describe(runner):
        calls.append(runner)
        raise KeyError("no tp group")

    guard = Guard(describe_rank=describe)
    output = Output([[1]])
    runner = Runner(execute_result=output)
    assert runner.execute_model(sched(a=1)) is output
    assert guard.processor.errors.total == 1
    assert runner.execute_model(sched(a=1)) is output
    assert guard.processor.errors.total == 2
    assert len(runner.calls) == 2  # the bare method still ran each time
    assert guard.started == []


def test_error_in_streamer_offer_is_counted_and_result_returned(guard):
    runner = Runner(execute_result=Output([[1]]))
    runner.execute_model(sched(a=1))
    guard.streamers[0].fail_offer = True
    out = runner.execute_model(sched(a=1))
    assert out is runner.execute_result
    assert guard.processor.errors.total == 1
    # the sample path too
    runner.execute_result, runner.sample_result = None, Output([[1]])
    runner.execute_model(sched(a=1))
    assert runner.sample_tokens(None) is runner.sample_result
    assert guard.processor.errors.total == 2
    # and an open wave flushed at the next step
    runner.execute_model(sched(a=1))
    runner.execute_model(sched(a=1))
    assert guard.processor.errors.total == 3
    # once the streamer recovers, waves flow again, numbered without gaps
    guard.streamers[0].fail_offer = False
    runner.sample_tokens(None)
    runner.execute_model(sched(a=1))
    runner.sample_tokens(None)
    assert guard.records[-1].wave == 6
    assert guard.records[-1].sampled is True


def test_error_while_counting_async_output_is_counted(guard):
    class BadResolved:
        @property
        def sampled_token_ids(self):
            raise RuntimeError("not resolvable")

    class LateAsync(AsyncOutput):
        sampled_token_ids = None

    resolved = BadResolved()
    pending = LateAsync(resolved)
    runner = Runner(sample_result=pending)
    runner.execute_model(sched(a=1))
    runner.sample_tokens(None)
    assert pending.get_output() is resolved
    assert guard.processor.errors.total == 1


def test_processor_installed_mid_run_is_used_and_removed():
    runner = Runner(execute_result=Output([[1]]))
    runner.execute_model(sched(a=1))
    guard = Guard()
    runner.execute_model(sched(a=1))
    install(None)
    runner.execute_model(sched(a=1))
    assert [r.wave for r in guard.records] == [1]
    assert decorators.active_processor() is None


class ReentrantSub(Runner):
    @runtime_guard_step
    def execute_model(self, scheduler_output, intermediate_tensors=None):
        return super().execute_model(scheduler_output, intermediate_tensors)


def test_reentrant_override_counts_one_wave_even_when_the_guard_fails():
    def describe(runner):
        raise KeyError("no tp group")

    guard = Guard(describe_rank=describe)
    runner = ReentrantSub(execute_result=Output([[1]]))
    for _ in range(3):
        assert runner.execute_model(sched(a=1)) is runner.execute_result
    assert guard.processor.errors.total >= 3
    assert guard.processor.wave == 3


# -- the observer protocol and the module layering -------------------------------------------


class Recorder:
    """A wave observer with every hook, recording the calls."""

    def __init__(self, calls, name):
        self.calls, self.name = calls, name

    def begin_wave(self, wave):
        self.calls.append((self.name, "begin", wave))

    def on_schedule(self, wave, scheduler_output):
        self.calls.append((self.name, "schedule", wave))

    def on_output(self, wave, runner, output, tokens):
        self.calls.append((self.name, "output", wave))
        self.tokens = tokens

    def end_wave(self, wave):
        self.calls.append((self.name, "end", wave))


class CollectivesLike:
    """Only the hooks the collectives observer has (guard/collectives/observer.py), one raising."""

    def __init__(self, calls):
        self.calls = calls

    def begin_wave(self, wave):
        raise RuntimeError("tracker broke")

    def end_wave(self, wave):
        self.calls.append(("coll", "end", wave))

    def fill_batch(self, batch, with_heartbeat):
        batch.guard_errors_total += 5


def test_observers_are_called_in_order_and_a_failing_hook_is_counted(guard):
    calls = []
    guard.processor.add_observer(Recorder(calls, "a"))
    guard.processor.add_observer(CollectivesLike(calls))  # the collectives binding's way
    runner = Runner(sample_result=Output([[1]]))
    for _ in range(2):
        runner.execute_model(sched(a=1))
        runner.sample_tokens(None)
    per_wave = [("a", "begin"), ("a", "schedule"), ("a", "end"), ("coll", "end"), ("a", "output")]
    assert calls == [(name, hook, wave) for wave in (1, 2) for name, hook in per_wave]
    assert guard.processor.errors.total == 2  # the raising begin_wave, twice; the step ran
    assert [r.wave for r in guard.records] == [1, 2]
    batch = guard_pb2.Batch()
    guard.processor.fill_batch(batch, True)
    assert batch.guard_errors_total == 2 + 5 and batch.heartbeat.last_wave == 2


def test_the_wave_tokens_are_read_once_for_the_record_and_the_observers(guard):
    """The processor reads the sampled tokens once: the wave's record counts them and the
    observers get that same read, not the lists, which the scheduler may cut afterwards."""
    recorder = Recorder([], "a")
    guard.processor.add_observer(recorder)
    runner = Runner(sample_result=Output([[5], [6, 7]]))
    runner.execute_model(sched(a=1, b=2))
    runner.sample_tokens(None)
    assert recorder.tokens.ids == [5, 6, 7] and recorder.tokens.lengths == [1, 2]
    assert guard.records[-1].sampled_tokens == 3


def test_decorators_are_a_leaf_and_the_facade_needs_no_processor():
    import subprocess
    import sys

    code = (
        "import sys; import guard.incidents; "
        "print(sorted(m for m in sys.modules if m.startswith('guard')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['guard', 'guard.decorators', 'guard.incidents']"


def test_the_detectors_suite_takes_the_wave_hooks_itself_and_a_rebuild_swaps_it(guard):
    """The detector host names its suite as its wave delegate: the processor calls the
    suite's hooks with no forwarding frame, follows a live rebuild to the new suite, and
    calls nothing for the detectors while none is on."""
    runner = Runner(sample_result=Output([[1]]))
    runner.execute_model(sched(a=1))
    runner.sample_tokens(None)
    first = guard.processor.detectors
    assert first is not None  # the default detectors are on
    observers = guard.processor.observers
    assert [h.__self__ for h in observers.on_output_hooks] == [first]
    assert first in [h.__self__ for h in observers.on_schedule_hooks]

    names = ("logits_finite", "token_repeat", "spec_acceptance", "logits_stats", "token_range")
    off = {"sidecar": "localhost:1", "detectors": {n: {"enabled": False} for n in names}}
    guard.processor._config_changed(parse_config(off))
    assert guard.processor.detectors is None
    assert observers.on_output_hooks == ()
    assert all(h.__self__ is not first for h in observers.on_schedule_hooks)

    guard.processor._config_changed(parse_config({"sidecar": "localhost:1"}))
    second = guard.processor.detectors
    assert second is not None and second is not first
    assert [h.__self__ for h in observers.on_output_hooks] == [second]
    runner.execute_model(sched(b=1))
    runner.sample_tokens(None)
    assert [r.wave for r in guard.records] == [1, 2] and guard.processor.errors.total == 0


def test_async_output_of_a_rank_whose_output_vllm_never_fetches_is_sent_at_once():
    """vLLM fetches the async output of the first TP rank only: on TP rank 1 MRV2's
    `AsyncOutput` is dropped unread, so the wave is sent when `sample_tokens` returns (no
    token counts: the output rank has them), and once only if something fetches it after all."""
    rank1 = guard_pb2.RankInfo(run_id="r1", engine="e", tp_rank=1, tp_size=2, dp_size=1, pp_size=1)
    guard = Guard(describe_rank=lambda runner: rank1)
    try:
        pending = AsyncOutput(Output([[1], [2]]))
        runner = Runner(sample_result=pending)
        runner.execute_model(sched(a=1, b=1))
        assert runner.sample_tokens(None) is pending
        (record,) = guard.records
        assert (record.wave, record.sampled, record.sampled_tokens) == (1, True, 0)
        assert pending.calls == 0  # never fetched by the guard either: no sync forced
        pending.get_output()
        runner.execute_model(sched(a=1, b=1))
        runner.sample_tokens(None)
        assert [r.wave for r in guard.records] == [1, 2]
    finally:
        install(None)
