"""The one notion of a replica on the sidecar: (run, engine label, dp).

Each DP engine of a server has its own scheduler and its own wave numbering (wave N of dp0 and
wave N of dp1 are unrelated steps unless the engines run in lockstep), so everything that
compares ranks, counts waves or judges a hang does it within one replica: wave alignment and
skew (`ranksync`, per replica and PP stage), liveness and hang verdicts (`hangs`), wave trace
and span ids (`traces`, from run id, dp and wave). Use `replica_of` wherever a key is needed.
"""

from __future__ import annotations

from typing import NamedTuple

from telemetry.wire.proto import guard_pb2

# Prometheus labels of a per-replica series (per-rank series add tp and pp: metrics.RANK_LABELS)
REPLICA_LABELS = ("engine", "dp")


class Replica(NamedTuple):
    run_id: str
    engine: str  # the sidecar's bounded engine label
    dp: int

    def describe(self) -> str:
        return f"{self.engine} dp{self.dp}"


class RankKey(NamedTuple):
    """A rank within its replica."""

    tp: int
    pp: int


def replica_of(engine: str, rank: guard_pb2.RankInfo) -> Replica:
    """The replica a rank belongs to (`engine`: the label the sidecar gave rank.engine)."""
    return Replica(rank.run_id, engine, rank.dp_rank)


def rank_key(rank: guard_pb2.RankInfo) -> RankKey:
    return RankKey(rank.tp_rank, rank.pp_rank)
