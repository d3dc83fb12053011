"""Proof on a CUDA device: the guarded logits path makes no device sync, and what it costs.

Runs the logits detectors' per-wave work (one row reduction on the device, a non-blocking copy
into pinned host memory, an event) on CUDA logits of 256 × 152064, with
`torch.cuda.set_sync_debug_mode("error")` on while the guard's code runs: any operation in it
that synchronises the device raises. Between, a stand-in for the engine samples and copies the
sampled ids to the host (the engine's own wait, as in `get_output`); the checks are read after
it (`DetectorSuite.resolve_ready`), as in the engine. A NaN row in one wave must be reported.
Needs only torch (no vLLM); a few seconds. Without CUDA it says so and exits 0.

    python bench/gpu_no_sync.py [--reqs 256] [--vocab 152064] [--waves 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from guard.config.detectors import DetectorsConfig, LogitsStatsConfig  # noqa: E402
from guard.config.runtime_guard import IncidentsConfig  # noqa: E402
from guard.detectors import logits as logit_checks  # noqa: E402
from guard.detectors.evidence import EvidenceDumper  # noqa: E402
from guard.detectors.suite import DetectorSuite  # noqa: E402
from guard.stream.reporter import IncidentReporter  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reqs", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--waves", type=int, default=200)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_no_sync: SKIPPED, no CUDA device (the CPU stand-in test covers the logic)")
        return 0
    device = torch.device("cuda")
    sent = []
    reporter = IncidentReporter(
        IncidentsConfig(), run_id="g", current_wave=lambda: 0, sink=sent.append
    )
    # logits_stats off: the per-wave path is the row check alone (stats every N waves is a
    # separate, opt-in cost); sync_gate stays off (its default)
    config = DetectorsConfig(logits_stats=LogitsStatsConfig(enabled=False))
    suite = DetectorSuite(config, reporter, EvidenceDumper(config.dump, "g", "r"))
    req_ids = [f"req-{i}" for i in range(args.reqs)]
    runner = types.SimpleNamespace(
        input_batch=types.SimpleNamespace(req_ids=req_ids),
        model_config=types.SimpleNamespace(get_vocab_size=lambda: args.vocab),
    )
    logits = [torch.randn(args.reqs, args.vocab, device=device) for _ in range(2)]
    bad = torch.randn(args.reqs, args.vocab, device=device)
    bad[7, 123] = float("nan")
    weight = torch.randn(args.vocab, 64, device=device)  # a stand-in for the sampling work
    torch.cuda.synchronize()

    host_ns, read_ns = [], []
    start_evt, end_evt = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    strict = "error"  # any synchronising call raises while the guard's code runs
    try:
        for wave in range(1, args.waves + 1):
            batch = bad if wave == args.waves // 2 else logits[wave % 2]
            torch.cuda.set_sync_debug_mode(strict)
            t0 = time.perf_counter_ns()
            suite.on_logits(wave, runner, batch, None)  # the guarded step: reduce, copy, record
            host_ns.append(time.perf_counter_ns() - t0)
            torch.cuda.set_sync_debug_mode("default")
            # the engine's own work: sampling, and the copy of the sampled ids that its
            # get_output waits for (that wait is the engine's, not the guard's)
            sampled = (batch @ weight).argmax(dim=-1).cpu()
            del sampled
            torch.cuda.set_sync_debug_mode(strict)
            t0 = time.perf_counter_ns()
            suite.resolve_ready()  # after sampling: reads the checks whose copy has landed
            read_ns.append(time.perf_counter_ns() - t0)
            torch.cuda.set_sync_debug_mode("default")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    suite.resolve_ready(force=True)
    # device time of the check alone, events around it (read now, outside the debug mode)
    times = []
    for _ in range(50):
        start_evt.record()
        logit_checks.row_max(logits[0])
        end_evt.record()
        end_evt.synchronize()
        times.append(start_evt.elapsed_time(end_evt) * 1e3)
    nan_hits = [i for i in sent if i.type == "logits_finite"]
    print(f"device: {torch.cuda.get_device_name()}; logits {args.reqs} x {args.vocab} float32")
    print(f"guarded waves under set_sync_debug_mode('error'): {args.waves}, no sync raised")
    print(f"host us per wave (on_logits): median {statistics.median(host_ns) / 1e3:.1f}")
    print(f"host us per wave (reading checks): median {statistics.median(read_ns) / 1e3:.1f}")
    print(f"device us per wave (row reduction): median {statistics.median(times):.1f}")
    ok = len(nan_hits) == 1 and nan_hits[0].request_id == "req-7"
    print(f"NaN row found after sampling: {'yes, req-7' if ok else f'NO: {nan_hits}'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
