"""Collectives inside captured device graphs: noted at capture, counted at each replay.

Every test here runs the capture and replay of an ACL graph on the torch_npu stand-in in
tests/fakes/ (its `NPUGraph` capture hooks, timing events on a simulated stream that fail the
test if anyone waits for the device), because neither an NPU nor a CUDA device exists on this
machine; the CUDA path runs for real in tools/cuda_graph_check.py where a GPU is. The graph
managers are stand-ins too, each shaped like the vLLM one it names (piecewise: one graph per
piece and batch size, as `CUDAGraphWrapper`/`ACLGraphWrapper` capture; FULL: one graph per
batch size, as the MRV2 graph managers). The tensors and the guard code are real.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

from ascend_runtime.attach.collectives import bind_group_coordinator
from ascend_runtime.attach.graph_collectives import captured, graph_wrapper
from guard.collectives.install import install_tracker
from guard.collectives.tracker import CollectiveTracker
from guard.collectives.watchdog import CollectiveWatchdog
from guard.config.collectives import CollectivesConfig
from telemetry.wire.collective_columns import to_waves
from telemetry.wire.proto import guard_pb2

FAKES = Path(__file__).resolve().parents[2] / "fakes"
HIDDEN = 16
PIECE_MS = 2.0  # simulated device time of one replayed piece


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


class Coordinator:
    """A GroupCoordinator's collective methods (the wrapped ones), enqueueing nothing."""

    def __init__(self, name: str = "tp:0") -> None:
        self.unique_name = name
        self.world_size = 2
        self.rank_in_group = 0

    def _all_reduce_out_place(self, input_):
        return input_.clone()

    def _all_gather_out_place(self, input_, dim):
        return torch.cat([input_, input_], dim=dim)


@pytest.fixture
def parts(npu):
    """A bound coordinator class, a bound NPUGraph class (device work per replay), a tracker
    with the stand-in's timing events."""
    coordinator_cls = type("BoundCoordinator", (Coordinator,), dict(Coordinator.__dict__))
    bind_group_coordinator(coordinator_cls)

    class Graph(npu.NPUGraph):
        def capture_begin(self, *args, **kwargs):
            return super().capture_begin(*args, **kwargs)

        def capture_end(self):
            return super().capture_end()

        def replay(self):
            super().replay()
            npu.queue(PIECE_MS)  # the device runs the graph later

    for name in ("capture_begin", "capture_end", "replay"):
        setattr(Graph, name, graph_wrapper(name, Graph.__dict__[name]))
    wave = {"n": 0}
    tracker = CollectiveTracker(
        CollectivesConfig(), wave_source=lambda: wave["n"],
        new_event=lambda: npu.Event(enable_timing=True),
    )  # fmt: skip
    install_tracker(tracker)
    yield coordinator_cls, Graph, tracker, wave
    install_tracker(None)


class PiecewiseManager:
    """Stand-in of piecewise capture (vLLM `CUDAGraphWrapper`, vllm-ascend `ACLGraphWrapper`):
    the model is split at attention; each piece between splits is one graph per batch size,
    holding that piece's row-parallel all-reduces (o_proj, then down_proj)."""

    def __init__(self, graph_cls, group, pieces: int, sizes: list[int]) -> None:
        self.graph_cls, self.group, self.pieces, self.sizes = graph_cls, group, pieces, sizes
        self.graphs: dict[tuple[int, int], object] = {}

    def piece(self, x):
        return self.group._all_reduce_out_place(self.group._all_reduce_out_place(x))

    def capture(self, npu):
        for size in self.sizes:
            for i in range(self.pieces):
                graph = self.graph_cls()
                with npu.graph(graph):
                    self.piece(torch.zeros(size, HIDDEN))
                self.graphs[(i, size)] = graph

    def run(self, num_tokens: int) -> None:
        size = next(s for s in self.sizes if s >= num_tokens)  # padded to a captured size
        for i in range(self.pieces):
            self.graphs[(i, size)].replay()


