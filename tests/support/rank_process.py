"""A stand-in worker rank as its own process: the real streamer client, heartbeats saying
what a real rank would say, and (with --record-dir) the real shared-memory liveness record. Lets
tests freeze one rank with SIGSTOP without starting vLLM.

    python -m tests.support.rank_process ADDRESS --engine E --tp 1 --tp-size 2 [--in-collective]
        [--record-dir DIR] [--hold-gil-after S] [--node NAME] [--enter-on-usr1] [--seq-done N]
        [--tracker-calls N] [--evidence] [--npu INDEX] [--model-name NAME]

`--enter-on-usr1`: heartbeats say "in all_reduce on tp, seq 31" from the moment SIGUSR1 arrives
(a peer that starts waiting when the test says so). `--seq-done N`: the first batch reports
collectives on tp up to seq N (what a rank that ran before would have sent).

`--hold-gil-after S`: S seconds after the stream is up, the main thread calls libc `sleep()`
through `ctypes.PyDLL`, which (unlike `ctypes.CDLL`) does not release the GIL around the call
(Python docs, ctypes.PyDLL). Every thread of the process then stops running Python, the
streamer thread too, while the process itself runs (state S, not T): the stand-in for a peer
that waits inside a collective holding the GIL, as vLLM's CPU shared-memory all-reduce spins
inside a custom op. It is reliable where a busy loop in Python is not (the interpreter hands
the GIL over every 5 ms) and where a regex blow-up is not (its duration depends on the CPU).
SIGTERM ends the sleep (EINTR), so the process still stops cleanly.

`--tracker-calls N` (with --record-dir): the real `CollectiveTracker` makes N all-reduces on a
stand-in TP group (each returns at once; a wave every 6 calls, 512 bytes each) before streaming,
so its liveness record's ring and the stream's collective waves both come from the tracker, as in
a worker. With --in-collective, the main thread then stays inside call N+1 through the tracker
(the wait, or the GIL-holding sleep, is the collective's body). `--evidence`: the worker's stack
signal and facts file (guard/stream/evidence.py), as the guard installs them. `--npu INDEX`,
`--model-name NAME`: the device and model the guard reads when streaming starts, from stand-ins
(torch_npu cannot run here; see `_place`).
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import signal
import threading
import time

from guard.collectives.payload import first_arg
from guard.collectives.tracker import CollectiveTracker
from guard.config.collectives import CollectivesConfig
from guard.stream.evidence import RankEvidence
from guard.stream.streamer import HeartbeatState, Streamer
from telemetry.wire.liveness_record import LivenessRecord
from telemetry.wire.proto import guard_pb2
from tests.support.feed import FixedHeartbeat

WAVE = 5
SEQ = 31


def _place(streamer: Streamer, npu: int | None, model_name: str) -> None:
    """What the guard reads when streaming starts (guard/stream/placement.py), from stand-ins:
    torch_npu cannot run here, so `torch.npu.current_device()` is a stand-in answering `npu`,
    and the runner is a stand-in holding what vLLM's runners hold (`device`, `vllm_config`).
    The visible-devices variables are the process's real environment."""
    from types import SimpleNamespace

    from guard.stream import placement

    fake_torch = SimpleNamespace(npu=SimpleNamespace(current_device=lambda: npu))
    runner = SimpleNamespace(
        device=SimpleNamespace(type="npu", index=None) if npu is not None else None,
        vllm_config=SimpleNamespace(
            model_config=SimpleNamespace(served_model_name=model_name, model="/models/x")
        ),
    )
    streamer.device = placement.device_of(runner, torch_module=fake_torch)
    streamer.model_name = placement.model_name_of(runner)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("address")
    parser.add_argument("--engine", default="test")
    parser.add_argument("--run-id", default="run-ranks")
    parser.add_argument("--tp", type=int, default=0)
    parser.add_argument("--tp-size", type=int, default=2)
    parser.add_argument("--in-collective", action="store_true",
                        help="heartbeats say: inside all_reduce on tp, seq 31, since start")  # fmt: skip
    parser.add_argument("--record-dir", default=None, help="write a liveness record here")
    parser.add_argument(
        "--hold-gil-after", type=float, default=None, help="then hold the GIL in a C sleep"
    )
    parser.add_argument("--node", default="test-node", help="the hostname it reports")
    parser.add_argument("--enter-on-usr1", action="store_true",
                        help="on SIGUSR1, enter all_reduce on tp, seq 31, and stay (heartbeats)")  # fmt: skip
    parser.add_argument("--seq-done", type=int, default=0,
                        help="the first batch reports collectives on tp up to this seq")  # fmt: skip
    parser.add_argument("--tracker-calls", type=int, default=0,
                        help="the real tracker makes this many all-reduces first")  # fmt: skip
    parser.add_argument("--evidence", action="store_true", help="install the stack signal")
    parser.add_argument(
        "--npu",
        type=int,
        default=None,
        metavar="INDEX",
        help="the rank opened NPU INDEX (a torch_npu stand-in's current device)",
    )
    parser.add_argument("--model-name", default="", help="the model vLLM serves (served name)")
    args = parser.parse_args()
    started = time.perf_counter_ns()
    rank = guard_pb2.RankInfo(
        run_id=args.run_id, engine=args.engine, tp_rank=args.tp, tp_size=args.tp_size, dp_size=1,
        pp_size=1, node=args.node, pid=__import__("os").getpid(), runner="tests.RankProcess",
    )  # fmt: skip

    entered = [started if args.in_collective else 0]
    pending_seqs = [args.seq_done] if args.seq_done else []

    def fill(batch: guard_pb2.Batch, with_heartbeat: bool) -> None:
        if pending_seqs:
            cw = batch.collective_waves.add(
                wave=WAVE - 1, first_arrival_unix_nano=time.time_ns(), wait_ns=1_000_000
            )
            cw.stats.add(op="all_reduce", group="tp", backend="shm", dtype="float32",
                         calls=pending_seqs[0], first_seq=1, last_seq=pending_seqs.pop())  # fmt: skip
        if with_heartbeat and entered[0]:
            hb = batch.heartbeat
            hb.collective_op, hb.collective_group, hb.collective_seq = "all_reduce", "tp", SEQ
            hb.collective_backend = "shm"
            hb.collective_age_ns = time.perf_counter_ns() - entered[0]

    tracker = None
    wave = [1]
    if args.tracker_calls:
        tracker = CollectiveTracker(CollectivesConfig(), wave_source=lambda: wave[0])
    streamer = Streamer(
        args.address, rank, buffer_size=64, batch_max=16, flush_interval_s=0.02,
        heartbeat_interval_s=0.2, max_backoff_s=0.2,
        fillers=[FixedHeartbeat(HeartbeatState(WAVE, "execute_model", 0), fill),
                 *([tracker] if tracker is not None else [])],
    )  # fmt: skip
    if args.npu is not None or args.model_name:
        _place(streamer, args.npu, args.model_name)
    record = evidence = None
    if args.record_dir is not None:
        record = LivenessRecord.create(args.record_dir, args.run_id, 0, 0, args.tp)
        assert record is not None, "the liveness record could not be made"
        record.phase("execute_model", started, WAVE)
        if args.evidence:
            evidence = RankEvidence.install(record.path)
            assert evidence is not None, "the stack signal could not be installed"
        if tracker is not None:
            tracker.record = record
            for call in range(args.tracker_calls):
                wave[0] = call // 6 + 1
                tracker.run("all_reduce", _returns, _TP, (_Payload(),), {}, first_arg)
            tracker.end_wave(wave[0])
        elif args.in_collective:
            record.enter("all_reduce", "tp", SEQ, started)
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # a stack dump for a stuck test
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    if args.enter_on_usr1:
        signal.signal(signal.SIGUSR1, lambda *_: entered.__setitem__(0, time.perf_counter_ns()))
    streamer.start()
    print("started", flush=True)

    def hold(*_: object) -> None:
        if args.hold_gil_after is not None:
            while not streamer.connected and not done.is_set():
                time.sleep(0.01)
            done.wait(args.hold_gil_after)
            if not done.is_set():
                print("holding the GIL", flush=True)
                # returns early on any signal (EINTR): SIGTERM's handler then sets done, a stack
                # signal's (C, no Python handler) does not, and the sleep goes on
                while not done.is_set():
                    ctypes.PyDLL(None).sleep(3600)
        # with a timeout: a SIGTERM the kernel hands to another thread (gRPC's, say) does not
        # wake a main thread blocked for good in a lock; Python runs handlers in the main one
        while not done.wait(0.2):
            pass

    if tracker is not None and args.in_collective:  # inside call N+1, as the engine thread
        wave[0] += 1
        tracker.run("all_reduce", lambda group, *a: hold(), _TP, (_Payload(),), {}, first_arg)
    else:
        hold()
    streamer.stop()
    if evidence is not None:
        evidence.close()
    if record is not None:
        record.close()


class _Payload:
    nbytes = 512  # what the ring and the stream read of a tensor


class _Group:
    unique_name, world_size, rank_in_group, backend = "tp:0", 2, 0, "gloo"


_TP = _Group()


def _returns(group: _Group, data: _Payload) -> _Payload:
    return data


if __name__ == "__main__":
    main()
