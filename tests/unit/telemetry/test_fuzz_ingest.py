"""Fuzzing the sidecar's ingest with hypothesis, in process, through the real pipeline a
running sidecar uses (`Sidecar(...)`: validation, metrics, cross-rank view, hang detector,
span store, incident ledger), bounded in time so it runs in `make test`.

Inputs: valid protobuf `Batch` messages with hostile values (integers at and past 2^63, NaN and
infinities, giant and non-ASCII strings, empty rank info, 100,000 records), and raw bytes.
Goals: every input is answered (accepted, or refused with INVALID_ARGUMENT /
RESOURCE_EXHAUSTED) and nothing else raises; the span store loses no batch to an exception;
every label value that comes from the wire stays bounded; refusal logs are rate-limited.
The longer run is `tools/fuzz_sidecar.py` (100,000 inputs against a sidecar process).
"""

from __future__ import annotations

import logging
import math

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from telemetry.ingest import service as ingest_service
from telemetry.sidecar.app import Sidecar, SidecarSettings
from telemetry.wire.probes import PROBE_METRICS
from telemetry.wire.proto import guard_pb2

U32, U64, I64 = 2**32 - 1, 2**64 - 1, 2**63 - 1
ANSWERS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, details)
        self.code, self.details = code, details


class Context:
    """The two things IngestService asks of a gRPC context."""

    def abort(self, code, details):
        raise Aborted(code, details)

    def peer(self) -> str:
        return "fuzz"

    def is_active(self) -> bool:
        return True


class Errors(logging.Handler):
    """Error logs of the span pipeline (the exporter thread logs what it loses, and goes on)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module", autouse=True)
def worker_closes_every_stream():
    """In process, every stream ends because its iterator does, as a worker's close: the
    0.2 s the service waits to tell that from a dropped connection (a real gRPC context turns
    inactive in that moment; this one never does) would be most of this file's time."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ingest_service, "_closed_by_worker", lambda context, settle_s=0.2: True)
        yield


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    errors = Errors()
    logging.getLogger("opentelemetry").addHandler(errors)
    side = Sidecar(SidecarSettings(listen=f"unix://{root / 's.sock'}", store=str(root / "s.db")))
    side.span_errors = errors.records
    side.writer.start()  # the record path's writer: metrics, store (no gRPC server needed)
    yield side
    logging.getLogger("opentelemetry").removeHandler(errors)
    side.writer.stop()
    side.incidents.close()


def answer(sidecar: Sidecar, data: bytes) -> guard_pb2.Ack | Aborted:
    """What the sidecar answers a stream carrying these bytes."""
    ingest = sidecar.ingest
    try:
        return ingest.stream(iter([ingest._deserialize(data)]), Context())
    except Aborted as exc:
        return exc


texts = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=st.characters(codec="utf-8"), min_size=100, max_size=300),
    st.sampled_from(["", "tp", "all_reduce", "\x00", "a" * 129, "é" * 64, "x" * 200_000]),
)
short = st.text(max_size=40)  # fits every length limit: lets the values next to it be used
u32 = st.one_of(st.integers(0, 8), st.integers(0, U32))
u64 = st.one_of(st.integers(0, 100), st.sampled_from([I64, I64 + 1, U64]), st.integers(0, U64))
i64 = st.one_of(
    st.integers(-5, 10**9), st.sampled_from([-(2**63), I64]), st.integers(-(2**63), I64)
)
doubles = st.floats(allow_nan=True, allow_infinity=True)


@st.composite
def ranks(draw) -> guard_pb2.RankInfo:
    shape = draw(st.integers(0, 9))
    if shape == 0:
        return guard_pb2.RankInfo()  # empty rank info
    if shape < 6:  # a plausible rank, so that the hostile values behind it get used
        return guard_pb2.RankInfo(
            run_id=draw(st.text(min_size=1, max_size=20)),
            engine=draw(short),
            node=draw(short),
            tp_rank=draw(st.integers(0, 1)),
            tp_size=2,
            dp_size=1,
            pp_size=1,
            pid=draw(u32),
        )
    return guard_pb2.RankInfo(
        run_id=draw(texts),
        engine=draw(texts),
        node=draw(texts),
        runner=draw(texts),
        dp_rank=draw(u32),
        tp_rank=draw(u32),
        pp_rank=draw(u32),
        dp_size=draw(u32),
        tp_size=draw(u32),
        pp_size=draw(u32),
        pid=draw(u32),
    )


