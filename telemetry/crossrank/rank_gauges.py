"""Per-rank facts for cross-node rules: the gauges Prometheus joins across sidecars.

Each node's sidecar sees only its own ranks. These families say, per rank, what a rule needs to
judge a replica whose ranks stream to different sidecars (docs/cross-node.md):

- `ascend_guard_rank_last_seen_timestamp_seconds`: the latest sign of life (a batch on the
  stream, or a look at its liveness record), Unix time on the sidecar's clock;
- `ascend_guard_rank_collective_seq` / `ascend_guard_rank_collective_since_timestamp_seconds`
  (label `group`): the collective the rank is inside and since when; absent while in none;
- `ascend_guard_rank_collective_seq_reached` (label `group`): the highest seq per group the rank
  completed or entered;
- `ascend_guard_rank_collective_wait_seconds_total` / `ascend_guard_rank_collective_waves_total`:
  host time inside collectives and the waves it was summed over (wave skew by rank).

Timestamps, not ages: a timestamp is a fact about the rank that does not depend on when it is
read, so a rule takes the age at scrape time (`timestamp(g) - g`: right at any scrape interval,
unaffected by how late the rule runs) or now (`time() - g`, which keeps growing when the series
is last seen through federation or remote write). An age gauge would stop at its last value
when the sidecar stops answering.

Labels: `run_id`, `engine`, `dp` (the same on every node of one engine), `tp`, `pp`, `node`,
`pid` (which process to look at), and `group` / `comm` on the collective families (`comm`: the
communicator within the replica, "pp<N>" for a TP group, "tp<N>" for a PP group, "all" else).
Bounded: one series set per rank this sidecar has a live stream from (the hang detector forgets
a rank when its stream ends), at most `MAX_RANKS` ranks and `MAX_GROUPS` groups per rank;
what is left out is counted in `ascend_guard_rank_gauges_omitted`. Text from the wire is cut
to a safe alphabet, the same way on every node.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from telemetry.crossrank.hangs import RankFacts
from telemetry.wire.collective_columns import columns_of
from telemetry.wire.proto import guard_pb2

RANK_FACT_LABELS = ("run_id", "engine", "dp", "tp", "pp", "node", "pid")
MAX_RANKS = 1024
MAX_GROUPS = 16
_UNSAFE = re.compile(r"[^A-Za-z0-9_.:-]")


def clean(raw: str, limit: int = 64) -> str:
    """A label value from wire text: deterministic, so every node gives the same value."""
    return _UNSAFE.sub("_", raw)[:limit] or "_"


def communicator(group: str, tp: int, pp: int) -> str:
    """Which ranks of a replica share this group's communicator (the join key of the rules)."""
    if group == "tp":
        return f"pp{pp}"
    if group == "pp":
        return f"tp{tp}"
    return "all"


