"""Wire v3 collective columns: schema agreement, the worker's builder, v2 conversion, validation,
and the per-batch (numpy) consumers checked against plain per-message arithmetic."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry

from guard.collectives.columns import add_waves
from guard.collectives.records import FinishedWave
from telemetry.crossrank.ranksync import RankSync
from telemetry.ingest.validation import validate_batch
from telemetry.metrics.collectives import CollectiveMetrics
from telemetry.pipeline.writer import Item, RankSource
from telemetry.store import Store, collective_waves, connect, ranks
from telemetry.wire import schema
from telemetry.wire.collective_columns import (
    columns_of,
    from_waves,
    to_waves,
    wave_records,
    wave_rows,
)
from telemetry.wire.proto import guard_pb2
from telemetry.wire.schema import InvalidBatch


def _fields(message) -> dict[str, int]:
    return {f.name: f.number for f in message.DESCRIPTOR.fields}


def test_columns_have_the_names_and_numbers_of_the_messages():
    wave = _fields(guard_pb2.CollectiveWave)
    cols = _fields(guard_pb2.CollectiveColumns)
    for name in schema.COLLECTIVE_WAVE_COLUMNS + ("stats", "slow_calls"):
        assert cols[name] == wave[name], name
    stat = _fields(guard_pb2.CollectiveStat)
    stat_cols = _fields(guard_pb2.CollectiveStatColumns)
    for name in schema.COLLECTIVE_STAT_COLUMNS:
        assert stat_cols[name] == stat[name], name
    assert _fields(guard_pb2.CollectiveKey) == {n: stat[n] for n in schema.COLLECTIVE_KEY_FIELDS}
    # every numeric field of a stat is a column; every string one is in the key
    assert set(schema.COLLECTIVE_STAT_COLUMNS) | set(schema.COLLECTIVE_KEY_FIELDS) == set(stat)


def _random_waves(rng: random.Random, count: int) -> list[guard_pb2.CollectiveWave]:
    out = []
    for n in range(1, count + 1):
        cw = guard_pb2.CollectiveWave(
            wave=n,
            first_arrival_unix_nano=rng.randrange(1, 2**62) if rng.random() < 0.9 else 0,
            wait_ns=rng.randrange(0, 10**9),
            slow_calls_dropped=rng.randrange(0, 3),
            injected_delay_ns=rng.choice((0, 0, 5_000_000)),
            replay_device_ns=rng.randrange(0, 10**6),
        )
        for op in rng.sample(("all_reduce", "all_gather", "broadcast"), rng.randrange(0, 4)):
            cw.stats.add(
                op=op, group=rng.choice(("tp", "pp")), backend="hccl",
                dtype=rng.choice(("bfloat16", "float32")), calls=rng.randrange(1, 9),
                bytes=rng.randrange(0, 2**40), host_ns=rng.randrange(0, 10**8),
                max_host_ns=rng.randrange(0, 10**8), first_seq=rng.randrange(1, 2**40),
                last_seq=rng.randrange(1, 2**40), device_ns=rng.randrange(0, 10**6),
                replayed=rng.randrange(0, 3),
            )  # fmt: skip
        for _ in range(rng.choice((0, 0, 0, 2))):
            cw.slow_calls.add(op="all_reduce", group="tp", backend="hccl", seq=rng.randrange(1, 99),
                              bytes=8, start_unix_nano=5, host_ns=rng.randrange(0, 10**9))  # fmt: skip
        out.append(cw)
    return out


def test_v2_messages_survive_the_trip_through_columns():
    waves = _random_waves(random.Random(7), 200)
    cols = from_waves(waves, guard_pb2.CollectiveColumns())
    assert len(cols.keys) <= 3 * 2 * 2  # each distinct key once
    assert to_waves(cols) == waves
    assert to_waves(cols, {5, 6}) == waves[4:6]
    batch = guard_pb2.Batch()
    batch.collective_waves.extend(waves)
    assert columns_of(batch) == cols and not batch.collective_waves  # moved, in place
    assert columns_of(batch) == cols  # a second call finds them there


def test_wave_records_hold_what_the_messages_hold():
    waves = _random_waves(random.Random(11), 120)
    cols = from_waves(waves, guard_pb2.CollectiveColumns())
    rows_of = wave_rows(cols)
    for cw in waves:
        (record,) = wave_records(cols, cw.wave, rows_of)
        for name in schema.COLLECTIVE_WAVE_COLUMNS:
            assert getattr(record, name) == getattr(cw, name), name
        assert len(record.stats) == len(cw.stats) and list(record.slow_calls) == list(cw.slow_calls)
        for stat, message in zip(record.stats, cw.stats, strict=True):
            assert stat._asdict() == {f: getattr(message, f) for f in schema.COLLECTIVE_STAT_FIELDS}
    assert wave_records(cols, 10**6, rows_of) == []
    assert any(cw.slow_calls for cw in waves) and any(len(cw.stats) > 1 for cw in waves)


def test_the_workers_builder_writes_what_the_v2_messages_said():
    stats = {
        ("all_reduce", "tp"): [2, 16384, 7000, 4000, 3, 4, "hccl", "bfloat16", 1, 0],
        ("all_gather", "tp"): [1, 128000, 1000, 1000, 5, 5, "hccl", "bfloat16", 0, 1],
    }
    slow = [("all_reduce", "tp", "hccl", "bfloat16", 3, 8192, 99, 6000)]
    items = [
        FinishedWave(9, 123, 8000, stats, slow, 1, 50, 700),
        FinishedWave(10, 0, 0, {}, [], 0, 7),
    ]
    cols = guard_pb2.CollectiveColumns()
    add_waves(cols, items)
    first, second = to_waves(cols)
    assert (first.wave, first.first_arrival_unix_nano, first.wait_ns) == (9, 123, 8000)
    assert (first.slow_calls_dropped, first.injected_delay_ns, first.replay_device_ns) == (
        1,
        50,
        700,
    )
    assert [(s.op, s.calls, s.bytes, s.host_ns, s.max_host_ns, s.first_seq, s.last_seq, s.replayed,
             s.graph_counted)
            for s in first.stats] == [("all_reduce", 2, 16384, 7000, 4000, 3, 4, 1, 0),
                                      ("all_gather", 1, 128000, 1000, 1000, 5, 5, 0, 1)]  # fmt: skip
    assert [(c.seq, c.bytes, c.start_unix_nano, c.host_ns) for c in first.slow_calls] == [
        (3, 8192, 99, 6000)
    ]
    assert (second.wave, len(second.stats), second.injected_delay_ns) == (10, 0, 7)
    assert len(cols.keys) == 2  # (op, group, backend, dtype) once per batch
    batch = guard_pb2.Batch(rank=guard_pb2.RankInfo(run_id="r"), collective_columns=cols)
    validate_batch(batch)


def _valid_batch() -> guard_pb2.Batch:
    batch = guard_pb2.Batch(rank=guard_pb2.RankInfo(run_id="r", tp_size=2))
    from_waves(_random_waves(random.Random(3), 20), batch.collective_columns)
    return batch


@pytest.mark.parametrize(
    ("spoil", "message"),
    [
        (lambda c: c.wave.__setitem__(4, 2**63), "collective_columns.wave[4]: 9223372036854775808"),
        (lambda c: c.wave.__setitem__(0, 0), "collective_columns.wave[0]: 0 is outside"),
        (lambda c: c.wait_ns.__setitem__(3, -1), "collective_columns.wait_ns[3]: -1 is outside"),
        (lambda c: c.stats.host_ns.__setitem__(2, 10**15), "collective_columns.stats.host_ns[2]"),
        (lambda c: c.stats.key.__setitem__(1, 99), "collective_columns.stats.key[1]: 99"),
        (lambda c: c.stats.wave_index.__setitem__(0, 20), "stats.wave_index[0]: 20 is outside"),
        (lambda c: c.stats.calls.append(1), "collective_columns.stats.calls: "),
        (
            lambda c: c.injected_delay_ns.append(1),
            "collective_columns.injected_delay_ns: 21 values",
        ),
        (lambda c: c.keys[0].__setattr__("op", "o" * 5000), "collective_columns.keys[0].op: 5000"),
        (lambda c: c.slow_call_wave_index.append(0), "slow_call_wave_index: "),
    ],
)
def test_bad_columns_are_refused_naming_field_and_value(spoil, message):
    batch = _valid_batch()
    validate_batch(batch)
    spoil(batch.collective_columns)
    with pytest.raises(InvalidBatch, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate_batch(batch)


def _rank(tp: int, tp_size: int = 2) -> guard_pb2.RankInfo:
    return guard_pb2.RankInfo(run_id="r", engine="e", tp_rank=tp, tp_size=tp_size)


def _batch(tp: int, rows: list[tuple[int, int, int]], tp_size: int = 2) -> guard_pb2.Batch:
    """rows: (wave, wait_ns, first_arrival_unix_nano)"""
    batch = guard_pb2.Batch(rank=_rank(tp, tp_size))
    for wave, wait, arrival in rows:
        batch.collective_waves.add(wave=wave, wait_ns=wait, first_arrival_unix_nano=arrival)
    return batch


def test_alignment_merges_a_wave_handed_in_two_parts_and_counts_what_never_completes():
    metrics = CollectiveMetrics(CollectorRegistry())
    sync = RankSync(metrics, straggler_threshold_s=0.01, max_pending=3)
    assert sync.observe("e", _batch(0, [(1, 10_000_000, 100), (1, 5_000_000, 90)])) == []
    (done,) = sync.observe("e", _batch(1, [(1, 40_000_000, 130)]))
    # rank 0: 15 ms inside (two parts), first arrival 90; rank 1: 40 ms, arrival 130
    assert done.waits_s == {0: pytest.approx(0.015), 1: pytest.approx(0.04)}
    assert done.skew_s == pytest.approx(0.025) and done.arrival_skew_s == pytest.approx(40e-9)
    assert done.straggler_tp == 0
    # rank 0 runs ahead by 5 waves: the 2 oldest beyond max_pending are given up
    sync.observe("e", _batch(0, [(w, 1, 1) for w in range(2, 7)]))
    unaligned = metrics.waves_unaligned.labels("e", "0", "0")._value.get()
    assert unaligned == 2
    done = sync.observe("e", _batch(1, [(w, 1, 1) for w in range(2, 7)]))
    assert [d.wave for d in done] == [4, 5, 6]
    assert [s.wave for s in sync.recent] == [1, 4, 5, 6]


def test_alignment_matches_a_per_wave_reference_on_random_batches():
    rng = random.Random(11)
    tp_size = 4
    metrics = CollectiveMetrics(CollectorRegistry())
    sync = RankSync(metrics, straggler_threshold_s=0.002, keep_recent=10_000)
    waits = {(w, tp): rng.randrange(0, 5_000_000) for w in range(1, 301) for tp in range(tp_size)}
    arrivals = {key: rng.randrange(1, 10**6) for key in waits}
    next_wave = dict.fromkeys(range(tp_size), 1)
    while any(n <= 300 for n in next_wave.values()):  # ranks send batches of random sizes
        tp = rng.randrange(tp_size)
        first = next_wave[tp]
        last = min(300, first + rng.randrange(1, 40))
        if first > 300:
            continue
        rows = [(w, waits[w, tp], arrivals[w, tp]) for w in range(first, last + 1)]
        sync.observe("e", _batch(tp, rows, tp_size))
        next_wave[tp] = last + 1
    judged = {s.wave: s for s in sync.recent}
    assert sorted(judged) == list(range(1, 301))
    for w, s in judged.items():
        per_rank = [waits[w, tp] / 1e9 for tp in range(tp_size)]
        arr = [arrivals[w, tp] for tp in range(tp_size)]
        assert s.skew_s == pytest.approx(max(per_rank) - min(per_rank))
        assert s.arrival_skew_s == pytest.approx((max(arr) - min(arr)) / 1e9)
        expected = per_rank.index(min(per_rank)) if s.skew_s >= 0.002 else None
        assert s.straggler_tp == expected
    registry = metrics.skew
    (family, _arrival) = list(registry.collect())
    count = next(x.value for x in family.samples if x.name.endswith("_count"))
    assert count == 300


def test_counters_equal_plain_sums_over_the_messages():
    waves = _random_waves(random.Random(5), 300)
    metrics = CollectiveMetrics(CollectorRegistry())
    batch = guard_pb2.Batch(rank=_rank(0))
    batch.collective_waves.extend(waves)
    labels = ("e", "0", "0", "0")
    metrics.counts.add(labels, columns_of(batch))
    expected: dict[tuple, list[int]] = {}
    for cw in waves:
        for s in cw.stats:
            sums = expected.setdefault((s.op, s.group, s.backend), [0, 0, 0, 0])
            sums[0] += s.calls
            sums[1] += s.bytes
            sums[2] += s.host_ns
            sums[3] = s.max_host_ns
    got = {key[4:]: sums for key, sums in metrics.counts._ops.items()}
    assert got == expected
    seqs = {}
    for cw in waves:
        for s in cw.stats:
            seqs[s.group] = max(seqs.get(s.group, 0), s.last_seq)
    assert {key[4]: seq for key, seq in metrics.counts._seq.items()} == seqs
    slow = sum(len(cw.slow_calls) for cw in waves)
    assert sum(metrics.counts._slow.values()) == slow


def test_store_reads_v3_and_v2_blocks_back_as_waves(tmp_path):
    path = tmp_path / "store.db"
    store = Store(path)
    waves = _random_waves(random.Random(9), 50)
    rank = _rank(0)
    source = RankSource(rank, "e", ("e", "0", "0", "0"), ("r", "e", 0, 0, 0, 1))
    v3 = guard_pb2.Batch(rank=rank)
    from_waves(waves[:25], v3.collective_columns)
    v2 = guard_pb2.Batch(rank=rank)
    v2.collective_waves.extend(waves[25:])
    store.write([Item(source, v3, 0, 0), Item(source, v2, 0, 0)])
    store.close()
    conn = connect(path, readonly=True)
    (row,) = ranks(conn)
    for cw in (waves[0], waves[24], waves[25], waves[49]):
        assert collective_waves(conn, row.id, cw.wave) == [cw]
    (slow,) = conn.execute("SELECT COUNT(*) FROM slow_calls").fetchone()
    assert slow == len({(c.group, c.seq) for cw in waves for c in cw.slow_calls})
