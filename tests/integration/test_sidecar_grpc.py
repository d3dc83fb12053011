"""A real sidecar process over real gRPC: concurrent clients, refusals, drops, reconnects, CLI."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from telemetry.wire.proto import guard_pb2
from tests.support.feed import make_streamer, send_waves, wave_tuple
from tests.support.metrics import value
from tests.support.ports import free_port
from tests.support.sidecar import SidecarProcess
from tests.support.store import stored_spans

REPO = Path(__file__).resolve().parents[2]
METHOD = "/ascend_guard.v1.GuardIngest/Stream"

pytestmark = pytest.mark.timeout(60)


# -- helpers --------------------------------------------------------------------------------


def wait_for(check: Callable[[], object], timeout: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def metric(sidecar: SidecarProcess, name: str, **labels: str) -> float:
    return value(sidecar.metrics_text(), name, **labels)


def wait_metric(sidecar, name, expected, timeout=15.0, **labels):
    last = []

    def check():
        last[:] = [metric(sidecar, name, **labels)]
        return last[0] == expected

    try:
        wait_for(check, timeout, f"{name}{labels} == {expected}")
    except AssertionError:
        raise AssertionError(
            f"{name}{labels}: {last[0]} != {expected}\n{sidecar.log()[-3000:]}"
        ) from None


def raw_call(address: str, messages: list[bytes], timeout: float = 10.0) -> guard_pb2.Ack:
    channel = grpc.insecure_channel(address)
    try:
        call = channel.stream_unary(
            METHOD, request_serializer=lambda b: b, response_deserializer=guard_pb2.Ack.FromString
        )
        return call(iter(messages), timeout=timeout)
    finally:
        channel.close()


def rank(tp: int = 0, **overrides) -> guard_pb2.RankInfo:
    fields = dict(run_id="run-raw", engine="raw", dp_rank=0, tp_rank=tp, pp_rank=0, dp_size=1,
                  tp_size=2, pp_size=1, node="n", pid=77)  # fmt: skip
    fields.update(overrides)
    return guard_pb2.RankInfo(**fields)


def batch(*waves: int, rank_info: guard_pb2.RankInfo | None = None, **fields) -> guard_pb2.Batch:
    out = guard_pb2.Batch(rank=rank_info or rank(), **fields)
    for n in waves:
        out.waves.add(**wave_tuple(n, sampled=2)._asdict())
    return out


def store_rows(path: Path, sql: str, params=()) -> list[tuple]:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def send_in_process(address: str, **kwargs) -> subprocess.Popen:
    code = (
        "import sys, json\n"
        "from tests.support.feed import send_waves\n"
        "kw = json.loads(sys.argv[1])\n"
        "kw['ranks'] = [tuple(r) for r in kw['ranks']]\n"
        "send_waves(sys.argv[2], **kw)\n"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code, json.dumps(kwargs), address],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip


# -- (a) concurrent client processes --------------------------------------------------------


def test_concurrent_client_processes(sidecars):
    sidecar = sidecars()
    clients = {
        ("test", "0"): dict(engine="test", ranks=[(0, 0, 0)], waves=40, sampled_per_wave=3,
                            run_id="run-int"),
        ("test", "1"): dict(engine="test", ranks=[(0, 1, 0)], waves=40, sampled_per_wave=5,
                            run_id="run-int"),
        ("other", "0"): dict(engine="other", ranks=[(0, 0, 0)], waves=25, sampled_per_wave=2,
                             run_id="run-other"),
    }  # fmt: skip
    procs = [send_in_process(sidecar.address, **kw) for kw in clients.values()]
    for proc in procs:
        out, err = proc.communicate(timeout=40)
        assert proc.returncode == 0, err
    text = sidecar.metrics_text()
    for (engine, tp), kw in clients.items():
        labels = dict(engine=engine, dp="0", tp=tp, pp="0")
        assert value(text, "ascend_guard_waves_total", **labels) == kw["waves"]
        assert (
            value(text, "ascend_guard_sampled_tokens_total", **labels)
            == kw["waves"] * kw["sampled_per_wave"]
        )
        assert value(text, "ascend_guard_last_wave", **labels) == kw["waves"]
        assert value(text, "ascend_guard_records_dropped_total", **labels) == 0
    assert value(text, "ascend_guard_waves_total") == 105
    for engine in ("test", "other"):
        wait_metric(sidecar, "ascend_guard_ranks_connected", 0, engine=engine)
    assert value(sidecar.metrics_text(), "ascend_guard_ingest_rejected_total") == 0

    # the store: one trace per wave, one `rank` span per rank (built from the stored rows)
    def traces():
        per_wave: dict[tuple, list] = {}
        for span in stored_spans(sidecar.store_path, name="rank"):
            per_wave.setdefault((span.run_id, span.wave, span.trace_hex), []).append(span.tp)
        complete = len(per_wave) == 65 and all(
            len(tps) == (2 if run == "run-int" else 1) for (run, _, _), tps in per_wave.items()
        )
        return sorted(per_wave.items()) if complete else None

    rows = wait_for(traces, 15, "rank spans in the store")
    run_int = [(key, tps) for key, tps in rows if key[0] == "run-int"]
    assert [key[1] for key, _ in run_int] == list(range(1, 41))
    assert all(sorted(tps) == [0, 1] for _, tps in run_int)
    trace_ids = {key[2] for key, _ in rows}
    assert len(trace_ids) == 65  # one trace per (run, wave)
    roots = stored_spans(sidecar.store_path, name="wave", run_id="run-int")
    assert len(roots) == 40 and len({s.trace_id for s in roots}) == 40


# -- (b) malformed bytes --------------------------------------------------------------------


def test_malformed_bytes_are_refused_and_serving_continues(sidecars):
    sidecar = sidecars()
    with pytest.raises(grpc.RpcError) as info:
        raw_call(sidecar.address, [b"\xff\xff\xff garbage"])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a Batch message" in info.value.details()
    wait_metric(sidecar, "ascend_guard_ingest_rejected_total", 1, reason="malformed")

    # garbage after a good batch: the good one counts, the stream ends
    with pytest.raises(grpc.RpcError) as info:
        raw_call(sidecar.address, [batch(1, 2).SerializeToString(), b"\x0a\x05ab"])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    wait_metric(sidecar, "ascend_guard_ingest_rejected_total", 2, reason="malformed")
    assert metric(sidecar, "ascend_guard_waves_total", engine="raw") == 2
    wait_metric(sidecar, "ascend_guard_ranks_connected", 0, engine="raw")

    send_waves(sidecar.address, engine="after", ranks=((0, 0, 0),), waves=10)
    wait_metric(sidecar, "ascend_guard_waves_total", 10, engine="after")
    assert sidecar.proc.poll() is None


# -- (c) oversized --------------------------------------------------------------------------


def test_oversized_message_is_refused_and_serving_continues(sidecars):
    sidecar = sidecars(extra_args=("--max-message-bytes", "2048"))
    big = batch(*range(1, 81)).SerializeToString()
    assert 2048 < len(big) <= 4096, len(big)
    with pytest.raises(grpc.RpcError) as info:
        raw_call(sidecar.address, [big])
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    details = info.value.details()
    assert f"{len(big)} bytes" in details and "2048" in details
    wait_metric(sidecar, "ascend_guard_ingest_rejected_total", 1, reason="oversized")
    assert metric(sidecar, "ascend_guard_waves_total") == 0

    # a batch under the limit still goes through
    ack = raw_call(sidecar.address, [batch(1, 2, 3).SerializeToString()])
    assert (ack.batches, ack.waves) == (1, 3)
    wait_metric(sidecar, "ascend_guard_waves_total", 3, engine="raw")
    assert sidecar.proc.poll() is None


def test_far_oversized_message_is_counted_and_names_the_limit(sidecars):
    sidecar = sidecars(extra_args=("--max-message-bytes", "2048"))
    huge = batch(*range(1, 201)).SerializeToString()
    assert len(huge) > 2 * 2048
    with pytest.raises(grpc.RpcError) as info:
        raw_call(sidecar.address, [huge])
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # counted before the stream is aborted, so no waiting is needed
    assert metric(sidecar, "ascend_guard_ingest_rejected_total", reason="oversized") == 1
    assert "2048" in info.value.details()


# -- (d) semantically invalid ---------------------------------------------------------------


INVALID = [
    (guard_pb2.Batch(waves=[guard_pb2.WaveRecord(wave=1, start_unix_nano=1)]), "batch.rank"),
    (batch(1, rank_info=rank(tp=2)), "rank.tp_rank: 2 is not below tp_size 2"),
    (batch(0), "waves[0].wave"),
    (batch(1, rank_info=rank(run_id="")), "rank.run_id"),
]


def test_invalid_batches_are_refused_naming_the_field(sidecars):
    sidecar = sidecars()
    for count, (message, fragment) in enumerate(INVALID, start=1):
        with pytest.raises(grpc.RpcError) as info:
            raw_call(sidecar.address, [message.SerializeToString()])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, fragment
        assert fragment in info.value.details()
        wait_metric(sidecar, "ascend_guard_ingest_rejected_total", count, reason="invalid")
    assert metric(sidecar, "ascend_guard_waves_total") == 0
    assert metric(sidecar, "ascend_guard_ingest_rejected_total", reason="malformed") == 0
    ack = raw_call(sidecar.address, [batch(1).SerializeToString()])
    assert ack.waves == 1
    wait_metric(sidecar, "ascend_guard_waves_total", 1)


def test_invalid_batch_mid_stream_keeps_what_came_before(sidecars):
    sidecar = sidecars()
    good, bad = batch(1, 2, 3), batch(4, rank_info=rank(tp=5))
    with pytest.raises(grpc.RpcError) as info:
        raw_call(sidecar.address, [good.SerializeToString(), bad.SerializeToString()])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "rank.tp_rank: 5" in info.value.details()
    wait_metric(sidecar, "ascend_guard_ingest_rejected_total", 1, reason="invalid")
    assert metric(sidecar, "ascend_guard_waves_total", engine="raw", tp="0") == 3
    wait_metric(sidecar, "ascend_guard_ranks_connected", 0, engine="raw")


# -- (e) cumulative drop counts -------------------------------------------------------------


def test_cumulative_drop_counts_across_clients_and_restarts(sidecars, tmp_path):
    sidecar = sidecars()
    labels = dict(engine="drops", dp="0", tp="0", pp="0")
    send_waves(sidecar.address, engine="drops", ranks=((0, 0, 0),), waves=3, drop=5)
    wait_metric(sidecar, "ascend_guard_records_dropped_total", 5, **labels)
    send_waves(sidecar.address, engine="drops", ranks=((0, 0, 0),), waves=3, drop=12)
    wait_metric(sidecar, "ascend_guard_records_dropped_total", 12, **labels)
    # a stale (lower) cumulative value from the same worker never decreases the counter
    send_waves(sidecar.address, engine="drops", ranks=((0, 0, 0),), waves=1, drop=7)
    wait_metric(sidecar, "ascend_guard_waves_total", 7, **labels)
    assert metric(sidecar, "ascend_guard_records_dropped_total", **labels) == 12

    assert sidecar.stop() == 0
    restarted = sidecars()
    assert restarted.metrics_port != sidecar.metrics_port
    send_waves(restarted.address, engine="drops", ranks=((0, 0, 0),), waves=2, drop=3)
    wait_metric(restarted, "ascend_guard_records_dropped_total", 3, **labels)
    assert metric(restarted, "ascend_guard_waves_total", **labels) == 2


# -- (f) the worker's streamer reconnects ---------------------------------------------------


def test_streamer_buffers_drops_and_reconnects(sidecars, sock_dir):
    address = f"unix://{sock_dir / 'guard.sock'}"
    streamer = make_streamer(address, engine="recon", buffer_size=50)
    labels = dict(engine="recon", dp="0", tp="0", pp="0")
    streamer.start()
    try:
        for n in range(1, 21):
            streamer.offer(wave_tuple(n))
        time.sleep(0.3)
        assert not streamer.connected and streamer.sent_waves == 0
        assert streamer.dropped == 0

        first = sidecars()
        wait_metric(first, "ascend_guard_waves_total", 20, **labels)
        assert streamer.connects == 1 and streamer.dropped == 0
        wait_metric(first, "ascend_guard_ranks_connected", 1, engine="recon")

        first.stop()
        wait_for(lambda: not streamer.connected, 10, "the streamer to notice")
        for n in range(21, 101):
            streamer.offer(wave_tuple(n))
        assert streamer.dropped >= 30  # 80 offered into a buffer of 50
        dropped = streamer.dropped

        second = sidecars()
        wait_for(lambda: streamer.connects >= 2, 15, "a reconnect")
        wait_metric(second, "ascend_guard_waves_total", 50, **labels)  # the buffered ones
        wait_metric(second, "ascend_guard_records_dropped_total", dropped, **labels)
        assert streamer.dropped == dropped
        assert metric(second, "ascend_guard_last_wave", **labels) == 100
    finally:
        streamer.stop()


def test_offer_never_blocks_without_a_sidecar(sock_dir):
    streamer = make_streamer(f"unix://{sock_dir / 'nobody.sock'}", buffer_size=100)
    streamer.start()
    try:
        start = time.perf_counter()
        for n in range(1, 10_001):
            streamer.offer(wave_tuple(n))
        elapsed = time.perf_counter() - start
        assert streamer.dropped == 9_900
        assert elapsed < 2.0
    finally:
        stopped = time.perf_counter()
        streamer.stop()
        assert time.perf_counter() - stopped < 3.0


# -- (g) the sidecar command refuses what it cannot do --------------------------------------


def _sidecar_cmd(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "telemetry.cli", "sidecar", *args], cwd=REPO, capture_output=True,
        text=True, timeout=timeout,
    )  # fmt: skip


def test_sidecar_refuses_a_live_socket(sidecars, tmp_path):
    live = sidecars()
    proc = _sidecar_cmd(
        "--listen", live.address, "--metrics-host", "127.0.0.1", "--metrics-port",
        str(free_port()), "--store", str(tmp_path / "second.db"),
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    socket_path = live.address[len("unix://") :]
    assert "another process is already listening on" in proc.stderr
    assert socket_path in proc.stderr
    # the live one is untouched
    assert live.proc.poll() is None
    assert os.path.exists(socket_path)
    send_waves(live.address, engine="still", ranks=((0, 0, 0),), waves=2)
    wait_metric(live, "ascend_guard_waves_total", 2, engine="still")


def test_sidecar_takes_over_a_stale_socket(sidecars, sock_dir):
    import socket

    stale = sock_dir / "guard.sock"
    leftover = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    leftover.bind(str(stale))
    leftover.close()  # the file stays, nobody listens
    assert stale.exists()
    sidecar = sidecars()
    send_waves(sidecar.address, engine="stale", ranks=((0, 0, 0),), waves=2)
    wait_metric(sidecar, "ascend_guard_waves_total", 2, engine="stale")


@pytest.mark.parametrize("retention", ["forever", "-1h"])
def test_sidecar_bad_retention_exits_2(tmp_path, sock_dir, retention):
    proc = _sidecar_cmd(
        "--listen", f"unix://{sock_dir / 'r.sock'}", "--metrics-port", str(free_port()),
        "--store", str(tmp_path / "r.db"), f"--retention={retention}",
    )  # fmt: skip
    assert proc.returncode == 2
    assert f"--retention: {retention!r}" in proc.stderr
    assert not (sock_dir / "r.sock").exists()
