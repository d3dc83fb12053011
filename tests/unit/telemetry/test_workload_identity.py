"""The workload identity a worker sends and the sidecar publishes (telemetry/wire/workload.py,
telemetry/metrics/workload.py): what a hostile or odd value becomes, and how long an entry of a
rank whose stream ended stays. The path through real gRPC is in
tests/integration/test_dashboard_live.py."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from guard.stream.streamer import Streamer
from telemetry.metrics.workload import WorkloadBook, WorkloadInfo
from telemetry.wire import workload
from telemetry.wire.transport import ClientSecurity

ENV = {
    workload.POD_NAME_ENV: "vllm-qwen-7c9d-abcde",
    workload.POD_NAMESPACE_ENV: "serving",
    workload.NODE_NAME_ENV: "node-a",
}


def test_env_to_metadata_and_back():
    sent = workload.stream_metadata(workload.from_env(ENV))
    assert workload.from_metadata(sent) == ("serving", "vllm-qwen-7c9d-abcde", "node-a", "", "")
    assert workload.stream_metadata(workload.from_env({})) == ()
    assert not workload.from_metadata(None).known()


def test_values_are_cut_to_kubernetes_name_characters():
    got = workload.from_metadata([(workload.POD_KEY, 'Pod"} 1\nx{' + "a" * 400)])
    assert got.pod.startswith("pod__") and len(got.pod) == 253
    assert set(got.pod) <= set("abcdefghijklmnopqrstuvwxyz0123456789.-_")
    # binary metadata and other keys are ignored
    assert (
        workload.from_metadata([(workload.POD_KEY, b"x"), ("other", "y")]) == workload.NO_WORKLOAD
    )


def test_device_and_model_travel_with_the_workload():
    where = workload.from_env(ENV)._replace(device="7", model_name="Qwen/Qwen2.5-7B-Instruct")
    got = workload.from_metadata(workload.stream_metadata(where))
    assert got == where
    # a model name keeps its case and slashes (vLLM's label must join ours), cut like the rest
    odd = workload.from_metadata([(workload.MODEL_KEY, "Org/M x\n" + "a" * 400)])
    assert odd.model_name.startswith("Org/M_x_a") and len(odd.model_name) == 253


def test_the_stream_carries_token_and_workload(monkeypatch):
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)
    streamer = Streamer("unix:///nowhere.sock", buffer_size=8, batch_max=8, flush_interval_s=1,
                        heartbeat_interval_s=1, max_backoff_s=1)  # fmt: skip
    pairs = dict(streamer._metadata(ClientSecurity(token="t0k")))
    assert pairs["authorization"] == "Bearer t0k"
    assert pairs[workload.POD_KEY] == "vllm-qwen-7c9d-abcde"
    assert workload.DEVICE_KEY not in pairs
    streamer.device, streamer.model_name = "5", "qwen-chat"
    pairs = dict(streamer._metadata(None))
    assert (pairs[workload.DEVICE_KEY], pairs[workload.MODEL_KEY]) == ("5", "qwen-chat")
    for key in ENV:
        monkeypatch.delenv(key)
    streamer.device = streamer.model_name = ""
    assert streamer._metadata(None) is None


def test_book_lingers_after_the_last_stream_then_forgets():
    now = [0.0]
    book = WorkloadBook(linger_s=60.0, clock=lambda: now[0])
    key = ("qwen", 0, 1, 0)
    pod = workload.Workload("serving", "vllm-a", "node-a")
    book.opened(key, pod)
    book.opened(("qwen", 0, 0, 0), workload.Workload())  # no pod named: no series
    book.closed(key)
    now[0] = 59.0
    assert book.snapshot() == [(key, pod)]
    # a restarted pod's rank replaces the entry (one series per rank, for the rules' joins)
    newer = workload.Workload("serving", "vllm-b", "node-a")
    book.opened(key, newer)
    now[0] = 500.0
    assert book.snapshot() == [(key, newer)]  # its stream is open
    book.closed(key)
    now[0] = 561.0
    assert book.snapshot() == []


def test_info_family_text():
    book = WorkloadBook()
    book.opened(("qwen", 0, 1, 0), workload.Workload("serving", "vllm-a", "node-a", "7", "Qwen/Q"))
    # no pod named (outside Kubernetes): no series, whose join would blank the target's own
    # namespace and pod; the verdicts still read its device
    bare = workload.Workload(device="3", model_name="Qwen/Q")
    book.opened(("qwen", 0, 0, 0), bare)
    registry = CollectorRegistry()
    registry.register(WorkloadInfo(book))
    text = generate_latest(registry).decode()
    assert (
        'ascend_guard_rank_workload_info{device="7",dp="0",engine="qwen",model_name="Qwen/Q",'
        'namespace="serving",node="node-a",pod="vllm-a",pp="0",tp="1"} 1.0'
    ) in text
    assert text.count("ascend_guard_rank_workload_info{") == 1
    assert book.get(("qwen", 0, 0, 0)) == bare
    assert book.get(("qwen", 0, 9, 0)) == workload.NO_WORKLOAD
