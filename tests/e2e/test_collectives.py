"""End to end, real `vllm serve` on CPU at TP=2 with a real sidecar: collectives, a fire drill
and a frozen worker.

One server serves the whole module (a vLLM start is the expensive part); the tests run in
file order: first the collective counts (against the tiny model's shapes and the API's token
counts), then the fire drill that delays rank 1 at a known wave (skew and straggler), then a
SIGSTOP of rank 1's worker process (verdict, liveness, recovery). No hang verdict may appear
before the SIGSTOP: warm-up and the drill must not be taken for hangs. Last, a second SIGSTOP
whose evidence bundle is read while rank 1 is still stopped.

Hang thresholds and heartbeats are the product defaults. Timing bounds come from measured
distributions (bench/README.md, "Hang verdict timing"); each bound says which.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.http import get_json
from tests.support.metrics import value
from tests.support.ports import free_port
from tests.support.sidecar import SidecarProcess
from tests.support.vllm_server import VllmServer, cpu_tp_backend

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ENGINE = "coll"
# past every wave the tests before the drill run (6 prompts x 12 tokens: under 100 even one by one)
DRILL_WAVE = 200
DRILL_DELAY_S = 0.5
LONG = 900  # tokens per request in flight during the SIGSTOP: several seconds of decoding
HOLD_STOPPED_S = 4.0  # longer than the watchdog deadline (3 s), so rank 0 reports too
# SIGSTOP -> /live 503 at product defaults (frozen after 1 s of silence in state T): measured
# MEASURED; the bound is the product goal's maximum
VERDICT_WITHIN_S = 3.0
PROMPTS = [
    "Collectives are counted",
    "Every layer reduces twice",
    "The embedding is reduced once",
    "Logits are gathered per request",
    "Sequence numbers agree",
    "Two ranks, one wave",
]


class Deployment:
    def __init__(
        self,
        root: Path,
        model: Path,
        *,
        env: dict[str, str] | None = None,
        drill: bool = True,
        extra_args: tuple[str, ...] = (),
        eager: bool = True,
    ) -> None:
        """`env` and `extra_args`: the server's extra environment and arguments
        (tests/e2e/test_mrv2_collectives.py runs MRV2); `drill`: the fire drill's fault
        injection at DRILL_WAVE; `eager=False`: torch.compile on."""
        self.root = root
        self.model = model
        self.health_port = free_port()
        self.query_port = free_port()  # the sidecar's Tempo-compatible query API
        sock = root / "guard.sock"
        live = root / "live"  # the workers' liveness records (telemetry/wire/liveness_record.py)
        self.sidecar = SidecarProcess.start(
            root, address=f"unix://{sock}",
            extra_args=("--health-port", str(self.health_port), "--health-host", "127.0.0.1",
                        "--liveness-dir", str(live), "--query-port", str(self.query_port),
                        "--query-host", "127.0.0.1", "--bundle-dir", str(root / "bundles")),
        )  # fmt: skip
        guard = {
            "sidecar": f"unix://{sock}", "engine": ENGINE, "flush_interval_ms": 20,
            "reconnect_max_backoff_s": 0.5, "liveness_dir": str(live),
            "fault_injection": {"enabled": drill, "tp_rank": 1, "at_wave": DRILL_WAVE,
                                "delay_ms": DRILL_DELAY_S * 1000, "where": "execute_model"},
        }  # fmt: skip
        try:
            self.server = VllmServer.start(
                model,
                root,
                tp=2,
                guard=guard,
                env=env,
                extra_args=extra_args,
                eager=eager,
                timeout=600,
            )
        except BaseException:
            self.sidecar.stop()
            raise

    def get(self, path: str) -> tuple[int, dict]:
        return get_json(f"http://127.0.0.1:{self.health_port}{path}")

    def traceql(self, query: str, since_s: float = 900.0) -> list[dict]:
        """The traces `/api/search?q=` answers (newest first), over the last `since_s`."""
        now = time.time()
        url = (f"http://127.0.0.1:{self.query_port}/api/search?" + urllib.parse.urlencode(
            {"q": query, "start": int(now - since_s), "end": int(now) + 60, "limit": 100,
             "spss": 100}))  # fmt: skip
        status, body = get_json(url, timeout=30.0)
        assert status == 200, body
        return body.get("traces", [])

    def metrics(self) -> str:
        return self.sidecar.metrics_text()

    def cli(self, *args: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "telemetry.cli", *args, "--store", str(self.sidecar.store_path)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        return out.stdout + out.stderr

    def stop(self) -> None:
        self.server.stop()
        self.sidecar.stop()


@pytest.fixture(scope="module")
def dep(tiny_model, tmp_path_factory):
    d = Deployment(tmp_path_factory.mktemp("collectives"), tiny_model)
    yield d
    d.stop()


def rank(tp: int) -> dict[str, str]:
    return {"engine": ENGINE, "dp": "0", "tp": str(tp), "pp": "0"}


def coll(text: str, name: str, tp: int, op: str) -> float:
    return value(text, name, op=op, group="tp", **rank(tp))


def test_collective_counts_and_bytes_follow_the_model_shape(dep: Deployment) -> None:
    check_collective_counts(dep, max_tokens=12)


def check_collective_counts(dep: Deployment, max_tokens: int, compiled: bool = False) -> None:
    """Per rank: (1 + 2 x layers) all-reduces per model step — the vocab-parallel embedding
    reduces once, and each layer's row-parallel o_proj and down_proj once — carrying
    tokens x hidden x 4 bytes each, and one all-gather of the logits, (vocab / tp) x 4 bytes per
    sampled row. Token counts come from the API's usage; both ranks agree, sequence numbers
    too."""
    config = json.loads((dep.model / "config.json").read_text())
    layers, hidden, vocab = (
        config["num_hidden_layers"], config["hidden_size"], config["vocab_size"],
    )  # fmt: skip
    per_step = 1 + 2 * layers
    before = dep.metrics()
    responses = dep.server.complete_many(PROMPTS, max_tokens=max_tokens)
    fed_tokens = sum(r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] - 1
                     for r in responses)  # fmt: skip
    sampled = sum(r["usage"]["completion_tokens"] for r in responses)
    want_reduce_bytes = per_step * fed_tokens * hidden * 4
    want_gather_bytes = sampled * (vocab // 2) * 4

    def grown(text: str, name: str, tp: int, op: str) -> float:
        return coll(text, name, tp, op) - coll(before, name, tp, op)

    def settled(text: str) -> bool:
        return all(
            grown(text, "ascend_guard_collective_bytes_total", tp, "all_gather") >= want_gather_bytes
            for tp in (0, 1)
        )  # fmt: skip

    dep.sidecar.wait_for(settled, timeout=20)
    time.sleep(0.5)
    text = dep.metrics()
    for tp in (0, 1):
        reduces = grown(text, "ascend_guard_collective_calls_total", tp, "all_reduce")
        gathers = grown(text, "ascend_guard_collective_calls_total", tp, "all_gather")
        model_waves = (
            value(text, "ascend_guard_waves_total", **rank(tp))
            - value(text, "ascend_guard_dummy_waves_total", **rank(tp))
            - value(before, "ascend_guard_waves_total", **rank(tp))
            + value(before, "ascend_guard_dummy_waves_total", **rank(tp))
        )
        assert gathers == model_waves > 0, f"tp{tp}: one logits all-gather per model step"
        assert reduces == per_step * gathers, f"tp{tp}: {reduces} all-reduces in {gathers} steps"
        assert grown(text, "ascend_guard_collective_bytes_total", tp, "all_reduce") == (
            want_reduce_bytes
        )
        assert grown(text, "ascend_guard_collective_bytes_total", tp, "all_gather") == (
            want_gather_bytes
        )
        backend, _ = cpu_tp_backend()  # shm with AVX-512 kernels, else gloo
        assert value(text, "ascend_guard_collective_calls_total", backend=backend, **rank(tp)) > 0
    seq = [value(text, "ascend_guard_collective_last_seq", group="tp", **rank(tp)) for tp in (0, 1)]
    total = [
        value(text, "ascend_guard_collective_calls_total", group="tp", **rank(tp)) for tp in (0, 1)
    ]
    if compiled:  # the compile warm-up's forward runs outside any wave: numbered, not counted
        assert seq[0] == seq[1] and total[0] == total[1], (seq, total)
        assert 0 <= seq[0] - total[0] <= 2 * (per_step + 1), (seq, total)
    else:
        assert seq[0] == seq[1] == total[0] == total[1], (seq, total)
    assert value(text, "ascend_guard_guard_errors_total") == 0


def test_fire_drill_shows_rank_1_as_straggler_by_the_injected_delay(dep: Deployment) -> None:
    def last_wave() -> float:
        return min(value(dep.metrics(), "ascend_guard_last_wave", **rank(tp)) for tp in (0, 1))

    now = last_wave()
    assert now < DRILL_WAVE - 8, f"wave {now}: the drill wave passed before this test"
    deadline = time.monotonic() + 180
    while now < DRILL_WAVE + 3:
        assert time.monotonic() < deadline, "the server did not reach the drill wave"
        # one request decoding through the drill wave: a wave where requests end can hold no
        # forward (no collectives), and a drill there shows no skew (1 loop run in 7 with
        # rounds of short requests). /metrics runs behind, so this request runs long, not short.
        dep.server.complete(PROMPTS[0], max_tokens=int(max(8, DRILL_WAVE + 16 - now)))
        now = last_wave()
    waves, near = [], []
    for _ in range(50):
        skew = dep.get("/skew")[1]["waves"]
        waves = [w for w in skew if w["wave"] == DRILL_WAVE]
        if waves:
            break
        time.sleep(0.1)
    else:  # what the sidecar aligned around the drill wave: a gap is a wave with no forward
        near = sorted(w["wave"] for w in skew if abs(w["wave"] - DRILL_WAVE) <= 5)
    assert len(waves) == 1, f"the drill wave was not aligned across both ranks; near it: {near}"
    drill = waves[0]
    assert drill["straggler_tp"] == 1
    assert drill["injected_s"] == {"1": pytest.approx(DRILL_DELAY_S, abs=0.05)}
    assert DRILL_DELAY_S * 0.9 <= drill["skew_s"] <= DRILL_DELAY_S + 0.25, drill
    assert DRILL_DELAY_S * 0.9 <= drill["arrival_skew_s"] <= DRILL_DELAY_S + 0.25, drill
    assert drill["waits_s"]["0"] > drill["waits_s"]["1"] + DRILL_DELAY_S * 0.9
    text = dep.metrics()
    assert value(text, "ascend_guard_straggler_waves_total", **rank(1)) >= 1
    assert value(text, "ascend_guard_straggler_seconds_total", **rank(1)) >= DRILL_DELAY_S * 0.9
    replica = {"engine": ENGINE, "dp": "0", "pp": "0"}
    over = value(text, "ascend_guard_wave_skew_seconds_count", **replica) - value(
        text, "ascend_guard_wave_skew_seconds_bucket", le="0.25", **replica
    )
    assert over >= 1, "the drill's skew is in the histogram's upper buckets"
    # neither warm-up nor the drill is taken for a hang
    assert dep.get("/hangs")[1]["history"] == []
    assert dep.get(f"/live/{ENGINE}")[0] == 200


def test_timeline_of_the_drill_shows_rank_0_waiting_for_rank_1(dep: Deployment, tmp_path) -> None:
    """`ascend-guard timeline` of the drilled waves (telemetry/spans/timeline.py): the wait arrow
    of the drill wave goes from the delayed rank 1 to rank 0, and rank 0's collective slice
    that the arrow ends on is longer than rank 1's by about the delay."""
    out = tmp_path / "drill.json"
    waves = f"{DRILL_WAVE - 1}..{DRILL_WAVE + 1}"
    deadline = time.monotonic() + 20
    while True:  # the store is written a moment after /skew judged the wave
        said = dep.cli("timeline", "--waves", waves, "--engine", ENGINE, "-o", str(out))
        trace = json.loads(out.read_text()) if out.exists() else {"traceEvents": []}
        events = trace["traceEvents"]
        flows = [e for e in events if e["ph"] in ("s", "f")]
        if any(e["ph"] == "s" and e["args"]["wave"] == DRILL_WAVE for e in flows):
            break
        assert time.monotonic() < deadline, said
        time.sleep(0.5)
    assert said.startswith("timeline: 2 rank(s), 3 wave(s)"), said
    tp_of = {e["pid"]: int(e["args"]["name"].split(" tp")[1].split()[0])
             for e in events if e["name"] == "process_name"}  # fmt: skip
    drill_flows = [e for e in flows if e["ph"] == "s" and e["args"]["wave"] == DRILL_WAVE]
    (start,) = drill_flows
    (end,) = [e for e in flows if e["ph"] == "f" and e["id"] == start["id"]]
    assert (tp_of[start["pid"]], tp_of[end["pid"]]) == (1, 0)
    assert start["args"]["waited_ns"] >= DRILL_DELAY_S * 0.9e9, start["args"]

    def bound(event: dict) -> dict:
        (enclosing,) = [
            e for e in events if e["ph"] == "X" and e["pid"] == event["pid"]
            and e["tid"] == event["tid"] and e["ts"] < event["ts"] < e["ts"] + e["dur"]
        ]  # fmt: skip
        return enclosing

    waited, late = bound(end), bound(start)
    drill = {(tp_of[e["pid"]], e["name"]): round(e["dur"] / 1000, 3) for e in events
             if e["ph"] == "X" and e["args"].get("wave") == DRILL_WAVE}  # fmt: skip
    print(f"drill wave {DRILL_WAVE}, slice ms by (tp, name): {sorted(drill.items())}")
    assert waited["name"] == late["name"] and waited["name"].startswith("collective:")
    assert waited["dur"] - late["dur"] >= DRILL_DELAY_S * 0.9e6, (waited, late)


