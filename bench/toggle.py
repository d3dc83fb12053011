"""Guard overhead on ONE engine: the guard's decorators swapped in and out between rounds.

`overhead.py` compares two servers, which on a 2-core machine differ by more than the effect
being measured (its rounds spread by tens of percent). Here a single in-process vLLM engine
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, TP=1; torch runs its default threads, two here, and the
main thread's affinity stays both cores) runs every round; between rounds the runner class's
`execute_model` / `sample_tokens` are set either to the bare functions (exactly what runs
without the guard) or to the guarded ones, which stream every wave to a real sidecar (a
separate process, every thread of it pinned to core 1). Rounds go off, on, on, off, ... so
drift cancels.

With `--detectors all` (the default) "on" also runs every sampling detector at its default
settings (the sampler and rejection-sampler hooks are swapped together with the runner's);
`--detectors none` measures streaming alone, and a detector's name runs that one alone.

Besides throughput, it reports where the guard's cost lands: its time on the engine thread,
timed in place, less the timers' own cost (the unguarded rounds run the bare methods through
the same timers), in the guarded rounds without the detectors' timers (every other guarded
round carries them, for the detectors' own figure), with the garbage collections it adds (on
against off) in place of any that ran inside it, and each entry's median call against its
mean (a mean well above the median is a few long calls: work done once every so many waves);
the verdict line reads that against the 1% goal, and says whether any other guard wrapper
(the worker's device time, the scheduler's config stamp) stayed on the engine thread: those
step aside here, and one that did not would be guard time the figure misses. Then the
sidecar's CPU; the engine process's CPU by thread, to the nanosecond (the scheduler's own
count), on against off (the engine thread's added CPU beyond the guard's in-place time is the
runner's own code running slower in guarded rounds); and garbage collection. `--engine-core`
gives the engine thread core 0 alone, with one torch thread, and moves everything else to
core 1: the layout of a host whose model does not share cores with the guard's threads and
sidecar. The measured rounds start once the detectors' kernels are in (with no numba cache
they compile on a thread of their own for seconds) and a full collection has swept up what
start-up left.

    python bench/toggle.py [--rounds 12] [--requests 16] [--max-tokens 128]
                           [--detectors all|none|NAME] [--engine-core] [--wave-ring]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from telemetry.cli.table import render_table  # noqa: E402
from tests.support.metrics import value  # noqa: E402
from tests.support.sidecar import SidecarProcess  # noqa: E402
from tools.make_tiny_model import build_tiny_model  # noqa: E402

GOAL_LOSS_PCT = {"none": 1.0, "all": 2.0}  # streaming alone; with every sampling detector
DETECTOR_NAMES = ("logits_finite", "token_repeat", "spec_acceptance", "logits_stats", "token_range")
GOAL_ADDED_US = 30.0
GOAL_IN_PLACE_PCT = 1.0  # issue 10: the guard with defaults, timed in place, share of the wave
DETECTOR_ENTRIES = ("on_schedule", "on_logits", "on_output")
PROMPTS = (
    "The quick brown fox jumps over the lazy dog.",
    "A small model can still answer a simple question.",
    "The weather today is sunny with a light breeze.",
    "She opened the window and listened to the birds.",
)


def abba(rounds: int) -> list[str]:
    """off, on, on, off, off, on, ... (`rounds` of each)."""
    order: list[str] = []
    while len(order) < 2 * rounds:
        order += ["off", "on"] if (len(order) // 2) % 2 == 0 else ["on", "off"]
    return order


def _time_detectors() -> dict:
    """Timers for the detector suite's entry points (bench only): the time spent inside the
    detectors is measured in place, which the round-to-round noise cannot blur. They cost
    time of their own (about 4 us a wave in the engine), so `acc["install"](flag)` puts them
    in or takes them out, and the whole guard is timed in the rounds without them."""
    from guard.decorators import active_processor
    from guard.detectors.suite import DetectorSuite

    acc: dict[str, Any] = {"measured_ns": 0, "measuring": False}
    originals = {name: getattr(DetectorSuite, name) for name in DETECTOR_ENTRIES}
    timers = {}
    for name, original in originals.items():

        def timed(self, *a, _original=original, **kw):
            start = time.perf_counter_ns()
            try:
                return _original(self, *a, **kw)
            finally:
                took = time.perf_counter_ns() - start
                if acc["measuring"]:
                    acc["measured_ns"] += took
                    acc[_original.__name__] = acc.get(_original.__name__, 0) + took
                    acc["n_" + _original.__name__] = acc.get("n_" + _original.__name__, 0) + 1

        timers[name] = timed

    def install(timed: bool) -> None:
        for name in DETECTOR_ENTRIES:
            setattr(DetectorSuite, name, (timers if timed else originals)[name])
        processor = active_processor()
        if processor is not None:  # the processor holds the suite's hooks bound: bind anew
            processor.observers.refresh()

    acc["install"] = install
    return acc


def _time_guard() -> dict:
    """Time the whole guard on the engine thread in place (bench only): the processor's
    `run_step` and `run_sample` less the runner's own call inside them, and the sampler
    hook's `on_logits`.

    The timers cost time of their own, in the same cold code after the model's work, so the
    unguarded rounds run the bare methods through the same timers with nothing between them
    (`timed_bare`, `timed_bare_sampler`): that is `timer_ns`, the timers' own cost in place,
    which the report takes off the guarded rounds' figure.

    A garbage collection runs inside whichever code allocates past the collector's threshold,
    most often vLLM's. `in_guard` is set while the timed code is the guard's (or the timers'),
    so `_time_collections` can tell the collections that ran inside it (`gc_ns`, and
    `gc_timer_ns` in unguarded rounds); the report charges the guard the collections it adds
    (on against off) in their place."""
    from guard.processor import GuardProcessor

    acc: dict[str, Any] = {
        "ns": 0, "timer_ns": 0, "gc_ns": 0, "gc_timer_ns": 0, "measuring": False,
        "in_guard": False, "calls": {},
    }  # fmt: skip

    def counting(fn):
        """`fn` wrapped to add its own time to the returned cell: the runner's call, which the
        in-place figure leaves out (the same wrapper in both modes, so the timers match)."""
        inner = [0]

        def timed_fn(*a, **kw):
            outer = acc["in_guard"]
            acc["in_guard"] = False
            begin = time.perf_counter_ns()
            try:
                return fn(*a, **kw)
            finally:
                inner[0] += time.perf_counter_ns() - begin
                acc["in_guard"] = outer

        return timed_fn, inner

    def own_time(original, key="ns"):
        calls = acc["calls"].setdefault(original.__name__, [])  # each call's figure, in order

        def timed(self, fn, runner, args, kwargs):
            timed_fn, inner = counting(fn)
            outer = acc["in_guard"]
            acc["in_guard"] = True
            start = time.perf_counter_ns()
            try:
                return original(self, timed_fn, runner, args, kwargs)
            finally:
                if acc["measuring"]:
                    took = time.perf_counter_ns() - start - inner[0]
                    acc[key] += took
                    calls.append(took)
                acc["in_guard"] = outer

        return timed

    def whole_time(original, key="ns"):
        calls = acc["calls"].setdefault(f"{key}:{original.__name__}", [])

        def timed(self, *a, **kw):
            outer = acc["in_guard"]
            acc["in_guard"] = True
            start = time.perf_counter_ns()
            try:
                return original(self, *a, **kw)
            finally:
                if acc["measuring"]:
                    took = time.perf_counter_ns() - start
                    acc[key] += took
                    calls.append(took)
                acc["in_guard"] = outer

        return timed

    def timed_bare(fn):
        """`fn` (a bare runner method) inside `own_time`'s timers, with no guard between."""

        def timed(self, *args, **kwargs):
            timed_fn, inner = counting(fn)
            outer = acc["in_guard"]
            acc["in_guard"] = True
            start = time.perf_counter_ns()
            try:
                return timed_fn(self, *args, **kwargs)
            finally:
                if acc["measuring"]:
                    acc["timer_ns"] += time.perf_counter_ns() - start - inner[0]
                acc["in_guard"] = outer

        return timed

    empty_timed = whole_time(lambda self: None, "timer_ns")

    def timed_bare_sampler(fn):
        """`fn` (a bare sampler forward) after an empty call inside `whole_time`'s timer."""

        def timed(self, *args, **kwargs):
            empty_timed(self)
            return fn(self, *args, **kwargs)

        return timed

    GuardProcessor.run_step = own_time(GuardProcessor.run_step)
    GuardProcessor.run_sample = own_time(GuardProcessor.run_sample)
    GuardProcessor.on_logits = whole_time(GuardProcessor.on_logits)
    acc["timed_bare"] = timed_bare
    acc["timed_bare_sampler"] = timed_bare_sampler
    return acc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=12, help="measured rounds per mode")
    parser.add_argument("--requests", type=int, default=16, help="requests per round (one batch)")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument(
        "--detectors",
        choices=("all", "none", *DETECTOR_NAMES),
        default="all",
        help="sampling detectors in 'on': every default one, none, or only the one named",
    )
    parser.add_argument(
        "--engine-core",
        action="store_true",
        help="give the engine thread core 0 to itself, with one torch thread; every other thread "
        "and the sidecar share core 1 (a host where the model does not share the guard's cores)",
    )
    parser.add_argument(
        "--wave-ring",
        action="store_true",
        help="the guard writes its waves into the shared-memory wave ring the sidecar drains "
        "(runtime_guard.wave_ring) instead of streaming them from its gRPC thread",
    )
    args = parser.parse_args(argv)
    if args.engine_core:
        os.environ["OMP_NUM_THREADS"] = "1"  # read when torch loads, below

    os.environ.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_TARGET_DEVICE="cpu", VLLM_CPU_OMP_THREADS_BIND="0",
        TOKENIZERS_PARALLELISM="false",
    )  # fmt: skip
    model = build_tiny_model(REPO / ".cache" / "tiny-llama")
    work = Path(tempfile.mkdtemp(prefix="guard-toggle-"))
    args.live_dir = str(work / "live")  # liveness records and wave rings, shared
    sidecar = SidecarProcess.start(
        work, address=f"unix://{work / 'guard.sock'}", extra_args=("--liveness-dir", args.live_dir)
    )
    _pin_process(sidecar.proc.pid, {1})
    try:
        return _run(args, model, sidecar)
    finally:
        sidecar.stop()


