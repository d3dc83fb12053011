"""Hang verdicts from heartbeats, liveness records and /proc: which rank stopped or exited,
and which collective its peers wait in.

Every batch from a rank proves its streamer thread is alive; its heartbeat says what the engine
thread is doing (phase, or the collective it is inside, with group and sequence number). On the
sidecar's own node, the rank's liveness record and `/proc` say the same without the stream
(proc_looks.py). The rules (verdict_rules.py) run on the checker thread (hang_checker.py)
several times a second for each engine replica (run, engine, dp).

A rank lives as long as its process, not its stream (rank_state.py): a local rank whose stream
ended keeps its state and its verdict while its process exists; its process's end is its own
incident, `rank_exited` (with the exit status or signal where /proc still shows it), and its
replica stays wedged while peers run. A remote rank whose stream ended stays in its last state
as `lost`. A verdict stands until the named ranks move again (`hang_recovered`); one whose
replica's processes are all gone, or whose lost ranks lingered out, is closed (`hang_closed`),
never reported as a recovery.

This module holds the state (ingest threads write it through `observe` and `rank_gone`), raises
the incidents, and answers the liveness endpoint and the rank gauges.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from telemetry.crossrank import proc_looks
from telemetry.crossrank.bundle import BundleWriter
from telemetry.crossrank.hang_checker import Checker
from telemetry.crossrank.peers import NOT_SEEN, unseen_ranks
from telemetry.crossrank.rank_state import (
    CLOSED,
    EXITED,
    LOST,
    STREAMING,
    HangSettings,
    RankFacts,
    RankState,
)
from telemetry.crossrank.verdict_rules import KINDS, Verdict, back, judge, silence_limit
from telemetry.metrics.collectives import CollectiveMetrics
from telemetry.store.incidents import CLOSED_VERDICT, EXIT, RECOVERY, VERDICT
from telemetry.wire.collective_columns import columns_of, last_seq_by_group
from telemetry.wire.liveness_record import RecordReader, proc_stat
from telemetry.wire.proto import guard_pb2
from telemetry.wire.replica import RankKey, Replica, rank_key, replica_of
from telemetry.wire.workload import NO_WORKLOAD, Workload

__all__ = ["HangDetector", "HangSettings", "RankFacts", "RankState", "Verdict"]

log = structlog.get_logger("ascend_guard.hangs")

SEARCH_EVERY_S = 1.0  # how often a replica with unseen ranks has their records looked for


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


def _placement(where: Workload) -> dict[str, str]:
    """The per-rank part of a workload a verdict names: pod, namespace, device (known ones)."""
    named = {"namespace": where.namespace, "pod": where.pod, "device": where.device}
    return {k: v for k, v in named.items() if v}


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
        self._searched: dict[Replica, float] = {}
        self._unjudged: set[Replica] = set()  # replicas new since the latest check
        self.verdicts: dict[Replica, Verdict] = {}
        self.history: list[dict[str, Any]] = []  # verdicts, recoveries, exits; newest last
        self._ids = itertools.count(1)
        self._id_prefix = f"sidecar-{os.getpid()}-{time.time_ns()}"
        self.checker = Checker(self.settings, metrics, self.check, self.caught_up)
        self.bundles: BundleWriter | None = None  # evidence bundle per verdict (None: off)
        # (engine, dp, tp, pp) -> the workload its worker named: Kubernetes pod, device, model
        # (telemetry/metrics/workload.py's book; None: verdicts name none)
        self.workload_of: Callable[[tuple[str, int, int, int]], Workload] | None = None

    # -- ingest side ----------------------------------------------------------------------------
    def observe(self, engine: str, batch: guard_pb2.Batch) -> None:
        rank = batch.rank
        now = self._clock()
        key = replica_of(engine, rank)
        seqs_done = last_seq_by_group(columns_of(batch))  # per batch, over the columns
        with self._lock:
            if key not in self._ranks:
                self._unjudged.add(key)
            ranks = self._ranks.setdefault(key, {})
            state = ranks.get(rank_key(rank))
            if state is None or state.rank.pid != rank.pid:
                state = RankState(guard_pb2.RankInfo(), now)
                state.rank.CopyFrom(rank)
                ranks[rank_key(rank)] = state
                self._create_series(engine, rank)
            if not state.stream_open:
                state.stream_open, state.stream_closed = True, False
            if (
                now - state.heard_at() > silence_limit(self.settings, state)
                or not state.speaking_since
            ):
                state.speaking_since = now  # back from a silence: give it time to catch up
            state.last_seen = now
            for group, seq in seqs_done.items():
                if seq > state.seq_done.get(group, 0):
                    state.seq_done[group] = seq
            if batch.HasField("heartbeat"):
                self._heartbeat(state, batch.heartbeat, now)

    @staticmethod
    def _heartbeat(state: RankState, hb: guard_pb2.Heartbeat, now: float) -> None:
        if state.heartbeat_at:
            gap = now - state.heartbeat_at
            state.heartbeat_interval = (
                gap if not state.heartbeat_interval else 0.8 * state.heartbeat_interval + 0.2 * gap
            )
        state.heartbeat_at = now
        sent = hb.time_unix_nano / 1e9
        state.heartbeat_sent_unix = max(state.heartbeat_sent_unix, sent)
        state.lag_s = max(0.0, time.time() - sent)
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

    def rank_gone(self, engine: str, rank: guard_pb2.RankInfo, clean: bool = False) -> None:
        """A rank's stream ended (`clean`: its worker closed it). The rank stays: a local one
        until its process is gone, a remote one as lost. A remote rank's goodbye (its worker
        shuts down) is the end of all this sidecar can know of it: it is forgotten at once."""
        key = replica_of(engine, rank)
        now = self._clock()
        with self._lock:
            ranks = self._ranks.get(key, {})
            state = ranks.get(rank_key(rank))
            if state is None or state.rank.pid != rank.pid:
                return
            state.stream_open, state.stream_ended_at, state.stream_closed = False, now, clean
            if clean and not state.local:
                self._forget_rank(key, ranks, state)
                return
        log.info(
            "rank_stream_ended",
            engine=engine,
            dp=rank.dp_rank,
            tp=rank.tp_rank,
            pp=rank.pp_rank,
            pid=rank.pid,
            clean=clean,
            now=state.status,
        )

    def _forget_rank(self, key: Replica, ranks: dict[RankKey, RankState], state: RankState):
        rank = state.rank
        ranks.pop(rank_key(rank), None)
        if self._records is not None:
            self._records.forget(rank.run_id, rank.dp_rank, rank.pp_rank, rank.tp_rank)
        if not ranks:
            self._ranks.pop(key, None)

    def caught_up(self, since: float) -> bool:
        """Ingest read every open stream since `since` (or a rank had stale_s to speak). A
        local rank whose process is stopped now cannot deliver: it is not waited for."""
        with self._lock:
            if self._clock() - since >= self.settings.stale_s:
                return True
            return all(
                state.last_seen >= since
                for states in self._ranks.values()
                for state in states.values()
                if state.stream_open and not self._stopped_now(state)
            )

    def _stopped_now(self, state: RankState) -> bool:
        if self._records is None or not state.local:
            return False
        stat = proc_stat(state.rank.pid)
        return stat is not None and stat[1] == state.start_ticks and stat[0] in ("T", "t")

    # -- judging --------------------------------------------------------------------------------
    def start(self) -> None:
        self.checker.start()

    def stop(self) -> None:
        self.checker.stop()

    def check(self) -> list[dict[str, Any]]:
        """Judge every replica once; returns the verdicts, recoveries and exits raised now."""
        now = self._clock()
        events: list[dict[str, Any]] = []
        with self._lock:
            if self._records is not None:
                self._look_locally(now, events)
            self._linger_lost(now)
            for key in set(self._ranks) | set(self.verdicts):
                self._judge_replica(key, now, events)
            self._unjudged.clear()
            self.history.extend(events)
            del self.history[:-256]
        return events

    def _judge_replica(self, key: Replica, now: float, events: list[dict[str, Any]]) -> None:
        states = self._ranks.get(key, {})
        standing = self.verdicts.get(key)
        if all(state.status == EXITED for state in states.values()):
            # every process of the replica is gone (or the rest were forgotten): no recovery
            for state in list(states.values()):
                self._forget_rank(key, states, state)
            self._searched.pop(key, None)
            if standing is not None:
                del self.verdicts[key]
                events.append(self._close(standing, now, "its processes are gone"))
            return
        found = judge(self.settings, key, states, now)
        if found is not None and standing is None:
            self._place(found)
            self.verdicts[key] = found
            events.append(self._raise(found))
        elif found is None and standing is not None:
            if any(k not in states for k in standing.named):
                del self.verdicts[key]  # nothing can show a forgotten rank back
                events.append(self._close(standing, now, "ranks it names were forgotten"))
            elif back(standing, states):
                del self.verdicts[key]
                events.append(self._recover(standing, now))

    def _look_locally(self, now: float, events: list[dict[str, Any]]) -> None:
        """Look at the ranks of every replica with a rank that needs a look (proc_looks.py);
        and, once a second, for records of the replica's unseen ranks."""
        records = self._records
        for key, states in list(self._ranks.items()):
            if any(proc_looks.needs_look(s, self.settings, now) for s in states.values()):
                for state in list(states.values()):
                    if state.status == EXITED:
                        continue
                    ended = proc_looks.look(records, state, now)
                    if ended is not None:
                        self._process_gone(key, states, state, ended, events)
            if states and now - self._searched.get(key, -1e9) >= SEARCH_EVERY_S:
                self._searched[key] = now
                for state in proc_looks.find_unstreamed(records, key, states, now):
                    states[rank_key(state.rank)] = state
                    proc_looks.look(records, state, now)
                    self._create_series(key.engine, state.rank)

    def _process_gone(
        self,
        key: Replica,
        states: dict[RankKey, RankState],
        state: RankState,
        ended: dict[str, Any],
        events: list[dict[str, Any]],
    ) -> None:
        """A local rank's process is gone. After a goodbye on its stream, with no verdict on
        its replica, it is forgotten quietly (a shutdown); otherwise it stays as `exited`, a
        `rank_exited` incident, and its replica is wedged while its peers run."""
        rank = state.rank
        if state.stream_closed and key not in self.verdicts:
            self._forget_rank(key, states, state)
            log.info("rank_left", engine=key.engine, dp=key.dp, tp=rank.tp_rank, pid=rank.pid)
            return
        state.exited = {
            **ended,
            "exited_unix": round(time.time(), 3),
            "stream": "closed" if state.stream_closed else "broke",
        }
        state.proc_state, state.stopped_since = "gone", 0.0
        peers = sum(1 for s in states.values() if s.status not in (EXITED, CLOSED))
        events.append(self._exit(key, state, peers))

    def _linger_lost(self, now: float) -> None:
        for key, states in list(self._ranks.items()):
            for state in list(states.values()):
                if (
                    state.status == LOST
                    and now - state.stream_ended_at > self.settings.lost_linger_s
                ):
                    self._forget_rank(key, states, state)

    # -- reporting ------------------------------------------------------------------------------
    def _workload(self, engine: str, dp: int, tp: int, pp: int) -> Workload:
        if self.workload_of is None:
            return NO_WORKLOAD
        try:
            return self.workload_of((engine, dp, tp, pp))
        except Exception:  # noqa: BLE001 - a verdict is raised without it rather than lost
            log.exception("hang_workload_lookup_failed")
            return NO_WORKLOAD

    def _place(self, verdict: Verdict) -> None:
        """Each named rank's Kubernetes pod and the device it opened (`npu-smi` points at that
        chip), and the replica's model name, where its workers named them."""
        for entry in (*verdict.stopped, *verdict.waiting):
            where = self._workload(verdict.engine, entry["dp"], entry["tp"], entry["pp"])
            entry.update(_placement(where))
            verdict.model_name = verdict.model_name or where.model_name

    def _raise(self, verdict: Verdict) -> dict[str, Any]:
        if self.bundles is not None:  # named in the incident; written on the bundle thread
            ranks = self._ranks.get(Replica(verdict.run_id, verdict.engine, verdict.dp), {})
            verdict.bundle = self.bundles.request(
                {"event": VERDICT, **verdict.as_dict()}, [r.rank for r in ranks.values()]
            )
        event = {"event": VERDICT, **verdict.as_dict()}
        m = self.metrics
        m.wedged.labels(verdict.engine, str(verdict.dp)).set(1)
        for r in verdict.stopped:
            m.hang_verdicts.labels(
                verdict.engine, str(r["dp"]), str(r["tp"]), str(r["pp"]), verdict.kind
            ).inc()
        log.error("hang_verdict", **{k: v for k, v in event.items() if k != "event"})
        self._emit(verdict, VERDICT, "critical", verdict.summary(), event)
        return event

    def _recover(self, verdict: Verdict, now: float) -> dict[str, Any]:
        """The named ranks moved again."""
        stall = max(0.0, now - verdict.onset_mono)
        # a table: one row per line, columns aligned (fmt: skip)
        event = {
            "event": RECOVERY, "engine": verdict.engine, "run_id": verdict.run_id,
            "how": "moving", "dp": verdict.dp, "kind": verdict.kind, "stall_s": round(stall, 3),
            "recovered_unix": time.time(), "verdict": verdict.as_dict(),
            "summary": f"engine {verdict.engine} dp{verdict.dp} moves again after a "
                       f"{stall:.1f}s stall ({verdict.kind})",
        }  # fmt: skip
        self._verdict_over(verdict, stall, recovered=True)
        log.warning("hang_recovered", engine=verdict.engine, dp=verdict.dp, stall_s=stall)
        self._emit(verdict, RECOVERY, "info", event["summary"], event)
        return event

    def _close(self, verdict: Verdict, now: float, why: str) -> dict[str, Any]:
        """The verdict ends without its ranks moving again: not a recovery."""
        stall = max(0.0, now - verdict.onset_mono)
        # a table: one row per line, columns aligned (fmt: skip)
        event = {
            "event": CLOSED_VERDICT, "engine": verdict.engine, "run_id": verdict.run_id,
            "dp": verdict.dp, "kind": verdict.kind, "stall_s": round(stall, 3), "why": why,
            "closed_unix": time.time(), "verdict": verdict.as_dict(),
            "summary": f"engine {verdict.engine} dp{verdict.dp}: {verdict.kind} verdict closed "
                       f"after {stall:.1f}s: {why} (not a recovery)",
        }  # fmt: skip
        self._verdict_over(verdict, stall, recovered=False)
        log.warning("hang_closed", engine=verdict.engine, dp=verdict.dp, why=why)
        self._emit(verdict, CLOSED_VERDICT, "warning", event["summary"], event)
        return event

    def _verdict_over(self, verdict: Verdict, stall: float, recovered: bool) -> None:
        m = self.metrics
        replica = (verdict.engine, str(verdict.dp))
        still = any((v.engine, str(v.dp)) == replica for v in self.verdicts.values())
        m.wedged.labels(*replica).set(1 if still else 0)
        if recovered:
            m.hang_recoveries.labels(*replica).inc()
        m.stall_duration.labels(*replica).observe(stall)

    def _exit(self, key: Replica, state: RankState, peers: int) -> dict[str, Any]:
        rank, ended = state.rank, state.exited or {}
        summary = proc_looks.exit_summary(key, state, ended, peers)
        # a table: one row per line, columns aligned (fmt: skip)
        event = {
            "event": EXIT, "engine": key.engine, "run_id": key.run_id, "dp": key.dp,
            "tp": rank.tp_rank, "pp": rank.pp_rank, "pid": rank.pid, "node": rank.node,
            "exit": ended, "peers_running": peers, "last_wave": state.last_wave,
            "summary": summary,
        }  # fmt: skip
        where = self._workload(key.engine, key.dp, rank.tp_rank, rank.pp_rank)
        event.update(_placement(where))
        if where.model_name:
            event["model_name"] = where.model_name
        log.error("rank_exited", **{k: v for k, v in event.items() if k != "event"})
        info = guard_pb2.RankInfo()
        info.CopyFrom(rank)
        self._send(
            key.engine,
            info,
            EXIT,
            "critical" if peers else "warning",
            summary,
            state.last_wave,
            event,
        )
        return event

    def _emit(
        self, verdict: Verdict, kind: str, severity: str, summary: str, evidence: dict
    ) -> None:
        self._send(
            verdict.engine,
            self._rank_info(verdict),
            kind,
            severity,
            summary,
            verdict.wave,
            evidence,
        )

    def _send(
        self,
        engine: str,
        rank: guard_pb2.RankInfo | None,
        kind: str,
        severity: str,
        summary: str,
        wave: int,
        evidence: dict,
    ) -> None:
        if self._sink is None:
            return
        incident = guard_pb2.Incident(
            schema_version=1,
            id=f"{self._id_prefix}:{next(self._ids)}",
            type=kind,
            severity=severity,
            wave=wave,
            time_unix_nano=time.time_ns(),
            summary=summary,
            evidence_json=json.dumps(evidence, default=str, sort_keys=True),
            actions=["report"],
            occurrence=1,
        )
        try:
            self._sink(engine, rank, incident)
        except Exception:  # noqa: BLE001
            log.exception("hang_incident_failed")

    def _rank_info(self, verdict: Verdict) -> guard_pb2.RankInfo | None:
        """The first stopped rank's identity, so the incident lands under its rank span."""
        if not verdict.stopped:
            return None
        r = verdict.stopped[0]
        return guard_pb2.RankInfo(
            run_id=verdict.run_id,
            engine=verdict.engine,
            dp_rank=r["dp"],
            tp_rank=r["tp"],
            pp_rank=r["pp"],
            pid=r["pid"],
            node=r["node"],
        )

    # -- liveness -------------------------------------------------------------------------------
    def engine_status(
        self, engine: str, dp: int | None = None
    ) -> tuple[bool, dict[str, Any]] | None:
        """(live, body) for one engine label, or one replica of it (`dp`); None when no rank
        of it is known. The body lists every rank of every replica (with where it runs and
        what its stream does), each replica's state, and the replicas a standing verdict
        names as wedged. A replica new since the latest check (its first rank just came, as
        after this sidecar restarted) is judged first, so that the answer is never one the
        looks have not made yet."""
        if self._unjudged and any(key.engine == engine for key in list(self._unjudged)):
            self.check()
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
        """Standing verdicts, the recent events, the ranks with no open stream (local ones
        judged from their records, lost remote ones, exited ones), and the replicas with
        ranks this sidecar does not see (on other nodes: no local verdict covers them)."""
        with self._lock:
            now = self._clock()
            partial = [
                {"engine": key.engine, "run_id": key.run_id, "dp": key.dp, **part}
                for key, states in sorted(self._ranks.items())
                if (part := _unseen_part(states))
            ]
            quiet = [
                {"engine": key.engine, "run_id": key.run_id, **state.describe(now)}
                for key, states in sorted(self._ranks.items())
                for _, state in sorted(states.items())
                if state.status != STREAMING
            ]
            return {
                "standing": [v.as_dict() for v in self.verdicts.values()],
                "history": list(self.history),
                "partial": partial,
                "without_stream": quiet,
            }

    def holds(self, engine: str) -> bool:
        """Whether any rank of `engine` is still known (its series must stay)."""
        with self._lock:
            return any(key.engine == engine for key in (*self._ranks, *self.verdicts))

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
