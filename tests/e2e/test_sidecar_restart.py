"""The sidecar SIGKILLed and restarted while a real TP=2 `vllm serve` (CPU) serves load.

Real parts throughout: vLLM's OpenAI server with the guard on both ranks, the sidecar process
over real gRPC on a unix socket, its SQLite store. The same load (greedy requests that loop, so
the token_repeat detector raises incidents) runs three times on one server: sidecar up, sidecar
killed and restarted in the middle, sidecar up again. What must hold:

- serving goes on: every request of the killed run completes, no token of it waits more than a
  second after the one before (vLLM's own inter-token latency histogram: a guard that blocked
  the engine through the 2 s outage would make every running request's next token wait that
  long), and its tokens/s is printed beside the runs around it. Only a gross slowdown fails on
  tokens/s: the restarted sidecar starts up on the same 2 cores as the ranks, and on a noisy
  host one run of this drill measured 0.54 of its neighbours' rate with no stall at all;
- no incident is lost: the incidents of a worker are numbered 1, 2, 3, ... by the worker
  (`<run>:<pid>:<n>`), and the store holds every number up to the last, each once, including
  those raised while the sidecar was down (spooled by the worker, guard/stream/spool.py);
- the wave accounting closes, per rank: waves emitted (the worker's wave counter, reported as
  `ascend_guard_last_wave`) = waves in the store + records counted as dropped (the worker's own
  cumulative counter, `ascend_guard_records_dropped_total`, and the sidecars'
  `ascend_guard_pipeline_dropped_records_total`), plus the restarted sidecar's restart gap (what
  the killed one lost, less the worker's drops: a restart slower than the worker's buffer makes
  the worker drop too). The worker counts the batch in flight when its stream breaks as dropped,
  because it cannot know whether it arrived; so "closes" is: nothing missing from the store is
  uncounted, and the count exceeds what is missing by at most that one batch per rank;
- cross-checked with vLLM: the sampled tokens of the stored waves on tp0, plus what the dropped
  waves could hold, agree with `vllm:generation_tokens_total` and the API's usage.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import sqlite3
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from telemetry.store import connect, decode_waves
from tests.support.metrics import value
from tests.support.sidecar import SidecarProcess
from tests.support.vllm_server import VllmServer, completion_tokens

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

TP = 2
BATCH_MAX = 32
PROMPTS = [f"Request {i} of the restart drill repeats" for i in range(8)]
MAX_TOKENS = 192
ROUNDS = 4  # of all prompts at once, per run: each run outlasts the outage and the restart
OUTAGE_S = 2.0
# A sidecar started beside the two pinned, spinning ranks under load gets a sliver of the two
# cores: it took 11.3 s to answer /metrics here (0.46 s on an idle machine, the same code), and
# more than 20 s on a CI machine (the default start timeout, which it once exceeded). The test
# times the restart and prints it; how long it takes is not what it checks.
RESTART_READY_TIMEOUT_S = 90.0


def guard_config(sock: Path) -> dict:
    return {
        "sidecar": f"unix://{sock}",
        "engine": "restart",
        "batch_max": BATCH_MAX,
        "flush_interval_ms": 20,
        "heartbeat_interval_s": 0.5,
        "reconnect_max_backoff_s": 0.5,
    }


# vLLM's inter-token latency bucket that no token of a serving engine should pass, even with
# the restarted sidecar starting up beside it (a stall through the outage would)
STALL_S = "1.0"


def slow_tokens(text: str) -> float:
    """Tokens that vLLM saw arrive more than `STALL_S` after the one before."""
    name = "vllm:inter_token_latency_seconds"
    return value(text, f"{name}_count") - value(text, f"{name}_bucket", le=STALL_S)


def run_load(server: VllmServer, rounds: int = ROUNDS) -> tuple[float, list[dict]]:
    """`rounds` rounds of every prompt at once; (tokens per second, responses)."""
    start = time.monotonic()
    responses = []
    for _ in range(rounds):
        responses += server.complete_many(PROMPTS, max_tokens=MAX_TOKENS)
    took = time.monotonic() - start
    return completion_tokens(responses) / took, responses


def stored(store: Path) -> tuple[dict[int, list[int]], dict[int, int], list[tuple[str, int]]]:
    """Per tp rank: the stored wave numbers and their sampled tokens; the incident ids."""
    conn = connect(store, readonly=True)
    try:
        tp_of = {rid: tp for rid, tp in conn.execute("SELECT id, tp FROM ranks")}
        waves: dict[int, list[int]] = collections.defaultdict(list)
        sampled: dict[int, int] = collections.Counter()
        for rank_id, blob in conn.execute("SELECT rank, columns FROM wave_blocks"):
            cols = decode_waves(blob)
            waves[tp_of[rank_id]] += list(cols.wave)
            sampled[tp_of[rank_id]] += sum(cols.sampled_tokens)
        incidents = [(row[0], row[1]) for row in conn.execute("SELECT id, time_ns FROM incidents")]
    finally:
        conn.close()
    return waves, sampled, incidents


def gaps(numbers: list[int], last: int) -> list[tuple[int, int]]:
    """The runs of wave numbers in 1..last that are missing from `numbers`."""
    out: list[list[int]] = []
    for n in sorted(set(range(1, last + 1)) - set(numbers)):
        if out and n == out[-1][1] + 1:
            out[-1][1] = n
        else:
            out.append([n, n])
    return [tuple(run) for run in out]


def scrape(url: str, timeout: float) -> str:
    """/metrics of a sidecar starved of CPU (vLLM's ranks spin on both cores here): it can take
    seconds to answer under load; "" when it does not answer within `timeout`."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.read().decode()
    except OSError:
        return ""


def log_events(sidecar: SidecarProcess, event: str) -> list[dict]:
    out = []
    for line in sidecar.log().splitlines():
        if line.startswith("{") and f'"{event}"' in line:
            record = json.loads(line)
            if record.get("event") == event:
                out.append(record)
    return out


def pipeline_drops(text: str) -> float:
    """Records the sidecar itself shed (the worker's own drops are mirrored as worker_buffer)."""
    return value(text, "ascend_guard_pipeline_dropped_records_total") - value(
        text, "ascend_guard_pipeline_dropped_records_total", stage="worker_buffer"
    )


@pytest.fixture(scope="module")
def rig(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("restart")
    sock = root / "guard.sock"
    store = root / "store.db"
    sidecar = SidecarProcess.start(
        root, address=f"unix://{sock}", store_path=store, extra_args=("--log-json",)
    )
    try:
        server = VllmServer.start(tiny_model, root, tp=TP, guard=guard_config(sock))
    except BaseException:
        sidecar.stop()
        raise
    state = {"root": root, "sock": sock, "store": store, "sidecar": sidecar, "server": server}
    yield state
    server.stop()
    state["sidecar"].stop()


def test_sigkill_of_the_sidecar_under_load_loses_no_incident_and_accounting_closes(rig) -> None:
    server: VllmServer = rig["server"]
    first: SidecarProcess = rig["sidecar"]
    store: Path = rig["store"]
    run_load(server, rounds=1)  # warm-up: the first requests pay one-off costs
    before_text = server.metrics_text()
    vllm_before = value(before_text, "vllm:generation_tokens_total")

    before_rate, before = run_load(server)
    mid_text = server.metrics_text()

    # the middle run: SIGKILL the sidecar once it is under way, restart it after OUTAGE_S
    result: dict = {}
    load = threading.Thread(
        target=lambda: result.update(zip(("rate", "responses"), run_load(server), strict=True))
    )
    load.start()
    started = time.monotonic()
    # the dying sidecar's own counts, if it answers quickly (starved of CPU it may not): the
    # kill must not wait for it, or the load can be over before the outage begins
    old_text = scrape(first.metrics_url, timeout=0.8)
    time.sleep(max(0.0, 1.0 - (time.monotonic() - started)))
    assert load.is_alive(), "the load ended before the kill; make it longer"
    os.kill(first.proc.pid, signal.SIGKILL)
    first.proc.wait(10)
    killed_ns = time.time_ns()
    time.sleep(OUTAGE_S)
    second = SidecarProcess.start(
        rig["root"],
        address=first.address,
        store_path=store,
        extra_args=("--log-json",),
        timeout=RESTART_READY_TIMEOUT_S,
    )
    rig["sidecar"] = second
    back_ns = time.time_ns()
    load.join(600)
    assert not load.is_alive()
    killed_rate, killed = result["rate"], result["responses"]
    killed_text = server.metrics_text()

    after_rate, after = run_load(server)
    responses = before + killed + after
    api_tokens = completion_tokens(responses)
    assert api_tokens == 3 * ROUNDS * len(PROMPTS) * MAX_TOKENS  # every request completed
    vllm_tokens = value(server.metrics_text(), "vllm:generation_tokens_total") - vllm_before
    assert vllm_tokens == api_tokens

    # settle: the restarted sidecar has every rank's latest wave and the store holds it
    def account() -> list[tuple[int, int, int]]:
        text = second.metrics_text()
        waves, _, _ = stored(store)
        return [
            (
                int(value(text, "ascend_guard_last_wave", tp=str(tp))),
                len(waves[tp]),
                int(value(text, "ascend_guard_records_dropped_total", tp=str(tp))),
            )
            for tp in range(TP)
        ]

    def arrived() -> bool:  # the store holds each rank's latest wave
        waves, _, _ = stored(store)
        return all(last and last in waves[tp] for tp, (last, _, _) in enumerate(account()))

    deadline = time.monotonic() + 30
    while not arrived():
        if time.monotonic() > deadline:
            waves, _, _ = stored(store)
            lines = [
                line
                for line in server.log_path.read_text(errors="replace").splitlines()
                if "sidecar_" in line or "spool" in line
            ]
            raise AssertionError(
                f"(emitted, stored, dropped) per rank: {account()}; missing runs: "
                f"{[gaps(waves[tp], account()[tp][0])[:8] for tp in range(TP)]}\n"
                + "\n".join(lines[-20:])
            )
        time.sleep(0.2)
    time.sleep(1.0)  # heartbeats carry the last wave: anything still arriving shows now
    text = second.metrics_text()
    waves, sampled, incidents = stored(store)

    # -- throughput ------------------------------------------------------------------------------
    baseline = (before_rate + after_rate) / 2
    ratio = killed_rate / baseline
    print(
        f"\nsidecar restart: {killed_rate:.1f} tok/s with the kill vs {before_rate:.1f} before, "
        f"{after_rate:.1f} after (ratio {ratio:.3f}); outage {OUTAGE_S:.1f} s, "
        f"restarted sidecar ready {(back_ns - killed_ns) / 1e9:.2f} s after the kill; tokens "
        f"after a gap over {STALL_S} s: {slow_tokens(killed_text) - slow_tokens(mid_text):.0f}, "
        f"of {value(killed_text, 'vllm:inter_token_latency_seconds_count'):.0f} in all"
    )
    stalled = slow_tokens(killed_text) - slow_tokens(mid_text)
    assert stalled == 0, (
        f"{stalled:.0f} tokens of the killed run waited more than {STALL_S} s after the one "
        f"before ({slow_tokens(mid_text) - slow_tokens(before_text):.0f} in the run before it)"
    )
    assert ratio > 0.3, (killed_rate, before_rate, after_rate)

    # -- accounting per rank ------------------------------------------------------------------
    sidecar_drops = pipeline_drops(old_text) + pipeline_drops(text)
    assert sidecar_drops == 0, text
    gap_lines = {line["tp"]: line for line in log_events(second, "store_restart_gap")}
    assert value(text, "ascend_guard_store_restart_gap_records_total") == sum(
        line["missing_waves"] for line in gap_lines.values()
    )
    for tp in range(TP):
        emitted = int(value(text, "ascend_guard_last_wave", tp=str(tp)))
        numbers = waves[tp]
        assert len(numbers) == len(set(numbers)), f"tp{tp}: a wave stored twice"
        assert set(numbers) <= set(range(1, emitted + 1))
        missing = emitted - len(numbers)
        worker = int(value(text, "ascend_guard_records_dropped_total", tp=str(tp)))
        gap = gap_lines.get(tp, {}).get("missing_waves", 0)
        received_old = int(value(old_text, "ascend_guard_waves_total", tp=str(tp)))
        print(
            f"tp{tp}: emitted {emitted}, stored {len(numbers)}, missing {missing}; counted: "
            f"{worker} by the worker, {gap} as the restart gap; the killed sidecar had "
            f"received {received_old} (its metrics just before the kill)"
        )
        # every missing wave is counted once: the gap leaves out what the worker counted (its
        # buffer overflowing while the sidecar restarts: once 3,756 waves here, which the gap
        # counted too before it subtracted them); only the worker's in-flight batch, counted by
        # it whether or not it arrived, may be counted for a wave that is stored
        assert missing <= worker + gap, f"tp{tp}: {missing - worker - gap} waves lost uncounted"
        assert worker + gap - missing <= BATCH_MAX, f"tp{tp}: drops counted for waves stored"
        # no hole while the first sidecar was up: what is missing starts after the last wave
        # it stored (a worker whose buffer overflowed through a slow restart may go on dropping,
        # and counting, while the restarted sidecar catches up: later runs are allowed)
        runs = gaps(numbers, emitted)
        last_stored = gap_lines.get(tp, {}).get("last_stored_wave", emitted)
        assert all(start > last_stored for start, _ in runs), (
            f"tp{tp}: waves missing before the kill: {runs[:8]}"
        )
        print(f"tp{tp}: missing runs {runs[:4]}{' ...' if len(runs) > 4 else ''}")
    committed_old = value(old_text, "ascend_guard_store_committed_records_total")
    print(
        f"killed sidecar just before the kill ({'scraped' if old_text else 'no answer in 0.8 s'}): received {value(old_text, 'ascend_guard_waves_total'):.0f}"
        f" waves, committed {committed_old:.0f}, queue {value(old_text, 'ascend_guard_pipeline_queue_bytes'):.0f} B"
    )
    # cross-check with vLLM (its counter since start; the store holds every wave since start):
    # tp0 samples every generated token, one wave holds at most one token per running request
    vllm_total = value(server.metrics_text(), "vllm:generation_tokens_total")
    missing_tp0 = int(value(text, "ascend_guard_last_wave", tp="0")) - len(waves[0])
    print(
        f"sampled tokens in the store (tp0): {sampled[0]}, vLLM generation tokens {vllm_total:.0f}"
    )
    assert sampled[0] <= vllm_total <= sampled[0] + missing_tp0 * len(PROMPTS)
    if missing_tp0 == 0:
        assert sampled[0] == vllm_total

    # -- incidents: none lost -------------------------------------------------------------------
    by_worker: dict[str, list[int]] = collections.defaultdict(list)
    for incident_id, _ in incidents:
        worker, _, number = incident_id.rpartition(":")
        by_worker[worker].append(int(number))
    assert by_worker, "the load was meant to raise token_repeat incidents"
    for worker, numbers in by_worker.items():
        assert sorted(numbers) == list(range(1, max(numbers) + 1)), (worker, sorted(numbers))
    during = [t for _, t in incidents if killed_ns <= t < back_ns]
    print(
        f"incidents: {len(incidents)} stored from {len(by_worker)} worker(s), "
        f"{len(during)} raised while the sidecar was down, none missing"
    )
    # Incidents raised after the kill must have arrived (numbered without a hole, above). How
    # many fall inside the 2 s outage varies: 68-91 in most runs, 0 in one fresh-clone-sized
    # run whose loop incidents all came before the kill or after the restart (not understood
    # yet; see the closing note). Those raised during it reach the new sidecar through the spool.
    after_kill = [t for _, t in incidents if t >= killed_ns]
    assert after_kill, "no incident was raised after the kill: the drill proved nothing"
    replayed = server.log_path.read_text(errors="replace").count("incident_spool_replayed")
    assert replayed >= 1 or not during, "incidents raised in the outage were not replayed"
    assert value(text, "ascend_guard_store_moved_aside_total") == 0
    conn = sqlite3.connect(f"file:{store}?mode=ro", uri=True)
    try:
        assert conn.execute("PRAGMA quick_check").fetchone()[0] == "ok"
    finally:
        conn.close()