def test_piecewise_capture_notes_collectives_and_replays_count_them_as_replayed(parts, npu):
    """Stand-in NPU and graph manager (see the module docstring)."""
    coordinator_cls, graph_cls, tracker, wave = parts
    tp = coordinator_cls("tp:0")
    manager = PiecewiseManager(graph_cls, tp, pieces=3, sizes=[1, 2, 4, 8])
    manager.capture(npu)
    # capture: collectives are noted on their graph, nothing is counted, no seq is taken
    assert tracker.finished == collections_empty() and tp._ascend_guard_collective_meta.seq == 0
    graph = manager.graphs[(0, 4)]
    record = captured(graph)
    assert [(op, meta.label, nbytes) for op, meta, nbytes, _ in record.calls] == [
        ("all_reduce", "tp", 4 * HIDDEN * 4)
    ] * 2
    assert record.holds() == f"all_reduce tp x2 ({2 * 4 * HIDDEN * 4} B)"

    wave["n"] = 1
    manager.run(num_tokens=3)  # padded to the 4-token graphs
    tp._all_gather_out_place(torch.ones(1, HIDDEN), -1)  # logits: an eager call after the graphs
    wave["n"] = 2
    manager.run(num_tokens=8)
    npu.complete()  # the device catches up; nobody waited for it
    tracker.roll(0)
    first, second = tracker.finished
    reduce1 = first.stats[("all_reduce", "tp")]
    # calls, bytes, host_ns, max_host_ns, first_seq, last_seq, backend, dtype, replayed
    assert reduce1[0] == reduce1[8] == 3 * 2
    assert reduce1[1] == 3 * 2 * 4 * HIDDEN * 4
    assert reduce1[2] == 0  # no host call inside a replay
    assert reduce1[4:6] == [1, 6]
    assert first.stats[("all_gather", "tp")][0] == 1
    assert first.stats[("all_gather", "tp")][8] == 0  # called, not replayed
    assert first.stats[("all_gather", "tp")][4] == 7  # numbered after the replayed ones
    reduce2 = second.stats[("all_reduce", "tp")]
    assert reduce2[0] == reduce2[8] == 6 and reduce2[1] == 6 * 8 * HIDDEN * 4
    assert reduce2[4:6] == [8, 13]
    # device time of the replays, from the events around them, resolved without a sync
    assert first.replay_device_ns == pytest.approx(3 * PIECE_MS * 1e6)
    assert second.replay_device_ns == pytest.approx(3 * PIECE_MS * 1e6)


def collections_empty():
    import collections

    return collections.deque()


def test_full_graph_per_batch_size_and_the_wire(parts, npu):
    """Stand-in NPU; a FULL-mode stand-in (one graph per batch size holding the whole forward:
    the embedding's all-reduce, two per layer, as MRV2's graph managers capture). Checks the
    stat and wave fields on the wire."""
    coordinator_cls, graph_cls, tracker, wave = parts
    tp = coordinator_cls("tp:0")
    layers, graphs = 2, {}
    for size in (2, 4):
        graph = graph_cls()
        with npu.graph(graph):
            x = tp._all_reduce_out_place(torch.zeros(size, HIDDEN))
            for _ in range(layers):
                x = tp._all_reduce_out_place(tp._all_reduce_out_place(x))
        graphs[size] = graph
    wave["n"] = 5
    graphs[4].replay()
    npu.complete()
    tracker.end_wave(5)
    batch = guard_pb2.Batch()
    tracker.fill_batch(batch, with_heartbeat=True)
    (msg,) = to_waves(batch.collective_columns)
    (stat,) = msg.stats
    assert (stat.op, stat.calls, stat.replayed, stat.bytes) == (
        "all_reduce", 1 + 2 * layers, 1 + 2 * layers, (1 + 2 * layers) * 4 * HIDDEN * 4,
    )  # fmt: skip
    assert (stat.first_seq, stat.last_seq) == (1, 5)
    assert msg.replay_device_ns == int(PIECE_MS * 1e6)
    assert batch.heartbeat.collective_op == ""  # the device finished: no current collective


