"""What collective instrumentation costs: ns per call, its share of a step, and throughput at TP=2.

**Micro (in-process).** A GroupCoordinator-shaped object whose `_all_reduce_out_place` is a
real `torch.distributed.all_reduce` on a one-rank gloo group (a decode-size tensor: 1 token x
hidden 128 x fp32), called through three bindings in interleaved rounds:
bare (vLLM without the guard), wrapped with no tracker (guard off) and wrapped with a tracker
(guard on: numbering, per-wave aggregates, a wave roll every 6 calls as in the tiny model).
The same three on a no-op method give the pure cost of the wrapper.

**Macro (real servers).** Two `vllm serve` at TP=2 on the tiny model, both with the guard on and
streaming to one sidecar; A has `collectives.enabled=false`, B records collectives. Rounds go
A, B, B, A, ... with one server loaded at a time; output tokens/s per round, medians and the
paired B/A ratios. On a 2-core machine the rounds spread by several percent, far more than
the effect; the micro numbers and the measured step time give the share that the macro
numbers cannot resolve.

**Compiled (in-process, torch.compile with inductor).** The same calls made from inside a
compiled function, as vLLM's compiled model makes them: on CPU Dynamo inlines the communicator
down to its kernel (a gloo all_reduce, or a no-op kernel); on CUDA / Ascend the graph calls
vLLM's custom op. Bare is the compiled function as vLLM runs it without the guard; guard off
and on add the guard's wrapper around the compiled callable (`compiled_collectives.counted`,
what the guard puts on vLLM's `VllmSerializableFunction.__call__`), which counts the graph's
`COMPILED_CALLS` collectives per compiled call (dim 0 symbolic, read per call). Compiled steps
are entered as vLLM enters them (`--entry bytecode`, its `VLLM_USE_BYTECODE_HOOK` default: the
bytecode Dynamo made runs as a plain function); `--entry dynamo` goes through the
`torch.compile` wrapper instead, whose eval-frame callback sees every frame inside.

All variants run in one interleaved schedule (every variant's modes in turn, the order
reversed every other round), so each round's on - bare is a paired difference. The summary
compares the guard's added cost per collective compiled against eager on the same path: the
CPU path against the wrapped method called eagerly, the custom-op path against the custom op
called eagerly (vLLM's eager CUDA / Ascend path: its implementation reaches the wrapped
method, which counts per call). The last line reads
`collectives: compiled/eager guard cost per call: CPU path X, custom op Y; goal <= 1: ...`.

    python bench/collectives.py [--calls 20000] [--rounds 15] [--macro-rounds 6] [--no-macro]
                                [--entry bytecode|dynamo]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from telemetry.cli.table import render_table  # noqa: E402

CALLS_PER_WAVE = 6  # tiny model at TP=2: 5 all-reduces + 1 all-gather per step
COMPILED_CALLS = 6  # collectives per compiled call (a wave's worth)


def _timed_round(tracker, wave: dict, on: bool, calls: int, per_wave: int, fn, *args) -> float:
    """One round of `calls` calls of `fn(*args)`, a new wave every `per_wave` of them, with the
    tracker installed when `on` (guard on) and none otherwise: ns per call."""
    from guard.collectives.install import install_tracker

    install_tracker(tracker if on else None)
    start = time.perf_counter_ns()
    for i in range(calls):
        if i % per_wave == 0:
            wave["n"] += 1
        fn(*args)
    elapsed = time.perf_counter_ns() - start
    install_tracker(None)
    tracker.finished.clear()
    return elapsed / calls


def _micro(calls: int, rounds: int, entry: str) -> dict[str, dict[str, list[float]]]:
    import torch
    import torch.distributed as dist

    from guard.collectives.install import wrap_collective as wrap
    from guard.collectives.tracker import CollectiveTracker
    from guard.config.collectives import CollectivesConfig

    store = tempfile.NamedTemporaryFile(prefix="ag-bench-", delete=False)  # noqa: SIM115
    dist.init_process_group("gloo", init_method=f"file://{store.name}", rank=0, world_size=1)
    group = dist.new_group([0], backend="gloo")
    tensor = torch.ones(1, 128, dtype=torch.float32)

    class Coordinator:
        unique_name = "tp:0"
        world_size = 2  # as the guard sees a TP=2 group; the transport below is one rank
        rank_in_group = 0

        def _all_reduce_out_place(self, input_):
            dist.all_reduce(input_, group=group)
            return input_

        def noop(self, input_):
            return input_

    bare = Coordinator()
    wave = {"n": 1}
    tracker = CollectiveTracker(CollectivesConfig(), wave_source=lambda: wave["n"])
    compiling = torch.compiler.is_compiling
    variants = {}
    for name in ("_all_reduce_out_place", "noop"):
        fn = getattr(Coordinator, name)
        variants[name] = {
            "bare": fn,
            "guard off": wrap("all_reduce", fn, is_compiling=compiling),
            "guard on": wrap("all_reduce", fn, is_compiling=compiling),
        }

    runners: dict[str, dict[str, Callable[[], float]]] = {}
    for name, by_mode in variants.items():
        runners[name] = {
            mode: functools.partial(
                _timed_round,
                tracker,
                wave,
                mode == "guard on",
                calls,
                CALLS_PER_WAVE,
                method,
                bare,
                tensor,
            )
            for mode, method in by_mode.items()
        }
    cleanups: list[Callable[[], None]] = []
    runners.update(_compiled(calls, group, tracker, wave, entry, cleanups))
    samples = _interleave(runners, rounds)
    for cleanup in cleanups:
        cleanup()
    dist.destroy_process_group()
    os.unlink(store.name)
    return samples


def _interleave(
    runners: dict[str, dict[str, Callable[[], float]]], rounds: int
) -> dict[str, dict[str, list[float]]]:
    """Every variant's modes, one round each in turn, the order reversed every other round
    (round 0 warms up and is dropped): rounds of eager and compiled lie side by side in
    time, so the paired ratios of one round share the machine's state."""
    import torch

    samples = {label: {mode: [] for mode in modes} for label, modes in runners.items()}
    with torch.inference_mode():
        for r in range(rounds + 1):
            labels = list(runners) if r % 2 else list(reversed(runners))
            for label in labels:
                modes = list(runners[label])
                for mode in modes if r % 2 else reversed(modes):
                    ns = runners[label][mode]()
                    if r:
                        samples[label][mode].append(ns)
    return samples


