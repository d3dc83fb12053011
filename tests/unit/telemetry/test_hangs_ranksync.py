"""Sidecar-side judgement on hand-made batches with a controlled clock: hang verdicts,
recovery, no verdict in warm-up or on short waits; wave skew and straggler attribution."""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry

from telemetry.crossrank.hangs import HangDetector, HangSettings
from telemetry.crossrank.ranksync import RankSync
from telemetry.metrics.collectives import CollectiveMetrics
from telemetry.wire.proto import guard_pb2


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def batch(
    tp, *, wave=5, op="", seq=0, age_s=0.0, phase="execute_model", pid=None, tp_size=2, lag_s=0.0
):
    b = guard_pb2.Batch(
        rank=guard_pb2.RankInfo(
            run_id="r1",
            engine="e",
            tp_rank=tp,
            tp_size=tp_size,
            dp_size=1,
            pp_size=1,
            pid=pid or 1000 + tp,
            node="n",
        )  # fmt: skip
    )
    hb = b.heartbeat
    hb.time_unix_nano, hb.last_wave, hb.phase = time.time_ns() - int(lag_s * 1e9), wave, phase
    if op:
        hb.collective_op, hb.collective_group, hb.collective_seq = op, "tp", seq
        hb.collective_age_ns = int(age_s * 1e9)
    return b


@pytest.fixture
def det():
    clock = Clock()
    incidents = []
    d = HangDetector(
        CollectiveMetrics(CollectorRegistry()), HangSettings(stale_s=2.0, wait_s=3.0),
        incident_sink=lambda engine, rank, inc: incidents.append((engine, rank, inc)),
        clock=clock,
    )  # fmt: skip
    d.clock, d.incidents = clock, incidents
    return d


def beat(det, *batches, dt=0.5):
    det.clock.t += dt
    for b in batches:
        det.observe("e", b)
    return det.check()


def test_silent_rank_is_named_with_the_op_its_peer_waits_in_and_recovery_follows(det):
    for _ in range(4):
        assert beat(det, batch(0), batch(1)) == []
    # rank 1 freezes; rank 0 enters all_reduce seq 40 and waits there
    events = []
    for i in range(1, 6):
        events += beat(det, batch(0, op="all_reduce", seq=40, age_s=0.5 * i))
    assert len(events) == 1
    verdict = events[0]
    assert verdict["event"] == "hang_verdict" and verdict["kind"] == "no_heartbeat"
    assert [r["tp"] for r in verdict["stopped"]] == [1]
    assert verdict["stopped"][0]["pid"] == 1001
    assert (verdict["op"], verdict["group"], verdict["seq"]) == ("all_reduce", "tp", 40)
    assert [r["tp"] for r in verdict["waiting"]] == [0]
    assert 2.0 < verdict["detect_s"] <= 2.6
    live, body = det.engine_status("e")
    assert not live and body["verdicts"][0]["kind"] == "no_heartbeat"
    assert det.metrics.wedged.labels("e", "0")._value.get() == 1
    # rank 1 resumes; rank 0's heartbeat still says it waits (it is a moment old), rank 1's
    # first one comes from before the collective: that is not a new hang
    events = beat(det, batch(0, op="all_reduce", seq=40, age_s=3.6), batch(1), dt=0.1)
    assert [e["event"] for e in events] == ["hang_recovered"]
    assert beat(det, batch(0, op="all_reduce", seq=40, age_s=3.7), batch(1), dt=0.1) == []
    assert beat(det, batch(0, wave=6), batch(1, wave=6)) == []
    assert events[0]["stall_s"] >= 2.5
    assert det.engine_status("e")[0] is True
    assert det.metrics.wedged.labels("e", "0")._value.get() == 0
    kinds = [inc.type for _, _, inc in det.incidents]
    assert kinds == ["hang_verdict", "hang_recovered"]
    assert det.incidents[0][1].tp_rank == 1 and det.incidents[0][2].severity == "critical"


def test_rank_that_never_arrives_at_the_collective_is_named(det):
    events = []
    for i in range(1, 10):
        events += beat(det, batch(0, op="all_reduce", seq=9, age_s=0.5 * i),
                       batch(1, phase="execute_model"))  # fmt: skip
    assert len(events) == 1 and events[0]["kind"] == "not_arrived"
    assert [r["tp"] for r in events[0]["stopped"]] == [1]
    assert events[0]["seq"] == 9


def test_no_verdict_during_warm_up_or_for_short_waits(det):
    events = []
    for i in range(1, 12):  # wave 1: rank 0 waits 5 s for its peer's warm-up
        events += beat(det, batch(0, wave=1, op="all_reduce", seq=1, age_s=0.5 * i),
                       batch(1, wave=1))  # fmt: skip
    for _ in range(20):  # serving: waits well under wait_s
        events += beat(det, batch(0, op="all_reduce", seq=7, age_s=0.3), batch(1))
    assert events == []


