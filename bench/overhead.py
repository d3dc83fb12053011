"""Guard overhead, guard off and guard on side by side in one run.

Macro (throughput): one sidecar and two vLLM OpenAI servers on the same tiny model at TP=1, one
with the guard off and one streaming to the sidecar. Both engines' workers are pinned to the
same core (`VLLM_CPU_OMP_THREADS_BIND`), the client and the sidecar to the other one(s). After a
warm-up, rounds alternate A,B,B,A,A,B,... (one server loaded at a time); each round sends N
concurrent greedy completions with `ignore_eos` and a fixed `max_tokens`, and its output tokens/s
come from the API's `usage.completion_tokens` over the round's wall time.

Micro (host time per step): in-process, no server. A fake runner whose `execute_model` /
`sample_tokens` do next to nothing is called with a real vLLM `SchedulerOutput` (16 running
decode requests) and returns a real `ModelRunnerOutput`; its steps are timed bare, decorated
with the guard off, and decorated with the guard on (records streamed to a live sidecar, and
records only buffered because the sidecar address is dead). Variants are interleaved block by
block with the garbage collector off.

    python bench/overhead.py [--rounds N] [--requests N] [--max-tokens N] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: make the repo's tests.support importable

from telemetry.cli.table import render_table  # noqa: E402
from tests.support.metrics import value  # noqa: E402
from tests.support.ports import free_port  # noqa: E402
from tests.support.ready import wait_http_ok  # noqa: E402

DEFAULT_MODEL_DIR = REPO / ".cache" / "tiny-llama"
THROUGHPUT_LOSS_GOAL_PCT = 1.0
ADDED_HOST_TIME_GOAL_US = 30.0
ENGINE_CPU = 0  # both engines' workers run here; client and sidecar get the other cores
PROMPTS = (
    "The quick brown fox jumps over the lazy dog.",
    "A small model can still answer a simple question.",
    "The weather today is sunny with a light breeze from the west.",
    "She opened the window and listened to the birds singing outside.",
)


# -- processes -----------------------------------------------------------------------------------
class Children:
    """Child processes, each the leader of its own session; stopped group by group."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._procs: list[tuple[str, subprocess.Popen]] = []

    def start(
        self, name: str, cmd: Sequence[str], *, cpus: set[int], env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                list(cmd),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                preexec_fn=lambda: os.sched_setaffinity(0, cpus),
            )
        self._procs.append((name, proc))
        return proc

    def log_tail(self, name: str, lines: int = 30) -> str:
        try:
            text = (self.log_dir / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, proc: subprocess.Popen, timeout: float = 15.0) -> None:
        """SIGTERM the process group, wait for all of it to go, then SIGKILL what is left."""
        pgid = proc.pid
        if not _group_alive(pgid, proc):
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and _group_alive(pgid, proc):
            time.sleep(0.1)
        if _group_alive(pgid, proc):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)

    def stop_all(self) -> None:
        while self._procs:
            _, proc = self._procs.pop()
            self.stop(proc)


def _group_alive(pgid: int, leader: subprocess.Popen) -> bool:
    leader.poll()  # reap the leader, so a zombie does not keep the group "alive"
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _descendants(pid: int) -> list[int]:
    """Pids below `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _worker_pids(server_pid: int) -> list[int]:
    """The server's model-runner worker process(es)."""
    found = []
    for pid in _descendants(server_pid):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().startswith("VLLM::Worker"):
                found.append(pid)
    return found


def _allowed_cpus(pids: Sequence[int]) -> str:
    """Cpus_allowed_list of each pid, e.g. '0'."""
    found = []
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("Cpus_allowed_list:"):
                    found.append(line.split(":", 1)[1].strip())
    return ",".join(found) or "?"


