"""Per-rank gauges for the cross-node rules (telemetry/crossrank/rank_gauges.py), read from a real hang
detector fed hand-made batches on a controlled clock and scraped through prometheus-client's
own exposition; and what a sidecar that sees part of a replica says about the rest."""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from telemetry.crossrank import rank_gauges
from telemetry.crossrank.hangs import HangDetector, HangSettings
from telemetry.crossrank.peers import unseen_ranks
from telemetry.crossrank.rank_gauges import RankGauges
from telemetry.metrics.collectives import CollectiveMetrics
from telemetry.wire.collective_columns import columns_of
from telemetry.wire.proto import guard_pb2


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def batch(tp, *, tp_size=2, pp=0, pp_size=1, op="", seq=0, age_s=0.0, run_id="r 1", done=0):
    b = guard_pb2.Batch(
        rank=guard_pb2.RankInfo(
            run_id=run_id,
            engine="moe",
            tp_rank=tp,
            pp_rank=pp,
            tp_size=tp_size,
            dp_size=1,
            pp_size=pp_size,
            pid=1000 + tp,
            node=f"node/{tp}",
        )  # fmt: skip
    )
    hb = b.heartbeat
    hb.time_unix_nano, hb.last_wave, hb.phase = time.time_ns(), 5, "execute_model"
    if op:
        hb.collective_op, hb.collective_group, hb.collective_seq = op, "tp", seq
        hb.collective_age_ns = int(age_s * 1e9)
    if done:
        cw = b.collective_waves.add(wave=4, wait_ns=250_000_000)
        cw.stats.add(op="all_reduce", group="tp", calls=done, first_seq=1, last_seq=done)
    return b


@pytest.fixture
def det():
    clock = Clock()
    d = HangDetector(
        CollectiveMetrics(CollectorRegistry()), HangSettings(stale_s=2.0, wait_s=3.0), clock=clock
    )
    d.clock = clock
    return d


def scrape(gauges: RankGauges) -> dict[str, list]:
    registry = CollectorRegistry()
    registry.register(gauges)
    text = generate_latest(registry).decode()
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def test_gauges_say_when_each_rank_was_seen_and_where_it_waits(det):
    gauges = RankGauges(det.rank_facts)
    det.observe("moe", batch(0, op="all_reduce", seq=31, age_s=1.5, done=30))
    first = time.time()
    det.clock.t += 2.0  # tp1 speaks 2 s later
    det.observe("moe", batch(1, done=30))
    gauges.count("moe", batch(1, done=30))
    gauges.count("moe", batch(1, done=30))
    got = scrape(gauges)
    seen = {s[0]["tp"]: s[1] for s in got["ascend_guard_rank_last_seen_timestamp_seconds"]}
    # tp0 was last seen 2 s before tp1 (the detector's clock, turned into wall time)
    assert seen["1"] - seen["0"] == pytest.approx(2.0, abs=0.01)
    assert abs(seen["0"] - (first - 2.0)) < 0.5
    labels = got["ascend_guard_rank_last_seen_timestamp_seconds"][0][0]
    # wire text is cut to the label alphabet the same way on every node
    assert labels == {
        "run_id": "r_1", "engine": "moe", "dp": "0", "tp": "0", "pp": "0", "node": "node_0",
        "pid": "1000",
    }  # fmt: skip
    (seq,) = got["ascend_guard_rank_collective_seq"]
    assert (seq[0]["tp"], seq[0]["group"], seq[0]["comm"], seq[1]) == ("0", "tp", "pp0", 31)
    (since,) = got["ascend_guard_rank_collective_since_timestamp_seconds"]
    # entered 1.5 s before its heartbeat, which came 2 s before now
    assert since[1] == pytest.approx(seen["0"] - 1.5, abs=0.01)
    reached = {s[0]["tp"]: s[1] for s in got["ascend_guard_rank_collective_seq_reached"]}
    assert reached == {"0": 31, "1": 30}  # tp0 entered 31; tp1 completed 30
    waits = {s[0]["tp"]: s[1] for s in got["ascend_guard_rank_collective_wait_seconds_total"]}
    assert waits == {"1": 0.5}
    waves = {s[0]["tp"]: s[1] for s in got["ascend_guard_rank_collective_waves_total"]}
    assert waves == {"1": 2}
    assert got["ascend_guard_rank_gauges_omitted"] == [({}, 0)]