class RankGauges:
    """Custom Collector: live rank state read from the hang detector at scrape time, plus
    per-rank collective wait sums added once per batch (`count`, the writer thread)."""

    def __init__(self, facts: Callable[[], list[RankFacts]]) -> None:
        self._facts = facts
        self._lock = threading.Lock()
        # (run_id, engine label, dp, tp, pp, pid) -> [wait_ns, waves]
        self._waits: dict[tuple, list[int]] = {}

    def count(self, engine: str, batch: guard_pb2.Batch) -> None:
        # the columns (wire v3; a v2 batch's messages are moved there by the first reader)
        cols = columns_of(batch)
        if not len(cols.wave):
            return
        rank = batch.rank
        wait_ns = sum(cols.wait_ns)
        key = (rank.run_id, engine, rank.dp_rank, rank.tp_rank, rank.pp_rank, rank.pid)
        with self._lock:
            sums = self._waits.get(key)
            if sums is None:
                sums = self._waits[key] = [0, 0]
            sums[0] += wait_ns
            sums[1] += len(cols.wave)

    def collect(self):
        facts = sorted(
            self._facts(),
            key=lambda f: (
                f.replica.engine,
                f.replica.run_id,
                f.replica.dp,
                f.rank.pp_rank,
                f.rank.tp_rank,
            ),
        )
        omitted = max(0, len(facts) - MAX_RANKS)
        facts = facts[:MAX_RANKS]
        seen = GaugeMetricFamily(
            "ascend_guard_rank_last_seen_timestamp_seconds",
            "Unix time (sidecar clock) of a rank's latest sign of life: a batch on its stream, "
            "or a look at its liveness record. Age: timestamp(x) - x.",
            labels=RANK_FACT_LABELS,
        )
        labels = (*RANK_FACT_LABELS, "group", "comm")
        seq = GaugeMetricFamily(
            "ascend_guard_rank_collective_seq",
            "Sequence number of the collective a rank is inside now (absent while in none).",
            labels=labels,
        )
        since = GaugeMetricFamily(
            "ascend_guard_rank_collective_since_timestamp_seconds",
            "Unix time a rank entered the collective it is inside now (absent while in none).",
            labels=labels,
        )
        reached = GaugeMetricFamily(
            "ascend_guard_rank_collective_seq_reached",
            "Highest sequence number per group a rank completed or entered.",
            labels=labels,
        )
        wait = CounterMetricFamily(
            "ascend_guard_rank_collective_wait_seconds",
            "Host time a rank spent inside collectives, summed over its collective waves.",
            labels=RANK_FACT_LABELS,
        )
        waves = CounterMetricFamily(
            "ascend_guard_rank_collective_waves",
            "Waves whose collectives a rank reported (the divisor of the wait per wave).",
            labels=RANK_FACT_LABELS,
        )
        live = {
            (
                f.replica.run_id,
                f.replica.engine,
                f.rank.dp_rank,
                f.rank.tp_rank,
                f.rank.pp_rank,
                f.rank.pid,
            )
            for f in facts
        }
        with self._lock:
            for key in [k for k in self._waits if k not in live]:
                del self._waits[key]  # its stream ended (or it is over MAX_RANKS)
            waits = {k: list(v) for k, v in self._waits.items()}
        for fact in facts:
            r = fact.rank
            # a table: one row per line, columns aligned (fmt: skip)
            rank_labels = (
                clean(fact.replica.run_id), clean(fact.replica.engine),
                str(r.dp_rank), str(r.tp_rank), str(r.pp_rank), clean(r.node), str(r.pid),
            )  # fmt: skip
            seen.add_metric(rank_labels, fact.heard_unix)
            groups = sorted(fact.seq_reached)
            if len(groups) > MAX_GROUPS:
                omitted += 1
                groups = groups[:MAX_GROUPS]
            for group in groups:
                g = (clean(group, 32), communicator(group, r.tp_rank, r.pp_rank))
                reached.add_metric((*rank_labels, *g), fact.seq_reached[group])
            if fact.op and fact.group:
                g = (clean(fact.group, 32), communicator(fact.group, r.tp_rank, r.pp_rank))
                seq.add_metric((*rank_labels, *g), fact.seq)
                since.add_metric((*rank_labels, *g), fact.since_unix)
            key = (fact.replica.run_id, fact.replica.engine, r.dp_rank, r.tp_rank, r.pp_rank, r.pid)
            sums = waits.get(key)
            if sums is not None:
                wait.add_metric(rank_labels, sums[0] / 1e9)
                waves.add_metric(rank_labels, sums[1])
        yield from (seen, seq, since, reached, wait, waves)
        left_out = GaugeMetricFamily(
            "ascend_guard_rank_gauges_omitted",
            f"Ranks (over {MAX_RANKS}) and ranks' groups (over {MAX_GROUPS}) left out of the "
            "per-rank gauges at the latest scrape.",
        )
        left_out.add_metric((), omitted)
        yield left_out