def _cpu_ns(pids: Sequence[int]) -> int:
    """CPU time (ns) the live threads of these processes have run, from schedstat."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError, ValueError):
                    total += int(Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()[0])
    return total


# -- http ------------------------------------------------------------------------------------------
def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def _post_json(url: str, body: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.load(resp)


def _metric_sums(text: str, names: Sequence[str], **labels: str) -> dict[str, float]:
    """Sum of each named sample over the series whose labels include `labels`."""
    return {name: value(text, name, **labels) for name in names}


# -- macro -----------------------------------------------------------------------------------------
GUARD_METRICS = (
    "ascend_guard_waves_total",
    "ascend_guard_sampled_tokens_total",
    "ascend_guard_records_dropped_total",
    "ascend_guard_guard_errors_total",
)


@dataclasses.dataclass
class Server:
    label: str
    port: int
    proc: subprocess.Popen
    workers: list[int] = dataclasses.field(default_factory=list)
    tree: list[int] = dataclasses.field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclasses.dataclass
class MacroResult:
    tok_s: dict[str, list[float]]  # per round, "off" / "on"
    round_s: dict[str, list[float]]
    worker_cpu_us: dict[str, list[float]]  # worker CPU per output token, per round
    server_cpu_us: dict[str, list[float]]  # whole server (API, engine core, worker) likewise
    pair_ratios: list[float]  # on/off of each adjacent pair of rounds
    worker_cpus: dict[str, str]
    guard_delta: dict[str, float]
    on_completion_tokens: int
    vllm_generation_tokens: float
    other_engines_streamed: bool


def _wait_healthy(children: Children, servers: Sequence[Server], timeout: float) -> None:
    deadline = time.monotonic() + timeout  # the servers start in parallel; one deadline
    for server in servers:
        left = max(0.0, deadline - time.monotonic())
        status = wait_http_ok(server.proc, f"{server.url}/health", left, interval=0.5)
        if status == "exited":
            tail = children.log_tail(f"vllm-{server.label}")
            raise RuntimeError(f"vLLM server '{server.label}' exited during start-up:\n{tail}")
        if status == "timeout":
            raise RuntimeError(f"vLLM server(s) not healthy after {timeout:.0f}s")


def _round(pool: ThreadPoolExecutor, server: Server, model: str, n: int, max_tokens: int):
    """N concurrent greedy completions: completion tokens, wall s, worker and server CPU ns."""

    def one(i: int) -> int:
        body = {
            "model": model,
            "prompt": f"{PROMPTS[i % len(PROMPTS)]} #{i}",
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        return int(_post_json(f"{server.url}/v1/completions", body)["usage"]["completion_tokens"])

    worker0, tree0 = _cpu_ns(server.workers), _cpu_ns(server.tree)
    start = time.perf_counter()
    tokens = sum(pool.map(one, range(n)))
    wall = time.perf_counter() - start
    worker_cpu, tree_cpu = _cpu_ns(server.workers) - worker0, _cpu_ns(server.tree) - tree0
    if tokens != n * max_tokens:
        raise RuntimeError(f"{server.label}: got {tokens} completion tokens, want {n * max_tokens}")
    return tokens, wall, worker_cpu, tree_cpu


def _guard_metrics(sidecar_metrics_url: str, engine: str) -> dict[str, float]:
    return _metric_sums(_get(sidecar_metrics_url), GUARD_METRICS, engine=engine)


def _settled_guard_metrics(url: str, engine: str, want_tokens: float) -> dict[str, float]:
    """Guard counters once the last records have been flushed (or 5 s have passed)."""
    deadline = time.monotonic() + 5.0
    last = _guard_metrics(url, engine)
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = _guard_metrics(url, engine)
        if now == last and now["ascend_guard_sampled_tokens_total"] >= want_tokens:
            return now
        last = now
    return last


def run_macro(
    args: argparse.Namespace, model: Path, children: Children, sidecar: _Sidecar
) -> MacroResult:
    helper_cpus = _helper_cpus()
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=str(ENGINE_CPU))
    all_cpus = os.sched_getaffinity(0)
    base = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--dtype", "float32", "--enforce-eager", "--gpu-memory-utilization", "0.1",
    ]  # fmt: skip
    guard_config = {"runtime_guard": {"sidecar": sidecar.address, "engine": "bench-on"}}
    servers = {}
    for label, extra in (("off", []), ("on", ["--additional-config", json.dumps(guard_config)])):
        port = free_port()
        cmd = [*base, "--port", str(port), *extra]
        proc = children.start(f"vllm-{label}", cmd, cpus=all_cpus, env=env)
        servers[label] = Server(label, port, proc)
    _say(f"starting two vLLM servers (guard off :{servers['off'].port}, "
         f"guard on :{servers['on'].port}); logs in {children.log_dir}")  # fmt: skip
    _wait_healthy(children, list(servers.values()), args.startup_timeout)
    for server in servers.values():
        server.workers = _worker_pids(server.proc.pid)
        server.tree = [server.proc.pid, *_descendants(server.proc.pid)]
    worker_cpus = {label: _allowed_cpus(s.workers) for label, s in servers.items()}
    _say(f"healthy; worker CPUs: off={worker_cpus['off']} on={worker_cpus['on']}")

    model_name = str(model)
    os.sched_setaffinity(0, helper_cpus)  # the client threads (created below) inherit it
    guard_before = _guard_metrics(sidecar.metrics_url, "bench-on")
    vllm_before = _metric_sums(
        _get(f"{servers['on'].url}/metrics"), ["vllm:generation_tokens_total"]
    )["vllm:generation_tokens_total"]
    on_tokens = 0
    tok_s: dict[str, list[float]] = {"off": [], "on": []}
    round_s: dict[str, list[float]] = {"off": [], "on": []}
    worker_cpu: dict[str, list[float]] = {"off": [], "on": []}
    server_cpu: dict[str, list[float]] = {"off": [], "on": []}
    with ThreadPoolExecutor(max_workers=args.requests, thread_name_prefix="client") as pool:
        for _ in range(args.warmup_rounds):
            for label in ("off", "on"):
                tokens, *_ = _round(
                    pool, servers[label], model_name, args.requests, args.max_tokens
                )
                on_tokens += tokens if label == "on" else 0
        _say(f"warmed up ({args.warmup_rounds} round(s) each); measuring {args.rounds} rounds each")
        for label in _abba(args.rounds):
            tokens, wall, w_cpu, s_cpu = _round(
                pool, servers[label], model_name, args.requests, args.max_tokens
            )
            on_tokens += tokens if label == "on" else 0
            tok_s[label].append(tokens / wall)
            round_s[label].append(wall)
            worker_cpu[label].append(w_cpu / tokens / 1e3)
            server_cpu[label].append(s_cpu / tokens / 1e3)
            _say(
                f"  round {label:>3}: {tokens} tokens in {wall:.3f} s = {tokens / wall:,.0f} tok/s,"
                f" worker CPU {w_cpu / tokens / 1e3:.1f} us/tok"
            )
    os.sched_setaffinity(0, all_cpus)
    guard_after = _settled_guard_metrics(
        sidecar.metrics_url,
        "bench-on",
        guard_before["ascend_guard_sampled_tokens_total"] + on_tokens,
    )
    vllm_after = _metric_sums(
        _get(f"{servers['on'].url}/metrics"), ["vllm:generation_tokens_total"]
    )["vllm:generation_tokens_total"]
    all_waves = _metric_sums(_get(sidecar.metrics_url), ["ascend_guard_waves_total"])
    for server in servers.values():
        children.stop(server.proc)
    return MacroResult(
        tok_s=tok_s,
        round_s=round_s,
        worker_cpu_us=worker_cpu,
        server_cpu_us=server_cpu,
        pair_ratios=[on / off for on, off in zip(tok_s["on"], tok_s["off"], strict=True)],
        worker_cpus=worker_cpus,
        guard_delta={k: guard_after[k] - guard_before[k] for k in GUARD_METRICS},
        on_completion_tokens=on_tokens,
        vllm_generation_tokens=vllm_after - vllm_before,
        other_engines_streamed=all_waves["ascend_guard_waves_total"]
        > guard_after["ascend_guard_waves_total"],
    )


def _abba(rounds: int) -> Iterator[str]:
    """off,on, on,off, off,on, ... : `rounds` rounds of each, balanced in position."""
    for i in range(rounds):
        yield from (("off", "on") if i % 2 == 0 else ("on", "off"))


def _helper_cpus() -> set[int]:
    cpus = os.sched_getaffinity(0)
    return (cpus - {ENGINE_CPU}) or cpus


# -- micro -----------------------------------------------------------------------------------------
@dataclasses.dataclass
class MicroResult:
    iters: int
    blocks: int
    reqs: int
    wall_ns: dict[str, list[float]]  # ns per step (perf_counter), one value per block
    thread_ns: dict[str, list[float]]  # CPU ns per step of the calling (engine) thread
    cpu_ns: dict[str, list[float]]  # process CPU ns per step, incl. the streamer's drain
    dropped: dict[str, int]
    sent: dict[str, int]


def _scheduler_outputs(num_reqs: int) -> tuple[Any, Any]:
    """A prefill step with `num_reqs` new requests, and a decode step of the same requests."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    ids = [f"cmpl-bench-{i:04d}-0" for i in range(num_reqs)]
    prompt_len = 24
    prefill = SchedulerOutput(
        scheduled_new_reqs=[
            NewRequestData(
                req_id=req_id,
                prompt_token_ids=list(range(5, 5 + prompt_len)),
                mm_features=[],
                sampling_params=SamplingParams(temperature=0.0, max_tokens=256),
                pooling_params=None,
                block_ids=([i * 4, i * 4 + 1],),
                num_computed_tokens=0,
                lora_request=None,
            )
            for i, req_id in enumerate(ids)
        ],
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens=dict.fromkeys(ids, prompt_len),
        total_num_scheduled_tokens=prompt_len * num_reqs,
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )
    decode = SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData(
            req_ids=list(ids),
            resumed_req_ids=set(),
            new_token_ids=[],
            all_token_ids={},
            new_block_ids=[None] * num_reqs,
            num_computed_tokens=[prompt_len + 40] * num_reqs,
            num_output_tokens=[41] * num_reqs,
        ),
        num_scheduled_tokens=dict.fromkeys(ids, 1),
        total_num_scheduled_tokens=num_reqs,
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )
    return prefill, decode


