"""Hang evidence bundles: the worker's collective ring in the liveness record, the stack signal,
the bundle writer's bounds and drops, the file format, and `ascend-guard hangs --bundle`.

The rank here is this test process (its own liveness record, ring and stack signal) or a child
process it stops; the sidecar's pieces are the real ones, in process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from guard.stream import evidence
from guard.stream.evidence import RankEvidence, flight_recorder
from telemetry.cli import main as cli
from telemetry.crossrank import rank_evidence
from telemetry.crossrank.bundle import (
    FORMAT,
    BundleSettings,
    BundleWriter,
    bundle_path,
    list_bundles,
    read_bundle,
)
from telemetry.metrics.bundles import BundleMetrics
from telemetry.wire.liveness_record import (
    RING_SLOTS,
    SIZE,
    LivenessRecord,
    RecordReader,
    companion_path,
)
from telemetry.wire.proto import guard_pb2

RUN = "run-bundle"


class Tensor:
    """What the ring reads of a payload: `nbytes` (as torch.Tensor has it)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


def _rank(tp: int = 0, pid: int | None = None) -> guard_pb2.RankInfo:
    return guard_pb2.RankInfo(
        run_id=RUN,
        engine="eng",
        tp_rank=tp,
        tp_size=2,
        pid=pid or os.getpid(),
        node=os.uname().nodename,
    )


def _writer(tmp_path, **kw) -> tuple[BundleWriter, CollectorRegistry]:
    registry = CollectorRegistry()
    settings = BundleSettings(str(tmp_path / "bundles"), liveness_dir=str(tmp_path / "live"), **kw)
    return BundleWriter(settings, BundleMetrics(registry)), registry


