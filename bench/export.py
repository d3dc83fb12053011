"""OTLP export at a node's full wave rate: what does exporting every wave cost the sidecar?

One run, in this process:

1. The worker's real processor and streamer (tests/support/request_sim.py: simulated vLLM steps,
   no vLLM here) make the batches of a 16-rank node: two DP replicas of TP=8, `--requests`
   requests each, their tp0 ranks with request membership, every rank's waves with an
   all_reduce and an all_gather (the collective tracker's own columns, as tests/support/flood.py
   makes them). A real store holds them, as the
   sidecar's writer would have written them before the exporter runs.
2. The exporter (telemetry/export/otlp.py) at `--otlp-keep-one-in 1` decides on and exports
   every rank-wave, `--rounds` times over, to a real OTLP/gRPC receiver in another process (it
   only counts spans). CPU is this process's (time.process_time, all threads: the exporter's
   own work, protobuf and gRPC's client), so W is rank-waves per CPU-second of the sidecar.
3. Each finished request's trace is built from the store and exported (R: traces per
   CPU-second).

    python bench/export.py [--requests 64] [--rounds 5]

Goal: a 16-rank node at 200 steps/s (3,200 rank-waves/s) fits in one core: W >= 3,200.
Ends with: `export: W waves/s exported unsampled per sidecar core; request traces R/s; spans per wave S`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from prometheus_client import CollectorRegistry  # noqa: E402

from guard.config.runtime_guard import GuardConfig  # noqa: E402
from guard.processor import GuardProcessor  # noqa: E402
from telemetry.cli.table import render_table  # noqa: E402
from telemetry.export.otlp import ExportSettings, OtlpExporter  # noqa: E402
from telemetry.pipeline.writer import Drops, Item  # noqa: E402
from telemetry.store import Store  # noqa: E402
from telemetry.wire.proto import guard_pb2  # noqa: E402
from tests.support.flood import _filler as with_collectives  # noqa: E402
from tests.support.ports import free_port  # noqa: E402
from tests.support.request_sim import Sim, SimRequest, _QuietStreamer, drive, items_of  # noqa: E402

TP, DP = 8, 2
ENGINE = "bench"


def receiver(port: int) -> None:
    """The receiver process: counts the spans it is sent; prints the count on stdin's EOF."""
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    class Counting(trace_service_pb2_grpc.TraceServiceServicer):
        spans = 0

        def Export(self, request, context):  # noqa: N802 - gRPC method name
            for rs in request.resource_spans:
                for ss in rs.scope_spans:
                    Counting.spans += len(ss.spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Counting(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print("ready", flush=True)
    sys.stdin.read()
    print(Counting.spans, flush=True)
    server.stop(0)


def node_items(requests: int) -> list[Item]:
    """Every rank's batches of the simulated node, as ingest hands them to the sinks."""
    items = []
    for dp in range(DP):
        for tp in range(TP):
            rank = guard_pb2.RankInfo(
                run_id="run-bench", engine=ENGINE, dp_rank=dp, dp_size=DP, tp_rank=tp,
                tp_size=TP, pp_size=1, node="node-1", pid=1000 + 10 * dp + tp,
            )  # fmt: skip
            config = GuardConfig(sidecar="localhost:1", liveness_record=False)
            processor = GuardProcessor(config, lambda runner, r=rank: r, _QuietStreamer)
            reqs = [
                SimRequest(f"cmpl-b{dp}-{i}-0", prompt=40 + 7 * i, max_tokens=48 + i % 32,
                           arrive_wave=1 + i)
                for i in range(requests)
            ]  # fmt: skip
            batches = drive(processor, Sim(reqs, budget=512))
            collectives = with_collectives(tp)
            for batch in batches:
                collectives(batch, False)
            items += items_of(batches, ENGINE)
    return items


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64, help="requests per replica")
    parser.add_argument("--rounds", type=int, default=5, help="times every wave is exported")
    parser.add_argument("--receiver", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.receiver:
        receiver(args.receiver)
        return 0

    print(
        f"simulating a {DP * TP}-rank node (DP={DP} x TP={TP}), {args.requests} requests per replica"
    )
    items = node_items(args.requests)
    rank_waves = sum(item.records for item in items)
    port = free_port()
    recv = subprocess.Popen(
        [sys.executable, __file__, "--receiver", str(port)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert recv.stdout.readline().strip() == "ready"
    rows = []
    with tempfile.TemporaryDirectory(prefix="ag-export-") as tmp:
        store = Store(str(Path(tmp) / "store.db"))
        finished: list[tuple[int, int, int]] = []
        store.requests.finished_listeners.append(finished.extend)
        store.write(items)
        drops = Drops(CollectorRegistry())
        settings = ExportSettings(f"http://127.0.0.1:{port}", keep_one_in=1, decision_delay_s=0)
        exporter = OtlpExporter(
            settings, drops, CollectorRegistry(), "node-1", store_path=store.path
        )
        exporter.export_due(float("inf"))  # the store connection and the channel, once
        # waves: every rank-wave, `rounds` times
        wave_cpu, wave_spans = [], 0
        for _ in range(args.rounds):
            before_spans, cpu = exporter.spans_exported, time.process_time()
            exporter.write(items)
            exporter.export_due(float("inf"))
            wave_cpu.append(time.process_time() - cpu)
            wave_spans += exporter.spans_exported - before_spans
            print(f"  round {len(wave_cpu)}/{args.rounds}: {rank_waves} rank-waves in "
                  f"{wave_cpu[-1]:.2f} CPU-s", flush=True)  # fmt: skip
        exported = exporter.decisions.labels("exported")._value.get()
        # request traces: each finished request's, built from the store
        cpu = time.process_time()
        before_spans = exporter.spans_exported
        exporter.on_requests_finished(finished)
        exporter.export_due(float("inf"))
        request_cpu = time.process_time() - cpu
        traces = exporter.request_traces.labels("exported")._value.get()
        request_spans = exporter.spans_exported - before_spans
        exporter.close()
        store.close()
    recv.stdin.close()
    received = int(recv.stdout.readline())
    recv.wait(10)
    lost = sum(drops.totals.values())
    waves_per_cpu = exported / sum(wave_cpu)
    traces_per_cpu = traces / request_cpu if request_cpu else float("inf")
    spans_per_wave = wave_spans / exported
    rows.append(("waves, unsampled", f"{exported:.0f} rank-waves", f"{sum(wave_cpu):.2f}",
                 f"{waves_per_cpu:,.0f} rank-waves/s", f"{spans_per_wave:.2f}"))  # fmt: skip
    rows.append(("request traces", f"{traces:.0f} traces", f"{request_cpu:.2f}",
                 f"{traces_per_cpu:,.0f} traces/s", f"{request_spans / max(traces, 1):.1f} a trace"))  # fmt: skip
    print(render_table(("what", "exported", "CPU s", "per CPU-second", "spans each"), rows))
    sent = exporter.spans_exported
    print(f"receiver got {received} spans of {sent} sent; drops {lost}")
    node_rate = DP * TP * 200
    print(f"a {DP * TP}-rank node at 200 steps/s makes {node_rate} rank-waves/s: "
          f"{node_rate / waves_per_cpu:.2f} of a core to export unsampled")  # fmt: skip
    print(
        f"export: {waves_per_cpu:.0f} waves/s exported unsampled per sidecar core; "
        f"request traces {traces_per_cpu:.0f}/s; spans per wave {spans_per_wave:.2f}"
    )
    return 0 if received == sent else 1


if __name__ == "__main__":
    raise SystemExit(main())
