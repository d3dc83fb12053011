"""Collectives inside torch.compile'd graphs are counted per compiled-graph call.

Real torch.compile (Dynamo + AOT autograd, `fullgraph=True`: a graph break fails the test,
`mark_dynamic` as vLLM does: the batch size is symbolic) over GroupCoordinator- and CpuCommunicator-shaped
stand-ins with vLLM's method names and call chain (`_all_reduce_out_place` ->
`device_communicator.all_reduce` -> a kernel), registered in vLLM's real group table.

Two kernel shapes, as vLLM has them:
- the CPU path: the communicator calls a shared-memory kernel by handle, which Dynamo inlines
  into the graph. vLLM's real `_C.shm_allreduce` refuses a world size of 1, so a stand-in
  kernel of the same schema (`ag_test::shm_allreduce(int handle, Tensor(a!) data)`) is
  registered here and added to the scanner's kernel table; the real one is compiled by the
  e2e test (tests/e2e/test_collectives_compiled.py).
- the CUDA / Ascend path: vLLM's real custom op `torch.ops.vllm.all_reduce(t, group_name)`,
  opaque to Dynamo, whose implementation calls the (wrapped) `_all_reduce_out_place`.

The compiled callable is wrapped the way vLLM's is (`compiled_collectives.counted` around the
backend's result, and `compiled_graph_wrapper` on vLLM's real `VllmSerializableFunction`).
"""

from __future__ import annotations

import sys
import weakref

import pytest
import torch

from ascend_runtime.attach import compiled_collectives
from ascend_runtime.attach.collectives import bind_group_coordinator
from guard.collectives.graphs import GRAPH_COUNTED
from guard.collectives.install import install_tracker
from guard.collectives.tracker import CollectiveTracker
from guard.collectives.watchdog import CollectiveWatchdog
from guard.config.collectives import CollectivesConfig

HANDLE = 77
_lib = torch.library.Library("ag_test", "DEF")
_lib.define("shm_allreduce(int handle, Tensor(a!) data) -> ()")
_kernel_calls = []


def _shm_allreduce(handle, data):
    _kernel_calls.append(handle)
    data.mul_(2)  # "the other rank holds the same values"


_lib.impl("shm_allreduce", _shm_allreduce, "CompositeExplicitAutograd")
_lib._register_fake("shm_allreduce", lambda handle, data: None)


class ShmModule:
    def __init__(self) -> None:
        self.handle = HANDLE


class Communicator:
    """CpuCommunicator's shape: in-place all_reduce through the shared-memory module."""

    def __init__(self) -> None:
        self.dist_module = ShmModule()

    def all_reduce(self, input_):
        torch.ops.ag_test.shm_allreduce(self.dist_module.handle, input_)
        return input_


_callers: list[str] = []  # who called `_all_reduce_out_place`, when a test asks


class Coordinator:
    def __init__(self, name: str) -> None:
        self.unique_name = name
        self.world_size = 2
        self.rank_in_group = 0
        self.device_communicator = Communicator()
        self.note_caller = False

    def _all_reduce_out_place(self, input_):
        if self.note_caller:  # not under torch.compile: only the custom-op shape sets it
            _callers.append(sys._getframe(1).f_code.co_name)
        return self.device_communicator.all_reduce(input_.clone())


bind_group_coordinator(Coordinator)


@pytest.fixture
def setup():
    from vllm.distributed import parallel_state

    torch._dynamo.reset()
    compiled_collectives.KERNELS["ag_test::shm_allreduce"] = ("all_reduce", 1, "handle", 0)
    group = Coordinator("tp:77")
    parallel_state._groups[group.unique_name] = weakref.ref(group)
    wave = {"n": 1}
    tracker = CollectiveTracker(CollectivesConfig(), wave_source=lambda: wave["n"])
    install_tracker(tracker)
    _kernel_calls.clear()
    yield group, tracker, wave
    install_tracker(None)
    parallel_state._groups.pop(group.unique_name, None)
    compiled_collectives.KERNELS.pop("ag_test::shm_allreduce", None)
    torch._dynamo.reset()


def inlined(group: Coordinator, x: torch.Tensor) -> torch.Tensor:
    """The CPU shape: an embedding-like all-reduce, then two per "layer"."""
    h = group._all_reduce_out_place(x * 1.0)
    for _ in range(2):
        h = group._all_reduce_out_place(h + 1.0) - 1.0
    return h