def _metric(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def _verdict(stopped_tp: int = 1) -> dict:
    return {
        "engine": "eng",
        "run_id": RUN,
        "dp": 0,
        "kind": "no_heartbeat",
        "op": "all_reduce",
        "group": "tp",
        "seq": 71,
        "wave": 5,
        "onset_unix": time.time() - 2,
        "verdict_unix": time.time(),
        "summary": "engine eng dp0: no_heartbeat: tp1 stopped",
        "stopped": [{"tp": stopped_tp, "pp": 0, "pid": 1}],
        "waiting": [{"tp": 0, "pp": 0}],
    }


@pytest.fixture
def record(tmp_path):
    rec = LivenessRecord.create(str(tmp_path / "live"), RUN, 0, 0, 0)
    assert rec is not None
    yield rec
    rec.close()


def _fill(rec: LivenessRecord, calls: int, *, stuck: bool) -> None:
    for seq in range(1, calls + 1):
        rec.enter("all_reduce", "tp", seq, time.perf_counter_ns(), Tensor(512))
        rec.leave(time.perf_counter_ns())
    if stuck:
        rec.enter("all_gather", "tp", calls + 1, time.perf_counter_ns(), [Tensor(64), Tensor(64)])


# -- the ring -------------------------------------------------------------------------------
def test_ring_keeps_the_last_slots_oldest_first_with_the_stuck_call_not_returned(record, tmp_path):
    _fill(record, 70, stuck=True)
    ring = RecordReader(str(tmp_path / "live")).ring(RUN, 0, 0, 0, os.getpid())
    assert ring is not None and len(ring) == RING_SLOTS
    assert [e.seq for e in ring] == list(range(71 - RING_SLOTS + 1, 72))
    assert [e.call for e in ring] == sorted(e.call for e in ring)
    *done, last = ring
    assert all(e.returned and e.op == "all_reduce" and e.nbytes == 512 for e in done)
    assert all(e.end_unix >= e.start_unix for e in done)
    assert (last.op, last.group, last.seq, last.nbytes, last.returned) == (
        "all_gather",
        "tp",
        71,
        128,
        False,
    )
    assert abs(last.start_unix - time.time()) < 5


def test_a_slot_being_refilled_is_skipped_and_an_old_layout_has_no_ring(record, tmp_path):
    _fill(record, 70, stuck=False)
    # the engine thread is inside enter() of call 71: word 12 already says 71, and call 7's slot
    # (71 mod 64) holds some of call 71's words under call 7's number
    record._words[12] = 71
    record._ring[(71 % RING_SLOTS) * 6 + 2] = 999
    reader = RecordReader(str(tmp_path / "live"))
    ring = reader.ring(RUN, 0, 0, 0, os.getpid())
    assert [e.call for e in ring] == list(range(8, 71)) and 999 not in [e.seq for e in ring]
    bare = LivenessRecord.create(str(tmp_path / "old"), RUN, 0, 0, 1, ring_slots=0)
    assert bare is not None and os.path.getsize(bare.path) == SIZE
    bare.enter("all_reduce", "tp", 1, time.perf_counter_ns(), Tensor(8))
    old = RecordReader(str(tmp_path / "old"))
    assert old.ring(RUN, 0, 0, 1, os.getpid()) is None
    assert old.read(RUN, 0, 0, 1, os.getpid()).seq == 1  # the first layout still reads
    bare.close()
    with pytest.raises(ValueError, match="power of two"):
        LivenessRecord.create(str(tmp_path / "old"), RUN, 0, 0, 2, ring_slots=48)


# -- the stack signal and the facts ----------------------------------------------------------
def test_the_stack_signal_answers_with_the_engine_thread_marked(record, tmp_path):
    ev = RankEvidence.install(record.path)
    assert ev is not None
    try:
        facts, why = rank_evidence.read_facts(
            companion_path(record.path, "facts.json"), os.getpid()
        )
        assert facts is not None, why
        assert facts["stack_signal"] >= signal.SIGRTMIN + evidence.FIRST_SIGNAL_OFFSET
        assert facts["flight_recorder"]["available"] is False  # no process group here
        ask, why = rank_evidence.ask_stack(facts, "", "S (sleeping)", os.getpid())
        assert ask is not None, why
        got = rank_evidence.collect_stack(ask, time.monotonic() + 5, 1 << 20)
        assert got["answered"], got
        engine = got["threads"][0]
        assert engine["engine"] and any(
            "test_the_stack_signal_answers" in frame for frame in engine["frames"]
        ), got
    finally:
        ev.close()
    assert not os.path.exists(companion_path(record.path, "facts.json"))
    assert signal.getsignal(ev.signal) == signal.SIG_DFL


def test_a_signal_taken_outside_python_is_not_chosen(record):
    """A handler installed from C (here: faulthandler, which Python's signal table does not see)
    makes the guard pick the next free signal."""
    import faulthandler

    first = evidence._free_signal()
    faulthandler.register(first, file=sys.stderr, chain=False)
    try:
        assert signal.getsignal(first) == signal.SIG_DFL  # invisible to the signal module
        assert evidence._kernel_handler(first) not in (0, None)
        # the next free one above it, or none where it was the last (earlier tests in this
        # process may hold the signals below SIGRTMAX through processors they left open)
        second = evidence._free_signal()
        assert second != first and (second is None or second > first)
        if first + 1 < signal.SIGRTMAX and second is not None:
            assert all(
                evidence._kernel_handler(s) not in (0, None)
                or signal.getsignal(s) != signal.SIG_DFL
                for s in range(first + 1, second)
            )  # every signal skipped is taken
    finally:
        faulthandler.unregister(first)
    assert evidence._kernel_handler(first) == 0


def test_the_stack_file_is_emptied_past_its_bound(record, monkeypatch):
    ev = RankEvidence.install(record.path)
    assert ev is not None
    try:
        monkeypatch.setattr(evidence, "MAX_STACK_FILE", 10)
        os.kill(os.getpid(), ev.signal)
        stacks = companion_path(record.path, "stacks")
        assert os.path.getsize(stacks) > 10
        ev.keep_bounded()
        assert os.path.getsize(stacks) == 0
    finally:
        ev.close()


def test_a_stopped_process_is_never_signalled():
    """The facts name SIGTERM: were it sent, the child would end. It must stay stopped."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not rank_evidence.process_view(child.pid)["state"].startswith("T"):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        facts = {"pid": child.pid, "stack_signal": int(signal.SIGTERM), "stack_file": "/dev/null"}
        view = rank_evidence.process_view(child.pid)
        ask, why = rank_evidence.ask_stack(facts, "", view["state"], child.pid)
        assert ask is None and "SIGCONT" in why
        assert view["wchan"] and ("kernel_stack" in view or "kernel_stack_note" in view)
        os.kill(child.pid, signal.SIGCONT)
        time.sleep(0.2)
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()


def test_facts_of_another_process_are_refused(tmp_path):
    path = tmp_path / "x.facts.json"
    path.write_text(json.dumps({"pid": os.getpid(), "start_ticks": 1, "stack_signal": 40}))
    facts, why = rank_evidence.read_facts(str(path), os.getpid())
    assert facts is None and "earlier process" in why


def test_flight_recorder_facts_per_backend():
    env = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": "/x/p_"}
    fr = flight_recorder("nccl", 3, env)
    assert (
        fr["available"] and fr["pipe"] == "/x/p_3.pipe" and fr["dump"] == "/tmp/nccl_trace_rank_3"
    )
    assert not flight_recorder("nccl", 3, {})["available"]
    hccl = flight_recorder(
        "hccl",
        1,
        {
            "TORCH_HCCL_TRACE_BUFFER_SIZE": "10",
            "TORCH_HCCL_DEBUG_INFO_PIPE_FILE": "/y/h_",
            "TORCH_HCCL_DEBUG_INFO_TEMP_FILE": "/y/d_",
        },
    )
    assert hccl["pipe"] == "/y/h_1.pipe" and hccl["dump"] == "/y/d_1"
    gloo = flight_recorder("gloo", 0, env)
    assert not gloo["available"] and "gloo" in gloo["note"]


def test_the_flight_recorder_pipe_is_written(tmp_path):
    pipe = tmp_path / "fr_0.pipe"
    os.mkfifo(pipe)
    reader = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)  # torch's watchdog end of the pipe
    try:
        facts = {
            "flight_recorder": {
                "available": True,
                "backend": "nccl",
                "pipe": str(pipe),
                "dump": str(tmp_path / "dump_0"),
            }
        }
        fr = rank_evidence.trigger_flight_recorder(facts, "")
        assert fr["triggered"], fr
        assert os.read(reader, 128) == b"dump\n"
        rank_evidence.dump_state(fr)
        assert fr["dump_bytes"] is None  # nothing dumped by this stand-in
    finally:
        os.close(reader)
    os.unlink(pipe)
    gone = rank_evidence.trigger_flight_recorder(facts, "")
    assert gone["triggered"] is False


# -- the writer: format, bounds, drops -------------------------------------------------------
def test_a_bundle_holds_each_rank_ring_stack_and_process(record, tmp_path):
    _fill(record, 10, stuck=True)
    ev = RankEvidence.install(record.path)
    try:
        writer, registry = _writer(tmp_path)
        remote = _rank(tp=1, pid=1)
        remote.node = "other-node"
        named = writer.request(_verdict(), [_rank(), remote])
        assert named["show"] == f"ascend-guard hangs --bundle {named['id']}"
        job = writer._queue.get_nowait()
        assert writer.write(job) == named["path"]
    finally:
        ev.close()
    bundle = read_bundle(str(tmp_path / "bundles"), named["id"])
    assert bundle["format"] == FORMAT and bundle["verdict"]["kind"] == "no_heartbeat"
    here, there = bundle["ranks"]
    assert (here["tp"], here["role"], there["tp"], there["role"]) == (0, "waiting", 1, "stopped")
    entries = here["collectives"]["entries"]
    assert [e["seq"] for e in entries] == list(range(1, 12))
    assert entries[-1]["end_unix"] == rank_evidence.NOT_RETURNED and entries[-1]["bytes"] == 128
    assert here["stack"]["answered"] and here["stack"]["threads"][0]["engine"]
    assert here["process"]["state"].startswith(("R", "S"))
    assert here["flight_recorder"]["available"] is False  # no process group in this test
    assert there["process"]["state"] == "remote" and not there["collectives"]["entries"]
    assert oct(os.stat(named["path"]).st_mode & 0o777) == "0o640"
    assert _metric(registry, "ascend_guard_hang_bundles_total") == 1


def test_a_bundle_is_cut_to_its_size_and_the_cut_counted(record, tmp_path):
    _fill(record, 70, stuck=True)
    writer, registry = _writer(tmp_path, max_bytes=4096, collectives=64)
    bundle = writer.gather(_job(writer))
    data = writer._bounded(bundle)
    assert len(data) <= 4096
    cut = json.loads(data)["cut"]
    assert "collectives past the latest 8" in cut
    assert _metric(registry, "ascend_guard_hang_bundle_drops_total", reason="cut_to_size") == len(
        cut
    )


def _job(writer: BundleWriter):
    writer.request(_verdict(), [_rank()])
    return writer._queue.get_nowait()


def test_a_full_queue_drops_the_bundle_and_counts_it(tmp_path):
    writer, registry = _writer(tmp_path, max_pending=1)
    assert "path" in writer.request(_verdict(), [_rank()])
    dropped = writer.request(_verdict(), [_rank()])
    assert dropped["written"] is False and "queue full" in dropped["note"]
    assert _metric(registry, "ascend_guard_hang_bundle_drops_total", reason="queue_full") == 1


def test_the_folder_keeps_the_newest_bundles(tmp_path):
    writer, registry = _writer(tmp_path, max_files=3, stack_timeout_s=0.1)
    ids = []
    for _ in range(5):
        ids.append(writer.request(_verdict(), [_rank(pid=1)])["id"])
        writer.write(writer._queue.get_nowait())
        time.sleep(0.01)  # distinct mtimes
    assert sorted(list_bundles(str(tmp_path / "bundles"))) == sorted(ids[2:])
    assert _metric(registry, "ascend_guard_hang_bundle_drops_total", reason="evicted") == 2


def test_the_bundle_thread_writes_what_the_checker_queued(tmp_path):
    writer, registry = _writer(tmp_path, stack_timeout_s=0.1)
    writer.start()
    try:
        named = writer.request(_verdict(), [_rank(pid=1)])
        deadline = time.monotonic() + 10
        while not os.path.exists(named["path"]):
            assert time.monotonic() < deadline, "the bundle thread wrote nothing"
            time.sleep(0.02)
    finally:
        writer.stop()
    assert not any(t.name == "hang-bundles" for t in threading.enumerate())


def test_an_id_never_reaches_outside_the_folder(tmp_path):
    for bad in ("../etc/passwd", "a/b", "", ".hidden"):
        with pytest.raises(ValueError):
            bundle_path(str(tmp_path), bad)


# -- the CLI --------------------------------------------------------------------------------
def _written(record, tmp_path) -> tuple[str, str]:
    _fill(record, 5, stuck=True)
    writer, _ = _writer(tmp_path, stack_timeout_s=0.1)
    named = writer.request(_verdict(), [_rank()])
    writer.write(writer._queue.get_nowait())
    return str(tmp_path / "bundles"), named["id"]


def test_cli_shows_a_bundle_in_sections(record, tmp_path, capsys):
    folder, bundle_id = _written(record, tmp_path)
    capsys.readouterr()  # the writer's log line
    assert cli.main(["hangs", "--bundle", bundle_id, "--bundle-dir", folder]) == 0
    out = capsys.readouterr().out

    assert out.startswith(f"bundle {bundle_id}")
    assert "verdict engine eng dp0: no_heartbeat" in out
    assert "== dp0 tp0 pp0" in out and "WAITING" in out
    lines = out.splitlines()
    header = next(line for line in lines if "call" in line and "op" in line and "seq" in line)
    assert header.split() == ["call", "op", "group", "seq", "bytes", "start", "(UTC)", "took"]
    stuck = [line for line in lines if "NOT RETURNED" in line]
    assert len(stuck) == 1 and "all_gather" in stuck[0] and " 6 " in stuck[0]
    assert "python stack none:" in out  # this rank installed no stack signal
    assert "flight rec.  not available:" in out


def test_cli_json_list_and_errors(record, tmp_path, capsys):
    folder, bundle_id = _written(record, tmp_path)
    capsys.readouterr()
    assert cli.main(["hangs", "--bundle", bundle_id, "--bundle-dir", folder, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["id"] == bundle_id
    assert cli.main(["hangs", "--bundle", "--bundle-dir", folder]) == 0
    assert bundle_id in capsys.readouterr().out
    assert cli.main(["hangs", "--bundle", "20990101T000000Z-x", "--bundle-dir", folder]) == 1
    assert "no bundle" in capsys.readouterr().out
    assert cli.main(["hangs", "--bundle", "../x", "--bundle-dir", folder]) == 2
    assert cli.main(["hangs", "--bundle", "--bundle-dir", str(tmp_path / "none")]) == 0
    assert "no evidence bundles" in capsys.readouterr().out


def test_the_checker_names_the_bundle_in_the_incident(tmp_path):
    """The hook in HangDetector._raise: the verdict's evidence, and the verdict while it stands,
    carry the bundle's id and path."""
    from telemetry.crossrank.hangs import HangDetector, HangSettings
    from telemetry.metrics.collectives import CollectiveMetrics

    incidents = []
    clock = SimpleNamespace(now=100.0)
    hangs = HangDetector(
        CollectiveMetrics(CollectorRegistry()),
        HangSettings(stale_s=1.0),
        incident_sink=lambda engine, rank, inc: incidents.append(inc),
        clock=lambda: clock.now,
    )
    writer, _ = _writer(tmp_path)
    hangs.bundles = writer
    for tp in (0, 1):
        batch = guard_pb2.Batch(rank=_rank(tp=tp, pid=1000 + tp))
        batch.heartbeat.last_wave = 5
        hangs.observe("eng", batch)
    clock.now += 0.5
    hangs.observe("eng", guard_pb2.Batch(rank=_rank(tp=0, pid=1000)))
    clock.now += 1.0
    (event,) = hangs.check()
    evidence_json = json.loads(incidents[0].evidence_json)
    assert evidence_json["bundle"]["id"] == event["bundle"]["id"]
    job = writer._queue.get_nowait()
    assert job.bundle_id == event["bundle"]["id"]
    assert sorted(r.tp_rank for r in job.ranks) == [0, 1]
    # the standing verdict names it too: /hangs, /live and `hangs --live` show where it is
    (standing,) = hangs.snapshot()["standing"]
    assert standing["bundle"]["id"] == event["bundle"]["id"]
    _, body = hangs.engine_status("eng")
    assert body["verdicts"][0]["bundle"]["show"] == f"ascend-guard hangs --bundle {job.bundle_id}"
