"""The sidecar's record path in one process: ingest -> bounded queue -> writer -> store and
metrics, with no subprocess and no socket (the gRPC servicer context is the only stand-in:
`_Context.abort` raises as grpc's does). The wire schema and its derived names are checked here
too."""

from __future__ import annotations

import contextlib

import grpc
import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from guard.stream.streamer import HeartbeatState, Streamer, WaveTuple
from telemetry import store as store_mod
from telemetry.crossrank.view import CrossRankView
from telemetry.ingest.service import IngestService, _Refused
from telemetry.metrics.waves import SidecarMetrics
from telemetry.pipeline.writer import STAGE_QUEUE, BoundedQueue, Drops, Item, Writer
from telemetry.store import Store
from telemetry.wire import schema
from telemetry.wire.collective_columns import from_waves
from telemetry.wire.proto import guard_pb2
from tests.support.feed import FixedHeartbeat, wave_tuple
from tests.support.span_search import SpanQuery, search


class _Aborted(Exception):
    pass


class _Context:
    def __init__(self) -> None:
        self.code = None
        self.details = ""

    def peer(self) -> str:
        return "test"

    def is_active(self) -> bool:
        return True

    def abort(self, code, details):
        self.code, self.details = code, details
        raise _Aborted(details)


def rank(tp: int = 0, **overrides) -> guard_pb2.RankInfo:
    fields = dict(
        run_id="run-rp",
        engine="rp",
        tp_rank=tp,
        tp_size=2,
        dp_size=1,
        pp_size=1,
        node="n",
        pid=100 + tp,
    )
    fields.update(overrides)
    return guard_pb2.RankInfo(**fields)


def streamer_batches(tp: int, waves: range, per_batch: int = 64) -> list[guard_pb2.Batch]:
    """Batches as the worker's streamer makes them (wire v2: rank in the first only)."""
    s = Streamer(
        "unix:///nowhere",
        rank(tp),
        buffer_size=1024,
        batch_max=per_batch,
        flush_interval_s=1,
        heartbeat_interval_s=1,
        max_backoff_s=1,
        fillers=[FixedHeartbeat(HeartbeatState(0, "", 0))],
    )
    records = [wave_tuple(n) for n in waves]
    return [
        s._make_batch(records[i : i + per_batch], i == 0) for i in range(0, len(records), per_batch)
    ]