def _run(args: argparse.Namespace, model: Path, sidecar: SidecarProcess) -> int:
    import psutil  # a dependency of vLLM's
    import torch
    from vllm import LLM, SamplingParams
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from guard.decorators import is_guarded, unwrap

    guard = {"sidecar": sidecar.address, "engine": "toggle", "liveness_dir": args.live_dir}
    if args.wave_ring:
        guard["wave_ring"] = True
    if args.detectors != "all":
        guard["detectors"] = {name: {"enabled": name == args.detectors} for name in DETECTOR_NAMES}
    llm = LLM(
        model=str(model), dtype="float32", enforce_eager=True, gpu_memory_utilization=0.1, max_model_len=1024,
        seed=0, additional_config={"runtime_guard": guard},
    )  # fmt: skip
    methods = [
        (GPUModelRunner, "execute_model"),
        (GPUModelRunner, "sample_tokens"),
        (Sampler, "forward"),
        (RejectionSampler, "forward"),
    ]
    guarded = {key: key[0].__dict__[key[1]] for key in methods}
    if not all(is_guarded(m) for m in guarded.values()):
        print("the guard did not bind the runner and samplers; nothing to measure", file=sys.stderr)
        return 2
    bare = {key: unwrap(m) for key, m in guarded.items()}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    inside = _time_detectors()
    guard_time = _time_guard()
    # unguarded rounds: the bare methods, through the in-place timers alone (their own cost)
    unguarded = {
        key: guard_time["timed_bare_sampler" if key[0] is Sampler else "timed_bare"](method)
        if key[0] is not RejectionSampler
        else method
        for key, method in bare.items()
    }

    def set_mode(mode: str) -> None:
        for (cls, name), method in guarded.items():
            setattr(cls, name, method if mode == "on" else unguarded[(cls, name)])

    prompts = [f"{PROMPTS[i % len(PROMPTS)]} #{i}" for i in range(args.requests)]

    sidecar_proc = psutil.Process(sidecar.proc.pid)

    def sidecar_cpu() -> float:
        times = sidecar_proc.cpu_times()
        return times.user + times.system

    thread_cpu: dict[str, dict[int, list[float]]] = {"off": {}, "on": {}}  # per round

    gc_time = _time_collections(guard_time)

    def one_round(mode: str) -> tuple[float, float, float, int, list[list[int]]]:
        """Wall seconds, process CPU seconds (engine and streamer threads), the sidecar's CPU
        seconds, tokens, token ids."""
        set_mode(mode)
        gc_time["mode"] = mode
        cpu, side, threads = time.process_time(), sidecar_cpu(), _thread_times()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        took = time.perf_counter() - start
        cpu, side = time.process_time() - cpu, sidecar_cpu() - side
        per_thread = thread_cpu[mode]
        for tid, spent in _thread_times().items():
            per_thread.setdefault(tid, []).append(spent - threads.get(tid, 0.0))
        ids = [list(o.outputs[0].token_ids) for o in outputs]
        return took, cpu, side, sum(map(len, ids)), ids

    print(
        f"warming up; then {args.rounds} rounds per mode of {args.requests} x {args.max_tokens} tokens"
    )
    tokens_on = 0
    reference: list[list[int]] | None = None
    for mode in ("off", "on", "off", "on"):
        _, _, _, tokens, ids = one_round(mode)
        tokens_on += tokens if mode == "on" else 0
        reference = reference or ids
    untimed = _untimed_guard_wrappers()
    _settle_start_up()
    if args.engine_core:
        _pin_engine_thread()
    times: dict[str, list[float]] = {"off": [], "on": []}
    cpus: dict[str, list[float]] = {"off": [], "on": []}
    sidecar_cpus: dict[str, list[float]] = {"off": [], "on": []}
    identical = True
    inside["measured_ns"] = 0
    thread_cpu["off"].clear()
    thread_cpu["on"].clear()
    gc_time.update(on_ns=0, off_ns=0, on_gen2=0, off_gen2=0)
    # every other guarded round carries the detectors' timers; the whole guard is timed in
    # the others, so their own cost stays out of its figure
    detector_timers = args.detectors != "none"
    wall = {"guard": 0.0, "detectors": 0.0}  # guarded rounds' seconds, by what they timed
    rounds_of = {"guard": 0, "detectors": 0}
    for index, mode in enumerate(abba(args.rounds)):
        timing = (
            "detectors" if mode == "on" and detector_timers and len(times["on"]) % 2 else "guard"
        )
        inside["install"](timing == "detectors")
        inside["measuring"] = timing == "detectors"
        guard_time["measuring"] = timing == "guard"
        took, cpu, side, tokens, ids = one_round(mode)
        if mode == "on":
            wall[timing] += took
            rounds_of[timing] += 1
        times[mode].append(took)
        cpus[mode].append(cpu)
        sidecar_cpus[mode].append(side)
        identical &= ids == reference
        if mode == "on":
            tokens_on += tokens
        print(f"  round {index + 1:2d} {mode:>3}: {tokens / took:8.0f} tok/s", flush=True)
    set_mode("on")
    inside["install"](False)
    inside["measuring"] = guard_time["measuring"] = False
    # each (off, on) pair of adjacent rounds is one paired sample
    paired = [on / off for off, on in zip(times["off"], times["on"], strict=True)]
    paired_cpu = [on / off for off, on in zip(cpus["off"], cpus["on"], strict=True)]

    with contextlib.suppress(TimeoutError):  # the cross-check below says what arrived
        sidecar.wait_for(
            lambda t: value(t, "ascend_guard_sampled_tokens_total", engine="toggle") >= tokens_on,
            15,
        )
    text = sidecar.metrics_text()
    guard_tokens = value(text, "ascend_guard_sampled_tokens_total", engine="toggle")
    dropped = value(text, "ascend_guard_records_dropped_total", engine="toggle")
    waves = value(text, "ascend_guard_waves_total", engine="toggle")

    tokens_per_round = args.requests * args.max_tokens
    med = {mode: statistics.median(values) for mode, values in times.items()}
    rate = {mode: tokens_per_round / med[mode] for mode in med}
    steps_per_round = waves / (args.rounds + 2) if waves else float("nan")
    q = statistics.quantiles(paired, n=4) if len(paired) >= 2 else [paired[0]] * 3
    rows = [
        (mode, f"{rate[mode]:,.0f}", f"{med[mode] * 1e3:.1f}", f"{min(times[mode]) * 1e3:.1f}", f"{max(times[mode]) * 1e3:.1f}")
        for mode in ("off", "on")
    ]  # fmt: skip
    print("\nSAME ENGINE, guard decorators swapped between rounds (TP=1, in-process)")
    print(
        render_table(
            ("guard", "median tok/s", "median ms", "min ms", "max ms"), rows, right=(1, 2, 3, 4)
        )
    )
    loss = (1 - rate["on"] / rate["off"]) * 100
    paired_loss = (statistics.median(paired) - 1) * 100
    added_us = (med["on"] - med["off"]) / steps_per_round * 1e6
    print(
        f"ratio on/off (medians) {rate['on'] / rate['off']:.4f} -> throughput loss {loss:+.2f}%; "
        f"paired rounds on/off time: median {statistics.median(paired):.4f} (IQR {q[0]:.4f}..{q[2]:.4f})"
    )
    print(f"wall time added per wave: {added_us:+.1f} us ({steps_per_round:.0f} waves per round)")
    waves_measured = args.rounds * steps_per_round
    if rounds_of["detectors"]:
        waves_timed = rounds_of["detectors"] * steps_per_round
        share = inside["measured_ns"] / 1e9 / wall["detectors"] * 100
        print(
            f"time inside the detectors (timed in place, in the {rounds_of['detectors']} guarded "
            f"rounds with their timers): {inside['measured_ns'] / 1e3 / waves_timed:.1f} us per "
            f"wave = {share:.2f}% of those rounds' wall time"
        )
        parts = ", ".join(
            f"{name} {inside.get(name, 0) / 1e3 / waves_timed:.1f} us"
            f" ({inside.get('n_' + name, 0) / waves_timed:.2f} calls)"
            for name in DETECTOR_ENTRIES
        )
        print(f"  per entry point and wave: {parts}")
    waves_guard = rounds_of["guard"] * steps_per_round
    guard_us = guard_time["ns"] / 1e3 / waves_guard
    timers_us = guard_time["timer_ns"] / 1e3 / waves_measured
    net_us = guard_us - timers_us
    wave_us = wall["guard"] * 1e6 / waves_guard
    print(
        f"time inside the whole guard on the engine thread (timed in place, in the "
        f"{rounds_of['guard']} guarded rounds without the detectors' timers): {guard_us:.1f} us "
        f"per wave = {guard_us / wave_us * 100:.2f}% of those rounds' wall time"
    )
    print(
        f"  less the timers' own cost in place ({timers_us:.1f} us per wave, timed around the "
        f"bare methods in unguarded rounds): {net_us:.1f} us per wave = "
        f"{net_us / wave_us * 100:.2f}% of the wave"
    )
    _print_per_call(guard_time["calls"], waves_guard)
    # collections that ran inside the timed code, and the ones the guard adds (on against off)
    gc_inside_us = guard_time["gc_ns"] / 1e3 / waves_guard
    gc_timers_us = guard_time["gc_timer_ns"] / 1e3 / waves_measured
    gc_added_us = max(0.0, (gc_time["on_ns"] - gc_time["off_ns"]) / 1e3 / waves_measured)
    own_us = net_us - (gc_inside_us - gc_timers_us) + gc_added_us
    met = own_us / wave_us * 100 <= GOAL_IN_PLACE_PCT
    print(
        f"  of that, garbage collections that ran inside it: {gc_inside_us:.1f} us per wave "
        f"({gc_timers_us:.1f} inside the timers alone); the guard adds {gc_added_us:.1f} us of "
        "collections per wave (on against off, below)"
    )
    print(
        "  guard wrappers left on the engine thread outside these timers: "
        + (", ".join(untimed) + " (not counted above)" if untimed else "none (stepped aside)")
    )
    print(
        f"in-place goal: the guard's own time, with the collections it adds in place of those "
        f"that ran inside it: {own_us:.1f} us per wave = {own_us / wave_us * 100:.2f}% of the "
        f"wave, goal <= {GOAL_IN_PLACE_PCT:g}%: "
        + ("INCOMPLETE (untimed wrappers above)" if untimed else "MET" if met else "MISSED")
    )

    qc = statistics.quantiles(paired_cpu, n=4) if len(paired_cpu) >= 2 else [paired_cpu[0]] * 3
    cpu_added = (statistics.median(cpus["on"]) - statistics.median(cpus["off"])) / steps_per_round
    print(
        f"process CPU per round on/off: paired median {statistics.median(paired_cpu):.4f} "
        f"(IQR {qc[0]:.4f}..{qc[2]:.4f}); CPU added per wave {cpu_added * 1e6:+.1f} us"
    )
    # CPU clocks tick every 10 ms: per-round figures are coarse, so sum over the rounds
    sidecar_mean = {mode: sum(values) / args.rounds for mode, values in sidecar_cpus.items()}
    side_on, side_off = sidecar_mean["on"], sidecar_mean["off"]
    print(
        f"sidecar CPU per round on/off (mean): {side_on * 1e3:.1f} / {side_off * 1e3:.1f} ms; "
        f"per wave {(side_on - side_off) / steps_per_round * 1e6:+.1f} us "
        f"(the sidecar on core 1; {torch.get_num_threads()} torch thread(s), "
        f"{'the engine thread alone on core 0' if args.engine_core else 'on both cores'})"
    )
    threads_us = _print_thread_cpu(thread_cpu, steps_per_round)
    print(
        f"garbage collection per wave on/off: {gc_time['on_ns'] / 1e3 / waves_measured:.1f}"
        f" / {gc_time['off_ns'] / 1e3 / waves_measured:.1f} us; full collections "
        f"{gc_time['on_gen2']} / {gc_time['off_gen2']}"
    )
    print(
        f"cross-check: sidecar sampled tokens {guard_tokens:.0f} vs tokens generated in guarded rounds "
        f"{tokens_on} ({'match' if guard_tokens == tokens_on else 'MISMATCH'}); dropped {dropped:.0f}; "
        f"greedy outputs identical across all rounds: {identical}"
    )
    # 95% interval of the median paired loss: sigma from the IQR, standard error of a median
    sigma = (q[2] - q[0]) / 1.349
    half_width = 2 * 1.2533 * sigma / math.sqrt(len(paired)) * 100
    low, high = paired_loss - half_width, paired_loss + half_width
    goal = GOAL_LOSS_PCT.get(args.detectors, GOAL_LOSS_PCT["all"])
    if high < goal:
        verdict = "PASS"
    elif low > goal:
        verdict = "FAIL"
    else:
        verdict = "UNRESOLVED: the interval straddles the goal; this machine is too noisy to tell"
    print(
        f"verdict: paired throughput loss {paired_loss:+.2f}% (95% interval {low:+.2f}% .. {high:+.2f}%), "
        f"goal < {goal}% (detectors: {args.detectors}): {verdict}"
    )
    sidecar_us = (side_on - side_off) / steps_per_round * 1e6
    print(
        f"worker ({'wave ring' if args.wave_ring else 'gRPC streamer'}, {args.requests} requests): "
        f"in place {own_us:.1f} us/wave ({own_us / wave_us * 100:.2f}%); process added "
        f"{cpu_added * 1e6:.1f} us/wave (Z/X = {cpu_added * 1e6 / own_us:.2f}); other guard "
        f"threads {threads_us:.1f} us/wave; sidecar {sidecar_us:.1f} us/wave"
    )
    return 0 if guard_tokens == tokens_on and identical else 1


