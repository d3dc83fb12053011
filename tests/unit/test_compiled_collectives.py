"""Collectives that torch.compile would inline (vLLM's CPU path) stay visible per call.

Real torch.compile (Dynamo + AOT autograd, `fullgraph=True`: a graph break fails the test) over
a GroupCoordinator-shaped and a CpuCommunicator-shaped class with the same method names and
call chain as vLLM's (`_all_reduce_out_place` -> `device_communicator.all_reduce`, in place),
registered in vLLM's real group table. The real classes are compiled by the e2e test
(tests/e2e/test_collectives_compiled.py); here the counts, the no-double-count rule in eager
mode, and the graph's content are checked in seconds.
"""

from __future__ import annotations

import weakref

import pytest
import torch

from ascend_runtime import collective_ops
from ascend_runtime.collective_binding import bind_group_coordinator
from guard.collectives import CollectivesConfig, CollectiveTracker, install_tracker


class Communicator:
    """CpuCommunicator's shape: in-place all_reduce, concatenating all_gather."""

    def __init__(self, name: str) -> None:
        self.unique_name = name
        self.calls = 0

    def all_reduce(self, input_):
        self.calls += 1
        input_.mul_(2)  # "the other rank holds the same values"
        return input_

    def all_gather(self, input_, dim=-1):
        self.calls += 1
        return torch.cat([input_, input_], dim=dim)


class Coordinator:
    def __init__(self, name: str) -> None:
        self.unique_name = name
        self.world_size = 2
        self.rank_in_group = 0
        self.device_communicator = BoundCommunicator(name)

    def _all_reduce_out_place(self, input_):
        return self.device_communicator.all_reduce(input_)

    def _all_gather_out_place(self, input_, dim):
        return self.device_communicator.all_gather(input_, dim)


BoundCommunicator = type("BoundCommunicator", (Communicator,), dict(Communicator.__dict__))
for _name in collective_ops.COMPILED_METHODS:
    setattr(
        BoundCommunicator,
        _name,
        collective_ops.compiled_collective_wrapper(_name, Communicator.__dict__[_name]),
    )
bind_group_coordinator(Coordinator)


@pytest.fixture
def setup():
    from vllm.distributed import parallel_state

    torch._dynamo.reset()
    group = Coordinator("tp:77")
    parallel_state._groups[group.unique_name] = weakref.ref(group)
    wave = {"n": 1}
    tracker = CollectiveTracker(CollectivesConfig(), wave_source=lambda: wave["n"])
    install_tracker(tracker)
    yield group, tracker
    install_tracker(None)
    parallel_state._groups.pop(group.unique_name, None)
    collective_ops._targets.clear()
    torch._dynamo.reset()


def layer(group: Coordinator, x: torch.Tensor) -> torch.Tensor:
    """Embedding-like all-reduce, two per "layer", as a row-parallel model does."""
    h = group._all_reduce_out_place(x * 1.0)
    for _ in range(2):
        h = group._all_reduce_out_place(h + 1.0) - 1.0
    return group._all_gather_out_place(h, -1)


def test_eager_calls_are_counted_once_though_both_layers_are_wrapped(setup):
    group, tracker = setup
    layer(group, torch.ones(4, 8))
    tracker.roll(0)
    (wave,) = tracker.finished
    assert wave.stats[("all_reduce", "tp")][:2] == [3, 3 * 4 * 8 * 4]
    assert wave.stats[("all_gather", "tp")][0] == 1
    assert group.device_communicator.calls == 4


def test_compiled_calls_are_counted_per_call_with_no_graph_break(setup):
    from torch._dynamo.utils import counters

    group, tracker = setup
    counters.clear()
    compiled = torch.compile(lambda x: layer(group, x), backend="aot_eager", fullgraph=True)
    x = torch.arange(32, dtype=torch.float32).reshape(4, 8)
    want = layer(group, x.clone())  # eager, counted as wave 1's first 4 calls
    for _ in range(3):
        assert torch.equal(compiled(x.clone()), want)
    tracker.roll(0)
    (wave,) = tracker.finished
    reduce_ = wave.stats[("all_reduce", "tp")]
    assert reduce_[0] == 4 * 3 and reduce_[1] == 4 * 3 * 4 * 8 * 4
    assert reduce_[4:6] == [1, 15]  # numbered across eager and compiled calls alike (4 a run)
    assert wave.stats[("all_gather", "tp")][0] == 4
    assert counters["stats"]["unique_graphs"] == 1  # traced once: no recompile
    assert not counters["graph_break"]


def test_the_compiled_graph_holds_the_guard_op_in_place_of_the_backend_call(setup):
    group, _ = setup
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(lambda x: layer(group, x), backend=backend, fullgraph=True)(torch.ones(2, 8))
    (gm,) = graphs
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count("ascend_guard.all_reduce_.default") == 3
    assert targets.count("ascend_guard.all_gather.default") == 1
    assert not [t for t in targets if "mul_" in t]  # the communicator's body is not traced


def test_guard_off_the_compiled_op_is_the_bare_call(setup):
    group, tracker = setup
    install_tracker(None)
    compiled = torch.compile(lambda x: layer(group, x), backend="aot_eager", fullgraph=True)
    out = compiled(torch.ones(2, 8))
    assert out.shape == (2, 16) and group.device_communicator.calls == 4
    tracker.roll(0)
    assert list(tracker.finished) == []
