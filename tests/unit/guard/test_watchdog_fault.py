"""The rank-local watchdog and the fault injector, driven with a chosen clock and rank."""

from __future__ import annotations

import time

from guard.collectives.fault_injection import FaultInjector
from guard.collectives.observer import CollectiveGuard
from guard.collectives.records import GroupMeta
from guard.collectives.tracker import CollectiveTracker
from guard.collectives.watchdog import CollectiveWatchdog
from guard.config.collectives import CollectivesConfig
from guard.config.fault_injection import FaultInjectionConfig


def _watchdog(tracker, reports, deadline_s=1.0, arm=1):
    return CollectiveWatchdog(
        tracker, deadline_s=deadline_s, interval_s=0.01, arm_after_waves=arm,
        report=lambda *a, **kw: reports.append((a, kw)), wave_source=lambda: 7,
    )  # fmt: skip


def test_watchdog_fires_once_per_stuck_call_and_only_when_armed():
    tracker = CollectiveTracker(CollectivesConfig())
    reports: list = []
    dog = _watchdog(tracker, reports)
    start = 1_000_000_000
    tracker.current = ("all_reduce", "tp", "shm", 12, start)
    assert not dog.check(now_ns=start + 5_000_000_000)  # not armed: warm-up wave
    tracker.completed_waves = 1
    assert not dog.check(now_ns=start + 900_000_000)  # under the deadline
    assert dog.check(now_ns=start + 1_100_000_000)
    assert not dog.check(now_ns=start + 9_000_000_000)  # same call: reported once
    (args, kwargs) = reports[0]
    assert args[:2] == ("hang_suspected", "critical")
    assert "all_reduce" in args[2] and "seq 12" in args[2]
    evidence = kwargs["evidence"]
    assert (evidence["op"], evidence["group"], evidence["seq"], evidence["wave"]) == (
        "all_reduce", "tp", 12, 7,
    )  # fmt: skip
    tracker.current = ("all_reduce", "tp", "shm", 13, start)
    assert dog.check(now_ns=start + 2_000_000_000)  # the next stuck call is a new incident
    tracker.current = None
    assert not dog.check(now_ns=start + 9_000_000_000)
    assert dog.fired == 2


def test_watchdog_skips_the_tick_after_its_own_process_was_frozen():
    """After a SIGSTOP/SIGCONT the frozen rank's own call looks old; it is not reported."""
    tracker = CollectiveTracker(CollectivesConfig())
    tracker.completed_waves = 3
    reports: list = []
    dog = _watchdog(tracker, reports, deadline_s=1.0)
    start = 1_000_000_000
    tracker.current = ("all_reduce", "tp", "shm", 5, start)
    dog.tick(100.0, now_ns=start)
    assert not dog.tick(104.0, now_ns=start + 4_000_000_000)  # woke 4 s late: frozen itself
    assert dog.tick(104.01, now_ns=start + 4_010_000_000)  # still stuck on the next tick
    assert len(reports) == 1


def test_watchdog_thread_reports_while_the_call_blocks():
    tracker = CollectiveTracker(CollectivesConfig())
    tracker.completed_waves = 5
    reports: list = []
    dog = _watchdog(tracker, reports, deadline_s=0.05)
    dog.start()
    try:
        tracker.current = ("broadcast", "pp", "gloo", 3, time.perf_counter_ns())
        deadline = time.monotonic() + 3
        while not reports and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        dog.stop()
    assert reports and reports[0][1]["evidence"]["group"] == "pp"


class _Sleeps:
    def __init__(self) -> None:
        self.calls: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)
        time.sleep(0.001)


def test_execute_model_delay_hits_only_the_chosen_rank_and_waves():
    for rank, expected in (((0, 1, 0), 2), ((0, 0, 0), 0)):
        tracker = CollectiveTracker(CollectivesConfig())
        sleeps = _Sleeps()
        config = FaultInjectionConfig(enabled=True, tp_rank=1, at_wave=3, waves=2, delay_ms=250)
        injector = FaultInjector(config, tracker, lambda rank=rank: rank, sleep=sleeps)
        for wave in range(1, 8):
            tracker.roll(wave)
            injector.begin_wave(wave)
        assert sleeps.calls == [0.25] * expected
        assert injector.injected == expected


def test_collective_delay_lands_before_the_first_matching_call_of_the_wave():
    tracker = CollectiveTracker(
        CollectivesConfig(), wave_source=lambda: 4,
        describe_group=lambda g: GroupMeta(g.unique_name, "shm", 1, 2),
    )  # fmt: skip
    sleeps = _Sleeps()
    config = FaultInjectionConfig(
        enabled=True, at_wave=4, delay_ms=100, where="collective", op="all_gather", group="tp"
    )
    injector = FaultInjector(config, tracker, lambda: (0, 1, 0), sleep=sleeps)
    tracker.roll(4)
    injector.begin_wave(4)

    class G:
        def __init__(self, name):
            self.unique_name = name

    g = G("tp")
    tracker.run("all_reduce", lambda self: None, g, (), {}, lambda *a: (0, None))
    assert sleeps.calls == []
    tracker.run("all_gather", lambda self: None, g, (), {}, lambda *a: (0, None))
    tracker.run("all_gather", lambda self: None, g, (), {}, lambda *a: (0, None))
    assert sleeps.calls == [0.1]
    tracker.roll(5)
    assert tracker.finished[-1].injected_delay_ns > 0