def _runner_classes() -> tuple[type, type]:
    """A bare fake runner, and the same runner with the guard's two decorators."""
    from vllm.v1.outputs import ModelRunnerOutput

    from guard.decorators import runtime_guard_sample_tokens, runtime_guard_step

    class BareRunner:
        def __init__(self) -> None:
            self.tokens = 0
            self.req_ids: list[str] = []

        def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None) -> None:
            self.tokens += scheduler_output.total_num_scheduled_tokens
            self.req_ids = scheduler_output.scheduled_cached_reqs.req_ids
            return None

        def sample_tokens(self, grammar_output: Any) -> Any:
            req_ids = self.req_ids
            return ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=[[7] for _ in req_ids],
            )

    class GuardedRunner(BareRunner):
        execute_model = runtime_guard_step(BareRunner.execute_model)
        sample_tokens = runtime_guard_sample_tokens(BareRunner.sample_tokens)

    return BareRunner, GuardedRunner


def _processor(address: str, engine: str):
    from guard.config.runtime_guard import GuardConfig
    from guard.processor import GuardProcessor
    from telemetry.wire.proto import guard_pb2

    rank = guard_pb2.RankInfo(
        run_id="bench-micro", engine=engine, dp_rank=0, tp_rank=0, pp_rank=0, dp_size=1,
        tp_size=1, pp_size=1, node="bench", pid=os.getpid(), runner="bench.overhead.GuardedRunner",
    )  # fmt: skip
    return GuardProcessor(GuardConfig(sidecar=address, engine=engine), lambda runner: rank)