def custom_op(group: Coordinator, x: torch.Tensor) -> torch.Tensor:
    """The CUDA / Ascend shape: vLLM's opaque custom op, three times."""
    h = torch.ops.vllm.all_reduce(x * 1.0, group.unique_name)
    for _ in range(2):
        h = torch.ops.vllm.all_reduce(h + 1.0, group.unique_name) - 1.0
    return h


def compile_counted(fn, graphs: list | None = None):
    """torch.compile with aot_eager, its compiled callable wrapped as vLLM's is."""
    from torch._dynamo.backends.debugging import aot_eager

    def backend(gm, example_inputs):
        if graphs is not None:
            graphs.append(gm)
        return compiled_collectives.counted(gm, aot_eager(gm, example_inputs))

    compiled = torch.compile(fn, backend=backend, fullgraph=True)

    def call(x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.mark_dynamic(x, 0)  # the batch size is symbolic, as vLLM marks it
        return compiled(x)

    return call


@pytest.mark.parametrize("shape", [inlined, custom_op], ids=["cpu-inlined", "custom-op"])
def test_compiled_calls_counted_per_graph_call_with_bytes_per_batch_size(setup, shape):
    from torch._dynamo.utils import counters

    group, tracker, _ = setup
    counters.clear()
    compiled = compile_counted(lambda x: shape(group, x))
    sizes = (4, 7, 9)
    for n in sizes:
        x = torch.arange(n * 8, dtype=torch.float32).reshape(n, 8)
        assert torch.equal(compiled(x.clone()), shape(group, x.clone()))  # then eager
    tracker.roll(0)
    (wave,) = tracker.finished
    stat = wave.stats[("all_reduce", "tp")]
    calls, nbytes, host_ns, _, first_seq, last_seq = stat[:6]
    assert calls == 2 * 3 * len(sizes)  # compiled and eager alike
    assert nbytes == 2 * 3 * sum(n * 8 * 4 for n in sizes)  # the batch size read per call
    assert stat[GRAPH_COUNTED] == 3 * len(sizes)  # the compiled ones, marked
    assert (first_seq, last_seq) == (1, 2 * 3 * len(sizes))  # one numbering, eager and compiled
    assert host_ns > 0  # eager calls timed; the graph-counted ones add none
    assert counters["stats"]["unique_graphs"] == 1  # three batch sizes, traced once
    assert not counters["graph_break"]
    assert tracker.errors == 0


def test_the_graph_is_the_same_with_the_guard_on_and_off(setup):
    group, _, _ = setup
    on: list = []
    compile_counted(lambda x: inlined(group, x), on)(torch.ones(3, 8))
    torch._dynamo.reset()
    install_tracker(None)
    off: list = []
    compile_counted(lambda x: inlined(group, x), off)(torch.ones(3, 8))
    (gm_on,), (gm_off,) = on, off

    def targets(gm):
        return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]

    assert targets(gm_on) == targets(gm_off)
    assert targets(gm_on).count("ag_test.shm_allreduce") == 3
    assert not [t for t in targets(gm_on) if "ascend_guard" in t]  # no guard op in the graph


def test_inside_the_call_the_heartbeat_and_watchdog_name_the_graph(setup, monkeypatch):
    """The custom op's implementation runs inside the compiled call: there it sees what the
    heartbeat and the watchdog see (the graph's first collective, the graph and its list)."""
    group, tracker, _ = setup
    incidents = []
    watchdog = CollectiveWatchdog(
        tracker,
        deadline_s=1.0,
        interval_s=0.1,
        arm_after_waves=0,
        report=lambda *args, **kwargs: incidents.append((args, kwargs)),
    )
    inside = []
    bare = Coordinator._all_reduce_out_place

    def probe(self, input_):
        inside.append((tracker.current, tracker.in_replay))
        if tracker.current is not None:
            watchdog.check(now_ns=tracker.current[4] + 5 * 10**9)
        return bare(self, input_)

    compiled = compile_counted(lambda x: custom_op(group, x))
    monkeypatch.setattr(Coordinator, "_all_reduce_out_place", probe)
    compiled(torch.ones(5, 8))
    assert len(inside) == 3, "the custom op's implementation ran inside the compiled call"
    current, in_replay = inside[0]
    assert current[:4] == ("all_reduce", "tp", tracker._meta(group).backend, 1)
    assert in_replay.graph.label.startswith("compiled graph #")
    assert in_replay.graph.holds() == "all_reduce tp x3 (480 B)"  # 3 x 5 x 8 x 4 bytes
    assert len(incidents) == 1  # once per (group, seq)
    (kind, _, summary), kwargs = incidents[0]
    assert kind == "hang_suspected"
    assert kwargs["evidence"]["graph"] == in_replay.graph.label
    assert kwargs["evidence"]["seq"] == 1 and "all_reduce tp x3" in summary
    assert tracker.current is None and tracker.in_replay is None  # cleared after the call