def _compiled_fns(step, example, reset: bool = True, entry: str = "bytecode") -> dict:
    """`step` compiled with inductor twice: bare (vLLM without the guard), and with the
    guard's per-compiled-graph-call wrapper (guard off: no tracker installed; guard on).

    `entry` is how each compiled step is entered. "bytecode" is vLLM's own way
    (`VLLM_USE_BYTECODE_HOOK=1`, its default for `VLLM_COMPILE`): the bytecode Dynamo made
    of `step` runs as a plain function, with no eval-frame callback. "dynamo" calls the
    `torch.compile` wrapper, whose callback then sees every Python frame run inside it."""
    import types

    import torch
    from torch._inductor.compile_fx import compile_fx

    from ascend_runtime.attach import compiled_collectives

    def counted_backend(gm, example_inputs):
        return compiled_collectives.counted(gm, compile_fx(gm, example_inputs))

    if reset:
        torch._dynamo.reset()
    made: list = []  # the bytecode Dynamo produced for `step`, once per compile

    def keep(old_code, new_code):
        if old_code is step.__code__:
            made.append(new_code)

    hook = torch._dynamo.convert_frame.register_bytecode_hook(keep)
    try:
        fns = {}
        for mode, backend in (("bare", "inductor"), ("guard off", counted_backend)):
            compiled = torch.compile(step, backend=backend, fullgraph=True)
            torch._dynamo.mark_dynamic(example, 0)  # the batch size is symbolic, as in vLLM
            compiled(example)  # compile outside the timing
            if entry == "dynamo":
                fns[mode] = compiled
            else:  # Dynamo keeps the arguments and free variables, so the code swaps in
                code = made[-1]
                fns[mode] = types.FunctionType(
                    code, step.__globals__, step.__name__, step.__defaults__, step.__closure__
                )
                torch._dynamo.eval_frame.remove_from_cache(step.__code__)  # compile anew
    finally:
        hook.remove()
    fns["guard on"] = fns["guard off"]
    for fn in fns.values():
        fn(example)
    return fns


def _compiled_runners(fns: dict, n: int, tracker, wave, tensor) -> dict[str, Callable[[], float]]:
    """Per mode, a round of `n` compiled calls, a wave each: ns per collective."""

    def run(fn, on: bool) -> float:
        return _timed_round(tracker, wave, on, n, 1, fn, tensor) / COMPILED_CALLS

    return {mode: functools.partial(run, fn, mode == "guard on") for mode, fn in fns.items()}


