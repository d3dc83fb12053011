"""NPU-only probe paths (device events, ACL-graph capture, HCCL) against the torch_npu stand-in
in tests/fakes/, as vllm-ascend's own CPU unit tests run without an NPU. Each test says so.
The tensors are real CPU tensors; only the NPU runtime is a stand-in."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

from ascend_runtime.attach.points import AttachPoint
from ascend_runtime.probes import graphs, hccl, report
from ascend_runtime.probes.device_time import PhaseTimer, event_factory

FAKES = Path(__file__).resolve().parents[2] / "fakes"


def guard_processor():
    """A real GuardProcessor (no sidecar yet: readings wait in its streamer until it starts)."""
    from guard.config.runtime_guard import GuardConfig
    from guard.processor import GuardProcessor
    from telemetry.wire.proto import guard_pb2

    return GuardProcessor(GuardConfig(sidecar="localhost:1"), lambda r: guard_pb2.RankInfo())


def held_probes(processor):
    return {name: dict(labels) for name, labels in processor.streamer._probes}


@pytest.fixture
def npu(monkeypatch):
    """The torch_npu stand-in on sys.path for this test only."""
    monkeypatch.syspath_prepend(str(FAKES))
    for name in [m for m in sys.modules if m == "torch_npu" or m.startswith("torch_npu.")]:
        monkeypatch.delitem(sys.modules, name)
    module = importlib.import_module("torch_npu")
    module.npu.reset()
    yield module.npu
    for name in [m for m in sys.modules if m == "torch_npu" or m.startswith("torch_npu.")]:
        sys.modules.pop(name, None)


def test_detection_says_ascend_when_torch_npu_sees_an_npu(npu):
    """Stand-in torch_npu: one simulated NPU, then none."""
    from ascend_runtime.attach.detect import detect_platform

    platform, why = detect_platform()
    assert platform == "ascend" and "1 NPU" in why
    npu.reset(devices=0)
    platform, why = detect_platform()
    assert platform == "cpu" and "sees no NPU" in why


def test_detection_without_torch_npu_is_cpu_here():
    from ascend_runtime.attach.detect import detect_platform

    assert "torch_npu" not in sys.modules
    assert detect_platform()[0] == ("cuda" if torch.cuda.is_available() else "cpu")


def test_phase_times_resolve_only_once_the_device_passed_them(npu):
    """Stand-in torch_npu events on a simulated stream; a sync would fail the test."""
    timer = PhaseTimer(event_factory("ascend"))
    with report.capture() as seen:
        started = timer.start("execute_model")
        npu.queue(7.5)  # the step's kernels
        timer.end(started)
        started = timer.start("sample_tokens")
        npu.queue(1.25)
        timer.end(started)
        assert seen.probe_values("device_phase_ms") == []  # device still busy: nothing read
        npu.complete(until_ms=7.5)  # the device finished the step, not the sampling
        assert timer.poll() == 1
        npu.complete()
        assert timer.poll() == 1
        assert timer.poll() == 0
    assert seen.probe_values("device_phase_ms") == [
        (7.5, {"phase": "execute_model"}),
        (1.25, {"phase": "sample_tokens"}),
    ]


def test_phase_timer_drops_the_oldest_when_the_device_falls_far_behind(npu):
    """Stand-in torch_npu events: the device never completes; pending pairs stay bounded."""
    timer = PhaseTimer(event_factory("ascend"), max_pending=4)
    for _ in range(10):
        npu.queue(1.0)
        timer.end(timer.start("execute_model"))
    assert timer.dropped == 6 and timer.resolved == 0


class GraphParams:
    """vllm-ascend's FULL-mode graph parameters: one attention workspace per captured size."""

    def __init__(self, sizes):
        self.workspaces = {size: None for size in sizes}


def _capture_all(npu, params, sizes, *, release: bool):
    """What ModelAclGraphManager.capture does per size under torch_npu_graph_wrapper: the
    attention op stores its workspace during capture; on exit the wrapper weak-refs it."""
    graphs_by_size = {}
    for size in sizes:
        graph = npu.NPUGraph()
        with npu.graph(graph):
            npu.state["allocated"] += size * 1024  # memory the graph pool keeps
            params.workspaces[size] = torch.empty(size * 16, dtype=torch.float16)
        if release:  # weak_ref_workspaces: the dict no longer owns the tensor
            params.workspaces[size] = params.workspaces[size][:0].clone()
        graphs_by_size[size] = graph
    return graphs_by_size


def _session(npu, params, labels):
    return graphs.CaptureSession(
        graphs.graph_class("ascend"),
        memory_allocated=graphs.memory_reader("ascend"),
        describe=lambda: labels.pop(0),
        workspace_params=lambda: [params],
        source="test",
    )


def test_capture_stats_per_graph_and_released_workspaces_pass(npu):
    """Stand-in torch_npu NPUGraph; real CPU tensors as the attention workspaces."""
    sizes = [4, 8, 16]
    params = GraphParams(sizes)
    labels = [f"tokens={s}" for s in sizes]
    with report.capture() as seen, _session(npu, params, labels) as session:
        captured = _capture_all(npu, params, sizes, release=True)
    assert all(g.captured for g in captured.values())
    assert seen.incidents == []
    counts = {labels["graph"]: v for v, labels in seen.probe_values("graph_captures")}
    assert counts == {"tokens=4": 1, "tokens=8": 1, "tokens=16": 1}
    mem = {labels["graph"]: v for v, labels in seen.probe_values("graph_capture_bytes")}
    assert mem == {"tokens=4": 4096, "tokens=8": 8192, "tokens=16": 16384}
    assert all(v >= 0 for v, _ in seen.probe_values("graph_capture_seconds"))
    # the session put the graph class and the workspaces dict back as they were
    assert "capture_begin" not in vars(npu.NPUGraph) or vars(npu.NPUGraph)["capture_begin"]
    assert type(params.workspaces) is dict
    assert session.leaks == []