def test_inside_the_call_the_custom_op_reaches_the_method_with_no_guard_frame(setup):
    """vLLM's custom op calls `_all_reduce_out_place` from Python. Inside a counted call the
    unwrapped method shadows the class's wrapper on that coordinator, so no guard frame runs
    per collective; after the call the wrapper is back, and an eager call is counted again."""
    group, tracker, _ = setup
    compiled = compile_counted(lambda x: custom_op(group, x))
    compiled(torch.ones(5, 8))  # compiled and scanned
    group.note_caller = True
    _callers.clear()
    compiled(torch.ones(5, 8))
    assert _callers == ["all_reduce"] * 3  # vLLM's own implementation, then the method
    assert "_all_reduce_out_place" not in vars(group)  # the shadow is gone after the call
    group._all_reduce_out_place(torch.ones(5, 8))
    assert _callers[-1] == "run"  # the wrapper, through the tracker: counted
    tracker.roll(0)
    (wave,) = tracker.finished
    stat = wave.stats[("all_reduce", "tp")]
    assert (stat[0], stat[GRAPH_COUNTED]) == (3 + 3 + 1, 6)  # two compiled calls, one eager
    assert (stat[4], stat[5]) == (1, 7)  # one numbering across them
    assert tracker.errors == 0


def test_a_device_graph_captured_around_the_call_holds_its_collectives(setup):
    """FULL graph capture around the compiled call: the calls are noted on the captured graph
    at the capture's batch size (no seq taken) and counted at each replay."""
    group, tracker, wave = setup
    compiled = compile_counted(lambda x: inlined(group, x))
    wave["n"] = 0
    compiled(torch.ones(2, 8))  # warm-up outside any wave: numbered, not counted
    captured = tracker.begin_capture("FULL tokens=6")
    compiled(torch.ones(6, 8))
    tracker.end_capture()
    assert [(op, meta.label, n) for op, meta, n, _ in captured.calls] == [
        ("all_reduce", "tp", 6 * 8 * 4)
    ] * 3
    wave["n"] = 1
    tracker.replay(captured, lambda g: None, None)
    tracker.roll(0)
    stat = tracker.finished[0].stats[("all_reduce", "tp")]
    assert stat[:2] == [3, 3 * 6 * 8 * 4] and stat[4:6] == [4, 6]  # seq 1-3 at warm-up
    assert stat[8] == 3 and stat[GRAPH_COUNTED] == 0  # replayed, not graph-counted


def test_vllm_serializable_function_is_wrapped_per_call(setup):
    """vLLM's real `VllmSerializableFunction` (what its backend returns) with the guard's
    `__call__`: the graph is read from its `graph_module`."""
    from torch._dynamo.backends.debugging import aot_eager
    from vllm.compilation.caching import VllmSerializableFunction

    group, tracker, _ = setup
    Wrapped = type("Wrapped", (VllmSerializableFunction,), {})
    Wrapped.__call__ = compiled_collectives.compiled_graph_wrapper(
        "__call__", VllmSerializableFunction.__call__
    )

    def backend(gm, example_inputs):
        return Wrapped(gm, example_inputs, "backbone", aot_eager(gm, example_inputs))

    compiled = torch.compile(lambda x: inlined(group, x), backend=backend)
    for n in (3, 5):
        x = torch.ones(n, 8)
        torch._dynamo.mark_dynamic(x, 0)
        compiled(x)
    tracker.roll(0)
    stat = tracker.finished[0].stats[("all_reduce", "tp")]
    assert stat[:2] == [6, 3 * (3 + 5) * 8 * 4] and stat[GRAPH_COUNTED] == 6


def test_guard_off_the_compiled_call_is_the_bare_call(setup):
    group, tracker, _ = setup
    install_tracker(None)
    out = compile_counted(lambda x: inlined(group, x))(torch.ones(2, 8))
    assert out.shape == (2, 8) and _kernel_calls == [HANDLE] * 3
    tracker.roll(0)
    assert list(tracker.finished) == []


