"""The shared-memory liveness record: written by one process, read by another (the real mmap in
a temporary directory), checked against /proc; and the hang detector's use of what it reads."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
from prometheus_client import CollectorRegistry

from telemetry.crossrank.hangs import HangDetector, HangSettings
from telemetry.metrics.collectives import CollectiveMetrics
from telemetry.wire.liveness_record import (
    _COUNTER,
    LivenessRecord,
    RecordReader,
    RecordView,
    proc_stat,
    record_path,
)
from tests.unit.telemetry.test_hangs_ranksync import Clock, batch


def test_a_record_round_trips_phase_and_collective(tmp_path):
    rec = LivenessRecord.create(str(tmp_path), "run-1", 0, 0, 1)
    assert rec is not None and os.path.basename(rec.path).endswith("-dp0-pp0-tp1.live")
    reader = RecordReader(str(tmp_path))
    start = time.monotonic_ns()
    rec.phase("execute_model", start - 2_000_000_000, 7)
    view = reader.read("run-1", 0, 0, 1, os.getpid())
    assert view is not None and view.state == "R"
    assert (view.wave, view.phase, view.in_call, view.op) == (7, "execute_model", False, "")
    assert 2.0 <= view.phase_age_s < 3.0
    rec.enter("all_reduce", "tp", 41, start - 500_000_000)
    inside = reader.read("run-1", 0, 0, 1, os.getpid())
    assert (inside.in_call, inside.op, inside.group, inside.seq) == (True, "all_reduce", "tp", 41)
    assert 0.5 <= inside.call_age_s < 1.5 and inside.moves != view.moves
    rec.leave()
    after = reader.read("run-1", 0, 0, 1, os.getpid())
    assert (after.in_call, after.op, after.group, after.seq) == (False, "", "tp", 41)
    assert after.moves != inside.moves
    rec.close()
    assert not os.path.exists(rec.path)


def test_a_torn_record_is_not_read(tmp_path):
    rec = LivenessRecord.create(str(tmp_path), "run-1", 0, 0, 0)
    reader = RecordReader(str(tmp_path))
    assert reader.read("run-1", 0, 0, 0, os.getpid()) is not None
    rec._words[_COUNTER] = rec._counter + 1  # the writer is in the middle of an update
    assert reader.read("run-1", 0, 0, 0, os.getpid()) is None


def test_a_record_of_another_process_or_run_is_not_trusted(tmp_path):
    rec = LivenessRecord.create(str(tmp_path), "run-1", 0, 0, 0)
    reader = RecordReader(str(tmp_path))
    assert reader.read("run-2", 0, 0, 0, os.getpid()) is None  # no such file
    assert reader.read("run-1", 0, 0, 0, os.getppid()) is None  # another pid in the header
    rec._words[3] += 1  # start time of an earlier process with the same pid
    assert reader.read("run-1", 0, 0, 0, os.getpid()) is None
    assert proc_stat(2**22 + 12345) is None


def test_an_unwritable_directory_turns_the_record_off(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert LivenessRecord.create(str(blocker / "sub"), "run", 0, 0, 0) is None


def _child(directory: str, ready, go) -> None:
    rec = LivenessRecord.create(directory, "run-x", 0, 0, 3)
    rec.enter("all_gather", "tp", 9, time.monotonic_ns())
    ready.set()
    go.wait(30)


def test_the_sidecar_sees_a_stopped_process_as_stopped(tmp_path):
    """Another process writes the record; SIGSTOP shows as state T, SIGCONT clears it."""
    ctx = multiprocessing.get_context("spawn")
    ready, go = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_child, args=(str(tmp_path), ready, go))
    proc.start()
    try:
        assert ready.wait(30)
        reader = RecordReader(str(tmp_path))
        view = reader.read("run-x", 0, 0, 3, proc.pid)
        assert view is not None and not view.stopped and view.op == "all_gather"
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not (view := reader.read("run-x", 0, 0, 3, proc.pid)).stopped:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert view.state == "T" and (view.op, view.seq) == ("all_gather", 9)
        os.kill(proc.pid, signal.SIGCONT)
    finally:
        go.set()
        proc.join(10)
    assert os.path.exists(record_path(str(tmp_path), "run-x", 0, 0, 3))  # no close(): kept


class StubRecords:
    """What RecordReader.read would return, per tp rank (the real reader is tested above)."""

    def __init__(self) -> None:
        self.views: dict[int, RecordView | None] = {}
        self.forgotten: list[int] = []
        self.exits: dict[int, dict] = {}  # pid -> how it ended (absent: it runs)
        self.owners: dict[int, int] = {}  # tp -> pid of a record with no stream

    def read(self, run_id, dp, pp, tp, pid):
        return self.views.get(tp)

    def exit_of(self, pid, start_ticks):
        return self.exits.get(pid)

    def owner(self, run_id, dp, pp, tp):
        return self.owners.get(tp)

    def forget(self, run_id, dp, pp, tp):
        self.forgotten.append(tp)


def view(state="S", *, op="", seq=0, age=0.0, moves=(2, 0), wave=5):
    return RecordView(
        state=state,
        wave=wave,
        phase="execute_model",
        phase_age_s=age,
        in_call=bool(op),
        op=op,
        group="tp" if op else "",
        seq=seq,
        call_age_s=age,
        moves=moves,
    )


@pytest.fixture
def local():
    clock = Clock()
    records = StubRecords()
    d = HangDetector(
        CollectiveMetrics(CollectorRegistry()),
        HangSettings(stale_s=2.0, wait_s=3.0),
        clock=clock,
        records=records,
    )
    d.clock, d.records = clock, records
    return d


def step(det, *batches, dt=0.1):
    det.clock.t += dt
    for b in batches:
        det.observe("e", b)
    return det.check()


def test_stopped_rank_is_frozen_after_one_second_and_a_silent_waiting_peer_is_not_named(local):
    for _ in range(5):
        assert step(local, batch(0), batch(1)) == []
    # both go quiet on the stream: rank 1 is stopped, rank 0 waits in all_reduce holding the GIL
    local.records.views = {0: view(op="all_reduce", seq=40, age=0.0), 1: view("T")}
    events = []
    for i in range(1, 40):
        local.records.views[0] = view(op="all_reduce", seq=40, age=0.1 * i)
        events += step(local)
        if events:
            break
    assert len(events) == 1 and 1.0 <= 0.1 * i <= 1.15, i  # frozen_s after the last batch
    verdict = events[0]
    assert verdict["kind"] == "no_heartbeat"
    assert [(r["tp"], r["state"]) for r in verdict["stopped"]] == [(1, "T")]
    assert [(r["tp"], r["state"]) for r in verdict["waiting"]] == [(0, "S")]
    assert (verdict["op"], verdict["seq"]) == ("all_reduce", 40)
    # long after --hang-after, still only rank 1
    for _ in range(50):
        local.records.views[0] = view(op="all_reduce", seq=40, age=5.0)
        assert step(local) == []
    assert [r["tp"] for r in local.verdicts[("r1", "e", 0)].stopped] == [1]


def test_a_silent_rank_whose_record_moves_is_alive(local):
    for _ in range(5):
        step(local, batch(0), batch(1))
    for i in range(60):  # 6 s of stream silence from rank 0, its waves still turn
        local.records.views[0] = view("R", moves=(2 * i + 2, i))
        assert step(local, batch(1)) == []


def test_a_silent_rank_that_runs_but_neither_moves_nor_waits_is_named_after_stale_s(local):
    for _ in range(5):
        step(local, batch(0), batch(1))
    local.records.views[0] = view("R")
    events, steps = [], 0
    while not events and steps < 40:
        steps += 1
        events += step(local, batch(1))
    assert [r["tp"] for r in events[0]["stopped"]] == [0]
    assert 0.1 * steps > 2.0, "the silence rule, not the frozen one"


def test_a_stopped_rank_still_speaking_through_a_late_stream_is_not_frozen_yet(local):
    """State T alone is not enough: it must also have been silent for frozen_s (a debugger's
    brief stop, a stream read late)."""
    for _ in range(5):
        step(local, batch(0), batch(1))
    local.records.views[1] = view("T")
    for _ in range(20):
        assert step(local, batch(0), batch(1)) == []


def test_batches_read_late_neither_hurry_nor_end_a_frozen_verdict(local):
    """A sidecar that runs behind reads, after the stop, batches sent before it: the verdict
    waits for state T to last, stands while T lasts, and ends once the process runs and speaks."""
    for _ in range(5):
        step(local, batch(0), batch(1))
    local.records.views[1] = view("T")
    events = []
    for _ in range(5):  # 0.5 s of silence; T seen from 0.3 s on
        events += step(local, batch(0))
    assert events == []
    events += step(local, batch(0), batch(1), dt=0.1)  # a late batch from before the stop
    for _ in range(6):
        events += step(local, batch(0))
    assert [e["event"] for e in events] == ["hang_verdict"]
    for _ in range(5):  # more late batches: still stopped, the verdict stands
        assert step(local, batch(0), batch(1)) == []
    local.records.views[1] = view("R", moves=(9, 9))  # SIGCONT
    events = step(local, batch(0), batch(1))
    assert [e["event"] for e in events] == ["hang_recovered"]


def test_a_local_rank_keeps_its_record_until_its_process_is_gone(local):
    local.records.views = {0: view(), 1: view()}
    b = batch(1)
    step(local, batch(0), b)
    local.rank_gone("e", b.rank, clean=True)  # a goodbye: the worker shuts down
    assert step(local, batch(0)) == [] and local.records.forgotten == []
    local.records.exits[b.rank.pid] = {"how": "exit", "status": 0, "detail": "exited"}
    assert step(local, batch(0)) == []  # a shutdown is no incident
    assert local.records.forgotten == [1]


def stop_rank_1(local) -> list:
    """Both ranks speak; then rank 1 is stopped (state T) while rank 0 waits in all_reduce."""
    local.records.views = {0: view(), 1: view()}
    for _ in range(5):
        step(local, batch(0), batch(1))
    local.records.views[1] = view("T")
    events = []
    for i in range(20):
        local.records.views[0] = view(op="all_reduce", seq=40, age=0.1 * i)
        events += step(local, batch(0, op="all_reduce", seq=40, age_s=0.1 * i))
    return events


def test_a_stopped_local_rank_whose_stream_ends_stays_named_until_it_moves(local):
    """gRPC may close a stopped rank's connection (an unanswered ping): the rank is local, its
    process exists, so it is still stopped and its verdict stands; it is back once it runs
    and moves (its record's counters), with no stream yet."""
    events = stop_rank_1(local)
    assert [e["kind"] for e in events] == ["no_heartbeat"]
    local.rank_gone("e", batch(1).rank)  # the stream broke
    for i in range(600):  # a minute
        local.records.views[0] = view(op="all_reduce", seq=40, age=2.0 + 0.1 * i)
        assert step(local, batch(0, op="all_reduce", seq=40, age_s=2.0 + 0.1 * i)) == []
    _, body = local.engine_status("e")
    rank1 = next(r for r in body["ranks"] if r["tp"] == 1)
    assert (rank1["where"], rank1["stream"], rank1["state"]) == ("local", "stream_ended", "T")
    assert not body["live"] and "not_seen" not in body["replicas"][0]
    local.records.views[1] = view("R", moves=(9, 9))  # SIGCONT: it runs and moves
    local.records.views[0] = view(moves=(7, 7))
    events = step(local, batch(0))
    assert [e["event"] for e in events] == ["hang_recovered"]


def test_a_local_rank_that_exits_is_its_own_incident_and_its_replica_stays_wedged(local):
    local.records.views = {0: view(), 1: view()}
    for _ in range(5):
        step(local, batch(0), batch(1))
    local.rank_gone("e", batch(1).rank)  # SIGKILL: the stream breaks ...
    local.records.exits[1001] = {"how": "signal", "signal": 9, "detail": "killed by SIGKILL"}
    events = step(local, batch(0))  # ... and its process is gone
    assert [e["event"] for e in events] == ["rank_exited", "hang_verdict"]
    assert events[0]["exit"]["signal"] == 9 and events[0]["peers_running"] == 1
    assert events[1]["kind"] == "rank_exited"
    assert [r["tp"] for r in events[1]["stopped"]] == [1]
    for _ in range(100):  # the one rank left waits: no recovery, no end
        local.records.views[0] = view(op="all_reduce", seq=41, age=1.0)
        assert step(local, batch(0, op="all_reduce", seq=41, age_s=1.0)) == []
    assert not local.engine_status("e")[0]
    # its peer is torn down too: the verdict is closed, never recovered
    local.rank_gone("e", batch(0).rank, clean=True)
    local.records.exits[1000] = {"how": "exit", "status": 0, "detail": "exited with status 0"}
    events = step(local)
    assert [e["event"] for e in events] == ["rank_exited", "hang_closed"]
    assert local.metrics.hang_recoveries.labels("e", "0")._value.get() == 0
    assert local.metrics.wedged.labels("e", "0")._value.get() == 0
    assert local.engine_status("e") is None


def test_a_restarted_sidecar_finds_a_stopped_rank_from_its_record(local):
    """A fresh detector (the sidecar restarted): rank 0 reconnects and waits in all_reduce;
    rank 1 is stopped and cannot reconnect. Its record names it; it is named within
    --hang-after of rank 0's return, never "every engine is moving"."""
    local.records.owners = {1: 4242}
    local.records.views = {0: view(op="all_reduce", seq=40, age=30.0), 1: view("T")}
    events, t = [], 0.0
    while not events and t < 2.0:
        t += 0.1
        events += step(local, batch(0, op="all_reduce", seq=40, age_s=30.0 + t))
    assert [e["kind"] for e in events] == ["no_heartbeat"], t
    assert [(r["tp"], r["pid"], r["stream"]) for r in events[0]["stopped"]] == [(1, 4242, "found")]
    assert (events[0]["op"], events[0]["seq"]) == ("all_reduce", 40)


def test_the_collective_tracker_writes_the_call_it_is_in(tmp_path):
    """The wrapped call is seen from the record while it runs, and as returned afterwards."""
    from guard.collectives.tracker import CollectiveTracker
    from guard.config.collectives import CollectivesConfig

    class Group:
        unique_name, world_size, rank_in_group, backend = "tp:0", 2, 0, "shm"

    tracker = CollectiveTracker(CollectivesConfig(), wave_source=lambda: 3)
    tracker.record = LivenessRecord.create(str(tmp_path), "run-t", 0, 0, 0)
    reader = RecordReader(str(tmp_path))
    seen = []

    def collective(group, value):
        seen.append(reader.read("run-t", 0, 0, 0, os.getpid()))
        return value

    group = Group()
    assert tracker.run("all_reduce", collective, group, (1,), {}, lambda a, k, r: None) == 1
    tracker.run("all_gather", collective, group, (2,), {}, lambda a, k, r: None)
    assert [(v.in_call, v.op, v.seq) for v in seen] == [
        (True, "all_reduce", 1),
        (True, "all_gather", 2),
    ]
    after = reader.read("run-t", 0, 0, 0, os.getpid())
    assert (after.in_call, after.group, after.seq) == (False, "tp", 2)