def _settled(dep: Deployment, *, watchdog: bool, timeout: float = 20.0) -> tuple[list, list, str]:
    """(`/hangs` history, store rows, /metrics) once they agree: every verdict recovered and
    stored, the metrics counted them, rank 0's watchdog report stored (when it waited in a
    collective), and `/hangs` the same before and after the other reads. The sidecar writes the store and the metrics a moment
    after `/hangs` changes, and a worker may stall again after the SIGCONT (a verdict of its
    own), so one read of each at different moments can disagree without anything being wrong.
    """
    deadline = time.monotonic() + timeout
    while True:
        history = dep.get("/hangs")[1]["history"]
        rows = [json.loads(line) for line in dep.cli("hangs", "--json").splitlines() if line]
        text = dep.metrics()
        verdicts = [e for e in history if e["event"] == "hang_verdict"]
        types = [r["type"] for r in rows]
        agree = (
            dep.get("/hangs")[1]["history"] == history
            and len(history) == 2 * len(verdicts)
            and types.count("hang_verdict") == types.count("hang_recovered") == len(verdicts)
            and ("hang_suspected" in types or not watchdog)
            and value(text, "ascend_guard_hang_recoveries_total", engine=ENGINE) == len(verdicts)
            and value(text, "ascend_guard_hang_verdicts_total")
            == sum(len(v["stopped"]) for v in verdicts)
        )
        if agree or time.monotonic() > deadline:
            return history, rows, text
        time.sleep(0.3)


