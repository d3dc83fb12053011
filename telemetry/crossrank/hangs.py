"""Hang verdicts from heartbeats: which rank stopped, and which collective its peers wait in.

Every batch from a rank proves its streamer thread is alive; its heartbeat says what the engine
thread is doing (phase, or the collective it is inside, with group and sequence number). A
checker thread looks at each engine replica (run, engine, dp) several times a second:

- **no_heartbeat**: a rank has sent nothing for longer than `stale_s` (or twice its own
  heartbeat interval, if longer). A process frozen whole (SIGSTOP, a paused VM) looks like
  this; its peers' heartbeats say where they wait. On the sidecar's own node a rank's
  shared-memory liveness record and `/proc/<pid>/stat` say more (telemetry/wire/liveness_record.py):
  a process seen in state T (stopped) for `frozen_s` (counted from the silence that started
  the looks) is frozen, judged without waiting for `stale_s`; a silent process that runs and is inside a collective (its streamer thread
  starved by a wait that holds the GIL), or whose record still moves, is alive, and is
  judged by the wait-based rules below, never named as stopped for its silence.
- **not_arrived**: the ranks still speak, but some have waited in collective (group G, seq N)
  for longer than `wait_s` while others are not in it: those never arrived (stuck in compute,
  in a different collective, or behind an earlier one).
- **collective_stuck**: every rank has been inside the same collective for longer than
  `wait_s`: they all arrived, and the transport does not complete.

The wait-based rules are armed once every rank of the replica has begun wave 2 (the first
wave includes warm-up, where one rank legitimately waits seconds for another). A verdict
stands until the condition clears; then a recovery is recorded with the stall's length.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from telemetry.crossrank.bundle import BundleWriter
from telemetry.crossrank.peers import NOT_SEEN, unseen_ranks
from telemetry.metrics.collectives import CollectiveMetrics
from telemetry.store.incidents import RECOVERY, VERDICT
from telemetry.wire.collective_columns import columns_of, last_seq_by_group
from telemetry.wire.liveness_record import RecordReader, RecordView
from telemetry.wire.proto import guard_pb2
from telemetry.wire.replica import RankKey, Replica, rank_key, replica_of

log = structlog.get_logger("ascend_guard.hangs")

KINDS = ("no_heartbeat", "not_arrived", "collective_stuck")


@dataclasses.dataclass(frozen=True)
class HangSettings:
    stale_s: float = 2.0  # no batch from a rank for this long: it stopped
    # a peer inside one collective this long while others are not in it; above stale_s, so a
    # frozen process is reported as silent (no_heartbeat) rather than as not arrived
    wait_s: float = 3.0
    check_interval_s: float = 0.1
    arm_wave: int = 2  # wait-based rules only once every rank has begun this wave
    # a local rank whose process is stopped (state T) and silent this long: frozen whole
    frozen_s: float = 1.0
    # a local rank silent this long gets its liveness record and process state read
    look_after_s: float = 0.25


@dataclasses.dataclass
class RankState:
    rank: guard_pb2.RankInfo
    last_seen: float  # sidecar monotonic time of the latest batch
    speaking_since: float = 0.0  # first batch after the rank's latest silence (or ever)
    seq_done: dict[str, int] = dataclasses.field(default_factory=dict)  # group -> highest seq
    lag_s: float = 0.0  # how old the latest heartbeat was when the sidecar got to it
    heartbeat_at: float = 0.0  # ... of the latest heartbeat
    heartbeat_interval: float = 0.0  # smoothed interval between heartbeats
    phase: str = ""
    phase_age_s: float = 0.0
    last_wave: int = 0
    op: str = ""
    group: str = ""
    seq: int = 0
    graph: str = ""  # the captured graph being replayed around that collective, if any
    graph_holds: str = ""  # ... and the collectives it holds
    op_age_s: float = 0.0  # as of op_at
    op_at: float = 0.0  # when op/op_age_s were read (a heartbeat, or the liveness record)
    proc_state: str = ""  # /proc state letter at the latest look while silent ("" = no look)
    stopped_since: float = 0.0  # first of the looks in a row that saw it stopped (state T)
    record_seen: float = 0.0  # latest look at the record that showed the rank alive
    record_moves: tuple[int, int] | None = None

    def waiting_s(self, now: float) -> float:
        """How long the rank has been inside its current collective, as of `now`."""
        return self.op_age_s + (now - self.op_at) if self.op else 0.0

    def heard_at(self) -> float:
        """The latest sign of life: a batch on the stream, or a look at its record."""
        return max(self.last_seen, self.record_seen)

    def describe(self, now: float) -> dict[str, Any]:
        info: dict[str, Any] = {
            "dp": self.rank.dp_rank, "tp": self.rank.tp_rank, "pp": self.rank.pp_rank,
            "pid": self.rank.pid, "node": self.rank.node, "last_wave": self.last_wave,
            "silent_s": round(now - self.last_seen, 3), "phase": self.phase,
            "lag_s": round(self.lag_s, 3), "state": self.proc_state,
        }  # fmt: skip
        if self.op:
            info.update(op=self.op, group=self.group, seq=self.seq,
                        waiting_s=round(self.waiting_s(now), 3))  # fmt: skip
            if self.graph:
                info.update(graph=self.graph, graph_holds=self.graph_holds)
        return info


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
        return f"engine {self.engine} dp{self.dp}: {self.kind}: {who} stopped{peers}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "engine": self.engine, "run_id": self.run_id, "dp": self.dp, "kind": self.kind,
            "stopped": self.stopped, "waiting": self.waiting, "op": self.op, "group": self.group,
            "seq": self.seq, "wave": self.wave, "onset_unix": self.onset_unix,
            "verdict_unix": self.verdict_unix,
            "detect_s": round(self.verdict_unix - self.onset_unix, 3), "summary": self.summary(),
        }  # fmt: skip


@dataclasses.dataclass(frozen=True)
class RankFacts:
    """One rank as this sidecar knows it (`HangDetector.rank_facts`)."""

    replica: Replica
    rank: guard_pb2.RankInfo
    heard_unix: float  # the latest sign of life: a batch, or a look at its liveness record
    op: str  # the collective it is inside ("" = none) ...
    group: str
    seq: int
    since_unix: float  # ... since then
    seq_reached: dict[str, int]  # group -> highest seq it completed or entered
    last_wave: int


def _unseen_part(states: dict[RankKey, RankState]) -> dict[str, Any]:
    """`not_seen` for a replica whose world (tp_size x pp_size) this sidecar sees only part
    of: the missing ranks are on other nodes, or have not connected."""
    missing = unseen_ranks(state.rank for state in states.values())
    if not missing:
        return {}
    return {
        "not_seen": [{"tp": tp, "pp": pp, "note": NOT_SEEN} for tp, pp in missing],
        "verdict_scope": "the ranks this sidecar sees; for the others, the cluster alert rules",
    }


IncidentSink = Callable[[str, guard_pb2.RankInfo | None, guard_pb2.Incident], Any]


class HangDetector:
    def __init__(
        self,
        metrics: CollectiveMetrics,
        settings: HangSettings | None = None,
        *,
        incident_sink: IncidentSink | None = None,
        clock: Callable[[], float] = time.monotonic,
        records: RecordReader | None = None,
    ) -> None:
        self.metrics = metrics
        self._records = records  # liveness records of ranks on this node (None: stream only)
        self.settings = settings or HangSettings()
        self._sink = incident_sink
        self._clock = clock
        self._lock = threading.Lock()
        self._ranks: dict[Replica, dict[RankKey, RankState]] = {}
        self.verdicts: dict[Replica, Verdict] = {}
        self.history: list[dict[str, Any]] = []  # verdicts and recoveries, newest last
        self._ids = itertools.count(1)
        self._id_prefix = f"sidecar-{os.getpid()}-{time.time_ns()}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.bundles: BundleWriter | None = None  # evidence bundle per verdict (None: off)

    # -- ingest side ----------------------------------------------------------------------------
    def observe(self, engine: str, batch: guard_pb2.Batch) -> None:
        rank = batch.rank
        now = self._clock()
        key = replica_of(engine, rank)
        seqs_done = last_seq_by_group(columns_of(batch))  # per batch, over the columns
        with self._lock:
            ranks = self._ranks.setdefault(key, {})
            state = ranks.get(rank_key(rank))
            if state is None or state.rank.pid != rank.pid:
                state = RankState(guard_pb2.RankInfo(), now)
                state.rank.CopyFrom(rank)
                ranks[rank_key(rank)] = state
                self._create_series(engine, rank)
            if now - state.heard_at() > self._silence_limit(state) or not state.speaking_since:
                state.speaking_since = now  # back from a silence: give it time to catch up
            state.last_seen = now
            for group, seq in seqs_done.items():
                if seq > state.seq_done.get(group, 0):
                    state.seq_done[group] = seq
            if batch.HasField("heartbeat"):
                hb = batch.heartbeat
                if state.heartbeat_at:
                    gap = now - state.heartbeat_at
                    state.heartbeat_interval = (
                        gap if not state.heartbeat_interval
                        else 0.8 * state.heartbeat_interval + 0.2 * gap
                    )  # fmt: skip
                state.heartbeat_at = now
                state.lag_s = max(0.0, time.time() - hb.time_unix_nano / 1e9)
                state.phase = hb.phase
                state.phase_age_s = hb.phase_age_ns / 1e9
                state.last_wave = max(state.last_wave, hb.last_wave)
                state.op = hb.collective_op
                state.group = hb.collective_group
                state.seq = hb.collective_seq
                state.op_age_s = hb.collective_age_ns / 1e9
                state.graph = hb.collective_graph
                state.graph_holds = hb.collective_graph_holds
                state.op_at = now
                if state.op and state.seq > state.seq_done.get(state.group, 0):
                    state.seq_done[state.group] = state.seq

    def _create_series(self, engine: str, rank: guard_pb2.RankInfo) -> None:
        """Series exist (at 0) once a rank speaks, so dashboards and alerts see them."""
        m = self.metrics
        replica = (engine, str(rank.dp_rank))
        m.wedged.labels(*replica)
        m.hang_recoveries.labels(*replica)
        m.stall_duration.labels(*replica)
        for kind in KINDS:
            m.hang_verdicts.labels(
                engine, str(rank.dp_rank), str(rank.tp_rank), str(rank.pp_rank), kind
            )

    def rank_gone(self, engine: str, rank: guard_pb2.RankInfo) -> None:
        """A rank's stream ended (the worker exited): it is no longer expected to speak."""
        key = replica_of(engine, rank)
        with self._lock:
            ranks = self._ranks.get(key, {})
            state = ranks.get(rank_key(rank))
            if state is not None and state.rank.pid == rank.pid:
                del ranks[rank_key(rank)]
                if self._records is not None:
                    self._records.forget(rank.run_id, rank.dp_rank, rank.pp_rank, rank.tp_rank)
            if not ranks:
                self._ranks.pop(key, None)

    # -- judging --------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="hang-detector", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.settings.check_interval_s):
            now = time.monotonic()
            gap, last = now - last, now
            if not self._woke(gap):
                continue
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the sidecar keeps serving
                log.exception("hang_check_failed")

    def _woke(self, gap: float) -> bool:
        """Count how late the checker woke, `gap` seconds after its last wake-up; False when
        it should not judge now."""
        interval = self.settings.check_interval_s
        if gap > 2 * interval:  # woken late: any verdict due meanwhile comes that much later
            self.metrics.hang_check_late.inc(gap - interval)
        # woken far too late: this sidecar was itself starved or paused, so it has not been
        # reading the streams either; judge silences again once it has caught up
        if gap > max(1.0, 10 * interval):
            log.warning("hang_check_late", gap_s=round(gap, 3))
            return False
        return True

    def check(self) -> list[dict[str, Any]]:
        """Judge every replica once; returns the verdicts and recoveries raised now."""
        now = self._clock()
        events: list[dict[str, Any]] = []
        with self._lock:
            if self._records is not None:
                self._look_locally(now)
            keys = set(self._ranks) | set(self.verdicts)
            for key in keys:
                found = self._judge(key, self._ranks.get(key, {}), now)
                standing = self.verdicts.get(key)
                if found is not None and standing is None:
                    self.verdicts[key] = found
                    events.append(self._raise(found))
                elif found is None and standing is not None:
                    del self.verdicts[key]
                    present = {r.rank.pid for r in self._ranks.get(key, {}).values()}
                    named = {r["pid"] for r in (*standing.stopped, *standing.waiting)}
                    how = "moving" if named <= present else "ranks_gone"
                    events.append(self._recover(standing, now, how))
            self.history.extend(events)
            del self.history[:-256]
        return events

    def _look_locally(self, now: float) -> None:
        """Read the liveness records and process states of every replica with a rank silent
        for look_after_s (or seen stopped): all its ranks, so that a verdict says where the
        peers are now, not where their latest heartbeat found them."""
        records = self._records
        for states in self._ranks.values():
            if not any(
                now - state.last_seen >= self.settings.look_after_s or state.stopped_since
                for state in states.values()
            ):
                continue  # every rank speaks
            for state in states.values():
                rank = state.rank
                try:
                    view = records.read(
                        rank.run_id, rank.dp_rank, rank.pp_rank, rank.tp_rank, rank.pid
                    )
                except Exception:  # noqa: BLE001 - a bad record must not stop the judging
                    log.exception("liveness_record_read_failed", pid=rank.pid)
                    view = None
                self._apply_record(state, view, now)

    @staticmethod
    def _apply_record(state: RankState, view: RecordView | None, now: float) -> None:
        if view is None:
            state.proc_state, state.stopped_since = "", 0.0
            return
        state.proc_state = view.state
        if view.stopped:
            state.stopped_since = state.stopped_since or now
            return  # frozen whole: nothing in its record is news
        state.stopped_since = 0.0
        moved = view.moves != state.record_moves
        state.record_moves = view.moves
        if moved or view.in_call:  # else it runs, but neither moves nor waits: stuck
            state.record_seen = now
        # what it does now: the record is fresher than any heartbeat
        state.last_wave = max(state.last_wave, view.wave)
        state.phase, state.phase_age_s = view.phase, view.phase_age_s
        state.op = view.op
        if view.group:
            state.group, state.seq = view.group, view.seq
            if view.seq > state.seq_done.get(view.group, 0):
                state.seq_done[view.group] = view.seq
        state.op_age_s, state.op_at = view.call_age_s, now

    def _frozen(self, state: RankState, now: float) -> bool:
        """Stopped whole (SIGSTOP, a debugger) for about frozen_s: looks begin after look_after_s
        of silence and have seen state T ever since. Timed by the process state, not by the
        stream: batches a lagging sidecar reads only now were sent before the stop, and must
        neither hurry the verdict nor end it."""
        s = self.settings
        return bool(state.stopped_since) and now - state.stopped_since >= max(
            0.0, s.frozen_s - s.look_after_s
        )

    def _judge(self, key: Replica, ranks: dict[RankKey, RankState], now: float):
        if not ranks:
            return None
        s = self.settings
        silent = [
            r for r in ranks.values()
            if self._frozen(r, now) or now - r.heard_at() > self._silence_limit(r)
        ]  # fmt: skip
        alive = [r for r in ranks.values() if r not in silent]
        armed = len(ranks) > 1 and min(r.last_wave for r in ranks.values()) >= s.arm_wave
        # a heartbeat's age is extrapolated to now; it must itself show a long wait, so that a
        # call that ended right after its heartbeat is not taken for a wait
        waiting = [
            r for r in alive
            if r.op and r.op_age_s >= s.wait_s / 2 and r.waiting_s(now) >= s.wait_s
        ] if armed else []  # fmt: skip
        if silent:
            peers = [r for r in alive if r.op]
            return self._verdict(key, "no_heartbeat", silent, peers, now)
        if not waiting:
            return None
        # the collective the waiting ranks are furthest into
        front = max(waiting, key=lambda r: (r.group, r.seq))
        at = [r for r in waiting if (r.group, r.seq) == (front.group, front.seq)]
        # not arrived: has not entered (group, seq) yet, and has been speaking for wait_s (a
        # rank just back from a freeze gets that long to catch up before it is judged again)
        behind = [
            r for r in alive
            if r not in at and r.seq_done.get(front.group, 0) < front.seq
            and now - r.speaking_since >= s.wait_s
        ]  # fmt: skip
        if behind:
            # peers wait for it and it has been quiet past stale_s: frozen
            quiet = any(
                self._frozen(r, now) or now - r.heard_at() > self._silence_limit(r) for r in behind
            )
            return self._verdict(key, "no_heartbeat" if quiet else "not_arrived", behind, at, now)
        # all arrived: only this sidecar sees the whole replica (a rank on another node may
        # not have arrived; that verdict is the Prometheus rules', docs/cross-node.md)
        if len(at) == len(ranks) and not unseen_ranks(r.rank for r in ranks.values()):
            return self._verdict(key, "collective_stuck", at, at, now)
        return None

    def _silence_limit(self, state: RankState) -> float:
        """How long a rank may be silent: stale_s, or twice its heartbeat interval. No
        allowance for a sidecar that reads late: the ingest handler updates this state before
        it queues the batch for storage (telemetry/pipeline/writer.py), so heartbeats do not wait
        behind span or store work (bench/sidecar_ingest.py: heartbeat lag under load)."""
        return max(self.settings.stale_s, 2.0 * state.heartbeat_interval)

    def _verdict(
        self,
        key: Replica,
        kind: str,
        stopped: list[RankState],
        waiting: list[RankState],
        now: float,
    ) -> Verdict:
        run_id, engine, dp = key
        wall = time.time()
        ref = max(waiting, key=lambda r: r.waiting_s(now)) if waiting else None
        if kind == "no_heartbeat":
            onset = min(r.last_seen for r in stopped)
        else:
            onset = now - (ref.waiting_s(now) if ref else 0.0)
        return Verdict(
            engine=engine, run_id=run_id, dp=dp, kind=kind,
            stopped=[r.describe(now) for r in stopped], waiting=[r.describe(now) for r in waiting],
            op=ref.op if ref else "", group=ref.group if ref else "", seq=ref.seq if ref else 0,
            wave=max((r.last_wave for r in waiting), default=max(r.last_wave for r in stopped)),
            onset_unix=wall - (now - onset), verdict_unix=wall, onset_mono=onset,
        )  # fmt: skip

    # -- reporting ------------------------------------------------------------------------------
    def _raise(self, verdict: Verdict) -> dict[str, Any]:
        event = {"event": VERDICT, **verdict.as_dict()}
        if self.bundles is not None:  # named in the incident; written on the bundle thread
            ranks = self._ranks.get(Replica(verdict.run_id, verdict.engine, verdict.dp), {})
            event["bundle"] = self.bundles.request(event, [r.rank for r in ranks.values()])
        m = self.metrics
        m.wedged.labels(verdict.engine, str(verdict.dp)).set(1)
        for r in verdict.stopped:
            m.hang_verdicts.labels(
                verdict.engine, str(r["dp"]), str(r["tp"]), str(r["pp"]), verdict.kind
            ).inc()
        log.error("hang_verdict", **{k: v for k, v in event.items() if k != "event"})
        self._emit(verdict, VERDICT, "critical", verdict.summary(), event)
        return event

    def _recover(self, verdict: Verdict, now: float, how: str) -> dict[str, Any]:
        """The verdict's condition cleared: the ranks move again ("moving"), or their streams
        ended ("ranks_gone": the workers exited or were restarted)."""
        stall = max(0.0, now - verdict.onset_mono)
        moving = "moves again" if how == "moving" else "lost its stalled ranks (streams ended)"
        event = {
            "event": RECOVERY, "engine": verdict.engine, "run_id": verdict.run_id, "how": how,
            "dp": verdict.dp, "kind": verdict.kind, "stall_s": round(stall, 3),
            "recovered_unix": time.time(), "verdict": verdict.as_dict(),
            "summary": f"engine {verdict.engine} dp{verdict.dp} {moving} after a "
                       f"{stall:.1f}s stall ({verdict.kind})",
        }  # fmt: skip
        m = self.metrics
        replica = (verdict.engine, str(verdict.dp))
        still = any((v.engine, str(v.dp)) == replica for v in self.verdicts.values())
        m.wedged.labels(*replica).set(1 if still else 0)
        m.hang_recoveries.labels(*replica).inc()
        m.stall_duration.labels(*replica).observe(stall)
        log.warning("hang_recovered", engine=verdict.engine, dp=verdict.dp, stall_s=stall)
        self._emit(verdict, RECOVERY, "info", event["summary"], event)
        return event

    def _emit(
        self, verdict: Verdict, kind: str, severity: str, summary: str, evidence: dict
    ) -> None:
        if self._sink is None:
            return
        import json

        incident = guard_pb2.Incident(
            schema_version=1, id=f"{self._id_prefix}:{next(self._ids)}", type=kind,
            severity=severity, wave=verdict.wave, time_unix_nano=time.time_ns(), summary=summary,
            evidence_json=json.dumps(evidence, default=str, sort_keys=True), actions=["report"],
            occurrence=1,
        )  # fmt: skip
        rank = self._rank_info(verdict)
        try:
            self._sink(verdict.engine, rank, incident)
        except Exception:  # noqa: BLE001
            log.exception("hang_incident_failed")

    def _rank_info(self, verdict: Verdict) -> guard_pb2.RankInfo | None:
        """The first stopped rank's identity, so the incident lands under its rank span."""
        if not verdict.stopped:
            return None
        r = verdict.stopped[0]
        return guard_pb2.RankInfo(
            run_id=verdict.run_id, engine=verdict.engine, dp_rank=r["dp"], tp_rank=r["tp"],
            pp_rank=r["pp"], pid=r["pid"], node=r["node"],
        )  # fmt: skip

    # -- liveness -------------------------------------------------------------------------------
    def engine_status(
        self, engine: str, dp: int | None = None
    ) -> tuple[bool, dict[str, Any]] | None:
        """(live, body) for one engine label, or one replica of it (`dp`); None when no rank
        of it is known. The body lists every rank of every replica, each replica's state, and
        the replicas a standing verdict names as wedged."""
        with self._lock:
            keys = {k for k in (*self._ranks, *self.verdicts) if k.engine == engine}
            if dp is not None:
                keys = {k for k in keys if k.dp == dp}
            if not keys:
                return None
            now = self._clock()
            replicas = []
            for key in sorted(keys):
                verdict = self.verdicts.get(key)
                states = self._ranks.get(key, {})
                replicas.append(
                    {
                        "run_id": key.run_id,
                        "dp": key.dp,
                        "live": verdict is None,
                        "ranks": [states[k].describe(now) for k in sorted(states)],
                        "verdict": verdict.as_dict() if verdict is not None else None,
                        **_unseen_part(states),
                    }
                )
        verdicts = [r["verdict"] for r in replicas if r["verdict"] is not None]
        body: dict[str, Any] = {
            "engine": engine,
            "live": not verdicts,
            "ranks": [rank for r in replicas for rank in r["ranks"]],
            "replicas": replicas,
            "wedged": [{"run_id": r["run_id"], "dp": r["dp"]} for r in replicas if not r["live"]],
            "verdicts": verdicts,
        }
        if dp is not None:
            body["dp"] = dp
        return not verdicts, body

    def snapshot(self) -> dict[str, Any]:
        """Standing verdicts, the recent verdicts and recoveries, and the replicas with ranks
        this sidecar does not see (on other nodes: no local verdict covers them)."""
        with self._lock:
            partial = [
                {"engine": key.engine, "run_id": key.run_id, "dp": key.dp, **part}
                for key, states in sorted(self._ranks.items())
                if (part := _unseen_part(states))
            ]
            return {
                "standing": [v.as_dict() for v in self.verdicts.values()],
                "history": list(self.history),
                "partial": partial,
            }

    def rank_facts(self) -> list[RankFacts]:
        """A copy of what this sidecar knows of each rank now, wall-clock times (read at
        scrape time by telemetry/crossrank/rank_gauges.py)."""
        with self._lock:
            now, wall = self._clock(), time.time()
            facts = []
            for key, states in self._ranks.items():
                for state in states.values():
                    rank = guard_pb2.RankInfo()
                    rank.CopyFrom(state.rank)
                    in_op = bool(state.op)
                    facts.append(
                        RankFacts(
                            replica=key,
                            rank=rank,
                            heard_unix=wall - (now - state.heard_at()),
                            op=state.op,
                            group=state.group if in_op else "",
                            seq=state.seq if in_op else 0,
                            since_unix=wall - state.waiting_s(now) if in_op else 0.0,
                            seq_reached=dict(state.seq_done),
                            last_wave=state.last_wave,
                        )
                    )
            return facts

    def engines(self) -> list[str]:
        with self._lock:
            return sorted({key.engine for key in (*self._ranks, *self.verdicts)})