@st.composite
def batches(draw) -> guard_pb2.Batch:
    batch = guard_pb2.Batch(
        rank=draw(ranks()), dropped_total=draw(u64), guard_errors_total=draw(u64), seq=draw(u64)
    )
    # plausible: times, durations and shapes valid, so the hostile numbers and strings next to
    # them get past validation and into metrics, spans and the store
    plausible = draw(st.booleans())
    some = short if plausible else texts
    durations = st.integers(0, 10**9) if plausible else i64
    for _ in range(draw(st.integers(0, 4))):
        batch.waves.add(
            wave=draw(u64),
            start_unix_nano=draw(st.integers(1, I64) if plausible else i64),
            execute_ns=draw(durations),
            sample_ns=draw(durations),
            sample_offset_ns=draw(durations),
            num_reqs=draw(u32),
            sampled_tokens=draw(u32),
            prefill_tokens=draw(u32),
            decode_tokens=draw(u32),
            dummy=draw(st.booleans()),
            sampled=draw(st.booleans()),
        )
    if draw(st.booleans()):
        hb = batch.heartbeat
        hb.time_unix_nano, hb.last_wave, hb.phase = draw(i64), draw(u64), draw(texts)
        hb.phase_age_ns = draw(durations)
        hb.collective_op, hb.collective_group = draw(texts), draw(texts)
        hb.collective_seq, hb.collective_age_ns = draw(u64), draw(i64)
    for _ in range(draw(st.integers(0, 2))):
        cw = batch.collective_waves.add(wave=draw(u64), wait_ns=draw(i64))
        cw.stats.add(
            op=draw(texts),
            group=draw(texts),
            backend=draw(texts),
            dtype=draw(texts),
            calls=draw(u64),
            bytes=draw(u64),
            host_ns=draw(i64),
            max_host_ns=draw(i64),
            first_seq=draw(u64),
            last_seq=draw(u64),
        )
        cw.slow_calls.add(
            op=draw(texts),
            group=draw(texts),
            seq=draw(u64),
            bytes=draw(u64),
            host_ns=draw(i64),
            start_unix_nano=draw(i64),
        )
    for _ in range(draw(st.integers(0, 2))):
        batch.incidents.add(
            schema_version=draw(st.sampled_from([1, 1, 1, 0, 2])),
            id=draw(st.text(min_size=1, max_size=30) if plausible else texts),
            type=draw(st.text(min_size=1, max_size=60) if plausible else texts),
            severity=draw(st.sampled_from(["info", "critical", "warning", "bad", ""])),
            wave=draw(u64),
            request_id=draw(some),
            time_unix_nano=draw(i64),
            summary=draw(some),
            evidence_json=draw(texts),
            occurrence=draw(u64),
            suppressed=draw(u64),
        )
    for _ in range(draw(st.integers(0, 2))):
        probe = batch.probes.add(name=draw(texts), value=draw(doubles))
        for key in draw(st.lists(texts, max_size=2)):
            probe.labels[key[:50]] = draw(texts)
    for key in draw(st.lists(texts, max_size=2)):
        batch.detector_hits_total[key[:200]] = draw(u64)
    return batch


@st.composite
def valid_with_hostile_numbers(draw) -> guard_pb2.Batch:
    """A batch that passes every shape check, carrying huge integers, NaN/inf probe values and
    odd (short) strings where they are allowed: these reach metrics, spans and the store."""
    rank = guard_pb2.RankInfo(
        run_id=draw(st.text(min_size=1, max_size=20)),
        engine=draw(short),
        node=draw(short),
        tp_rank=draw(st.integers(0, 1)),
        tp_size=2,
        dp_size=1,
        pp_size=1,
        pid=draw(u32),
    )
    batch = guard_pb2.Batch(rank=rank, dropped_total=draw(u64), guard_errors_total=draw(u64))
    for _ in range(draw(st.integers(0, 3))):
        batch.waves.add(
            wave=draw(st.one_of(st.integers(1, 1000), u64.filter(bool))),
            start_unix_nano=draw(st.integers(1, I64)),
            execute_ns=draw(st.integers(0, 10**12)),
            sample_ns=draw(st.integers(0, 10**12)),
            num_reqs=draw(u32),
            sampled_tokens=draw(u32),
            prefill_tokens=draw(u32),
            decode_tokens=draw(u32),
        )
    for _ in range(draw(st.integers(0, 2))):
        batch.incidents.add(
            schema_version=1,
            id=draw(st.text(min_size=1, max_size=30)),
            type=draw(st.text(min_size=1, max_size=60)),
            severity=draw(st.sampled_from(["info", "warning", "error", "critical"])),
            wave=draw(u64),
            occurrence=draw(u64),
            suppressed=draw(u64),
            time_unix_nano=draw(i64),
            summary=draw(short),
            request_id=draw(short),
        )
    for _ in range(draw(st.integers(0, 2))):
        name = draw(st.sampled_from([*sorted(PROBE_METRICS), "unknown_probe"]))
        probe = batch.probes.add(name=name, value=draw(doubles))
        for label in getattr(PROBE_METRICS.get(name), "labels", ()):
            probe.labels[label] = draw(short)
    for key in draw(st.lists(st.text(min_size=1, max_size=60), max_size=3)):
        batch.detector_hits_total[key] = draw(u64)
    if draw(st.booleans()):
        batch.heartbeat.time_unix_nano = draw(i64)
        batch.heartbeat.last_wave = draw(u64)
        batch.heartbeat.collective_op = draw(short)
        batch.heartbeat.collective_seq = draw(u64)
    return batch


def _check(result) -> None:
    assert isinstance(result, (guard_pb2.Ack, Aborted)), result
    if isinstance(result, Aborted):
        assert result.code in ANSWERS and result.details, (result.code, result.details)