def test_a_workspace_that_survives_its_capture_is_a_leak(npu):
    """Stand-in torch_npu NPUGraph; the workspaces are real CPU tensors, their sizes real."""
    sizes = [4, 8]
    params = GraphParams(sizes)
    with report.capture() as seen, _session(npu, params, ["tokens=4", "tokens=8"]):
        _capture_all(npu, params, sizes, release=False)
    leaks = [i for i in seen.incidents if i["type"] == "graph_workspace_leak"]
    assert sorted(i["evidence"]["num_tokens"] for i in leaks) == [4, 8]
    by_size = {i["evidence"]["num_tokens"]: i["evidence"]["bytes"] for i in leaks}
    assert by_size == {4: 4 * 16 * 2, 8: 8 * 16 * 2}  # float16 elements
    # the first leak is reported when the second capture begins, not at the end
    assert leaks[0]["evidence"]["graph"] == "tokens=4"
    total = seen.probe_values("graph_workspace_leaked_bytes")
    assert total == [(float(4 * 16 * 2 + 8 * 16 * 2), {})]


def test_graph_capture_action_wraps_a_manager_capture(npu, monkeypatch):
    """Stand-in torch_npu: the binder's graph_capture wrapper around a manager's capture()."""
    from ascend_runtime.attach import actions, detect
    from guard.decorators import install

    monkeypatch.setitem(detect._detected, "platform", "ascend")

    class Manager:
        def capture(self):
            for size in (2, 4):
                with npu.graph(npu.NPUGraph()):
                    npu.state["allocated"] += size
            return "captured"

    point = AttachPoint("graph", __name__, "Manager", "capture", "graph_capture", ("ascend-mrv2",))
    wrapped = actions.WRAPPERS["graph_capture"](Manager.capture, point)
    processor = guard_processor()
    install(processor)
    try:
        with report.capture() as seen:
            assert wrapped(Manager()) == "captured"
    finally:
        install(None)
    assert processor.errors.total == 0
    assert {"graph_captures", "graph_capture_seconds", "graph_capture_bytes"} <= set(
        held_probes(processor)
    )
    assert sorted(v for v, _ in seen.probe_values("graph_capture_bytes")) == [2.0, 4.0]
    assert "capture_begin" not in vars(npu.NPUGraph) or not hasattr(
        vars(npu.NPUGraph)["capture_begin"], "__wrapped__"
    )


def test_hccl_settings_info_and_the_hang_deadline_rule():
    """HCCL itself needs an NPU: the settings are read from the environment as HCCL reads them."""
    env = {"HCCL_ALGO": "level0:NA;level1:ring", "HCCL_EXEC_TIMEOUT": "600"}
    with report.capture() as seen:
        settings = hccl.report_settings("NPUCommunicator", env)
    assert settings == {
        "hccl_algo": "level0:NA;level1:ring",
        "hccl_exec_timeout": "600",
        "hccl_connect_timeout": "120",
    }
    assert seen.probe_values("hccl_settings_info") == [
        (1.0, {"communicator": "NPUCommunicator", **settings})
    ]
    assert hccl.check_hang_deadline(30.0, env) is None
    assert "above 0.1 x HCCL_EXEC_TIMEOUT (600 s)" in hccl.check_hang_deadline(120.0, env)
    assert hccl.check_hang_deadline(120.0, {}) is None  # default 1836 s
    assert hccl.check_hang_deadline(10.0, {"HCCL_EXEC_TIMEOUT": "0"}) is None
    assert "not a number" in hccl.check_hang_deadline(10.0, {"HCCL_EXEC_TIMEOUT": "ten"})


def test_communicator_init_action_reports_hccl_for_the_npu_communicator(npu, monkeypatch):
    """Stand-in for vllm-ascend's NPUCommunicator (it needs torch_npu and HCCL to construct)."""
    from ascend_runtime.attach import actions
    from guard.decorators import install

    class NPUCommunicator:
        def __init__(self, unique_name):
            self.unique_name = unique_name

    point = AttachPoint(
        "communicator", __name__, "NPUCommunicator", "__init__", "communicator_init", ("ascend-v1",)
    )
    monkeypatch.setattr(
        NPUCommunicator,
        "__init__",
        actions.WRAPPERS["communicator_init"](NPUCommunicator.__init__, point),
    )
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "900")
    processor = guard_processor()
    install(processor)
    try:
        with report.capture() as seen:
            NPUCommunicator("tp:0")
    finally:
        install(None)
    assert processor.errors.total == 0
    assert held_probes(processor)["hccl_settings_info"]["hccl_exec_timeout"] == "900"
    (info,) = seen.probe_values("device_communicator_info")
    assert info[1] == {"communicator": "NPUCommunicator", "backend": "hccl", "group": "tp:0"}
    (settings,) = seen.probe_values("hccl_settings_info")
    assert settings[1]["hccl_exec_timeout"] == "900"