def _span_tp(span: dict) -> int:
    (tp,) = [int(a["value"]["intValue"]) for a in span.get("attributes", [])
             if a["key"] == "ascend_guard.tp"]  # fmt: skip
    return tp


def test_traceql_finds_the_rank_the_drill_slowed_and_only_it(dep: Deployment) -> None:
    """Over the sidecar's real query API (`/api/search?q=`, as Grafana asks it): the fire
    drill's delay is on rank 1's collective spans of the drill wave and nowhere else, and the
    rank that waited for it (rank 0, a long `wait_ns` in that wave) is not the one found."""
    drill_trace = None
    deadline = time.monotonic() + 20
    while True:  # the store is written a moment after /skew judged the wave
        found = dep.traceql("{ .injected_delay_ns > 0 } | select(span.tp, span.wave)")
        if found:
            break
        assert time.monotonic() < deadline, "no span carries the drill's delay"
        time.sleep(0.5)
    (trace,) = found  # one drill wave: one trace
    drill_trace = trace["traceID"]
    spans = [sp for ss in trace["spanSets"] for sp in ss["spans"]]
    assert spans and all(sp["name"].startswith("collective:") for sp in spans), spans
    assert {_span_tp(sp) for sp in spans} == {1}, spans
    waves = {int(a["value"]["intValue"]) for sp in spans for a in sp["attributes"]
             if a["key"] == "ascend_guard.wave"}  # fmt: skip
    assert waves == {DRILL_WAVE}
    # the same trace holds rank 0 waiting for rank 1 in all_reduce for about the delay; the
    # bound (0.9 x the delay) is the one the /skew check above uses
    waited = dep.traceql(
        f'{{ name = "collective:all_reduce" && .wave = {DRILL_WAVE} '
        f"&& .wait_ns > {int(DRILL_DELAY_S * 0.9 * 1e9)} }} | select(span.tp)"
    )
    assert [t["traceID"] for t in waited] == [drill_trace], waited
    assert {_span_tp(sp) for t in waited for ss in t["spanSets"] for sp in ss["spans"]} == {0}
    # the drilled rank's own step (execute_model starts after the drill's sleep) is not slow
    slow_steps = dep.traceql(
        f'{{ name = "execute_model" && .wave = {DRILL_WAVE} && duration > '
        f"{int(DRILL_DELAY_S * 0.9 * 1000)}ms }} | select(span.tp)"
    )
    print(f"drill trace {drill_trace}; execute_model over 0.9 x delay: {slow_steps}")
    assert {_span_tp(sp) for t in slow_steps for ss in t["spanSets"] for sp in ss["spans"]} <= {0}


