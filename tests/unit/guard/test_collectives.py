"""Collective wrappers on a GroupCoordinator-shaped class: numbering, per-wave aggregates,
nesting, slow calls, the current call seen from another thread, and error isolation.

The class below stands in for vLLM's `GroupCoordinator` only to drive the wrappers with
chosen timings and failures; the real class is wrapped in the e2e test (tests/e2e)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ascend_runtime.attach.collectives import COLLECTIVE_METHODS, bind_group_coordinator
from guard.collectives.install import install_tracker, wrap_collective
from guard.collectives.payload import tensor_size
from guard.collectives.tracker import CollectiveTracker
from guard.config.collectives import CollectivesConfig
from telemetry.wire.collective_columns import to_waves
from telemetry.wire.proto import guard_pb2


class Coordinator:
    """Same method names and signatures as vLLM's GroupCoordinator (the ones we wrap)."""

    def __init__(self, name: str = "tp:0", world_size: int = 2, rank: int = 0) -> None:
        self.unique_name = name
        self.world_size = world_size
        self.rank_in_group = rank
        self.block: threading.Event | None = None
        self.fail = False

    def _all_reduce_out_place(self, input_):
        if self.block is not None:
            self.block.wait(5)
        if self.fail:
            raise RuntimeError("transport down")
        return input_ * 2

    def _all_gather_out_place(self, input_, dim):
        return torch.cat([input_, input_], dim=dim)

    def broadcast_object(self, obj=None, src=0):
        return obj

    def broadcast_tensor_dict(self, tensor_dict=None, src=0, group=None, metadata_group=None):
        self.broadcast_object(list(tensor_dict or {}), src=src)  # nested, as in vLLM
        return tensor_dict if tensor_dict is not None else {"x": torch.zeros(4)}

    def recv(self, size, dtype, src=None):
        return torch.zeros(size, dtype=dtype)


@pytest.fixture
def tracker():
    wave = {"n": 1}
    t = CollectiveTracker(CollectivesConfig(slow_call_ms=20.0, max_slow_calls_per_wave=1),
                          wave_source=lambda: wave["n"])  # fmt: skip
    t.wave_box = wave
    install_tracker(t)
    yield t
    install_tracker(None)


@pytest.fixture(scope="module")
def coordinator_cls():
    cls = type("BoundCoordinator", (Coordinator,), dict(Coordinator.__dict__))
    bound = bind_group_coordinator(cls)
    assert {"_all_reduce_out_place", "broadcast_tensor_dict", "recv"} <= set(bound)
    return cls


def finished(tracker: CollectiveTracker) -> list:
    tracker.roll(0)
    return list(tracker.finished)


def test_sequence_numbers_and_wave_aggregates(tracker, coordinator_cls):
    tp, pp = coordinator_cls("tp:0"), coordinator_cls("pp:0")
    x = torch.ones(8, 16, dtype=torch.float32)
    out = tp._all_reduce_out_place(x)
    assert torch.equal(out, x * 2)  # the result passes through
    tp._all_reduce_out_place(x)
    pp._all_reduce_out_place(x[:1])
    tp._all_gather_out_place(x, -1)
    tracker.wave_box["n"] = 2
    tp._all_reduce_out_place(x)
    waves = finished(tracker)
    assert [w.wave for w in waves] == [1, 2]
    first = waves[0].stats
    # calls, bytes, host_ns, max_ns, first_seq, last_seq, backend, dtype
    assert first[("all_reduce", "tp")][:2] == [2, 2 * 8 * 16 * 4]
    assert first[("all_reduce", "tp")][4:6] == [1, 2]
    assert first[("all_gather", "tp")][4:6] == [3, 3]  # numbered per group, across ops
    assert first[("all_reduce", "pp")][4:6] == [1, 1]
    assert first[("all_reduce", "tp")][7] == "float32"
    assert waves[1].stats[("all_reduce", "tp")][4] == 4
    assert waves[0].wait_ns >= sum(s[2] for s in first.values())
    assert waves[0].first_arrival_unix_nano == pytest.approx(time.time_ns(), abs=5e9)


def test_nested_collectives_count_once_and_receivers_report_bytes(tracker, coordinator_cls):
    g = coordinator_cls()
    g.broadcast_tensor_dict({"a": torch.zeros(3, dtype=torch.float16)})
    g.broadcast_tensor_dict(None)  # a receiving rank: bytes come from the result
    g.recv(torch.Size([5]), torch.int64)
    stats = finished(tracker)[0].stats
    assert ("broadcast_object", "tp") not in stats
    assert stats[("broadcast_tensor_dict", "tp")][:2] == [2, 6 + 16]
    assert stats[("recv", "tp")][:2] == [1, 40]


def test_single_rank_groups_and_wave_zero_are_not_aggregated(tracker, coordinator_cls):
    coordinator_cls("world:0", world_size=1)._all_reduce_out_place(torch.ones(2))
    tracker.wave_box["n"] = 0
    g = coordinator_cls()
    g._all_reduce_out_place(torch.ones(2))  # model load: numbered, not aggregated
    tracker.wave_box["n"] = 1
    g._all_reduce_out_place(torch.ones(2))
    waves = finished(tracker)
    assert len(waves) == 1 and waves[0].stats[("all_reduce", "tp")][4] == 2


