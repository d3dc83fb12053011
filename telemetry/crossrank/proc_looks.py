"""Looks at ranks on this node: their liveness records, and their processes in `/proc`.

A look says what a rank's engine thread does now (its record), whether its process is stopped
(state T), and whether its process still exists. Each rank is looked at once when first seen
(is it on this node?), then whenever it is silent for `look_after_s` or its stream ended; a
replica with one such rank has all its ranks looked at, so that a verdict says where the peers
are now. A sidecar that restarted also finds, from their records, ranks that cannot reconnect
(`find_unstreamed`). Runs on the checker thread, under the hang detector's lock.
"""

from __future__ import annotations

from typing import Any

import structlog

from telemetry.crossrank.peers import unseen_ranks
from telemetry.crossrank.rank_state import HangSettings, RankState
from telemetry.wire.liveness_record import RecordReader, RecordView
from telemetry.wire.proto import guard_pb2
from telemetry.wire.replica import RankKey, Replica

log = structlog.get_logger("ascend_guard.hangs")


def look(records: RecordReader, state: RankState, now: float) -> dict[str, Any] | None:
    """Read one rank's record and process state into `state`; returns how its process ended
    when a local rank's process is gone (None otherwise)."""
    rank = state.rank
    state.looked = True
    if state.local:
        ended = records.exit_of(rank.pid, state.start_ticks)
        if ended is not None:
            return ended
    try:
        view = records.read(rank.run_id, rank.dp_rank, rank.pp_rank, rank.tp_rank, rank.pid)
    except Exception:  # noqa: BLE001 - a bad record must not stop the judging
        log.exception("liveness_record_read_failed", pid=rank.pid)
        view = None
    if view is not None and not state.local:
        state.local, state.start_ticks = True, view.start_ticks
    apply_record(state, view, now)
    return None


def apply_record(state: RankState, view: RecordView | None, now: float) -> None:
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


def needs_look(state: RankState, settings: HangSettings, now: float) -> bool:
    return (
        not state.looked
        or not state.stream_open
        or bool(state.stopped_since)
        or now - state.last_seen >= settings.look_after_s
    )


def find_unstreamed(
    records: RecordReader, key: Replica, states: dict[RankKey, RankState], now: float
) -> list[RankState]:
    """Ranks of the replica with no stream here whose record on this node names a live
    process: a sidecar that restarted finds a stopped rank this way (it cannot reconnect)."""
    peers = list(states.values())
    found = []
    for tp, pp in unseen_ranks(state.rank for state in peers):
        pid = records.owner(key.run_id, key.dp, pp, tp)
        if pid is None:
            continue
        model = peers[0].rank
        rank = guard_pb2.RankInfo()
        rank.CopyFrom(model)
        rank.tp_rank, rank.pp_rank, rank.pid = tp, pp, pid
        state = RankState(rank, now, found_at=now, stream_open=False)
        found.append(state)
        log.warning(
            "rank_found_from_record",
            engine=key.engine,
            dp=key.dp,
            tp=tp,
            pp=pp,
            pid=pid,
            note="no stream to this sidecar; judged from its liveness record and /proc",
        )
    return found


def exit_summary(key: Replica, state: RankState, ended: dict[str, Any], peers: int) -> str:
    rank = state.rank
    who = f"tp{rank.tp_rank}/pp{rank.pp_rank} (pid {rank.pid})"
    tail = f"; {peers} peer(s) still run: the replica is wedged" if peers else ""
    return f"engine {key.engine} dp{key.dp}: rank_exited: {who} {ended['detail']}{tail}"
