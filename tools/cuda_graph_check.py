"""Replay accounting of a real CUDA graph holding a torch.distributed all_reduce (torch only).

Run on a machine with a CUDA device (no vLLM needed): `python tools/cuda_graph_check.py`.
It exits 0 with a SKIP line where there is no CUDA device, 0 with an OK line when every check
passes, 1 otherwise; it takes seconds (well under the 5-minute budget).

What it does, with the guard's own code (`guard.collectives.tracker`, `ascend_runtime.attach.graph_collectives`)
bound to the real `torch.cuda.CUDAGraph` exactly as the binder does:
1. an NCCL process group of world size 1; a GroupCoordinator-shaped object whose
   `_all_reduce_out_place` calls `torch.distributed.all_reduce`. vLLM does not communicate in a
   1-rank group, and the tracker skips such groups, so the group is described to the tracker
   as one of 2 ranks: the NCCL call is real, the accounting is what is checked;
2. captures a CUDA graph holding two all_reduces around enough matmuls to take milliseconds:
   the capture notes both (op, group, bytes) and counts nothing;
3. replays it in several waves: each wave counts 2 all_reduces, all replayed, bytes of the
   graph's batch size, consecutive sequence numbers; the device time of each wave's replay
   comes from the tracker's events, resolved without a sync (Event.synchronize and
   torch.cuda.synchronize raise while the tracker runs), and is checked against the script's
   own events around the same replays;
4. right after a replay returns (the device still inside the graph), the heartbeat names the
   graph and its collective list; once the device is done it names nothing.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HIDDEN = 1024
TOKENS = 1024
MATMULS = 40  # device work inside the graph: milliseconds on any GPU
WAVES = 5


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("SKIP cuda_graph_check: no CUDA device")
        return 0
    try:
        import structlog  # noqa: F401 - the guard logs through it
    except ImportError:
        print("FAIL cuda_graph_check: structlog is missing; carry its wheel with the tree")
        return 1
    import torch.distributed as dist

    from ascend_runtime.attach.graph_collectives import captured, graph_wrapper
    from guard.collectives.install import install_tracker, wrap_collective
    from guard.collectives.records import GroupMeta
    from guard.collectives.tracker import CollectiveTracker
    from guard.config.collectives import CollectivesConfig

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
        device_id=torch.device("cuda", 0),
    )  # fmt: skip

    class Coordinator:
        unique_name = "tp:0"

        def _all_reduce_out_place(self, input_):
            out = input_.clone()
            dist.all_reduce(out)
            return out

    Coordinator._all_reduce_out_place = wrap_collective(
        "all_reduce", Coordinator.__dict__["_all_reduce_out_place"]
    )
    graph_cls = torch.cuda.CUDAGraph
    bare = {name: graph_cls.__dict__[name] for name in ("capture_begin", "capture_end", "replay")}
    for name, method in bare.items():
        setattr(graph_cls, name, graph_wrapper(name, method))

    wave = {"n": 0}
    tracker = CollectiveTracker(
        CollectivesConfig(), wave_source=lambda: wave["n"],
        describe_group=lambda g: GroupMeta("tp", "nccl", 0, 2),
        new_event=lambda: torch.cuda.Event(enable_timing=True),
    )  # fmt: skip
    install_tracker(tracker)
    failures: list[str] = []

    def check(ok: bool, what: str) -> None:
        if not ok:
            failures.append(what)
            print(f"  FAILED: {what}")

    coordinator = Coordinator()
    x = torch.randn(TOKENS, HIDDEN, device="cuda")
    w = torch.randn(HIDDEN, HIDDEN, device="cuda") / HIDDEN**0.5

    def forward(t):
        h = coordinator._all_reduce_out_place(t)
        for _ in range(MATMULS):
            h = torch.tanh(h @ w)
        return coordinator._all_reduce_out_place(h)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        install_tracker(None)  # warm-up (NCCL and cuBLAS init) outside the accounting
        want = forward(x)
        install_tracker(tracker)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    graph = graph_cls()
    with torch.cuda.graph(graph):
        out = forward(x)
    record = captured(graph)
    nbytes = TOKENS * HIDDEN * 4
    check(record is not None and len(record.calls) == 2, "the capture noted two all_reduces")
    check([c[2] for c in record.calls] == [nbytes, nbytes], "bytes noted per captured call")
    check(tracker.finished == type(tracker.finished)(), "nothing counted at capture")
    print(f"captured: {record.label}: {record.holds()}")

    def no_sync(*args, **kwargs):
        raise AssertionError("the guard waited for the device")

    saved = (torch.cuda.Event.synchronize, torch.cuda.synchronize)
    ours = []
    seen_in_graph = 0
    from telemetry.wire.collective_columns import to_waves
    from telemetry.wire.proto import guard_pb2

    for n in range(1, WAVES + 1):
        wave["n"] = n
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.Event.synchronize, torch.cuda.synchronize = no_sync, no_sync
        try:
            start.record()
            graph.replay()
            end.record()
            batch = guard_pb2.Batch()
            tracker.fill_batch(batch, with_heartbeat=True)  # device still in the graph
            in_graph = not end.query()
        finally:
            torch.cuda.Event.synchronize, torch.cuda.synchronize = saved
        if in_graph:
            seen_in_graph += 1
            hb = batch.heartbeat
            check(hb.collective_graph == record.label, "heartbeat names the replayed graph")
            check(hb.collective_graph_holds == record.holds(), "heartbeat lists its collectives")
            check((hb.collective_op, hb.collective_group) == ("all_reduce", "tp"), "current op")
        result = out.cpu()  # the sampler's device-to-host copy: the step's own sync
        check(torch.allclose(result, want.cpu(), atol=1e-4), f"wave {n}: replay result")
        ours.append(start.elapsed_time(end) * 1e6)
        torch.cuda.Event.synchronize, torch.cuda.synchronize = no_sync, no_sync
        try:
            tracker.end_wave(n)
            batch = guard_pb2.Batch()
            tracker.fill_batch(batch, with_heartbeat=True)
        finally:
            torch.cuda.Event.synchronize, torch.cuda.synchronize = saved
        check(batch.heartbeat.collective_op == "", f"wave {n}: nothing current after the step")
        (msg,) = to_waves(batch.collective_columns)
        (stat,) = msg.stats
        check((stat.calls, stat.replayed, stat.bytes) == (2, 2, 2 * nbytes), f"wave {n}: counts")
        check((stat.first_seq, stat.last_seq) == (2 * n - 1, 2 * n), f"wave {n}: seq")
        ratio = msg.replay_device_ns / ours[-1] if ours[-1] else 0.0
        check(0.8 <= ratio <= 1.05, f"wave {n}: replay device time {msg.replay_device_ns} ns "
              f"vs the script's events {ours[-1]:.0f} ns")  # fmt: skip
        print(f"wave {n}: all_reduce calls={stat.calls} replayed={stat.replayed} "
              f"bytes={stat.bytes} seq={stat.first_seq}..{stat.last_seq} "
              f"device={msg.replay_device_ns / 1e6:.3f} ms (script {ours[-1] / 1e6:.3f} ms)"
              f"{' heartbeat in graph' if in_graph else ''}")  # fmt: skip
    check(seen_in_graph > 0, "the host got ahead of the device at least once (heartbeat check ran)")
    install_tracker(None)
    for name, method in bare.items():
        setattr(graph_cls, name, method)
    dist.destroy_process_group()
    if failures:
        print(f"FAIL cuda_graph_check: {len(failures)} checks failed")
        return 1
    print(f"OK cuda_graph_check: {WAVES} replays x 2 all_reduces counted as replayed, device "
          "time from events without a sync, heartbeat named the graph")  # fmt: skip
    return 0


if __name__ == "__main__":
    t0 = time.monotonic()
    code = main()
    print(f"took {time.monotonic() - t0:.1f} s", file=sys.stderr)
    os._exit(code)
