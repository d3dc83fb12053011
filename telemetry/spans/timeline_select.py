"""Which waves a timeline shows, and their collectives: the query (a time window and/or a wave
range, one engine and run), the ranks it covers, and the stored waves and slow calls it selects
(telemetry/spans/timeline.py lays them out).
"""

from __future__ import annotations

import dataclasses
import sqlite3

from telemetry import store
from telemetry.spans.builders import (
    Span,
    collective_spans,
    wave_spans,
)
from telemetry.spans.query import QueryError
from telemetry.store import RankRow
from telemetry.wire.collective_columns import to_waves

DEFAULT_MIN_WAIT_NS = 1_000_000  # below 1 ms the wait is scheduling noise, not a straggler


DEFAULT_MAX_RANK_WAVES = 20_000  # ~30 MB of JSON, ~3 s (bench/timeline.py); viewers slow beyond


@dataclasses.dataclass
class TimelineQuery:
    """Which waves: a time window and/or a wave range, optionally one engine and one run."""

    since_ns: int | None = None
    until_ns: int | None = None
    first_wave: int | None = None
    last_wave: int | None = None
    engine: str | None = None
    run_id: str | None = None
    min_wait_ns: int = DEFAULT_MIN_WAIT_NS
    max_rank_waves: int = DEFAULT_MAX_RANK_WAVES
    # only these waves of one replica (`--request`: the waves a request ran in)
    waves: frozenset[int] | None = None
    dp: int | None = None

    def validate(self) -> None:
        if self.since_ns is None and self.first_wave is None:
            raise QueryError("give --since or --waves")
        if (
            self.since_ns is not None
            and self.until_ns is not None
            and self.since_ns > self.until_ns
        ):
            raise QueryError("--since is later than --until")
        if self.max_rank_waves < 1:
            raise QueryError(f"--max-waves: {self.max_rank_waves} must be 1 or more")
        if self.min_wait_ns < 0:
            raise QueryError("--min-wait: must not be negative")


def parse_wave_range(text: str) -> tuple[int, int]:
    """'100..200' (both ends included) or '150' → (first, last)."""
    first, sep, last = text.strip().partition("..")
    try:
        a = int(first)
        b = int(last) if sep else a
    except ValueError:
        raise QueryError(
            f"--waves: {text!r} is not a wave range; use A..B, e.g. 100..200"
        ) from None
    if a < 0 or b < a:
        raise QueryError(f"--waves: {text!r}: A..B needs 0 <= A <= B")
    return a, b


@dataclasses.dataclass
class SlowCall:
    op: str
    group: str
    backend: str
    dtype: str
    seq: int
    bytes: int
    start_ns: int
    host_ns: int


@dataclasses.dataclass
class RankCollectives:
    """What one rank's collectives did in one wave, as the timeline needs it."""

    first_arrival_ns: int = 0
    wait_ns: int = 0
    injected_ns: int = 0
    spans: list[Span] = dataclasses.field(default_factory=list)  # as `ascend-guard trace`
    slow_calls: list[SlowCall] = dataclasses.field(default_factory=list)


def read_collectives(
    conn: sqlite3.Connection, rank: RankRow, waves: set[int]
) -> dict[int, RankCollectives]:
    """wave -> that rank's collectives in it: the one place the timeline reads collectives
    from the store (so a change of their storage is adapted here only)."""
    out: dict[int, RankCollectives] = {}
    if not waves:
        return out
    for cols in store.collective_blocks(conn, rank.id, min(waves), max(waves)):
        for cw in to_waves(cols, waves):
            entry = out.setdefault(cw.wave, RankCollectives())
            # a rank may hand in one wave in two parts (collectives after sample_tokens)
            if cw.first_arrival_unix_nano and (
                not entry.first_arrival_ns or cw.first_arrival_unix_nano < entry.first_arrival_ns
            ):
                entry.first_arrival_ns = cw.first_arrival_unix_nano
            entry.wait_ns += cw.wait_ns
            entry.injected_ns += cw.injected_delay_ns
            entry.spans += collective_spans(rank, cw)
            entry.slow_calls += [
                SlowCall(
                    c.op, c.group, c.backend, c.dtype, c.seq, c.bytes, c.start_unix_nano, c.host_ns
                )
                for c in cw.slow_calls
            ]
    return out


def timeline_ranks(conn: sqlite3.Connection, query: TimelineQuery) -> dict[int, RankRow]:
    where, params = [], []
    if query.engine is not None:
        where.append("ranks.engine = ?")
        params.append(query.engine)
    if query.run_id is not None:
        where.append("runs.run_id = ?")
        params.append(query.run_id)
    if query.dp is not None:
        where.append("ranks.dp = ?")
        params.append(query.dp)
    return {r.id: r for r in store.ranks(conn, " AND ".join(where), params)}


@dataclasses.dataclass
class RankWave:
    rank: RankRow
    wave: int
    start_ns: int
    spans: list[Span]


def select_waves(conn: sqlite3.Connection, query: TimelineQuery) -> tuple[list[RankWave], int]:
    """The rank-waves that match, oldest first, and how many matched before the cap."""
    ranks = timeline_ranks(conn, query)
    if not ranks:
        return [], 0
    since, until = query.since_ns, query.until_ns
    if query.first_wave is not None:
        window = store.time_of_waves(conn, list(ranks), query.first_wave, query.last_wave)
        if window is None:
            return [], 0
        since = window[0] if since is None else max(since, window[0])
        until = window[1] if until is None else min(until, window[1])
    found: list[RankWave] = []
    for rank_id, cols in store.wave_blocks(conn, list(ranks), since_ns=since, until_ns=until):
        rank = ranks[rank_id]
        for i, wave in enumerate(cols.wave):
            start = cols.start_unix_nano[i]
            if query.first_wave is not None and not query.first_wave <= wave <= query.last_wave:
                continue
            if query.waves is not None and wave not in query.waves:
                continue
            if query.since_ns is not None and start < query.since_ns:
                continue
            if query.until_ns is not None and start > query.until_ns:
                continue
            # the wave root span has the times of tp0/pp0's rank span: the rank span stands for it
            spans = [s for s in wave_spans(rank, cols, i) if s.name != "wave"]
            found.append(RankWave(rank, wave, start, spans))
    if query.first_wave is not None and query.run_id is None:
        runs = sorted({rw.rank.run_id for rw in found})
        if len(runs) > 1:
            raise QueryError(
                f"--waves: waves {query.first_wave}..{query.last_wave} exist in {len(runs)} runs "
                f"({', '.join(runs)}); pick one with --run"
            )
    found.sort(key=lambda rw: (rw.start_ns, rw.rank.id))
    matched = len(found)
    return found[-query.max_rank_waves :], matched