def test_wait_sums_count_column_batches_as_the_writer_hands_them(det):
    """The writer's sinks see a batch after others read its collectives: a v2 batch's
    messages were already moved into columns (collective_columns.columns_of), and a v3 batch
    never had messages. Both count (before, only the messages did, so the live sidecar showed no
    wait per wave)."""
    gauges = RankGauges(det.rank_facts)
    det.observe("moe", batch(0, done=30))
    v2 = batch(0, done=30)
    columns_of(v2)  # as CrossRank.count does first, in the same sink
    assert not v2.collective_waves and len(v2.collective_columns.wave) == 1
    gauges.count("moe", v2)
    v3 = guard_pb2.Batch(rank=batch(0).rank)
    v3.collective_columns.wave.extend([5, 6])
    v3.collective_columns.wait_ns.extend([100_000_000, 150_000_000])
    gauges.count("moe", v3)
    got = scrape(gauges)
    assert [s[1] for s in got["ascend_guard_rank_collective_wait_seconds_total"]] == [0.5]
    assert [s[1] for s in got["ascend_guard_rank_collective_waves_total"]] == [3]


def test_a_rank_whose_worker_closed_its_stream_leaves_the_gauges(det):
    gauges = RankGauges(det.rank_facts)
    for tp in (0, 1):
        det.observe("moe", batch(tp, done=3))
        gauges.count("moe", batch(tp, done=3))
    det.rank_gone("moe", batch(1).rank, clean=True)  # a remote rank's goodbye
    got = scrape(gauges)
    assert [s[0]["tp"] for s in got["ascend_guard_rank_last_seen_timestamp_seconds"]] == ["0"]
    assert [s[0]["tp"] for s in got["ascend_guard_rank_collective_waves_total"]] == ["0"]


def test_rank_and_group_counts_are_bounded(det, monkeypatch):
    monkeypatch.setattr(rank_gauges, "MAX_RANKS", 3)
    monkeypatch.setattr(rank_gauges, "MAX_GROUPS", 2)
    for tp in range(5):
        b = batch(tp, tp_size=5)
        cw = b.collective_waves.add(wave=4)
        for group in ("a", "b", "c"):
            cw.stats.add(op="x", group=group, calls=1, first_seq=1, last_seq=1)
        det.observe("moe", b)
    got = scrape(RankGauges(det.rank_facts))
    assert len(got["ascend_guard_rank_last_seen_timestamp_seconds"]) == 3
    assert len(got["ascend_guard_rank_collective_seq_reached"]) == 3 * 2
    # 2 ranks over MAX_RANKS, and 3 ranks with a group over MAX_GROUPS
    assert got["ascend_guard_rank_gauges_omitted"] == [({}, 5)]


def test_unseen_ranks_of_a_replica():
    def rank(tp, pp=0):
        return guard_pb2.RankInfo(tp_rank=tp, pp_rank=pp, tp_size=2, pp_size=2)

    assert unseen_ranks([rank(0), rank(1, 1)]) == [(1, 0), (0, 1)]
    assert unseen_ranks([rank(tp, pp) for tp in (0, 1) for pp in (0, 1)]) == []
    huge = guard_pb2.RankInfo(tp_size=65_535, pp_size=65_535)
    assert len(unseen_ranks([huge])) == 64  # never enumerated whole


def test_a_partial_view_names_the_ranks_it_does_not_see_and_judges_nothing(det):
    """tp0 and tp1 of a TP=4 group stream here, tp2 and tp3 to another node's sidecar; both
    local ranks wait in the same all_reduce. They have all arrived as far as this sidecar can
    tell, but the ranks on the other node may not have: no collective_stuck verdict."""
    for _ in range(10):
        det.clock.t += 0.5
        for tp in (0, 1):
            det.observe(
                "moe", batch(tp, tp_size=4, op="all_reduce", seq=31, age_s=det.clock.t - 100)
            )
    assert det.check() == []
    live, body = det.engine_status("moe")
    assert live and body["verdicts"] == []
    (replica,) = body["replicas"]
    assert [(r["tp"], r["note"]) for r in replica["not_seen"]] == [
        (2, "not seen by this sidecar"), (3, "not seen by this sidecar"),
    ]  # fmt: skip
    assert det.snapshot()["partial"][0]["not_seen"] == replica["not_seen"]


def test_a_whole_replica_here_still_gets_its_collective_stuck_verdict(det):
    for _ in range(10):
        det.clock.t += 0.5
        for tp in (0, 1):
            det.observe("moe", batch(tp, op="all_reduce", seq=31, age_s=det.clock.t - 100))
    (event,) = det.check()
    assert event["kind"] == "collective_stuck"
    live, body = det.engine_status("moe")
    assert not live and "not_seen" not in body["replicas"][0]
    assert det.snapshot()["partial"] == []