def test_heartbeat_interval_stretches_the_silence_threshold(det):
    for _ in range(4):
        assert beat(det, batch(0), batch(1), dt=3.0) == []  # 3 s heartbeats: not a stall
    events = beat(det, dt=8.0)
    assert events and {r["tp"] for r in events[0]["stopped"]} == {0, 1}


def test_heartbeats_read_late_give_no_extra_silence(det):
    """No lag allowance: heartbeats that were 3 s old when read do not stretch the silence
    limit (ingest updates liveness before storage, so a late read is not the sidecar's own
    backlog any more); 2 s without rank 1 is a verdict."""
    for _ in range(4):
        assert beat(det, batch(0), batch(1, lag_s=3.0)) == []
    assert beat(det, batch(0), dt=1.5) == []
    events = beat(det, batch(0), dt=1.0)  # 2.5 s: past stale_s
    assert [e["kind"] for e in events] == ["no_heartbeat"]


def test_a_quiet_laggard_that_peers_wait_for_is_frozen(det):
    for _ in range(4):
        assert beat(det, batch(0), batch(1, lag_s=3.0)) == []
    events = []
    for i in range(1, 10):
        events += beat(det, batch(0, op="all_reduce", seq=12, age_s=0.5 * i))
    assert [e["kind"] for e in events] == ["no_heartbeat"]
    assert events[0]["stopped"][0]["tp"] == 1 and events[0]["seq"] == 12


def test_a_remote_rank_that_closed_its_stream_is_not_a_hang(det):
    beat(det, batch(0), batch(1))
    det.rank_gone("e", batch(1).rank, clean=True)
    assert beat(det, batch(0), dt=5.0) == []
    assert det.engine_status("nope") is None


def test_a_remote_rank_whose_stream_broke_is_lost_and_stays_named_until_it_moves(det):
    """No record to read (another node): its stream is all there is. Its end is no recovery;
    the rank stays, `lost`, in its last state, and its peer waiting for it does not clear it."""
    for _ in range(4):
        beat(det, batch(0), batch(1))
    events = beat(det, batch(0, op="all_reduce", seq=12, age_s=0.1), dt=2.5)
    assert [e["kind"] for e in events] == ["no_heartbeat"]
    det.rank_gone("e", batch(1).rank)  # the stream breaks while the verdict stands
    for i in range(30):
        assert beat(det, batch(0, op="all_reduce", seq=12, age_s=3.0 + i), dt=1.0) == []
    _, body = det.engine_status("e")
    lost = next(r for r in body["ranks"] if r["tp"] == 1)
    assert (lost["where"], lost["stream"]) == ("remote", "lost") and not body["live"]
    assert det.snapshot()["without_stream"][0]["stream"] == "lost"
    # it reconnects and moves: a heartbeat made after the verdict, a new wave
    events = beat(det, batch(0, wave=6), batch(1, wave=6))
    assert [e["event"] for e in events] == ["hang_recovered"]


def test_a_remote_rank_lost_past_the_linger_closes_the_verdict_without_a_recovery():
    clock = Clock()
    det = HangDetector(
        CollectiveMetrics(CollectorRegistry()), HangSettings(lost_linger_s=10.0), clock=clock
    )
    det.clock = clock
    for _ in range(4):
        beat(det, batch(0), batch(1))
    assert [e["event"] for e in beat(det, batch(0), dt=2.5)] == ["hang_verdict"]
    det.rank_gone("e", batch(1).rank)
    events = []
    for _ in range(12):
        events += beat(det, batch(0), dt=1.0)
    assert [e["event"] for e in events] == ["hang_closed"]
    assert det.metrics.hang_recoveries.labels("e", "0")._value.get() == 0
    assert det.metrics.wedged.labels("e", "0")._value.get() == 0


def cw(tp, wave, wait_ms, arrival_ms, injected_ms=0.0):
    b = batch(tp)
    b.ClearField("heartbeat")
    w = b.collective_waves.add(wave=wave, wait_ns=int(wait_ms * 1e6),
                               first_arrival_unix_nano=int(1e18 + arrival_ms * 1e6),
                               injected_delay_ns=int(injected_ms * 1e6))  # fmt: skip
    w.stats.add(op="all_reduce", group="tp", backend="shm", calls=5, bytes=2560,
                host_ns=int(wait_ms * 1e6), max_host_ns=1, first_seq=wave * 6 - 5,
                last_seq=wave * 6)  # fmt: skip
    return b