def test_current_call_is_visible_from_another_thread(tracker, coordinator_cls):
    g = coordinator_cls()
    g.block = threading.Event()
    worker = threading.Thread(target=g._all_reduce_out_place, args=(torch.ones(2),))
    worker.start()
    deadline = time.monotonic() + 5
    while tracker.current is None and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(0.05)
    batch = guard_pb2.Batch()
    tracker.fill_batch(batch, with_heartbeat=True)
    g.block.set()
    worker.join()
    hb = batch.heartbeat
    assert (hb.collective_op, hb.collective_group, hb.collective_seq) == ("all_reduce", "tp", 1)
    assert hb.collective_age_ns >= 40_000_000
    assert tracker.current is None


def test_slow_calls_are_kept_one_by_one_up_to_the_cap(tracker, coordinator_cls):
    g = coordinator_cls()
    g.block = threading.Event()
    threading.Timer(0.03, g.block.set).start()
    g._all_reduce_out_place(torch.ones(2))
    g.block = threading.Event()
    threading.Timer(0.03, g.block.set).start()
    g._all_reduce_out_place(torch.ones(2))
    wave = finished(tracker)[0]
    assert len(wave.slow_calls) == 1 and wave.slow_calls_dropped == 1
    op, group, _backend, dtype, seq, nbytes, _start, host_ns = wave.slow_calls[0]
    assert (op, group, dtype, seq, nbytes) == ("all_reduce", "tp", "float32", 1, 8)
    assert host_ns >= 20_000_000
    batch = guard_pb2.Batch()
    tracker.finished.extend([wave])
    tracker.fill_batch(batch, with_heartbeat=False)
    msg = to_waves(batch.collective_columns)[0]  # wire v3: columns, read back as a wave
    assert msg.slow_calls[0].seq == 1
    assert msg.slow_calls_dropped == 1


def test_collective_errors_pass_through_and_guard_errors_are_contained(tracker, coordinator_cls):
    g = coordinator_cls()
    g.fail = True
    with pytest.raises(RuntimeError, match="transport down"):
        g._all_reduce_out_place(torch.ones(2))
    assert tracker.current is None and tracker._depth == 0
    g.fail = False
    tracker._wave_source = lambda: 1 / 0  # a broken guard must not break the collective
    assert torch.equal(g._all_reduce_out_place(torch.ones(2)), torch.full((2,), 2.0))
    assert tracker.errors == 1


def test_guard_off_and_while_compiling_is_the_bare_call():
    calls = []

    def bare(self, x):
        calls.append(x)
        return x

    install_tracker(None)
    wrapped = wrap_collective("all_reduce", bare)
    assert wrapped(None, 1) == 1
    tracker = CollectiveTracker(CollectivesConfig(), wave_source=lambda: 1)
    install_tracker(tracker)
    try:
        compiling = wrap_collective("all_reduce", bare, is_compiling=lambda: True)
        assert compiling(Coordinator(), 2) == 2
        assert tracker.current is None and not tracker._stats
    finally:
        install_tracker(None)
    assert wrap_collective("all_reduce", wrapped) is wrapped  # never wrapped twice


def test_every_attach_point_exists_in_the_installed_vllm():
    from vllm.distributed.parallel_state import GroupCoordinator

    missing = [m for m, _, _ in COLLECTIVE_METHODS if not hasattr(GroupCoordinator, m)]
    assert missing == [], f"GroupCoordinator lacks {missing}; update COLLECTIVE_METHODS"


def test_tensor_size_reads_tensors_lists_and_dicts():
    t = torch.zeros(2, 3, dtype=torch.bfloat16)
    assert tensor_size(t) == (12, torch.bfloat16)
    assert tensor_size([t, t])[0] == 24
    assert tensor_size({"a": t, "meta": 3}) == (12, torch.bfloat16)
    assert tensor_size("not a tensor") == (0, None)


def test_collective_rows_of_the_attach_point_table_match_the_wrapper_table():
    """One list of attach points: every GroupCoordinator row has a way to read its payload."""
    from ascend_runtime.attach.points import ATTACH_POINTS
    from ascend_runtime.attach.points import COLLECTIVE_METHODS as TABLE_METHODS

    rows = [p for p in ATTACH_POINTS if p.action == "collective"]
    assert {p.method for p in rows} == set(TABLE_METHODS) == {m for m, _, _ in COLLECTIVE_METHODS}
    assert {(p.module, p.qualname) for p in rows} == {
        ("vllm.distributed.parallel_state", "GroupCoordinator")
    }


def test_collective_wrappers_carry_the_common_guard_marker():
    from guard import decorators
    from guard.collectives import install as collective_install

    assert collective_install.GUARD_WRAPPED_ATTR == decorators.WRAPPED_ATTR

    def all_reduce(self, tensor):
        return tensor

    wrapped = collective_install.wrap_collective("all_reduce", all_reduce)
    assert decorators.is_guarded(wrapped) and decorators.unwrap(wrapped) is all_reduce