def test_sigstop_of_a_worker_is_named_within_3s_and_recovery_is_recorded(dep: Deployment) -> None:
    check_sigstop_named_and_recovered(dep, LONG)


def check_sigstop_named_and_recovered(dep: Deployment, long: int) -> None:
    """SIGSTOP of rank 1's worker while four requests of `long` tokens each decode: the verdict
    names it within 3 s, serving completes after the SIGCONT, and /hangs, the store and
    /metrics record one recovery per verdict."""
    status, body = dep.get(f"/live/{ENGINE}")
    assert status == 200 and body["live"] is True
    pids = {r["tp"]: r["pid"] for r in body["ranks"]}
    victim = pids[1]
    assert os.getpgid(victim) == dep.server.proc.pid, "rank 1 is a process of this server"

    # stop while tokens are flowing: as soon as each of the four requests has its first token
    # (the sidecar's view of the waves can run behind on this machine). Timed from the
    # requests' start (0.8 s), or 0.2 s after the first of them, they once finished first:
    # 4 x long tokens can take under 0.8 s on a quiet moment, and several seconds on a busy one
    result: dict = {}
    decoding: list[bool] = []  # one entry a request, at its first token
    arrivals: list[float] = []  # wall-clock times the client got tokens, all four requests

    def stream_all() -> None:
        with ThreadPoolExecutor(max_workers=4) as pool:
            result["r"] = list(
                pool.map(
                    lambda p: dep.server.complete_streamed(
                        p, long, lambda: decoding.append(True), arrivals
                    ),
                    PROMPTS[:4],
                )
            )

    request = threading.Thread(target=stream_all)
    request.start()
    deadline = time.monotonic() + 60
    while len(decoding) < 4:
        assert time.monotonic() < deadline, f"{len(decoding)} of 4 requests decode after 60 s"
        time.sleep(0.005)
    assert request.is_alive(), "the requests finished before the stop; make them longer"
    os.kill(victim, signal.SIGSTOP)
    stopped_at = time.monotonic()
    # A request sent while the rank is stopped can only be served after the SIGCONT. The four
    # above may not be: the client sees tokens behind the engine (the API server streams them
    # late on a busy machine), and once all 3,600 were made before the stop took hold
    late: dict = {}
    late_arrivals: list[float] = []
    late_request = threading.Thread(
        target=lambda: late.setdefault(
            "r", dep.server.complete_streamed(PROMPTS[4], 16, lambda: None, late_arrivals)
        )
    )
    late_request.start()
    peer_silent_s = 0.0  # how long rank 0's own stream went quiet while it waited
    try:
        verdict_after = None
        while time.monotonic() - stopped_at < 10:
            status, body = dep.get(f"/live/{ENGINE}")
            peer = [r for r in body.get("ranks", []) if r["tp"] == 0]
            peer_silent_s = max([peer_silent_s, *(r["silent_s"] for r in peer)])
            if status == 503:
                verdict_after = time.monotonic() - stopped_at
                break
            time.sleep(0.05)
        assert verdict_after is not None, "no verdict within 10 s"
        assert dep.server.health_status() == 200, "vLLM's /health still says all is well"
        time.sleep(max(0.0, HOLD_STOPPED_S - (time.monotonic() - stopped_at)))
    finally:
        # the time is taken before the signal: after it, this thread can lose the CPU to the
        # woken rank long enough that the client records tokens first (0.16 ms before a time
        # taken after it, in one full run here)
        continued_unix = time.time()
        os.kill(victim, signal.SIGCONT)
    print(f"stop -> 503: {verdict_after:.3f} s; rank 0 stream silent up to {peer_silent_s:.2f} s")
    assert verdict_after < VERDICT_WITHIN_S, f"verdict after {verdict_after:.2f}s"
    verdict = body["verdicts"][0]
    assert [(r["tp"], r["pid"]) for r in verdict["stopped"]] == [(1, victim)], json.dumps(body)
    assert verdict["stopped"][0]["state"] == "T", "judged from the process state on this node"
    assert verdict["kind"] == "no_heartbeat"
    # Rank 0 waits in the collective rank 1 never joins, or (1 run in 7 here, on a machine
    # loaded enough that the engine core itself ran late) between two steps; either way it
    # runs and is not named
    waiting = {r["tp"]: r for r in verdict["waiting"]}
    peer = next(r for r in body["ranks"] if r["tp"] == 0)
    assert set(waiting) <= {0} and peer["state"] not in ("T", "t"), json.dumps(body)
    if waiting:
        assert waiting[0]["group"] == "tp" and waiting[0]["op"] in ("all_reduce", "all_gather")
        assert (verdict["op"], verdict["seq"]) == (waiting[0]["op"], waiting[0]["seq"])

    request.join(120)
    late_request.join(120)
    assert [len(r["choices"][0]["token_ids"]) for r in result["r"]] == [long] * 4, (
        "serving completes after SIGCONT"
    )
    assert len(late["r"]["choices"][0]["token_ids"]) == 16, "the request sent while stopped"
    assert min(late_arrivals) > continued_unix, "a token was served while rank 1 was stopped"
    deadline = time.monotonic() + 10
    while dep.get(f"/live/{ENGINE}")[0] != 200:
        assert time.monotonic() < deadline, "liveness did not recover"
        time.sleep(0.1)
    # one settled snapshot of all three sources: /hangs, the store and /metrics
    # Inside a torch.compile'd call (MRV2's compiled module) the watchdog gives the call its
    # deadline plus twice the longest compiled call seen in a wave (compute and peer waits run
    # inside it: guard/collectives/watchdog.py), so its report may come after the hold
    in_graph = "inside replay of graph" in verdict.get("summary", "")
    watchdog = bool(waiting) and not in_graph
    history, rows, text = _settled(dep, watchdog=watchdog)
    events = [e["event"] for e in history]
    # On this shared 2-core machine (other engineers' vLLM servers spin on the same cores) a
    # worker can really stall again for seconds after the SIGCONT, and that is a verdict of
    # its own. The first verdict is the SIGSTOP's; every verdict ends in a recovery.
    assert events[:2] == ["hang_verdict", "hang_recovered"], json.dumps(history)
    assert events == ["hang_verdict", "hang_recovered"] * (len(events) // 2), json.dumps(history)
    assert [r["pid"] for r in history[0]["stopped"]] == [victim], json.dumps(history)
    verdicts = [e for e in history if e["event"] == "hang_verdict"]
    # onset = when the sidecar read the frozen rank's last batch, stall = recovery - onset:
    # at least the hold, less the stream's lag before the stop
    recovery = history[1]
    assert recovery["stall_s"] >= HOLD_STOPPED_S - 1.0, json.dumps(history)
    # ... and the recovery is seen soon after serving really moves again: the first token the
    # client got after the SIGCONT. Timed from the SIGCONT instead (hold + 5 s), a CI run on a
    # loaded 2-core machine once came to 9.1 s, cause unrecorded. Measured here, token ->
    # recovery over 20 runs: -0.02 to 0.13 s, and -2.25 s with two CPU burners (the first
    # token 2.8 s after the SIGCONT, the record showing rank 1 moving long before). The
    # bound is the verdict's own, 3 s
    resumed_unix = min(t for t in arrivals + late_arrivals if t > continued_unix)
    seen_after = recovery["recovered_unix"] - resumed_unix
    print(
        f"SIGCONT -> first token {resumed_unix - continued_unix:.2f} s -> recovery"
        f" {seen_after:.2f} s; stall {recovery['stall_s']:.2f} s (hold {HOLD_STOPPED_S} s)"
    )
    assert seen_after < VERDICT_WITHIN_S, (
        f"recovery {seen_after:.2f} s after serving moved again",
        json.dumps(history),
    )

    assert value(text, "ascend_guard_hang_verdicts_total", kind="no_heartbeat", **rank(1)) >= 1
    assert value(text, "ascend_guard_hang_verdicts_total") == sum(
        len(v["stopped"]) for v in verdicts
    )
    assert value(text, "ascend_guard_hang_recoveries_total", engine=ENGINE) == len(verdicts)
    assert value(text, "ascend_guard_engine_wedged", engine=ENGINE) == 0

    # the store: verdicts and recoveries from the sidecar, hang_suspected from rank 0's watchdog
    types = [r["type"] for r in rows]
    assert types.count("hang_verdict") == types.count("hang_recovered") == len(verdicts), rows
    suspected = [r for r in rows if r["type"] == "hang_suspected"]
    assert {r["tp"] for r in suspected} <= {0}, "the frozen rank's watchdog cannot report"
    table = dep.cli("hangs")
    assert "VERDICT no_heartbeat" in table and f"tp1/pid{victim}" in table
    assert "recovered" in table
    if watchdog:  # rank 0 sat in that collective past the watchdog's 3 s deadline
        assert suspected, "the waiting rank's watchdog reports"
        first = min(suspected, key=lambda r: r["time_ns"])["evidence"]
        assert (first["op"], first["seq"]) == (verdict["op"], verdict["seq"])
        assert "watchdog" in table
    incidents = dep.cli("incidents", "--type", "hang_verdict", "--json")
    assert json.loads(incidents.splitlines()[0])["trace_id"], "the verdict sits in a wave trace"


def test_the_evidence_bundle_of_a_stopped_worker_holds_both_rings_and_the_peer_stack(
    dep: Deployment,
) -> None:
    """Rank 1 SIGSTOPped while four requests decode; the verdict names its bundle. Read while
    rank 1 is still stopped, the bundle holds both workers' last collectives (written by the real
    tracker into the shared-memory ring), rank 1's process state and no stack (stopped: never
    signalled), and rank 0's Python stack (it answers from faulthandler while it waits).

    Cross-checks: rank 1's latest sequence number in the sidecar's metrics (read from the
    stream's collective waves, not from the ring) is a returned entry of its ring; the two
    rings agree call by call where they overlap (same op and bytes per seq: one program order);
    rank 0's unreturned call, if any, is the one the verdict names."""
    dep.server.complete_many(PROMPTS[:1], 4)  # run alone, the ranks have not streamed yet
    deadline = time.monotonic() + 30
    while len(ranks := dep.get(f"/live/{ENGINE}")[1].get("ranks", [])) < 2:
        assert time.monotonic() < deadline, "both ranks stream"
        time.sleep(0.1)
    victim = {r["tp"]: r["pid"] for r in ranks}[1]
    decoding: list[bool] = []
    pool = ThreadPoolExecutor(max_workers=4)
    jobs = [
        pool.submit(dep.server.complete_streamed, p, LONG, lambda: decoding.append(True))
        for p in PROMPTS[:4]
    ]
    deadline = time.monotonic() + 60
    while len(decoding) < 4:
        assert time.monotonic() < deadline, f"{len(decoding)} of 4 requests decode after 60 s"
        time.sleep(0.005)
    before = {e.get("bundle", {}).get("id") for e in dep.get("/hangs")[1]["history"]}
    os.kill(victim, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 15
        while True:
            new = [
                e for e in dep.get("/hangs")[1]["history"]
                if e["event"] == "hang_verdict" and e["bundle"]["id"] not in before
            ]  # fmt: skip
            if new and Path(new[0]["bundle"]["path"]).exists():
                break
            assert time.monotonic() < deadline, "no bundle within 15 s of the stop"
            time.sleep(0.1)
        verdict = new[0]
        bundle = json.loads(Path(verdict["bundle"]["path"]).read_text())
        metric_seq = value(dep.metrics(), "ascend_guard_collective_last_seq", group="tp", **rank(1))
        shown = dep.cli(
            "hangs", "--bundle", bundle["id"], "--bundle-dir", str(dep.root / "bundles")
        )
    finally:
        os.kill(victim, signal.SIGCONT)
    for job in jobs:
        assert len(job.result(120)["choices"][0]["token_ids"]) == LONG, "serving completes"
    pool.shutdown()
    assert [(r["tp"], r["pid"]) for r in verdict["stopped"]] == [(1, victim)], verdict
    ranks = {r["tp"]: r for r in bundle["ranks"]}
    stuck, peer = ranks[1], ranks[0]
    assert stuck["role"] == "stopped" and stuck["process"]["state"].startswith("T")
    assert not stuck["stack"]["answered"] and "SIGCONT" in stuck["stack"]["note"]
    ring1 = stuck["collectives"]["entries"]
    assert len(ring1) == bundle["settings"]["collectives"], "a worker that served fills its ring"
    assert {e["group"] for e in ring1} == {"tp"} and [e["seq"] for e in ring1] == list(
        range(ring1[0]["seq"], ring1[0]["seq"] + len(ring1))
    ), "consecutive sequence numbers: every collective of the group is in the ring"
    returned1 = {e["seq"] for e in ring1 if e["end_unix"] != "not returned"}
    # the stream can lag the ring (waves not yet sent when the rank stopped), never lead it
    assert 0 < metric_seq <= max(returned1), (metric_seq, sorted(returned1))
    if metric_seq >= ring1[0]["seq"]:
        assert metric_seq in returned1, (metric_seq, sorted(returned1))
    ring0 = peer["collectives"]["entries"]
    by_seq = {e["seq"]: e for e in ring0}
    common = [e for e in ring1 if e["seq"] in by_seq]
    assert common, "the two rings overlap"
    assert all((e["op"], e["bytes"]) == (by_seq[e["seq"]]["op"], by_seq[e["seq"]]["bytes"])
               for e in common), "the two ranks disagree on a collective"  # fmt: skip
    open0 = [e for e in ring0 if e["end_unix"] == "not returned"]
    if verdict["waiting"]:  # rank 0 waits in the call rank 1 has not finished
        assert [(e["op"], e["seq"]) for e in open0] == [(verdict["op"], verdict["seq"])]
        assert max(e["seq"] for e in ring1) in (verdict["seq"] - 1, verdict["seq"])
    assert peer["stack"]["answered"], peer["stack"]
    engine = peer["stack"]["threads"][0]
    assert engine["engine"] and any("vllm" in f for f in engine["frames"]), engine
    fr = peer["flight_recorder"]  # vLLM on CPU: gloo process groups, no flight recorder
    assert not fr["available"] and "gloo" in fr["note"], fr
    assert "NOT RETURNED" in shown or not open0
    assert "STOPPED" in shown and "engine thread" in shown, shown