def test_inside_collective_blocks_after_entry_while_the_call_is_reported_as_current():
    """The point a stuck transport hangs at: the call is entered (numbered, current, what
    heartbeats and the liveness record report), then the rank stays in it."""
    tracker = CollectiveTracker(
        CollectivesConfig(), wave_source=lambda: 4,
        describe_group=lambda g: GroupMeta(g.unique_name, "shm", 1, 2),
    )  # fmt: skip
    seen = []
    config = FaultInjectionConfig(
        enabled=True, tp_rank=-1, at_wave=4, delay_ms=250, where="inside_collective"
    )
    injector = FaultInjector(
        config, tracker, lambda: (0, 0, 0), sleep=lambda s: seen.append((s, tracker.current))
    )
    tracker.roll(4)
    injector.begin_wave(4)

    class G:
        unique_name = "tp"

    g = G()
    tracker.run("all_gather", lambda self: None, g, (), {}, lambda *a: (0, None))
    assert seen == []
    tracker.run("all_reduce", lambda self: None, g, (), {}, lambda *a: (0, None))
    tracker.run("all_reduce", lambda self: None, g, (), {}, lambda *a: (0, None))
    assert len(seen) == 1 and seen[0][0] == 0.25
    op, group, _, seq, _ = seen[0][1]
    assert (op, group, seq) == ("all_reduce", "tp", 2)


def test_guard_logs_a_loud_warning_when_the_drill_is_on(capsys):
    CollectiveGuard(
        CollectivesConfig(watchdog=False), FaultInjectionConfig(enabled=True),
        wave_source=lambda: 0, rank_source=lambda: (0, 0, 0),
    )  # fmt: skip
    out = capsys.readouterr()
    assert "FAULT_INJECTION_ENABLED" in out.out + out.err


def test_collective_guard_errors_reach_the_exported_error_count():
    from telemetry.wire.proto import guard_pb2

    guard = CollectiveGuard(
        CollectivesConfig(watchdog=False), FaultInjectionConfig(),
        wave_source=lambda: 1 / 0, rank_source=lambda: (0, 0, 0),
    )  # fmt: skip

    class G:
        unique_name = "tp:0"
        world_size = 2

    assert guard.tracker.run("all_reduce", lambda g: 7, G(), (), {}, lambda *a: None) == 7
    batch = guard_pb2.Batch(guard_errors_total=2)
    guard.fill_batch(batch, with_heartbeat=False)
    assert batch.guard_errors_total == 3


class _Observers:
    """The processor's list of observers, counting how often a member said it changed."""

    def __init__(self, guard):
        from guard.wave.observers import Observers

        self.list = Observers(lambda where: None)
        self.list.add(guard)
        self.refreshes = 0
        refresh = guard.on_change

        def counted():
            self.refreshes += 1
            refresh()

        guard.on_change = counted

    def hooks(self):
        return [h.__self__ for h in self.list.begin_wave_hooks + self.list.end_wave_hooks]


def _sized_guard(size, drill=False):
    def world_size():
        if size is None:
            raise RuntimeError("no groups")
        return size

    return CollectiveGuard(
        CollectivesConfig(watchdog=True, watchdog_interval_ms=5), FaultInjectionConfig(enabled=drill),
        wave_source=lambda: 1, rank_source=lambda: (0, 0, 0), world_size=world_size,
    )  # fmt: skip


def test_a_worker_whose_groups_span_one_rank_drops_its_wave_hooks_and_starts_no_watchdog():
    """TP=PP=DP=1: vLLM short-cuts every collective, so at the first wave the guard takes its
    two wave hooks off the engine thread and starts no watchdog thread."""
    guard = _sized_guard(1)
    observers = _Observers(guard)
    assert observers.hooks() == [guard, guard]
    guard.begin_wave(1)
    assert observers.refreshes == 1 and observers.hooks() == []
    assert guard.watchdog is not None and not guard.watchdog.started
    assert guard.tracker.wave == 0  # the wave it opened is closed


def test_a_worker_that_can_communicate_or_runs_a_drill_keeps_its_wave_hooks():
    for size, drill in ((2, False), (None, False), (0, False), (1, True)):
        guard = _sized_guard(size, drill)
        observers = _Observers(guard)
        guard.begin_wave(1)
        guard.end_wave(1)
        assert observers.hooks() == [guard, guard], (size, drill)
        assert guard.watchdog.started == (size != 1), (size, drill)
        guard.close()