def test_skew_and_straggler_come_from_aligned_waves():
    registry = CollectorRegistry()
    sync = RankSync(CollectiveMetrics(registry), straggler_threshold_s=0.05)
    assert sync.observe("e", cw(0, 1, 2.0, 0.0)) == []  # rank 1 not in yet
    done = sync.observe("e", cw(1, 1, 2.5, 0.2))
    assert len(done) == 1 and done[0].straggler_tp is None
    sync.observe("e", cw(0, 2, 302.0, 0.0))
    done = sync.observe("e", cw(1, 2, 1.5, 300.0, injected_ms=300.0))
    skew = done[0]
    assert skew.straggler_tp == 1
    assert skew.skew_s == pytest.approx(0.3005)
    assert skew.arrival_skew_s == pytest.approx(0.3)
    assert skew.injected_s == {1: pytest.approx(0.3)}
    get = registry.get_sample_value
    assert get("ascend_guard_straggler_waves_total",
               {"engine": "e", "dp": "0", "tp": "1", "pp": "0"}) == 1  # fmt: skip
    assert get("ascend_guard_wave_skew_seconds_count", {"engine": "e", "dp": "0", "pp": "0"}) == 2
    labels = {"engine": "e", "dp": "0", "tp": "0", "pp": "0", "op": "all_reduce", "group": "tp",
              "backend": "shm"}  # fmt: skip
    assert get("ascend_guard_collective_calls_total", labels) == 10
    assert get("ascend_guard_collective_bytes_total", labels) == 5120
    assert get("ascend_guard_collective_last_seq",
               {"engine": "e", "dp": "0", "tp": "0", "pp": "0", "group": "tp"}) == 12  # fmt: skip


def test_wire_label_values_are_bounded():
    registry = CollectorRegistry()
    sync = RankSync(CollectiveMetrics(registry))
    for i in range(100):
        b = cw(0, 1, 1.0, 0.0)
        b.collective_waves[0].stats[0].op = f"op{i}"
        sync.observe("e", b)
    bad = cw(0, 1, 1.0, 0.0)
    bad.collective_waves[0].stats[0].op = 'x"} 1\nevil'
    sync.observe("e", bad)
    ops = {
        s.labels["op"]
        for m in registry.collect() if m.name == "ascend_guard_collective_calls"
        for s in m.samples
    }  # fmt: skip
    assert len(ops) <= 65 and "_other" in ops


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [("--hang-after", "0s", "--hang-after: must be above 0"),
     ("--hang-wait", "soon", "--hang-wait: 'soon' is not a duration")],
)  # fmt: skip
def test_sidecar_refuses_bad_hang_thresholds(flag, value, message, capsys, monkeypatch):
    from telemetry.cli.main import main
    from telemetry.wire import logs

    # logs.configure() would bind structlog to capsys's stream, closed after this test
    monkeypatch.setattr(logs, "configure", lambda **_: None)
    assert main(["sidecar", flag, value]) == 2
    assert message in capsys.readouterr().err


def test_a_late_checker_counts_its_lateness_and_judges_only_once_ingest_caught_up() -> None:
    """The sidecar itself starved: the time its checker woke late is counted (verdicts due
    meanwhile came that much later), and after a late wake-up it judges nothing, neither
    verdict nor recovery, until every open stream was read since (or stale_s passed)."""
    from telemetry.crossrank.hang_checker import Checker

    registry = CollectorRegistry()
    clock = Clock()
    det = HangDetector(CollectiveMetrics(registry), HangSettings(check_interval_s=0.1), clock=clock)
    det.observe("e", batch(0))
    det.observe("e", batch(1))
    checker = Checker(det.settings, det.metrics, det.check, det.caught_up, clock=clock)

    def late() -> float:
        return registry.get_sample_value("ascend_guard_hang_check_late_seconds_total")

    def tick(dt: float) -> bool:
        clock.t += dt
        return checker.tick()

    assert tick(0.1) and tick(0.15) and late() == 0  # on time, or jitter
    assert tick(0.3)  # late, counted, but not starved
    assert late() == pytest.approx(0.2)
    assert not tick(3.1)  # starved: both ranks look silent for 3 s, and are not judged
    assert not tick(0.1)
    det.observe("e", batch(0))  # ingest reads the backlog, one stream after the other
    assert not tick(0.1)
    det.observe("e", batch(1))
    assert tick(0.1) and det.check() == []
    assert not tick(2.0)  # a rank that truly stopped never delivers: judged after stale_s
    det.observe("e", batch(0))
    judged = [tick(0.1) for _ in range(25)]
    first = judged.index(True)  # from stale_s (2 s) after that wake-up on
    assert first in (19, 20) and all(judged[first:]), judged