def _compiled(
    calls: int, group, tracker, wave, entry: str, cleanups: list
) -> dict[str, dict[str, Callable[[], float]]]:
    """Per-collective ns of collectives made inside an inductor-compiled function, as vLLM's
    compiled model makes them on CPU: Dynamo inlines the communicator down to its kernel (a
    real one-rank gloo all_reduce; or a no-op kernel of the scanner's table, to see the
    guard's own cost); the guard counts them per compiled-graph call."""
    import weakref

    import torch
    import torch.distributed as dist
    from vllm.distributed import parallel_state

    from ascend_runtime.attach import compiled_collectives

    lib = torch.library.Library("ag_bench", "FRAGMENT")
    lib.define("noop_allreduce(int handle, Tensor(a!) data) -> ()")
    lib.impl("noop_allreduce", lambda handle, data: None, "CompositeExplicitAutograd")
    lib._register_fake("noop_allreduce", lambda handle, data: None)
    compiled_collectives.KERNELS["ag_bench::noop_allreduce"] = ("all_reduce", 1, "handle", 0)

    class ShmModule:  # what the scanner resolves a kernel's handle through
        handle = 4242

    class Communicator:  # CpuCommunicator's shape
        dist_module = ShmModule()

        def all_reduce(self, input_):
            dist.all_reduce(input_, group=group)
            return input_

    class NoopCommunicator(Communicator):
        def all_reduce(self, input_):
            torch.ops.ag_bench.noop_allreduce(4242, input_)
            return input_

    class Coordinator:
        unique_name = "tp:bench"
        world_size = 2  # as the guard sees a TP=2 group; the transport is one rank
        rank_in_group = 0
        device_group = group

    runners: dict[str, dict[str, Callable[[], float]]] = {}
    tensor = torch.ones(2, 64, dtype=torch.float32)  # 512 B; dim 0 symbolic (not 0/1)
    n = max(1, calls // COMPILED_CALLS)
    alive: list = [lib]  # until the timing ends: a dropped Library takes its op away
    for label, cls in (("compiled _all_reduce_out_place", Communicator),
                       ("compiled noop", NoopCommunicator)):  # fmt: skip
        coordinator = Coordinator()
        coordinator.unique_name = f"tp:bench-{len(alive)}"  # both stay registered till the end
        coordinator.device_communicator = comm = cls()
        parallel_state._groups[coordinator.unique_name] = weakref.ref(coordinator)

        def step(x, comm=comm):
            for _ in range(COMPILED_CALLS):
                comm.all_reduce(x)
            return x

        fns = _compiled_fns(step, tensor.clone(), entry=entry)
        assert tracker.errors == 0, f"{label}: the guard could not read the compiled graph"
        runners[label] = _compiled_runners(fns, n, tracker, wave, tensor)
        cleanups.append(functools.partial(parallel_state._groups.pop, coordinator.unique_name))
        alive.append(coordinator)  # the group table holds weak references
    cleanups.append(functools.partial(compiled_collectives.KERNELS.pop, "ag_bench::noop_allreduce"))
    runners.update(_compiled_custom_op(n, tracker, wave, tensor, entry, cleanups))
    cleanups.append(alive.clear)
    return runners


def _compiled_custom_op(
    n: int, tracker, wave, tensor, entry: str, cleanups: list
) -> dict[str, dict[str, Callable[[], float]]]:
    """CUDA / Ascend shape: the compiled graph calls vLLM's own opaque `torch.ops.vllm.all_reduce`,
    whose implementation calls `GroupCoordinator._all_reduce_out_place` (no-op body here);
    bare = that method unwrapped (vLLM without the guard), guard off / on = wrapped."""
    import weakref

    import torch
    from vllm.distributed import parallel_state

    from ascend_runtime.attach.collectives import collective_wrapper

    def out_place(self, input_):
        return torch.empty_like(input_)  # a new tensor, as a device communicator returns

    coordinators = {}
    for name, method in (("bare", out_place),
                         ("guarded", collective_wrapper("_all_reduce_out_place", out_place))):  # fmt: skip
        cls = type(f"Coordinator_{name}", (), {
            "unique_name": f"tp:op-{name}", "world_size": 2, "rank_in_group": 0,
            "_all_reduce_out_place": method,
        })  # fmt: skip
        coordinators[name] = cls()
        parallel_state._groups[cls.unique_name] = weakref.ref(coordinators[name])

    def make(group_name: str):
        def step(x):
            for _ in range(COMPILED_CALLS):
                x = torch.ops.vllm.all_reduce(x, group_name=group_name)
            return x

        return step

    fns = _compiled_fns(make("tp:op-bare"), tensor.clone(), entry=entry)
    bare = fns["bare"]
    fns = _compiled_fns(make("tp:op-guarded"), tensor.clone(), reset=False, entry=entry)
    fns["bare"] = bare
    for name in coordinators:
        cleanups.append(functools.partial(parallel_state._groups.pop, f"tp:op-{name}"))
    cleanups.append(coordinators.clear)

    def eager(group_name: str, on: bool) -> Callable[[], float]:
        """The eager CUDA / Ascend path: `GroupCoordinator.all_reduce` calls the custom op,
        whose implementation reaches the wrapped method (the guard's per-call count)."""
        op = functools.partial(torch.ops.vllm.all_reduce, group_name=group_name)
        calls = n * COMPILED_CALLS
        return functools.partial(_timed_round, tracker, wave, on, calls, CALLS_PER_WAVE, op, tensor)

    return {
        "eager vllm custom op": {
            "bare": eager("tp:op-bare", False),
            "guard off": eager("tp:op-guarded", False),
            "guard on": eager("tp:op-guarded", True),
        },
        "compiled vllm custom op": _compiled_runners(fns, n, tracker, wave, tensor),
    }


def _macro(rounds: int, requests: int, max_tokens: int) -> dict:
    from tests.support.metrics import value
    from tests.support.sidecar import SidecarProcess
    from tests.support.vllm_server import VllmServer
    from tools.make_tiny_model import build_tiny_model

    model = Path(build_tiny_model(REPO / ".cache" / "tiny-llama"))
    root = Path(tempfile.mkdtemp(prefix="ag-bench-coll-", dir="/tmp"))
    sidecar = SidecarProcess.start(root, address=f"unix://{root / 'guard.sock'}")
    servers = {}
    try:
        for name, enabled in (("A", False), ("B", True)):
            guard = {"sidecar": sidecar.address, "engine": f"bench-coll-{name}",
                     "collectives": {"enabled": enabled}}  # fmt: skip
            servers[name] = VllmServer.start(model, root, tp=2, guard=guard)
        prompts = [f"Benchmark prompt number {i} says" for i in range(requests)]
        for server in servers.values():  # warm-up
            server.complete_many(prompts, max_tokens=8)
        tps: dict[str, list[float]] = {"A": [], "B": []}
        order = []
        while len(order) < 2 * rounds:
            order += ["A", "B"] if (len(order) // 2) % 2 == 0 else ["B", "A"]
        for name in order:
            start = time.perf_counter()
            out = servers[name].complete_many(prompts, max_tokens=max_tokens)
            elapsed = time.perf_counter() - start
            tps[name].append(sum(r["usage"]["completion_tokens"] for r in out) / elapsed)
        text = sidecar.metrics_text()
        labels = {"engine": "bench-coll-B", "tp": "0"}
        step_s = value(
            text, "ascend_guard_step_duration_seconds_sum", phase="step", **labels
        ) / max(
            1.0, value(text, "ascend_guard_step_duration_seconds_count", phase="step", **labels)
        )
        calls = value(text, "ascend_guard_collective_calls_total", **labels)
        waves = value(text, "ascend_guard_waves_total", **labels) - value(
            text, "ascend_guard_dummy_waves_total", **labels
        )
        pairs = [b / a for a, b in zip(tps["A"], tps["B"], strict=True)]
        return {
            "tps": tps,
            "pairs": pairs,
            "step_s": step_s,
            "calls_per_wave": calls / max(1, waves),
        }
    finally:
        for server in servers.values():
            server.stop()
        sidecar.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=20000, help="calls per micro round")
    parser.add_argument("--rounds", type=int, default=15, help="micro rounds per variant")
    parser.add_argument("--macro-rounds", type=int, default=6, help="macro rounds per server")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--no-macro", action="store_true", help="micro only (no vLLM)")
    parser.add_argument(
        "--entry",
        choices=("bytecode", "dynamo"),
        default="bytecode",
        help="how compiled steps are entered: vLLM's bytecode hook (its default) or the "
        "torch.compile wrapper (the eval-frame callback sees every frame inside)",
    )
    args = parser.parse_args(argv)

    samples = _micro(args.calls, args.rounds, args.entry)
    best = {k: {mode: min(v) for mode, v in modes.items()} for k, modes in samples.items()}
    median = {
        k: {mode: statistics.median(v) for mode, v in modes.items()} for k, modes in samples.items()
    }
    rows = []
    for name, label in (
        ("_all_reduce_out_place", "eager gloo all_reduce 512 B"),
        ("noop", "eager no-op"),
        ("compiled _all_reduce_out_place", "compiled gloo all_reduce 512 B"),
        ("compiled noop", "compiled no-op (CPU path, inlined)"),
        ("eager vllm custom op", "eager via vLLM custom op, no-op"),
        ("compiled vllm custom op", "compiled via vLLM custom op, no-op"),
    ):
        for figure, m in (("best round", best[name]), ("median", median[name])):
            rows.append((f"{label}, {figure}", f"{m['bare']:.0f}", f"{m['guard off']:.0f}",
                         f"{m['guard on']:.0f}", f"{m['guard off'] - m['bare']:+.0f}",
                         f"{m['guard on'] - m['bare']:+.0f}"))  # fmt: skip
    print(f"Micro: ns per call over {args.rounds} interleaved rounds (best round, and the median); "
          f"compiled steps entered as {args.entry}")  # fmt: skip
    print(render_table(("call", "bare", "guard off", "guard on", "off - bare", "on - bare"), rows,
                       right=(1, 2, 3, 4, 5)))  # fmt: skip

    def added(label: str) -> list[float]:
        """Per round, the guard's added ns per call: on minus bare of the same round."""
        m = samples[label]
        return [on - bare for on, bare in zip(m["guard on"], m["bare"], strict=True)]

    print(
        "\nCompiled vs eager, the guard's added host cost per collective call: the median over "
        "rounds of (on - bare) within a round, and the same for the best rounds (goal: ratio <= 1)"
    )
    verdict_rows, ratios = [], {}
    for compiled, eager, what in (
        ("compiled noop", "noop", "CPU path (Dynamo inlines the kernel), no-op"),
        (
            "compiled vllm custom op",
            "eager vllm custom op",
            "vLLM custom op (CUDA / Ascend), no-op",
        ),
        ("compiled vllm custom op", "noop", "custom op compiled, against eager no-op method"),
        ("compiled _all_reduce_out_place", "_all_reduce_out_place", "CPU path, gloo 512 B"),
    ):
        c_med, e_med = statistics.median(added(compiled)), statistics.median(added(eager))
        c_best = best[compiled]["guard on"] - best[compiled]["bare"]
        e_best = best[eager]["guard on"] - best[eager]["bare"]
        ratios[(compiled, eager)] = c_med / max(e_med, 1.0)
        verdict_rows.append((what, f"{c_med / 1e3:.2f}", f"{e_med / 1e3:.2f}",
                             f"{ratios[(compiled, eager)]:.2f}", f"{c_best / max(e_best, 1.0):.2f}"))  # fmt: skip
    print(render_table(("path", "compiled us", "eager us", "ratio", "ratio of best rounds"),
                       verdict_rows, right=(1, 2, 3, 4)))  # fmt: skip
    cpu = ratios[("compiled noop", "noop")]
    custom = ratios[("compiled vllm custom op", "eager vllm custom op")]
    ok = cpu <= 1.0 and custom <= 1.0
    print(
        f"collectives: compiled/eager guard cost per call: CPU path {cpu:.2f}, custom op "
        f"{custom:.2f}; goal <= 1: {'PASS' if ok else 'FAIL'} (the gloo row is reported, not "
        "judged: the transport's own spread is larger than the guard's cost)"
    )
    added_ns = best["noop"]["guard on"] - best["noop"]["bare"]
    if args.no_macro:
        return 0
    macro = _macro(args.macro_rounds, args.requests, args.max_tokens)
    a, b = statistics.median(macro["tps"]["A"]), statistics.median(macro["tps"]["B"])
    pairs = sorted(macro["pairs"])
    print(
        "\nMacro: TP=2 vllm serve, output tokens/s (A: collectives off, B: on), rounds A,B,B,A..."
    )
    print(render_table(
        ("server", "median tok/s", "min", "max"),
        [("A off", f"{a:.1f}", f"{min(macro['tps']['A']):.1f}", f"{max(macro['tps']['A']):.1f}"),
         ("B on", f"{b:.1f}", f"{min(macro['tps']['B']):.1f}", f"{max(macro['tps']['B']):.1f}")],
        right=(1, 2, 3),
    ))  # fmt: skip
    print(f"B/A median ratio {b / a:.4f} (loss {100 * (1 - b / a):+.2f}%); paired ratios: median "
          f"{statistics.median(pairs):.4f}, range {pairs[0]:.4f}..{pairs[-1]:.4f}")  # fmt: skip
    share = added_ns * macro["calls_per_wave"] / (macro["step_s"] * 1e9)
    print(f"Share of the step: {added_ns:.0f} ns x {macro['calls_per_wave']:.1f} calls per wave / "
          f"{macro['step_s'] * 1e3:.2f} ms per step = {100 * share:.4f}% (goal: < 1%)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
