"""Which ranks of a replica a sidecar does not see.

A TP or PP group can span nodes; each node's sidecar gets only its own ranks' streams. The
ranks a replica should have come from the sizes every rank reports (tp_size x pp_size); those
with no stream here are on other nodes (or not connected yet). No local verdict covers them:
the cluster verdict is Prometheus' (dashboards/prometheus/cluster.yml, docs/cross-node.md).
"""

from __future__ import annotations

from collections.abc import Iterable

from telemetry.wire.proto import guard_pb2

NOT_SEEN = "not seen by this sidecar"
# a world this large is not enumerated rank by rank (sizes come off the wire)
MAX_LISTED = 64


def unseen_ranks(ranks: Iterable[guard_pb2.RankInfo]) -> list[tuple[int, int]]:
    """(tp, pp) of the replica's ranks with no stream to this sidecar, at most MAX_LISTED."""
    seen: set[tuple[int, int]] = set()
    tp_size = pp_size = 1
    for rank in ranks:
        seen.add((rank.tp_rank, rank.pp_rank))
        tp_size = max(tp_size, rank.tp_size)
        pp_size = max(pp_size, rank.pp_size)
    if len(seen) >= tp_size * pp_size:
        return []
    missing = []
    for pp in range(pp_size):
        for tp in range(tp_size):
            if (tp, pp) not in seen:
                missing.append((tp, pp))
                if len(missing) >= MAX_LISTED:
                    return missing
    return missing