def _wait_drained(processor: Any, timeout: float = 10.0) -> None:
    """Wait until the streamer has sent (or dropped) every wave the processor recorded."""
    streamer = processor.streamer
    deadline = time.monotonic() + timeout
    while streamer.sent_waves + streamer.dropped < processor.wave and time.monotonic() < deadline:
        time.sleep(0.0005)


def run_micro(args: argparse.Namespace, live_address: str, dead_address: str) -> MicroResult:
    from guard.decorators import install

    prefill, decode = _scheduler_outputs(args.micro_reqs)
    bare_cls, guarded_cls = _runner_classes()
    processors = {
        "on, live sidecar": _processor(live_address, "bench-micro"),
        "on, sidecar away": _processor(dead_address, "bench-micro-dead"),
    }
    variants: dict[str, tuple[Any, Any]] = {
        "bare": (bare_cls(), None),
        "guard off": (guarded_cls(), None),
        **{name: (guarded_cls(), proc) for name, proc in processors.items()},
    }
    iters = args.micro_iters
    try:
        # Start the streamers, teach the processors the prompts, and fill the dead buffer.
        for name, (runner, proc) in variants.items():
            install(proc)
            runner.execute_model(prefill)
            runner.sample_tokens(None)
            warm = proc.config.buffer_size + iters if name == "on, sidecar away" else iters
            for _ in range(warm):
                runner.execute_model(decode)
                runner.sample_tokens(None)
            if name == "on, live sidecar":
                _wait_until_connected(proc)
                _wait_drained(proc)
        install(None)

        wall: dict[str, list[float]] = {name: [] for name in variants}
        thread: dict[str, list[float]] = {name: [] for name in variants}
        cpu: dict[str, list[float]] = {name: [] for name in variants}
        names = list(variants)
        for block in range(args.micro_blocks):
            shift = block % len(names)
            for name in names[shift:] + names[:shift]:
                runner, proc = variants[name]
                w, t, c = _time_block(runner, proc, decode, iters, install)
                wall[name].append(w)
                thread[name].append(t)
                cpu[name].append(c)
        return MicroResult(
            iters=iters,
            blocks=args.micro_blocks,
            reqs=args.micro_reqs,
            wall_ns=wall,
            thread_ns=thread,
            cpu_ns=cpu,
            dropped={name: p.streamer.dropped for name, p in processors.items()},
            sent={name: p.streamer.sent_waves for name, p in processors.items()},
        )
    finally:
        install(None)
        for proc in processors.values():
            proc.close()