def _pin_process(pid: int, cores: set[int]) -> None:
    """Every thread of process `pid` to `cores`. `sched_setaffinity(pid)` alone moves only the
    thread whose id is `pid`; the threads it started before keep every core."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux: leave the process be
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):  # a thread that has just ended
                os.sched_setaffinity(int(task.name), cores)


def _untimed_guard_wrappers() -> list[str]:
    """The guard's wrappers that run on the engine thread every wave besides the runner's and
    samplers' (which the in-place timers cover): the worker's device time and the scheduler's
    config stamp. Here (CPU, no config file) each steps aside at its first call; one still in
    place would be guard time the in-place figure misses."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_worker import Worker

    from guard.decorators import is_guarded

    methods = [(Worker, "execute_model"), (Worker, "sample_tokens"), (Scheduler, "schedule")]
    return [f"{cls.__name__}.{name}" for cls, name in methods if is_guarded(cls.__dict__.get(name))]


def _pin_engine_thread() -> None:
    """The calling (engine) thread to core 0, every other thread of this process to core 1.
    Threads started later inherit their starter's affinity, so this runs once the guard's
    threads are up."""
    _pin_process(os.getpid(), {1})
    os.sched_setaffinity(0, {0})  # on Linux, 0 names the calling thread alone
    print(f"engine thread {threading.get_native_id()} pinned to core 0; every other to core 1")