class Path_:
    """ingest -> queue -> writer -> (metrics, store), wired as the sidecar wires them."""

    def __init__(self, tmp_path, queue_bytes: int = 1 << 24) -> None:
        from telemetry.metrics.sink import MetricsSink

        self.metrics = SidecarMetrics(CollectorRegistry())
        self.drops = Drops(self.metrics.registry)
        self.queue = BoundedQueue(queue_bytes, self.drops, self.metrics.registry)
        self.cross = CrossRankView(self.metrics.registry)
        self.store = Store(tmp_path / "store.db")
        self.writer = Writer(
            self.queue, [MetricsSink(self.metrics, self.cross, self.drops), self.store], self.drops
        )
        self.ingest = IngestService(self.metrics, self.queue, self.drops, cross_rank=self.cross)
        self.path = tmp_path / "store.db"

    def send(self, batches: list[guard_pb2.Batch]) -> _Context:
        """One stream; returns its context (code set when the stream was refused)."""
        ctx = _Context()
        messages = [self.ingest._deserialize(b.SerializeToString()) for b in batches]
        with contextlib.suppress(_Aborted):
            self.ingest.stream(iter(messages), ctx)
        return ctx

    def flush(self) -> None:
        self.writer.write(self.queue.take(0, max_items=10**6))

    def sample(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0


def test_ingest_queue_writer_store_and_metrics(tmp_path):
    path = Path_(tmp_path)
    for tp in (0, 1):
        assert path.send(streamer_batches(tp, range(1, 201))).code is None
    assert path.ingest.received_records == 400
    path.flush()
    labels = dict(engine="rp", dp="0", pp="0")
    for tp in ("0", "1"):
        assert path.sample("ascend_guard_waves_total", tp=tp, **labels) == 200
        assert path.sample("ascend_guard_sampled_tokens_total", tp=tp, **labels) == 800
        assert path.sample("ascend_guard_last_wave", tp=tp, **labels) == 200
        # histogram from per-batch bucket counts: 2 ms execute lands in le=0.0025
        le = dict(tp=tp, phase="execute_model", **labels)
        assert path.sample("ascend_guard_step_duration_seconds_bucket", le="0.001", **le) == 0
        assert path.sample("ascend_guard_step_duration_seconds_bucket", le="0.0025", **le) == 200
        assert path.sample("ascend_guard_step_duration_seconds_count", **le) == 200
        assert path.sample("ascend_guard_step_duration_seconds_sum", **le) == pytest.approx(0.4)
    conn = store_mod.connect(path.path, readonly=True)
    assert store_mod.count_waves(conn) == 400
    spans = search(conn, SpanQuery(name="rank", limit=1000))
    assert sorted({(s.tp, s.wave) for s in spans}) == [
        (t, w) for t in (0, 1) for w in range(1, 201)
    ]


def test_a_wave_number_past_int64_is_refused_naming_it_and_spoils_nothing_else(tmp_path):
    path = Path_(tmp_path)
    good = streamer_batches(0, range(1, 65))
    bad = streamer_batches(1, range(1, 65))
    bad[0].wave_columns.wave[3] = 2**63
    ctx = path.send(bad)
    assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "wave_columns.wave[3]" in ctx.details and str(2**63) in ctx.details
    assert path.send(good).code is None
    path.flush()
    conn = store_mod.connect(path.path, readonly=True)
    assert store_mod.count_waves(conn) == 64  # the other rank's records are all stored
    assert path.sample("ascend_guard_ingest_rejected_total", reason="invalid") == 1
    assert (
        path.sample("ascend_guard_pipeline_dropped_records_total", stage="ingest", reason="invalid")
        == 64
    )


@pytest.mark.parametrize(
    ("spoil", "fragment"),
    [
        (
            lambda b: setattr(b.heartbeat, "phase", "x" * 10_000),
            "heartbeat.phase: 10000 characters",
        ),
        (lambda b: setattr(b.rank, "node", "n" * 500), "rank.node: 500 characters"),
        (
            lambda b: b.collective_waves.add(wave=1).stats.add(op="o" * 5000),
            "collective_waves[0].stats[0].op: 5000 characters",
        ),
        (
            lambda b: from_waves(
                [guard_pb2.CollectiveWave(wave=1), guard_pb2.CollectiveWave(wave=2, wait_ns=-3)],
                b.collective_columns,
            ),
            "collective_columns.wait_ns[1]: -3 is outside",
        ),
        (
            lambda b: b.wave_columns.execute_ns.__setitem__(0, -5),
            "wave_columns.execute_ns[0]: -5 is outside",
        ),
        (lambda b: b.wave_columns.sampled.append(True), "wave_columns.sampled: 65 values"),
    ],
)
def test_unstorable_values_are_refused_at_validation(tmp_path, spoil, fragment):
    path = Path_(tmp_path)
    batches = streamer_batches(0, range(1, 65))
    spoil(batches[0])
    ctx = path.send(batches)
    assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in ctx.details
    path.flush()
    assert store_mod.count_waves(store_mod.connect(path.path, readonly=True)) == 0


def test_a_bad_probe_or_incident_is_dropped_alone_and_counted(tmp_path):
    path = Path_(tmp_path)
    batches = streamer_batches(0, range(1, 65))
    first = batches[0]
    first.probes.add(name="kv_cache_bytes", labels={"k": "v" * 300})
    first.incidents.add(schema_version=1, id="bad", type="logits_finite", severity="fatal")
    first.incidents.add(schema_version=1, id="good", type="logits_finite", severity="error")
    ctx = path.send(batches)
    assert ctx.code is None  # the rest of the batch, and the stream, go on
    items = path.queue.take(0, max_items=10**6)
    assert [i.id for i in items[0].batch.incidents] == ["good"]
    assert not items[0].batch.probes
    path.writer.write(items)
    assert store_mod.count_waves(store_mod.connect(path.path, readonly=True)) == 64
    assert path.sample("ascend_guard_ingest_rejected_total", reason="invalid_probe") == 1
    assert path.sample("ascend_guard_ingest_rejected_total", reason="invalid_incident") == 1
    assert path.sample("ascend_guard_ingest_rejected_total", reason="invalid") == 0


def test_bad_utf8_is_refused_as_malformed(tmp_path):
    path = Path_(tmp_path)
    data = bytearray(guard_pb2.Batch(rank=rank(run_id="run-\u00e9")).SerializeToString())
    index = data.index("é".encode())
    data[index : index + 2] = b"\xff\xfe"  # not UTF-8, same length
    refused = path.ingest._deserialize(bytes(data))
    assert isinstance(refused, _Refused) and refused.reason == "malformed"


def test_refusals_are_all_counted_but_logged_at_a_bounded_rate(tmp_path):
    path = Path_(tmp_path)
    bad = guard_pb2.Batch(wave_columns=guard_pb2.WaveColumns(wave=[1]))  # no rank
    with capture_logs() as logs:
        for _ in range(500):
            assert path.send([bad]).code == grpc.StatusCode.INVALID_ARGUMENT
    assert path.sample("ascend_guard_ingest_rejected_total", reason="invalid") == 500
    lines = [e for e in logs if e["event"] == "ingest_refused"]
    assert 1 <= len(lines) <= 10, len(
        lines
    )  # telemetry/pipeline/ratelimit.py: 10 a minute per reason


def test_rank_is_named_once_per_stream_and_may_not_change(tmp_path):
    path = Path_(tmp_path)
    batches = streamer_batches(0, range(1, 129))
    assert batches[0].HasField("rank") and not batches[1].HasField("rank")
    assert path.send(batches).code is None
    other = streamer_batches(0, range(129, 193))
    other.append(guard_pb2.Batch(rank=rank(1)))
    ctx = path.send(other)
    assert (
        ctx.code == grpc.StatusCode.INVALID_ARGUMENT
        and "one stream carries one rank" in ctx.details
    )
    headless = streamer_batches(0, range(1, 65))
    headless[0].ClearField("rank")
    assert "first batch of a stream" in path.send(headless).details


def test_a_v1_batch_of_wave_messages_is_still_accepted(tmp_path):
    path = Path_(tmp_path)
    v1 = guard_pb2.Batch(rank=rank())
    for n in (1, 2, 3):
        v1.waves.add(**wave_tuple(n)._asdict())
    assert path.send([v1]).code is None
    path.flush()
    assert path.sample("ascend_guard_waves_total", engine="rp", dp="0", tp="0", pp="0") == 3
    bad = guard_pb2.Batch(rank=rank())
    bad.waves.add(**wave_tuple(0)._asdict())
    assert "waves[0].wave: must be 1 or more" in path.send([bad]).details


def test_a_full_queue_drops_and_counts_and_stays_bounded(tmp_path):
    batches = streamer_batches(0, range(1, 64 * 50 + 1))
    one = batches[1].ByteSize()
    path = Path_(tmp_path, queue_bytes=one * 10)
    assert path.send(batches).code is None
    assert path.queue.peak_bytes <= one * 11  # bounded (the first batch holds the rank)
    dropped = path.drops.total(STAGE_QUEUE)
    path.flush()
    stored = store_mod.count_waves(store_mod.connect(path.path, readonly=True))
    assert dropped > 0 and stored + dropped == 64 * 50
    assert (
        path.sample(
            "ascend_guard_pipeline_dropped_records_total", stage="sidecar_queue", reason="full"
        )
        == dropped
    )


def test_a_failing_sink_loses_only_its_write_counted(tmp_path):
    class Broken:
        stage = "store"

        def write(self, items):
            raise OSError("disk gone")

        def close(self):
            pass

    registry = CollectorRegistry()
    drops = Drops(registry)
    seen = []

    class Counting:
        stage = "metrics"

        def write(self, items):
            seen.extend(items)

        def close(self):
            pass

    queue = BoundedQueue(1 << 20, drops, registry)
    writer = Writer(queue, [Broken(), Counting()], drops)
    batch = streamer_batches(0, range(1, 11))[0]
    writer.write([Item(None, batch, batch.ByteSize(), 10)])
    assert len(seen) == 1
    assert drops.totals[("store", "OSError")] == 10


def test_a_batch_written_twice_is_stored_once(tmp_path):
    path = Path_(tmp_path)
    batches = streamer_batches(0, range(1, 65))
    path.send(batches)
    path.send(batches)
    path.flush()
    assert store_mod.count_waves(store_mod.connect(path.path, readonly=True)) == 64
    assert (path.store.stored_waves, path.store.ignored_waves) == (64, 64)


# -- one schema -------------------------------------------------------------------------------


def test_wave_columns_mirror_the_wave_record():
    record = {f.name: (f.number, f.type) for f in guard_pb2.WaveRecord.DESCRIPTOR.fields}
    columns = {f.name: (f.number, f.type) for f in guard_pb2.WaveColumns.DESCRIPTOR.fields}
    assert columns == record
    assert all(f.is_repeated for f in guard_pb2.WaveColumns.DESCRIPTOR.fields)
    assert WaveTuple._fields == schema.WAVE_FIELDS
    assert set(schema.WAVE_RANGES) == set(record)
    assert schema.WAVE_RANGES["wave"] == (1, 2**63 - 1)


# -- the OTLP exporter's own accounting -------------------------------------------------------


def _items(tp: int, waves: range) -> list[Item]:
    from telemetry.ingest.service import RankView

    view = RankView(rank(tp), "rp")
    out = []
    for batch in streamer_batches(tp, waves):
        batch.rank.CopyFrom(view.rank)
        out.append(Item(view.source, batch, batch.ByteSize(), len(batch.wave_columns.wave)))
    return out


def test_otlp_export_counts_a_full_queue_and_a_failed_receiver():
    from telemetry.export.otlp import ExportSettings, OtlpExporter
    from tests.support.ports import free_port

    registry = CollectorRegistry()
    drops = Drops(registry)
    items = _items(0, range(1, 257))  # 4 batches of 64
    settings = ExportSettings(
        f"http://127.0.0.1:{free_port()}",  # nobody listens
        keep_one_in=1,
        max_queue_bytes=sum(item.nbytes for item in items[:3]),
        timeout_s=0.5,
    )
    exporter = OtlpExporter(settings, drops, registry, "node")
    exporter.write(items)
    assert drops.totals[("otlp_export", "queue_full")] == 64  # the 4th batch did not fit
    assert exporter.export_due(float("inf")) == 0
    assert drops.totals[("otlp_export", "export_failed")] == 192  # the 3 queued, all lost
    assert (
        registry.get_sample_value("ascend_guard_otlp_records_total", {"decision": "exported"})
        == 192
    )
    exporter.close()


def test_tail_sampling_is_the_same_for_every_rank_and_about_one_in_n():
    from telemetry.export.otlp import sampled

    kept = [w for w in range(1, 100_001) if sampled(w, 100)]
    assert 800 <= len(kept) <= 1200
    assert all(sampled(w, 1) for w in range(1, 100))