def _wait_until_connected(processor: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not processor.streamer.connected:
        if time.monotonic() > deadline:
            raise RuntimeError("micro: the guard streamer did not connect to the live sidecar")
        time.sleep(0.01)


def _time_block(
    runner: Any, proc: Any, decode: Any, iters: int, install: Callable[[Any], None]
) -> tuple[float, float, float]:
    """Per step: wall ns, this thread's CPU ns, and process CPU ns incl. the streamer's drain."""
    execute, sample = runner.execute_model, runner.sample_tokens
    install(proc)
    gc.collect()
    gc.disable()
    try:
        cpu0 = time.process_time_ns()
        th0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        for _ in range(iters):
            execute(decode)
            sample(None)
        t1 = time.perf_counter_ns()
        th1 = time.thread_time_ns()
        if proc is not None and proc.streamer.connected:
            _wait_drained(proc)  # so the next block does not pay for this block's records
        cpu1 = time.process_time_ns()
    finally:
        gc.enable()
        install(None)
    return (t1 - t0) / iters, (th1 - th0) / iters, (cpu1 - cpu0) / iters


# -- report ----------------------------------------------------------------------------------------
_T0 = time.monotonic()


def _say(text: str) -> None:
    print(f"[{time.monotonic() - _T0:5.0f}s] {text}", flush=True)


def _spread(values: Sequence[float]) -> str:
    if len(values) < 2:
        return "-"
    med = statistics.median(values)
    return f"{(min(values) / med - 1) * 100:+.1f}% / {(max(values) / med - 1) * 100:+.1f}%"


def _quartiles(values: Sequence[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def report_macro(res: MacroResult, args: argparse.Namespace) -> str:
    lines = [
        f"MACRO: TP=1, {args.requests} concurrent requests x {args.max_tokens} tokens per round, "
        f"{args.rounds} rounds per server (A,B,B,A,...), worker CPUs off={res.worker_cpus['off']} "
        f"on={res.worker_cpus['on']}, client+sidecar CPUs {sorted(_helper_cpus())}",
    ]
    rows = []
    for label, name in (("off", "guard off"), ("on", "guard on (streaming)")):
        vals = res.tok_s[label]
        rows.append(
            (name, f"{statistics.median(vals):,.0f}", f"{min(vals):,.0f}", f"{max(vals):,.0f}",
             _spread(vals), f"{statistics.median(res.round_s[label]):.3f}",
             f"{statistics.median(res.worker_cpu_us[label]):.1f}",
             f"{statistics.median(res.server_cpu_us[label]):.1f}")
        )  # fmt: skip
    headers = ("server", "median tok/s", "min", "max", "spread vs median", "median round s",
               "worker CPU us/tok", "server CPU us/tok")  # fmt: skip
    lines.append(render_table(headers, rows, right=range(1, len(headers))))
    med_off, med_on = statistics.median(res.tok_s["off"]), statistics.median(res.tok_s["on"])
    ratio = med_on / med_off
    q1, q3 = _quartiles(res.pair_ratios)
    lines.append(
        f"ratio on/off (medians) {ratio:.4f} -> throughput loss {(1 - ratio) * 100:+.2f}%; "
        f"paired rounds on/off: median {statistics.median(res.pair_ratios):.4f}, "
        f"IQR {q1:.4f}..{q3:.4f}, range {min(res.pair_ratios):.4f}..{max(res.pair_ratios):.4f}"
    )
    d = res.guard_delta
    sampled = d["ascend_guard_sampled_tokens_total"]
    lines.append(
        f"guard counters (engine=bench-on): waves {d['ascend_guard_waves_total']:.0f}, "
        f"sampled tokens {sampled:.0f} vs completion tokens {res.on_completion_tokens} "
        f"({'match' if sampled == res.on_completion_tokens else 'MISMATCH'}; vLLM "
        f"generation_tokens {res.vllm_generation_tokens:.0f}), "
        f"records dropped {d['ascend_guard_records_dropped_total']:.0f}, "
        f"guard errors {d['ascend_guard_guard_errors_total']:.0f}"
        + ("; WARNING: another engine streamed waves" if res.other_engines_streamed else "")
    )
    for kind, values in (("worker", res.worker_cpu_us), ("whole server", res.server_cpu_us)):
        paired = [on / off for on, off in zip(values["on"], values["off"], strict=True)]
        c1, c3 = _quartiles(paired)
        r = statistics.median(values["on"]) / statistics.median(values["off"])
        lines.append(
            f"{kind} CPU per output token on/off (medians) {r:.4f} ({(r - 1) * 100:+.2f}%); "
            f"paired median {statistics.median(paired):.4f}, IQR {c1:.4f}..{c3:.4f}"
        )
    loss = (1 - ratio) * 100
    noise = (q3 - q1) / 2 * 100
    goal = THROUGHPUT_LOSS_GOAL_PCT
    if noise > goal:
        verdict = (
            f"UNRESOLVED: round-to-round noise (paired half-IQR {noise:.1f}%) is larger than "
            f"the {goal:g}% goal; rerun on an idle machine or with more --rounds"
        )
    else:
        verdict = "PASS" if loss < goal else "FAIL"
    lines.append(
        f"verdict: throughput loss with streaming on {loss:+.2f}% "
        f"(goal < {THROUGHPUT_LOSS_GOAL_PCT:g}%): {verdict}"
    )
    return "\n".join(lines)


def _median_added(values: Sequence[float], base: Sequence[float]) -> float:
    """Median over blocks of (variant - bare) in the same block, in microseconds."""
    return statistics.median([v - b for v, b in zip(values, base, strict=True)]) / 1e3


def report_micro(res: MicroResult) -> str:
    lines = [
        f"MICRO: fake runner, {res.reqs} decode requests, {res.blocks} interleaved blocks x "
        f"{res.iters} steps (execute_model + sample_tokens), gc off; us per step, medians"
    ]
    rows = []
    for name, wall in res.wall_ns.items():
        thread, cpu = res.thread_ns[name], res.cpu_ns[name]
        q1, q3 = _quartiles(wall)
        rows.append(
            (name, f"{statistics.median(wall) / 1e3:.2f}", f"{q1 / 1e3:.2f}..{q3 / 1e3:.2f}",
             f"{_median_added(wall, res.wall_ns['bare']):+.2f}",
             f"{statistics.median(thread) / 1e3:.2f}",
             f"{_median_added(thread, res.thread_ns['bare']):+.2f}",
             f"{statistics.median(cpu) / 1e3:.2f}",
             f"{_median_added(cpu, res.cpu_ns['bare']):+.2f}")
        )  # fmt: skip
    headers = (
        "variant",
        "wall",
        "wall IQR",
        "added",
        "thread CPU",
        "added",
        "process CPU*",
        "added",
    )
    lines.append(render_table(headers, rows, right=range(1, len(headers))))
    lines.append(
        "wall: perf_counter_ns around the loop (includes preemption by other processes); thread "
        "CPU: the calling thread only;\n* process CPU: all threads, including the streamer "
        "thread turning the block's records into protobuf and sending them (waited for after "
        "each block)"
    )
    for name, dropped in res.dropped.items():
        lines.append(f"{name}: streamer sent {res.sent[name]} records, dropped {dropped}")
    live = "on, live sidecar"
    added_cpu = _median_added(res.cpu_ns[live], res.cpu_ns["bare"])
    added_wall = _median_added(res.wall_ns[live], res.wall_ns["bare"])
    verdict = "PASS" if added_cpu < ADDED_HOST_TIME_GOAL_US else "FAIL"
    lines.append(
        f"verdict: host time added per step with the guard on (live sidecar, process CPU incl. "
        f"streamer) {added_cpu:+.2f} us, wall {added_wall:+.2f} us "
        f"(goal < {ADDED_HOST_TIME_GOAL_US:g} us): {verdict}"
    )
    return "\n".join(lines)


# -- main ------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=None, help="measured rounds per server (10)")
    p.add_argument("--requests", type=int, default=16, help="concurrent requests per round")
    p.add_argument("--max-tokens", type=int, default=None, help="output tokens per request (256)")
    p.add_argument("--quick", action="store_true", help="fewer/shorter rounds and micro blocks")
    p.add_argument("--micro-reqs", type=int, default=16, help="decode requests per micro step")
    p.add_argument("--part", choices=("all", "macro", "micro"), default="all")
    p.add_argument("--model", type=Path, default=None, help=f"model dir ({DEFAULT_MODEL_DIR})")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--keep-logs", action="store_true", help="keep the temp dir with the logs")
    return p


def _resolve(args: argparse.Namespace) -> argparse.Namespace:
    quick = args.quick
    args.rounds = args.rounds or (3 if quick else 10)
    args.max_tokens = args.max_tokens or (128 if quick else 256)
    args.warmup_rounds = 1 if quick else 2
    args.micro_iters = 1000 if quick else 2000
    args.micro_blocks = 10 if quick else 40
    return args


def _model_dir(path: Path | None) -> Path:
    if path is not None:
        return path
    from tools.make_tiny_model import build_tiny_model

    return build_tiny_model(DEFAULT_MODEL_DIR)


def _quiet_guard_logs() -> None:
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def _on_signal(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    args = _resolve(_parser().parse_args(argv))
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old_handlers = {s: signal.signal(s, _on_signal) for s in signals}
    original_cpus = os.sched_getaffinity(0)
    tmp = Path(tempfile.mkdtemp(prefix="guard-bench-"))
    children = Children(tmp)
    started = time.monotonic()
    try:
        _quiet_guard_logs()
        model = _model_dir(args.model)
        sidecar = _start_sidecar(children, tmp)
        reports = [f"guard overhead bench, {time.strftime('%Y-%m-%d %H:%M')}, "
                   f"{os.cpu_count()} CPUs, model {model}"]  # fmt: skip
        if args.part in ("all", "macro"):
            reports.append(report_macro(run_macro(args, model, children, sidecar), args))
        if args.part in ("all", "micro"):
            _say("micro: timing the decorators in-process")
            os.sched_setaffinity(0, {ENGINE_CPU})  # where a worker runs; sidecar stays apart
            res = run_micro(args, sidecar.address, f"unix://{tmp / 'nobody-listens.sock'}")
            os.sched_setaffinity(0, original_cpus)
            reports.append(report_micro(res))
        print("\n\n".join(["", *reports]), flush=True)
        _say(f"total {time.monotonic() - started:.0f} s")
        return 0
    except KeyboardInterrupt as exc:
        _say(f"interrupted ({exc or 'Ctrl-C'}); stopping child processes")
        return 130
    finally:
        for sig in signals:  # a second Ctrl-C must not cut the clean-up short
            signal.signal(sig, signal.SIG_IGN)
        children.stop_all()
        os.sched_setaffinity(0, original_cpus)
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)
        if args.keep_logs:
            _say(f"logs kept in {tmp}")
        else:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)


@dataclasses.dataclass
class _Sidecar:
    address: str
    metrics_url: str


def _start_sidecar(children: Children, tmp: Path) -> _Sidecar:
    address = f"unix://{tmp / 'guard.sock'}"
    port = free_port()
    cmd = [
        sys.executable, "-m", "telemetry.cli", "sidecar", "--listen", address,
        "--metrics-host", "127.0.0.1", "--metrics-port", str(port), "--store", str(tmp / "store.db"),
        "--health-port", "0", "--query-port", "0",
    ]  # fmt: skip
    proc = children.start("sidecar", cmd, cpus=_helper_cpus())
    sidecar = _Sidecar(address, f"http://127.0.0.1:{port}/metrics")
    status = wait_http_ok(proc, sidecar.metrics_url, 30, also=(tmp / "guard.sock").exists)
    if status == "ready":
        return sidecar
    raise RuntimeError(f"sidecar {status} before it was ready:\n{children.log_tail('sidecar')}")


if __name__ == "__main__":
    sys.exit(main())
