"""The incident matrix: hang faults on a real TP=2 `vllm serve` with a real sidecar, each
judged from `/live/<engine>` polled every second, as an on-call probe would see it.

Used by bench/incidents.py (150 s holds; `--hold` for shorter).
Scenarios, in the order they run on one server (the last one ends it):

- `starvation`: the sidecar SIGSTOPped for 3 s on an idle engine beside two CPU hogs: no verdict;
- `stuck`: every rank stuck inside one all_reduce for the hold (the fault-injection point
  `inside_collective`, at a wave the scenario drives the server to): collective_stuck;
- `tp1_stop`, `tp0_stop`: a worker SIGSTOPped while requests decode, held, then SIGCONT;
- `sidecar_restart`: tp1 SIGSTOPped, the sidecar SIGKILLed a third into the hold and started
  again; the new sidecar must find tp1 from its liveness record;
- `tp1_kill`: tp1 SIGKILLed: a rank_exited verdict; what vLLM then does is recorded.

Judged per scenario: the verdict names the right rank(s) within `detect_within_s` of onset;
its evidence bundle (read while the fault stands) holds each rank's collective ring and, for
a rank that can answer, its stack;
every poll after that until the fault ends finds it standing and naming them (`stood` of
`polls`); no recovery during the fault; recovery (`/live` 200) within 5 s of the end; no
verdict outside a fault (`false_verdicts`); never another rank (`wrong_ranks`).

`stream_args`: sidecar flags for gRPC's checks. Short holds pass `--stream-keepalive 1s
--stream-ping-timeout 5s`, so that gRPC drops a stopped rank's stream within the hold: the path
a 150 s hold took after 60 s at gRPC's own default ping timeout (`--stream-ping-timeout 1m`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from tests.support.ports import free_port
from tests.support.sidecar import SidecarProcess
from tests.support.vllm_server import VllmServer

ENGINE = "matrix"
STUCK_WAVE = 40  # the wave whose first tp all_reduce every rank gets stuck in
RECOVERY_WITHIN_S = 5.0
HANG_WAIT_S = 3.0  # the sidecar's default --hang-wait: collective_stuck needs that long
SCENARIOS = ("starvation", "stuck", "tp1_stop", "tp0_stop", "sidecar_restart", "tp1_kill")


@dataclasses.dataclass
class Outcome:
    name: str
    expect: tuple[int, ...]  # the tp ranks the verdict must name (empty: no verdict)
    polls: int = 0  # polls between detection deadline and the fault's end
    stood: int = 0  # ... that found the verdict naming exactly `expect`
    unanswered: int = 0  # polls the sidecar could not answer (it was down)
    false_verdicts: int = 0
    wrong_ranks: int = 0
    detect_s: float | None = None  # onset -> first poll with the right verdict
    recovery_s: float | None = None  # end of the fault -> /live 200
    recovered_during: int = 0  # recovery events while the fault lasted
    notes: list[str] = dataclasses.field(default_factory=list)
    # the verdict's evidence bundle, per tp rank: role, process state, ring length, whether its
    # newest collective had not returned, whether it answered with a stack (see `bundle_of`)
    bundle: dict[int, dict] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        if not self.expect:
            return self.false_verdicts == 0
        return (
            self.detect_s is not None
            and self.stood == self.polls
            and self.wrong_ranks == 0
            and self.recovered_during == 0
            and self.false_verdicts == 0
            and (self.name == "tp1_kill" or (self.recovery_s or 99) <= RECOVERY_WITHIN_S)
        )

    def row(self) -> dict:
        return dataclasses.asdict(self) | {"ok": self.ok}


class Matrix:
    def __init__(
        self, root: Path, model: Path, hold_s: float, stream_args: tuple[str, ...] = ()
    ) -> None:
        self.root, self.hold_s = root, hold_s
        self.health_port = free_port()
        sock, live = root / "guard.sock", root / "live"
        self.sidecar_args = (
            "--health-port", str(self.health_port), "--health-host", "127.0.0.1",
            "--liveness-dir", str(live), *stream_args,
        )  # fmt: skip
        self.address = f"unix://{sock}"
        self.sidecar = SidecarProcess.start(
            root, address=self.address, extra_args=self.sidecar_args
        )
        guard = {
            "sidecar": self.address, "engine": ENGINE, "flush_interval_ms": 20,
            "reconnect_max_backoff_s": 0.5, "liveness_dir": str(live),
            "fault_injection": {"enabled": True, "tp_rank": -1, "at_wave": STUCK_WAVE,
                                "delay_ms": hold_s * 1000, "where": "inside_collective"},
        }  # fmt: skip
        try:
            self.server = VllmServer.start(model, root, tp=2, guard=guard)
        except BaseException:
            self.sidecar.stop()
            raise
        self.outcomes: list[Outcome] = []
        self._load_stop = threading.Event()
        # a worker streams from its first wave on: one request, so that every rank reports
        try:
            self.server.complete("Warm up", 8)
        except BaseException:
            self.stop()
            raise

    # -- probes ---------------------------------------------------------------------------
    def live(self) -> tuple[int, dict]:
        url = f"http://127.0.0.1:{self.health_port}/live/{ENGINE}"
        try:
            try:
                with urllib.request.urlopen(url, timeout=3) as resp:
                    return resp.status, json.loads(resp.read())
            except urllib.error.HTTPError as exc:
                return exc.code, json.loads(exc.read())
        except (OSError, ValueError):  # down, or too slow to answer: no answer
            return 0, {}

    def history(self) -> list[dict]:
        url = f"http://127.0.0.1:{self.health_port}/hangs"
        try:
            with urllib.request.urlopen(url, timeout=3) as resp:
                return json.loads(resp.read())["history"]
        except (OSError, ValueError, KeyError):
            return []

    def pids(self, timeout: float = 20.0) -> dict[int, int]:
        """The workers' pids, as the sidecar names them (a slow answer is asked again)."""
        deadline = time.monotonic() + timeout
        while True:
            pids = {r["tp"]: r["pid"] for r in self.live()[1].get("ranks", [])}
            if len(pids) == 2 or time.monotonic() > deadline:
                return pids
            time.sleep(0.2)

    def wait_healthy(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.live()[0] != 200:
            if time.monotonic() > deadline:
                raise AssertionError(f"not live before the scenario: {self.live()}")
            time.sleep(0.2)

    # -- load -----------------------------------------------------------------------------
    def _request(self, tokens: int) -> None:
        body = {"model": self.server.model, "prompt": "Hold the line", "max_tokens": tokens,
                "temperature": 0.0, "ignore_eos": True}  # fmt: skip
        req = urllib.request.Request(
            f"{self.server.base}/v1/completions", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=self.hold_s + 120) as resp:
                resp.read()
        except OSError:
            pass

    def load(self, tokens: int = 300, streams: int = 2) -> list[threading.Thread]:
        """Requests that decode all along (a new one as each ends) until `stop_load`."""
        self._load_stop.clear()

        def loop() -> None:
            while not self._load_stop.is_set() and self.server.proc.poll() is None:
                self._request(tokens)

        threads = [threading.Thread(target=loop, daemon=True) for _ in range(streams)]
        for t in threads:
            t.start()
        time.sleep(1.0)  # tokens flow
        return threads

    def stop_load(self, threads: list[threading.Thread]) -> None:
        self._load_stop.set()
        for t in threads:
            t.join(self.hold_s + 130)

    # -- judging --------------------------------------------------------------------------
    def watch(
        self,
        out: Outcome,
        onset: float,
        end: float,
        within_s: float,
        during: Callable[[float], None],
    ) -> None:
        """Poll fast until the verdict, then every second until `end`; `during(t)` runs
        between polls (it may act on the fault, as the sidecar restart does)."""
        deadline, next_poll = onset + within_s, time.monotonic()
        while time.monotonic() < end:
            now = time.monotonic()
            during(now - onset)
            status, body = self.live()
            names = {r["tp"] for v in body.get("verdicts", []) for r in v["stopped"]}
            right = status == 503 and names == set(out.expect)
            if status in (0, 404):  # down, or restarted and not reached by a rank yet
                out.unanswered += 1 if now >= deadline else 0
            elif names - set(out.expect):
                out.wrong_ranks += 1
            if right and out.detect_s is None:
                out.detect_s = round(now - onset, 3)
            if now >= deadline and status not in (0, 404):
                out.polls += 1
                out.stood += int(right)
            if out.detect_s is None and now < deadline:
                time.sleep(0.1)
                continue
            next_poll += 1.0
            time.sleep(max(0.0, min(next_poll, end) - time.monotonic()))

    def recovered_within(self, out: Outcome, end: float, timeout: float = 15.0) -> None:
        while time.monotonic() - end < timeout:
            if self.live()[0] == 200:
                out.recovery_s = round(time.monotonic() - end, 3)
                return
            time.sleep(0.1)
        # not seen: say whether the sidecar itself went unscheduled meanwhile
        late = [x for x in self.sidecar.log().splitlines() if "hang_check_late" in x]
        out.notes.append(f"no recovery seen in {timeout:g}s; sidecar log: {late[-3:]}")

    def events(
        self, out: Outcome, before: int, start_unix: float, end_unix: float, slack: float = 0.0
    ) -> None:
        """Count the sidecar's events of this scenario: recoveries during the fault (`slack`:
        how far the fault's end may lie before `end_unix`, where it is an estimate), verdicts
        outside it (or any, where none is due), verdicts naming other ranks."""
        for e in self.history()[before:]:
            if e["event"] == "hang_recovered" and e["recovered_unix"] < end_unix - slack:
                out.recovered_during += 1
            if e["event"] == "hang_verdict":
                inside = start_unix - 1 <= e["verdict_unix"] <= end_unix + 1
                if not out.expect or not inside:
                    out.false_verdicts += 1
                    out.notes.append(f"verdict {e['kind']} at {e['verdict_unix']:.3f}")

    def bundle_of(self, out: Outcome, before: int, timeout: float = 10.0) -> None:
        """Read the evidence bundle the scenario's first verdict names (written on the
        sidecar's bundle thread within its stack timeout) into `out.bundle`."""
        verdicts = [e for e in self.history()[before:] if e["event"] == "hang_verdict"]
        named = verdicts[0].get("bundle", {}) if verdicts else {}
        if not named.get("path"):
            out.notes.append(f"no bundle named: {named or 'no verdict'}")
            return
        deadline = time.monotonic() + timeout
        while True:
            try:
                bundle = json.loads(Path(named["path"]).read_text())
                break
            except (OSError, ValueError):
                if time.monotonic() > deadline:
                    out.notes.append(f"bundle {named['id']} not written in {timeout:g}s")
                    return
                time.sleep(0.2)
        for rank in bundle["ranks"]:
            ring = rank["collectives"]["entries"]
            threads = rank["stack"].get("threads", [])
            out.bundle[rank["tp"]] = {
                "role": rank["role"],
                "state": rank["process"].get("state", "")[:1],
                "ring": len(ring),
                "open": bool(ring) and ring[-1]["end_unix"] == "not returned",
                "open_op": ring[-1]["op"] if ring else "",
                "stack": rank["stack"]["answered"],
                "engine_frames": sum(len(t["frames"]) for t in threads if t.get("engine")),
            }

    # -- scenarios ------------------------------------------------------------------------
    def run(self, names: tuple[str, ...] = SCENARIOS) -> list[Outcome]:
        """Run these scenarios in order; their outcomes (all so far: `self.outcomes`)."""
        done = []
        for name in names:
            out = getattr(self, f"_{name}")()
            self.outcomes.append(out)
            done.append(out)
            print(json.dumps(out.row()), flush=True)
        return done

    def _starvation(self) -> Outcome:
        out = Outcome("starvation", ())
        self.wait_healthy()
        before, start = len(self.history()), time.time()
        hog = "import time\nend = time.monotonic() + 12\nwhile time.monotonic() < end: pass"
        hogs = [subprocess.Popen([sys.executable, "-c", hog]) for _ in range(2)]
        try:
            time.sleep(1.0)
            os.kill(self.sidecar.proc.pid, signal.SIGSTOP)
            time.sleep(3.0)
        finally:
            os.kill(self.sidecar.proc.pid, signal.SIGCONT)
        for _ in range(6):
            status, _ = self.live()
            out.polls += 1
            out.stood += int(status == 200)  # here: stood healthy
            time.sleep(1.0)
        for h in hogs:
            h.kill()
            h.wait()
        self.events(out, before, start, time.time())
        out.false_verdicts += out.polls - out.stood
        return out

    def _fault(self, name: str, expect: tuple[int, ...], start: Callable[[], None],
               end: Callable[[], None], during: Callable[[float], None] = lambda t: None,
               within_s: float = 2.0) -> Outcome:  # fmt: skip
        out = Outcome(name, expect)
        self.wait_healthy()
        before, judge = len(self.history()), self.sidecar
        threads = self.load()
        start_unix, onset = time.time(), time.monotonic()
        start()
        try:
            self.watch(out, onset, onset + self.hold_s, within_s, during)
            if self.sidecar is not judge:  # restarted meanwhile: all of its history is this fault's
                before = 0
            self.bundle_of(out, before)
        finally:
            end()
        ended, end_unix = time.monotonic(), time.time()
        self.recovered_within(out, ended)
        self.stop_load(threads)
        self.events(out, before, start_unix, end_unix)
        return out

    def _stop(self, name: str, tp: int, during: Callable[[float], None] = lambda t: None):
        pid = self.pids()[tp]
        return self._fault(
            name, (tp,), lambda: os.kill(pid, signal.SIGSTOP), lambda: os.kill(pid, signal.SIGCONT),
            during,
        )  # fmt: skip

    def _tp1_stop(self) -> Outcome:
        return self._stop("tp1_stop", 1)

    def _tp0_stop(self) -> Outcome:
        return self._stop("tp0_stop", 0)

    def _sidecar_restart(self) -> Outcome:
        done = []

        def restart(t: float) -> None:
            if done or t < self.hold_s / 3:
                return
            done.append(t)
            self.sidecar.stop(signal.SIGKILL)
            self.sidecar = SidecarProcess.start(
                self.root / f"restart-{len(self.outcomes)}", address=self.address,
                extra_args=self.sidecar_args,
            )  # fmt: skip

        (self.root / f"restart-{len(self.outcomes)}").mkdir(parents=True, exist_ok=True)
        out = self._stop("sidecar_restart", 1, restart)
        out.notes.append(
            f"sidecar restarted {done[0]:.1f}s into the hold" if done else "no restart"
        )
        return out

    def _stuck(self) -> Outcome:
        """Drive the server to STUCK_WAVE: every rank blocks inside its first tp all_reduce of
        that wave for the hold (the fault-injection point; its time is the server's)."""
        out = Outcome("stuck", (0, 1))
        self.wait_healthy()
        waves = max(r["last_wave"] for r in self.live()[1]["ranks"])
        if waves >= STUCK_WAVE:
            out.notes.append(f"wave {waves} already past {STUCK_WAVE}: not run")
            out.false_verdicts += 1
            return out
        before, start_unix = len(self.history()), time.time()
        threads = self.load(tokens=STUCK_WAVE + 20, streams=1)
        onset = None
        deadline = time.monotonic() + 60
        while onset is None and time.monotonic() < deadline:
            ranks = self.live()[1].get("ranks", [])
            # both inside one call for over 0.5 s (an all_reduce of the tiny model takes
            # milliseconds): the stuck one; their own clocks say since when
            inside = [r for r in ranks if r.get("op") and r.get("waiting_s", 0) >= 0.5]
            if len(inside) == 2:
                onset = time.monotonic() - min(r["waiting_s"] for r in inside)
            time.sleep(0.05)
        if onset is None:
            out.notes.append("the stuck wave never came")
            self.stop_load(threads)
            return out
        end = onset + self.hold_s
        self.watch(out, onset, end, HANG_WAIT_S + 2.0, lambda t: None)
        self.bundle_of(out, before)
        end_unix = time.time()
        self.recovered_within(out, end)
        self.stop_load(threads)
        # the end is the injected delay's, estimated from the ranks' reported waits (their
        # heartbeats lag by up to an interval): a recovery up to 1 s before it is the end's
        self.events(out, before, start_unix, end_unix, slack=1.0)
        return out

    def _tp1_kill(self) -> Outcome:
        """SIGKILL of tp1: its process is gone. The verdict must name it at once and never turn
        into a recovery; what vLLM does then is recorded in the notes."""
        out = Outcome("tp1_kill", (1,))
        self.wait_healthy()
        pid = self.pids()[1]
        before, start_unix = len(self.history()), time.time()
        threads = self.load()
        onset = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        end = onset + min(self.hold_s, 30.0)
        served_until = None

        def vllm(t: float) -> None:
            nonlocal served_until
            if served_until is None and self.server.proc.poll() is not None:
                served_until = t

        self.watch(out, onset, end, 2.0, vllm)
        self._load_stop.set()
        code = self.server.proc.poll()
        out.notes.append(
            f"vLLM exited {served_until:.1f}s after the kill (code {code})"
            if served_until is not None
            else f"vLLM still running {end - onset:.0f}s after the kill (health {self._health()})"
        )
        kinds = [e.get("kind") for e in self.history()[before:] if e["event"] == "hang_verdict"]
        exits = [e for e in self.history()[before:] if e["event"] == "rank_exited"]
        out.notes.append(f"verdicts {kinds}; rank_exited {[e['exit'] for e in exits]}")
        self.events(out, before, start_unix, time.time() + 3600)
        self.stop_load(threads)
        return out

    def _health(self) -> int:
        try:
            return self.server.health_status()
        except OSError:
            return 0

    def stop(self) -> None:
        self._load_stop.set()
        self.server.stop()
        self.sidecar.stop()


def summary(outcomes: list[Outcome]) -> str:
    """The benchmark's last line."""
    judged = [o for o in outcomes if o.expect]
    polls = sum(o.polls for o in judged)
    stood = sum(o.stood for o in judged)
    false = sum(o.false_verdicts for o in outcomes)
    wrong = sum(o.wrong_ranks for o in outcomes)
    # a fault that ends but whose recovery was not seen within the wait counts as infinitely
    # late (tp1_kill has no end: its process is gone)
    recoveries = sorted(
        o.recovery_s if o.recovery_s is not None else float("inf")
        for o in judged
        if o.name != "tp1_kill"
    )
    p50 = recoveries[len(recoveries) // 2] if recoveries else float("nan")
    return (
        f"incidents: {len(outcomes)} scenarios; verdict stood through {stood}/{polls} polls; "
        f"false verdicts {false}; wrong ranks {wrong}; recovery p50 {p50:.1f} s"
    )