def test_a_hang_inside_a_replay_is_named_by_graph_and_collective_list(parts, npu):
    """Stand-in NPU that never finishes the replayed graph (a peer never joins its all-reduce):
    the heartbeat's current collective and the watchdog's incident name the graph and what it
    holds, without waiting for the device."""
    coordinator_cls, graph_cls, tracker, wave = parts
    tp = coordinator_cls("tp:0")
    graph = graph_cls()
    with npu.graph(graph):
        tp._all_reduce_out_place(tp._all_reduce_out_place(torch.zeros(2, HIDDEN)))
    label = captured(graph).label
    wave["n"] = 1
    tracker.roll(1)
    tracker.completed_waves = 1  # armed
    graph.replay()  # returns at once; the device is stuck inside it
    batch = guard_pb2.Batch()
    tracker.fill_batch(batch, with_heartbeat=True)
    hb = batch.heartbeat
    assert (hb.collective_op, hb.collective_group, hb.collective_seq) == ("all_reduce", "tp", 1)
    assert hb.collective_graph == label
    assert hb.collective_graph_holds == f"all_reduce tp x2 ({2 * 2 * HIDDEN * 4} B)"
    incidents = []
    dog = CollectiveWatchdog(
        tracker, deadline_s=0.05, interval_s=0.01, arm_after_waves=1,
        report=lambda *a, **k: incidents.append((a, k)),
    )  # fmt: skip
    assert dog.check(now_ns=tracker.in_replay.start_ns + int(1e9))
    ((args, kwargs),) = incidents
    assert label in args[2] and "all_reduce tp x2" in args[2]
    assert kwargs["evidence"]["graph"] == label
    npu.complete()  # the peer arrives: the replay finishes
    batch = guard_pb2.Batch()
    tracker.fill_batch(batch, with_heartbeat=True)
    assert batch.heartbeat.collective_op == ""


def test_guard_off_graph_wrappers_are_the_bare_methods(npu):
    """Stand-in NPUGraph: with no tracker installed nothing is noted or counted."""
    install_tracker(None)
    cls = type("G", (npu.NPUGraph,), dict(npu.NPUGraph.__dict__))
    for name in ("capture_begin", "capture_end", "replay"):
        setattr(cls, name, graph_wrapper(name, npu.NPUGraph.__dict__[name]))
    graph = cls()
    with npu.graph(graph):
        pass
    graph.replay()
    assert captured(graph) is None and graph.captured


def test_a_wave_waits_for_its_replay_times_then_is_handed_over_without_them(parts, npu):
    """Stand-in NPU whose device falls behind: a finished wave is held until its replays'
    events resolve (never waiting for them), and handed over without them once it is
    PARK_WAVES waves old, the late events counted."""
    from guard.collectives.graphs import PARK_WAVES

    coordinator_cls, graph_cls, tracker, wave = parts
    tp = coordinator_cls("tp:0")
    graph = graph_cls()
    with npu.graph(graph):
        tp._all_reduce_out_place(torch.zeros(2, HIDDEN))
    wave["n"] = 1
    graph.replay()
    tracker.end_wave(1)
    assert list(tracker.finished) == []  # held: the device has not run the replay yet
    npu.complete()
    wave["n"] = 2
    graph.replay()  # wave 2 begins: wave 1 is released with its device time
    assert [w.wave for w in tracker.finished] == [1]
    assert tracker.finished[0].replay_device_ns == int(PIECE_MS * 1e6)
    tracker.end_wave(2)
    for n in range(3, 3 + PARK_WAVES):  # the device never catches up again
        wave["n"] = n
        graph.replay()
        tracker.end_wave(n)
    assert [w.wave for w in tracker.finished][:2] == [1, 2]
    assert tracker.finished[1].replay_device_ns == 0
    assert tracker.replay_events_dropped >= 1