def _settle_start_up() -> None:
    """Let start-up finish before the measured rounds, so that what it leaves behind is not
    charged to either mode's waves.

    The detectors' compiled kernels load on a thread of their own from the first guarded wave;
    with no numba cache (a fresh checkout) they compile for seconds, and rounds measured
    meanwhile time the compiler's hold of the GIL (125 us a wave once, against 25). Wait for
    that load. The compile also leaves enough long-lived objects that a full collection came
    due in a measured round: in a fresh checkout at 256 requests one ran in a guarded round
    (about 60 ms, 320 us a wave charged to the guard, against 65-100 with a cache). Run it now.
    """
    import gc

    from guard.detectors import compiled

    if compiled.loading():
        print("waiting for the detectors' kernels to compile (no numba cache yet)", flush=True)
        with contextlib.suppress(Exception):  # a failed load is the guard's to report
            compiled.load()
    gc.collect()


def _print_per_call(calls: dict[str, list[int]], waves: float) -> None:
    """Each guarded entry's figure per call, median against mean (timers included): a mean
    well above its median is a few long calls, such as a batch's work done once every so
    many waves (issue 10, session 23 found the token log's hand-over that way)."""
    timed = {
        name.removeprefix("ns:"): took
        for name, took in calls.items()
        if took and not name.startswith("timer_ns:")  # the bare methods' timers: not the guard
    }
    if not timed or not waves:
        return
    parts = [
        f"{name} median {statistics.median(took) / 1e3:.1f} mean {statistics.fmean(took) / 1e3:.1f}"
        for name, took in timed.items()
    ]
    above = sum(
        (statistics.fmean(took) - statistics.median(took)) * len(took) for took in timed.values()
    )
    print(
        f"  per call, us (timers included): {'; '.join(parts)}; the calls above their "
        f"medians add {above / 1e3 / waves:.1f} us per wave"
    )


