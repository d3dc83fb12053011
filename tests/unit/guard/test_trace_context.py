"""A request's traceparent from vLLM's scheduler to the worker, on vLLM's real objects.

vLLM's own `Request` (with the trace headers its API server kept), `NewRequestData.from_request`
and `SchedulerOutput`, pickled and unpickled as the multiprocess executor's message queue sends
them to the workers; the scheduler around them is a stand-in (a real one needs a model).
"""

from __future__ import annotations

import pickle
import types

import pytest

from guard import trace_context
from guard.config.reload import guard_schedule

sched_output = pytest.importorskip("vllm.v1.core.sched.output")
vllm_request = pytest.importorskip("vllm.v1.request")
vllm_config = pytest.importorskip("vllm.config")
sampling = pytest.importorskip("vllm.sampling_params")

HEADER = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _request(req_id: str, headers: dict[str, str] | None):
    return vllm_request.Request(
        req_id, [1, 2, 3], sampling.SamplingParams(), None, trace_headers=headers
    )


def _config(endpoint: str | None):
    return vllm_config.VllmConfig(
        observability_config=vllm_config.ObservabilityConfig(otlp_traces_endpoint=endpoint)
    )


def _output(requests):
    new = [sched_output.NewRequestData.from_request(r, ([0],)) for r in requests]
    out = sched_output.SchedulerOutput.make_empty()
    out.scheduled_new_reqs = new
    out.num_scheduled_tokens = {r.request_id: 3 for r in requests}
    out.total_num_scheduled_tokens = 3 * len(requests)
    return out


def _scheduler_class(requests, config):
    """A stand-in for vLLM's Scheduler: its `requests` and `vllm_config`, and a `schedule()`
    that schedules every request as new, decorated as the binder decorates the real one."""

    class Scheduler:
        def __init__(self) -> None:
            self.requests = {r.request_id: r for r in requests}
            self.vllm_config = config

        @guard_schedule
        def schedule(self):
            return _output(list(self.requests.values()))

    return Scheduler


def test_with_tracing_on_each_new_request_carries_its_traceparent_to_the_worker(monkeypatch):
    monkeypatch.setattr("guard.config.reload.engine_watcher", lambda: None)
    long = "01-" + "a" * 32 + "-" + "b" * 16 + "-01-" + "x" * 600  # a later version, too long
    requests = [
        _request("with", {"traceparent": HEADER, "tracestate": "k=v"}),
        _request("without", None),
        _request("state-only", {"tracestate": "k=v"}),
        _request("long", {"traceparent": long}),
    ]
    scheduler = _scheduler_class(requests, _config("127.0.0.1:4317"))()
    assert trace_context.tracing_enabled(scheduler)
    sent = scheduler.schedule()
    received = pickle.loads(pickle.dumps(sent, protocol=pickle.HIGHEST_PROTOCOL))
    found = trace_context.of_new(received.scheduled_new_reqs)
    # cut one past the sidecar's limit, so that it is still refused there
    assert found == {"with": HEADER, "long": long[:513]}
    assert type(scheduler).__dict__["schedule"].__ascend_guard_wrapped__  # stays: tracing on


def test_with_tracing_off_nothing_is_stamped_and_the_hook_steps_aside(monkeypatch):
    """vLLM's API server drops trace headers when its tracing is off; the hook then has
    nothing to carry (and no config file to watch), so it leaves the scheduler."""
    monkeypatch.setattr("guard.config.reload.engine_watcher", lambda: None)
    cls = _scheduler_class([_request("with", {"traceparent": HEADER})], _config(None))
    wrapped = cls.__dict__["schedule"]
    scheduler = cls()
    assert not trace_context.tracing_enabled(scheduler)
    out = scheduler.schedule()
    assert trace_context.of_new(out.scheduled_new_reqs) is None
    assert cls.__dict__["schedule"] is wrapped.__ascend_guard_wrapped__  # stepped aside


def test_a_scheduler_without_what_the_hook_reads_is_left_alone() -> None:
    """No `requests` dictionary, no trace headers: nothing stamped, nothing raised."""
    out = types.SimpleNamespace(scheduled_new_reqs=[types.SimpleNamespace(req_id="a")])
    assert trace_context.stamp_new(types.SimpleNamespace(), out) == 0
    bare = types.SimpleNamespace(requests={"a": types.SimpleNamespace(trace_headers=None)})
    assert trace_context.stamp_new(bare, out) == 0
    assert trace_context.of_new(out.scheduled_new_reqs) is None
    assert not trace_context.tracing_enabled(types.SimpleNamespace())
