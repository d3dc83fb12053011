"""What the sidecar knows of one rank: the hang detector's per-rank state, and its settings.

A rank lives as long as its process, not its stream. Its state is kept when its stream ends;
what it means then depends on where the rank runs:

- **local**: its liveness record was read (telemetry/wire/liveness_record.py), so its process
  is on this node, in this pid namespace, and `/proc` tells whether it still exists. It is
  judged from its record and process state alone; it is forgotten only once its process is
  gone (an `exited` rank, its own incident).
- **remote**: no record this sidecar can read. Its stream is all there is: when it ends, the
  rank stays in its last state as `lost` until it reconnects or `lost_linger_s` passes.

Written by the ingest threads (`observe`) and the checker thread (looks, judging), always under
the hang detector's lock.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from telemetry.wire.proto import guard_pb2
from telemetry.wire.replica import Replica

# where a rank's news comes from (RankState.status)
STREAMING = "streaming"  # its stream is open
ENDED = "stream_ended"  # a local rank whose stream ended while its process runs
CLOSED = "closed"  # its worker closed its stream (shutting down); its silence is not judged
LOST = "lost"  # a remote rank whose stream ended: its last state, kept
FOUND = "found"  # found from its liveness record; no stream to this sidecar (yet)
EXITED = "exited"  # its process is gone


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
    # a remote rank whose stream ended is kept (as lost) this long unless it reconnects
    lost_linger_s: float = 15 * 60.0
    # a rank found from its record (this sidecar restarted) may reconnect within the worker's
    # reconnect backoff: it is judged silent only after stale_s plus this, unless stopped
    found_grace_s: float = 3.0
    # a checker woken this late was starved: it judges again only once ingest caught up
    late_wake_s: float = 0.5


@dataclasses.dataclass
class RankState:
    rank: guard_pb2.RankInfo
    last_seen: float  # sidecar monotonic time of the latest batch
    speaking_since: float = 0.0  # first batch after the rank's latest silence (or ever)
    seq_done: dict[str, int] = dataclasses.field(default_factory=dict)  # group -> highest seq
    lag_s: float = 0.0  # how old the latest heartbeat was when the sidecar got to it
    heartbeat_at: float = 0.0  # ... of the latest heartbeat
    heartbeat_interval: float = 0.0  # smoothed interval between heartbeats
    heartbeat_sent_unix: float = 0.0  # when the worker made its latest heartbeat (its clock)
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
    # the stream, and the process behind it
    stream_open: bool = True
    stream_ended_at: float = 0.0
    stream_closed: bool = False  # the worker closed it (a goodbye), rather than it broke
    local: bool = False  # a look at its liveness record succeeded: its process is on this node
    start_ticks: int = 0  # its process's start time (/proc/<pid>/stat field 22), when local
    looked: bool = False  # its record was looked for at least once
    found_at: float = 0.0  # found from its record, with no stream to this sidecar yet
    exited: dict[str, Any] | None = None  # how its process ended, once gone

    def waiting_s(self, now: float) -> float:
        """How long the rank has been inside its current collective, as of `now`."""
        return self.op_age_s + (now - self.op_at) if self.op else 0.0

    def heard_at(self) -> float:
        """The latest sign of life: a batch on the stream, or a look at its record."""
        return max(self.last_seen, self.record_seen)

    @property
    def status(self) -> str:
        if self.exited is not None:
            return EXITED
        if self.stream_open:
            return STREAMING
        if self.found_at and not self.stream_ended_at:
            return FOUND
        if self.stream_closed:
            return CLOSED
        return ENDED if self.local else LOST

    def describe(self, now: float) -> dict[str, Any]:
        # a table: one row per line, columns aligned (fmt: skip)
        info: dict[str, Any] = {
            "dp": self.rank.dp_rank, "tp": self.rank.tp_rank, "pp": self.rank.pp_rank,
            "pid": self.rank.pid, "node": self.rank.node, "last_wave": self.last_wave,
            "silent_s": round(now - self.last_seen, 3), "phase": self.phase,
            "lag_s": round(self.lag_s, 3), "state": self.proc_state,
            "where": "local" if self.local else "remote", "stream": self.status,
        }  # fmt: skip
        if self.exited is not None:
            info["exit"] = self.exited
        if self.op:
            info.update(
                op=self.op, group=self.group, seq=self.seq, waiting_s=round(self.waiting_s(now), 3)
            )
            if self.graph:
                info.update(graph=self.graph, graph_holds=self.graph_holds)
        return info


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