def _time_collections(guard_time: dict) -> dict:
    """Time the garbage collector by round mode (bench only): objects the guard allocates each
    wave make collections come sooner, and a full one walks vLLM's whole heap. A collection
    that runs inside the guard's timed code is also added to `guard_time` (`_time_guard`)."""
    import gc

    acc: dict = {"mode": "off", "start": 0, "on_ns": 0, "off_ns": 0, "on_gen2": 0, "off_gen2": 0}

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            acc["start"] = time.perf_counter_ns()
            return
        mode = acc["mode"]
        took = time.perf_counter_ns() - acc["start"]
        acc[mode + "_ns"] += took
        acc[mode + "_gen2"] += info.get("generation") == 2
        if guard_time["in_guard"] and guard_time["measuring"]:
            guard_time["gc_ns" if mode == "on" else "gc_timer_ns"] += took

    gc.callbacks.append(timed)
    return acc


def _thread_times() -> dict[int, float]:
    """CPU seconds each thread of this process has run, to the nanosecond: the first field of
    `/proc/self/task/<tid>/schedstat` (the scheduler's own count; psutil's per-thread times
    tick every 10 ms, too coarse for tens of microseconds a wave)."""
    out: dict[int, float] = {}
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):  # a thread that just ended
            out[int(task.name)] = int((task / "schedstat").read_text().split()[0]) / 1e9
    return out