@FUZZ
@given(batch=st.one_of(batches(), valid_with_hostile_numbers()))
def test_hostile_valid_batches_are_answered(sidecar, batch):
    _check(answer(sidecar, batch.SerializeToString()))


@FUZZ
@given(data=st.one_of(st.binary(max_size=512), batches().map(lambda b: b.SerializeToString()[:-1])))
def test_raw_and_truncated_bytes_are_answered(sidecar, data):
    _check(answer(sidecar, data))


def test_a_batch_of_100000_records_is_answered(sidecar):
    batch = guard_pb2.Batch(rank=guard_pb2.RankInfo(run_id="big", engine="big", tp_size=1))
    for n in range(1, 100_001):
        batch.waves.add(wave=n, start_unix_nano=1, execute_ns=1)
    result = answer(sidecar, batch.SerializeToString())
    _check(result)  # about 2.6 MB: under the 4 MiB default, so accepted
    assert isinstance(result, guard_pb2.Ack) and result.waves == 100_000


def test_the_store_lost_no_span_batch_and_labels_stay_bounded(sidecar):
    """Runs after the fuzz above (file order): what it left behind."""
    assert sidecar.writer.flush(60)
    lost = [f"{r.getMessage()} {r.exc_info[1]!r}" for r in sidecar.span_errors if r.exc_info]
    assert not lost, lost[:3]
    # no sink failed on a batch that passed validation (the writer counts each failure by sink)
    failed = {k: v for k, v in sidecar.drops.totals.items() if k[0] in ("metrics", "store")}
    assert not failed, failed
    caps = {"engine": 33}
    for family in sidecar.metrics.registry.collect():
        values: dict[str, set[str]] = {}
        for sample in family.samples:
            for name, label in sample.labels.items():
                values.setdefault(name, set()).add(label)
                assert len(label) <= 128, (family.name, name, label[:80])
        for name, seen in values.items():
            assert len(seen) <= caps.get(name, 65), (family.name, name, len(seen))
    for family in sidecar.metrics.registry.collect():
        for sample in family.samples:
            assert not math.isnan(sample.value) or family.type in ("gauge", "unknown"), sample


def test_every_label_from_the_wire_is_bounded(tmp_path):
    """300 batches, each naming a new engine, incident type, detector, probe label value,
    collective op, group, backend and dtype: no label of any family grows past its cap."""
    side = Sidecar(
        SidecarSettings(listen=f"unix://{tmp_path / 's.sock'}", store=str(tmp_path / "s.db"))
    )
    side.writer.start()
    try:
        probe, spec = next(iter(PROBE_METRICS.items()))
        for n in range(300):
            batch = guard_pb2.Batch(
                rank=guard_pb2.RankInfo(run_id="r", engine=f"e{n}", tp_size=1, dp_size=1, pp_size=1)
            )
            batch.incidents.add(
                schema_version=1, id=f"i{n}", type=f"type{n}", severity="info", summary="s"
            )
            batch.detector_hits_total[f"det{n}"] = 1
            reading = batch.probes.add(name=probe, value=1.0)
            for label in spec.labels:
                reading.labels[label] = f"v{n}"
            batch.collective_waves.add(wave=1).stats.add(
                op=f"op{n}", group=f"g{n}", backend=f"b{n}", dtype=f"d{n}", calls=1
            )
            _check(answer(side, batch.SerializeToString()))
        assert side.writer.flush(60)
        for family in side.metrics.registry.collect():
            seen: dict[str, set[str]] = {}
            for sample in family.samples:
                for name, label in sample.labels.items():
                    seen.setdefault(name, set()).add(label)
            for name, values in seen.items():
                assert len(values) <= 65, (family.name, name, len(values))
    finally:
        side.writer.stop()
        side.incidents.close()


def test_refusal_logs_are_rate_limited(tmp_path):
    """1,000 refusals: every one answered and counted, about ten logged (per reason and minute),
    and the next line after the window names how many were held back."""
    from structlog.testing import capture_logs

    sidecar = Sidecar(SidecarSettings(listen="unix:///nowhere.sock", store=str(tmp_path / "s.db")))
    before = sidecar.metrics.rejected.labels("malformed")._value.get()
    with capture_logs() as logs:
        for _ in range(1000):
            _check(answer(sidecar, b"\xff\xff\xff not a batch"))
    refused = [e for e in logs if e["event"] == "ingest_refused"]
    assert 1 <= len(refused) <= 10, len(refused)
    assert sidecar.metrics.rejected.labels("malformed")._value.get() - before == 1000


def test_the_rate_limiter_names_what_it_held_back():
    from telemetry.pipeline.ratelimit import RateLimitedLog

    now = [0.0]
    lines = []
    limited = RateLimitedLog(
        lambda event, **kw: lines.append(kw), burst=2, window_s=10.0, clock=lambda: now[0]
    )
    assert [limited("e", "a", n=i) for i in range(5)] == [True, True, False, False, False]
    assert limited("e", "b", n=9)  # another kind has its own lines
    now[0] = 10.0
    assert limited("e", "a", n=5)
    assert lines[-1] == {"n": 5, "suppressed_before": 3}
