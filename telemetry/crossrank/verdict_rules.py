"""The verdict rules: which rank of a replica hangs, and when a named rank is back.

- **no_heartbeat**: a rank has sent nothing for longer than `stale_s` (or twice its own
  heartbeat interval, if longer). A process frozen whole (SIGSTOP, a paused VM) looks like
  this; its peers' heartbeats say where they wait. On the sidecar's own node a rank's
  liveness record and `/proc/<pid>/stat` say more (proc_looks.py): a process seen in state T
  (stopped) for `frozen_s` (counted from the silence that started the looks) is frozen,
  judged without waiting for `stale_s`; a silent process that runs and is inside a collective
  (its streamer thread starved by a wait that holds the GIL), or whose record still moves, is
  alive, and is judged by the wait-based rules below, never named as stopped for its silence.
  The stream does not matter: a local rank whose stream ended is judged from its record and
  process, a remote one whose stream ended is `lost` and silent.
- **rank_exited**: a rank's process is gone while its replica's other ranks are not.
- **not_arrived**: the ranks still speak, but some have waited in collective (group G, seq N)
  for longer than `wait_s` while others are not in it: those never arrived.
- **collective_stuck**: every rank has been inside the same collective for longer than
  `wait_s`: they all arrived, and the transport does not complete.

The wait-based rules are armed once every rank of the replica has begun wave 2 (the first
wave includes warm-up). A verdict stands until its named ranks are back: each moved again (a
new wave, a collective entered or completed, its record's counters, or, for a silent rank, a
heartbeat made after the verdict). A rank that exited, or whose stream was lost, is never back.
Pure functions of the rank states; called on the checker thread under the detector's lock.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from telemetry.crossrank.peers import unseen_ranks
from telemetry.crossrank.rank_state import (
    CLOSED,
    EXITED,
    FOUND,
    STREAMING,
    HangSettings,
    RankState,
)
from telemetry.wire.replica import RankKey, Replica

KINDS = ("no_heartbeat", "not_arrived", "collective_stuck", "rank_exited")
SILENCE_KINDS = ("no_heartbeat", "rank_exited")


def progress(state: RankState) -> tuple:
    """What changes only when the rank moves (not its heartbeats' send times)."""
    return (state.last_wave, tuple(sorted(state.seq_done.items())), state.record_moves)


@dataclasses.dataclass
class Verdict:
    engine: str
    run_id: str
    dp: int
    kind: str
    stopped: list[dict[str, Any]]
    waiting: list[dict[str, Any]]
    op: str
    group: str
    seq: int
    wave: int
    onset_unix: float  # estimated start of the stall (wall clock)
    verdict_unix: float
    onset_mono: float
    # the served model name vLLM's metrics carry, as the ranks' workers named it ("" unknown)
    model_name: str = ""
    # (tp, pp) of each named rank -> (pid, progress at the verdict); not part of the report
    named: dict[RankKey, tuple[int, tuple]] = dataclasses.field(default_factory=dict, repr=False)
    # the evidence bundle the verdict's incident names (bundle.py), so that a standing verdict
    # shows it too; None where bundles are off
    bundle: dict[str, Any] | None = None

    def summary(self) -> str:
        who = ", ".join(f"tp{r['tp']}/pp{r['pp']} (pid {r['pid']})" for r in self.stopped)
        where = f"{self.op} on {self.group} seq {self.seq}" if self.op else "no collective"
        graph = next((r for r in self.waiting + self.stopped if r.get("graph")), None)
        if self.op and graph is not None:
            where += f" inside replay of graph {graph['graph']} ({graph['graph_holds']})"
        peers = (
            "; peers wait in " + where
            if self.waiting and self.kind != "collective_stuck"
            else f"; {where}"
        )
        how = "exited" if self.kind == "rank_exited" else "stopped"
        return f"engine {self.engine} dp{self.dp}: {self.kind}: {who} {how}{peers}"

    def as_dict(self) -> dict[str, Any]:
        bundle = {"bundle": self.bundle} if self.bundle is not None else {}
        return {
            "engine": self.engine,
            "run_id": self.run_id,
            "dp": self.dp,
            "kind": self.kind,
            "stopped": self.stopped,
            "waiting": self.waiting,
            "op": self.op,
            "group": self.group,
            "seq": self.seq,
            "wave": self.wave,
            "onset_unix": self.onset_unix,
            "verdict_unix": self.verdict_unix,
            "detect_s": round(self.verdict_unix - self.onset_unix, 3),
            "model_name": self.model_name,
            "summary": self.summary(),
            **bundle,
        }


def silence_limit(settings: HangSettings, state: RankState) -> float:
    """How long a rank may be silent: stale_s, or twice its heartbeat interval (plus, for a
    rank found from its record, the time its worker may take to reconnect). No allowance for
    a sidecar that reads late: the ingest handler updates this state before it queues the
    batch for storage, and the checker judges only once ingest caught up (hang_checker.py)."""
    limit = max(settings.stale_s, 2.0 * state.heartbeat_interval)
    return limit + settings.found_grace_s if state.status == FOUND else limit


def frozen(settings: HangSettings, state: RankState, now: float) -> bool:
    """Stopped whole (SIGSTOP, a debugger) for about frozen_s: looks begin after look_after_s
    of silence and have seen state T ever since. Timed by the process state, not by the
    stream: batches a lagging sidecar reads only now were sent before the stop, and must
    neither hurry the verdict nor end it. A rank found from its record (this sidecar
    restarted) and stopped is frozen at once."""
    s = settings
    if state.stopped_since and state.status == FOUND:
        return True  # no stream since this sidecar started: silent at least that long
    return bool(state.stopped_since) and now - state.stopped_since >= max(
        0.0, s.frozen_s - s.look_after_s
    )


def is_silent(settings: HangSettings, state: RankState, now: float) -> bool:
    if state.status == EXITED:
        return True
    return frozen(settings, state, now) or now - state.heard_at() > silence_limit(settings, state)


def judge(
    settings: HangSettings, key: Replica, ranks: dict[RankKey, RankState], now: float
) -> Verdict | None:
    # a rank whose worker closed its stream is leaving: neither silent nor a peer
    judged = {k: r for k, r in ranks.items() if r.status != CLOSED}
    if not judged:
        return None
    s = settings
    silent = [r for r in judged.values() if is_silent(s, r, now)]
    alive = [r for r in judged.values() if r not in silent]
    # one rank left is judged too: a rank that exited or was lost stays in `ranks`
    armed = len(judged) > 1 and min(r.last_wave for r in judged.values()) >= s.arm_wave
    # a heartbeat's age is extrapolated to now; it must itself show a long wait, so that a
    # call that ended right after its heartbeat is not taken for a wait
    waiting = (
        [r for r in alive if r.op and r.op_age_s >= s.wait_s / 2 and r.waiting_s(now) >= s.wait_s]
        if armed
        else []
    )
    if silent:
        peers = [r for r in alive if r.op]
        kind = "rank_exited" if any(r.status == EXITED for r in silent) else "no_heartbeat"
        return make_verdict(key, kind, silent, peers, now)
    if not waiting:
        return None
    # the collective the waiting ranks are furthest into
    front = max(waiting, key=lambda r: (r.group, r.seq))
    at = [r for r in waiting if (r.group, r.seq) == (front.group, front.seq)]
    # not arrived: has not entered (group, seq) yet, and has been speaking for wait_s (a rank
    # just back from a freeze gets that long to catch up before it is judged again)
    behind = [
        r
        for r in alive
        if r not in at
        and r.seq_done.get(front.group, 0) < front.seq
        and now - r.speaking_since >= s.wait_s
    ]
    if behind:
        return make_verdict(key, "not_arrived", behind, at, now)
    # all arrived: only this sidecar sees the whole replica (a rank on another node may not
    # have arrived; that verdict is the Prometheus rules', docs/cross-node.md)
    if len(at) == len(judged) and not unseen_ranks(r.rank for r in judged.values()):
        return make_verdict(key, "collective_stuck", at, at, now)
    return None


def make_verdict(
    key: Replica, kind: str, stopped: list[RankState], waiting: list[RankState], now: float
) -> Verdict:
    run_id, engine, dp = key
    wall = time.time()
    ref = max(waiting, key=lambda r: r.waiting_s(now)) if waiting else None
    if kind in SILENCE_KINDS:
        onset = min(r.last_seen for r in stopped)
    else:
        onset = now - (ref.waiting_s(now) if ref else 0.0)
    return Verdict(
        engine=engine,
        run_id=run_id,
        dp=dp,
        kind=kind,
        stopped=[r.describe(now) for r in stopped],
        waiting=[r.describe(now) for r in waiting],
        op=ref.op if ref else "",
        group=ref.group if ref else "",
        seq=ref.seq if ref else 0,
        wave=max((r.last_wave for r in waiting), default=max(r.last_wave for r in stopped)),
        onset_unix=wall - (now - onset),
        verdict_unix=wall,
        onset_mono=onset,
        named={(r.rank.tp_rank, r.rank.pp_rank): (r.rank.pid, progress(r)) for r in stopped},
    )


def back(verdict: Verdict, ranks: dict[RankKey, RankState]) -> bool:
    """Every rank the verdict names moved again since it was made. A process that took a
    named rank's place (a restarted worker) is back once it streams."""
    for key, (pid, before) in verdict.named.items():
        state = ranks.get(key)
        if state is None or state.status in (EXITED, CLOSED):
            return False
        if state.rank.pid != pid:
            if state.status != STREAMING:
                return False
            continue
        moved = progress(state) != before or (
            verdict.kind in SILENCE_KINDS and state.heartbeat_sent_unix > verdict.verdict_unix
        )
        if not moved or (state.status != STREAMING and not state.local):
            return False  # a lost rank is back once it reconnects and moves
    return True