def _thread_comm(tid: int) -> str:
    """The kernel's name for a thread no Python `Thread` object stands for (torch's, gloo's)."""
    try:
        return Path(f"/proc/self/task/{tid}/comm").read_text().strip() + " (native)"
    except OSError:
        return "(ended)"


def _thread_label(thread: Any) -> str:
    """A thread's name, with its target's module when the name alone does not say whose it is."""
    target = getattr(thread, "_target", None)  # private, but the one place the target is kept
    owner = getattr(target, "__module__", None) or getattr(
        getattr(target, "__self__", None), "__module__", None
    )
    return f"{thread.name} [{owner}]" if owner else thread.name


def _guard_thread(label: str) -> bool:
    """A thread the guard runs in the worker: its own (ascend-guard-*) or gRPC's, which pulls
    the streamer's batches."""
    return "ascend-guard" in label or "grpc" in label


def _print_thread_cpu(thread_cpu: dict[str, dict[int, list[float]]], waves: float) -> float:
    """The engine process's CPU per wave by thread, on against off (medians of the rounds, as
    for the wall time): where the CPU the guard adds outside its own code goes (its gRPC and
    streamer threads, torch's threads, the engine thread's own work running slower). Returns
    the guard's threads' added CPU per wave (us), the engine thread's excluded."""
    names = {t.native_id: _thread_label(t) for t in threading.enumerate()}
    rows = []
    guard_us = 0.0
    for tid in sorted(set(thread_cpu["on"]) | set(thread_cpu["off"])):
        on = statistics.median(thread_cpu["on"].get(tid) or [0.0])
        off = statistics.median(thread_cpu["off"].get(tid) or [0.0])
        if max(sum(thread_cpu[mode].get(tid, ())) for mode in ("on", "off")) < 0.001:
            continue  # under a millisecond in all: an idle thread
        label = names.get(tid) or _thread_comm(tid)
        if _guard_thread(label):
            guard_us += (on - off) / waves * 1e6
        rows.append(
            (
                str(tid),
                label,
                f"{on / waves * 1e6:.1f}",
                f"{off / waves * 1e6:.1f}",
                f"{(on - off) / waves * 1e6:+.1f}",
            )
        )
    print("engine process CPU per wave by thread (us; median round)")
    print(render_table(("tid", "thread", "on", "off", "added"), rows, right=(2, 3, 4)))
    return guard_us


if __name__ == "__main__":
    sys.exit(main())