def test_sidecar_verdict_names_the_replayed_graph_its_peer_waits_in():
    """No stand-in: the sidecar's real HangDetector on hand-made heartbeats. Rank 1 freezes;
    rank 0's device is inside a replayed graph's all-reduce (seq 41) that never completes: the
    verdict names the stopped rank, the waiting rank's phase, the graph and its collective
    list."""
    from prometheus_client import CollectorRegistry

    from telemetry.crossrank.hangs import HangDetector, HangSettings
    from telemetry.metrics.collectives import CollectiveMetrics

    clock = {"t": 100.0}
    det = HangDetector(
        CollectiveMetrics(CollectorRegistry()), HangSettings(stale_s=2.0, wait_s=3.0),
        incident_sink=lambda *a: None, clock=lambda: clock["t"],
    )  # fmt: skip

    def hb(tp: int, *, age_s: float = 0.0, in_graph: bool = False) -> guard_pb2.Batch:
        b = guard_pb2.Batch(rank=guard_pb2.RankInfo(
            run_id="r", engine="e", tp_rank=tp, tp_size=2, dp_size=1, pp_size=1, pid=10 + tp,
            node="n"))  # fmt: skip
        h = b.heartbeat
        h.time_unix_nano, h.last_wave, h.phase = time_ns(), 7, "execute_model"
        if in_graph:
            h.collective_op, h.collective_group, h.collective_seq = "all_reduce", "tp", 41
            h.collective_age_ns = int(age_s * 1e9)
            h.collective_graph, h.collective_graph_holds = "FULL tokens=8 #3", "all_reduce tp x5"
        return b

    events = []
    for _ in range(4):
        clock["t"] += 0.5
        det.observe("e", hb(0))
        det.observe("e", hb(1))
        events += det.check()
    for i in range(1, 7):
        clock["t"] += 0.5
        det.observe("e", hb(0, age_s=0.5 * i, in_graph=True))
        events += det.check()
    (verdict,) = [e for e in events if e.get("event") == "hang_verdict"]
    assert [r["tp"] for r in verdict["stopped"]] == [1]
    (waiting,) = verdict["waiting"]
    assert waiting["phase"] == "execute_model"
    assert (waiting["graph"], waiting["graph_holds"]) == ("FULL tokens=8 #3", "all_reduce tp x5")
    assert "inside replay of graph FULL tokens=8 #3 (all_reduce tp x5)" in verdict["summary"]


def time_ns() -> int:
    import time

    return time.time_ns()


def test_doctor_says_per_call_per_replay_or_not_at_all_and_why():
    """No stand-in: the doctor's reading of attach-point rows (as bound or not) per runtime."""
    from ascend_runtime.attach.points import points_for
    from ascend_runtime.doctor.coverage import Row, collective_lines
    from guard.config.runtime_guard import GuardConfig, parse_config

    def rows(runtime: str, failing: str = "") -> list[Row]:
        return [
            Row(p, "missing" if p.method == failing else "bound", "gone" if p.method == failing else "")
            for p in points_for(runtime)
        ]  # fmt: skip

    cpu = collective_lines(rows("cpu-v1"), "cpu-v1", GuardConfig())
    assert cpu["collectives eager"].startswith("per call")
    assert cpu["collectives compiled"].startswith("per compiled-graph call")
    assert "communicator's kernels" in cpu["collectives compiled"]
    assert cpu["collectives graphs"].startswith("none captured")
    cuda = collective_lines(rows("cuda-v1"), "cuda-v1", GuardConfig())
    assert cuda["collectives compiled"].startswith("per compiled-graph call")
    assert "vLLM's collective custom ops" in cuda["collectives compiled"]
    assert cuda["collectives graphs"].startswith("per replay")
    broken = collective_lines(rows("cuda-mrv2", failing="replay"), "cuda-mrv2", GuardConfig())
    assert broken["collectives graphs"] == "not at all: CUDAGraph.replay missing: gone"
    broken = collective_lines(rows("cpu-v1", failing="__call__"), "cpu-v1", GuardConfig())
    assert broken["collectives compiled"].startswith(
        "not at all: VllmSerializableFunction.__call__ missing"
    )
    off = parse_config({"sidecar": "localhost:1", "collectives": {"enabled": False}})
    lines = collective_lines(rows("cpu-v1"), "cpu-v1", off)
    assert set(lines.values()) == {"not at all: runtime_guard.collectives.enabled is false"}