def test_an_unreadable_graph_is_counted_as_an_error_and_runs(setup):
    group, tracker, _ = setup
    compiled_collectives.KERNELS["ag_test::shm_allreduce"] = ("all_reduce", 1, "handle", 5)
    out = compile_counted(lambda x: inlined(group, x))(torch.ones(2, 8))
    assert out.shape == (2, 8) and tracker.errors == 1


def test_the_watchdog_gives_a_compiled_call_its_compute_time_on_top_of_the_deadline(setup):
    """A compiled call's age includes the graph's compute: twice the longest call seen in a
    wave is added to the deadline before it reads as a hang."""
    from guard.collectives.graphs import CompiledGraph, InReplay

    group, tracker, _ = setup
    counted = []
    real = compiled_collectives.counted

    def keep(gm, compiled):
        counted.append(real(gm, compiled))
        return counted[-1]

    compiled_collectives.counted = keep
    try:
        compile_counted(lambda x: inlined(group, x))(torch.ones(3, 8))
    finally:
        compiled_collectives.counted = real
    (call,) = counted
    assert getattr(call, compiled_collectives.GRAPH_ATTR).longest_ns > 0  # measured in a wave
    incidents = []
    watchdog = CollectiveWatchdog(
        tracker,
        deadline_s=3.0,
        interval_s=0.1,
        arm_after_waves=0,
        report=lambda *args, **kwargs: incidents.append(kwargs),
    )
    g = CompiledGraph("compiled graph #x", [], [])
    g.longest_ns = 2 * 10**9
    tracker.current = ("all_reduce", "tp", "shm", 9, 0)
    tracker.in_replay = InReplay(g, "all_reduce", "tp", "shm", 9, 0, None)
    assert not watchdog.check(now_ns=int(6.9e9))  # 3 s + 2 x 2 s not passed yet
    assert watchdog.check(now_ns=int(7.1e9))
    assert incidents[0]["evidence"]["graph"] == "compiled graph #x"


def test_stock_backends_from_vllms_compilation_config_count_per_call(setup):
    """vLLM's real `CompilationConfig.init_backend` in DYNAMO_TRACE_ONCE mode (vLLM's CPU
    default) with the guard's wrapper: the stock backend it names comes back counting."""
    from vllm.config import CompilationConfig, CompilationMode

    group, tracker, _ = setup
    config = CompilationConfig(mode=CompilationMode.DYNAMO_TRACE_ONCE, backend="aot_eager")
    init_backend = compiled_collectives.compiled_graph_wrapper(
        "init_backend", CompilationConfig.init_backend
    )
    backend = init_backend(config, None)
    assert callable(backend) and backend.__name__ == "guard_counting_backend"
    compiled = torch.compile(lambda x: inlined(group, x), backend=backend, fullgraph=True)
    for n in (3, 4):
        x = torch.ones(n, 8)
        torch._dynamo.mark_dynamic(x, 0)
        compiled(x)
    tracker.roll(0)
    stat = tracker.finished[0].stats[("all_reduce", "tp")]
    assert stat[:2] == [6, 3 * (3 + 4) * 8 * 4] and stat[GRAPH_COUNTED] == 6


def test_an_aot_compiled_artifact_saves_and_loads_its_collective_list(setup, tmp_path):
    """vLLM's default with the compile cache on: AOT compile saves what the backend returned
    and a later process loads it. The counting wrapper saves the stock backend's artifact and
    the graph's collective list; loaded, it counts with bytes per batch size as before."""
    group, tracker, _ = setup
    backend = compiled_collectives.counting_backend("inductor", {})
    x = torch.ones(3, 8)
    torch._dynamo.mark_dynamic(x, 0)
    with torch._dynamo.config.patch(enable_aot_compile=True):
        compiled = torch.compile(lambda t: inlined(group, t), backend=backend, fullgraph=True)
        saved = compiled.aot_compile(((x,), {}))
    path = tmp_path / "artifact.bin"
    saved.save_compiled_function(str(path))
    with path.open("rb") as f:
        loaded = torch.compiler.load_compiled_function(f)
    for n in (5, 7):
        loaded(torch.ones(n, 8))
    tracker.roll(0)
    stat = tracker.finished[0].stats[("all_reduce", "tp")]
    assert stat[:2] == [6, 3 * (5 + 7) * 8 * 4] and stat[GRAPH_COUNTED] == 6
    assert tracker.errors == 0
