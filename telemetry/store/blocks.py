"""Reads of the stored blocks: ranks, blocks by time, wave or rowid, their decoded columns,
collective stats and slow calls. Read-only: the CLI, TraceQL and the query API read the file
from their own connections while the sidecar writes it.
"""

from __future__ import annotations

import bisect
import dataclasses
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

from telemetry.store.codec import _signed, decode_collectives, decode_waves
from telemetry.wire.collective_columns import to_waves
from telemetry.wire.proto import guard_pb2


@dataclasses.dataclass(frozen=True)
class RankRow:
    """One rank as the store knows it (the `ranks` table joined with `runs`)."""

    id: int
    run_id: str
    engine: str
    dp: int
    tp: int
    pp: int
    node: str
    pid: int

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> RankRow:
        return cls(
            row["id"],
            row["run_id"],
            row["engine"],
            row["dp"],
            row["tp"],
            row["pp"],
            row["node"],
            row["pid"],
        )


# -- reads (the CLI, the exporter's look-ups) ---------------------------------------------------
_RANK_SELECT = (
    "SELECT ranks.id, runs.run_id, ranks.engine, ranks.dp, ranks.tp, ranks.pp, ranks.node, "
    "ranks.pid FROM ranks JOIN runs ON runs.id = ranks.run"
)


def ranks(conn: sqlite3.Connection, where: str = "", params: Sequence = ()) -> list[RankRow]:
    sql = _RANK_SELECT + (f" WHERE {where}" if where else "")
    return [RankRow.from_row(row) for row in conn.execute(sql, params)]


def ranks_of_trace_key(conn: sqlite3.Connection, trace_key: int) -> list[RankRow]:
    return ranks(conn, "ranks.trace_key = ?", (_signed(trace_key),))


# -- block readers: the one way to find a rank's blocks -----------------------------------------
# A rank's blocks hold consecutive waves, so they follow each other in wave and in time. The
# readers walk a rank's blocks back from the newest that can matter, down the (rank, first_wave)
# key or the (rank, start_ns) index, and stop once blocks end before the range: a filter like
# `last_wave >= ?` or `end_ns >= ?` would read every older block of the rank (neither is
# indexed). Blocks overlap only where a batch was cut differently and sent again, so the walk
# stops after OVERLAP_LOOKBACK blocks in a row that end before the range.
WAVE_BLOCKS = "wave_blocks"


COLLECTIVE_BLOCKS = "collective_blocks"


OVERLAP_LOOKBACK = 8


# per table: its block-wide slowest span (NULL in collective blocks stored before the column)
_MAX_COLUMN = {WAVE_BLOCKS: "max_step_ns", COLLECTIVE_BLOCKS: "max_host_ns"}


class BlockRow(NamedTuple):
    """A stored block's typed columns (no blob). `end_ns`: the latest span end in a wave block,
    the latest collective start in a collective block (None where not stored); `max_ns`: the
    longest rank span (wave block) or collective (op, group) host time (None: not stored).
    A named tuple: block walks make one per row read, and a frozen dataclass costs 2-3x more."""

    table: str
    rowid: int
    rank: int
    first_wave: int
    last_wave: int
    start_ns: int
    end_ns: int | None
    max_ns: int | None


def _block_select(table: str) -> str:
    return (
        f"SELECT rowid, rank, first_wave, last_wave, start_ns, end_ns, {_MAX_COLUMN[table]} "
        f"FROM {table}"
    )


def blocks_by_time(
    conn: sqlite3.Connection,
    table: str,
    rank_ids: Iterable[int],
    lo: int | None,
    hi: int | None,
    *,
    min_ns: int | None = None,
) -> Iterator[BlockRow]:
    """The blocks of these ranks that may hold spans in [lo, hi] (None: open), newest first
    per rank; with `min_ns`, only those whose slowest span (`max_ns`) may reach it."""
    select = _block_select(table)
    for rank_id in rank_ids:
        if hi is None:
            rows = conn.execute(f"{select} WHERE rank = ? ORDER BY start_ns DESC", (rank_id,))
        else:
            rows = conn.execute(
                f"{select} WHERE rank = ? AND start_ns <= ? ORDER BY start_ns DESC",
                (rank_id, hi),
            )
        before = 0
        for row in rows:
            block = BlockRow(table, *row)
            # a block without end_ns reaches at most to the start of the one after it
            end = block.end_ns if block.end_ns is not None else None
            if lo is not None and (end if end is not None else block.start_ns) < lo:
                if end is None and not before:
                    yield from _kept(block, min_ns)  # it may still hold spans after lo
                before += 1
                if before >= OVERLAP_LOOKBACK:
                    break
                continue
            yield from _kept(block, min_ns)


def _kept(block: BlockRow, min_ns: int | None) -> Iterator[BlockRow]:
    if min_ns is None or block.max_ns is None or block.max_ns >= min_ns:
        yield block


def blocks_by_wave(
    conn: sqlite3.Connection, table: str, rank_id: int, first_wave: int, last_wave: int
) -> Iterator[BlockRow]:
    """The blocks of one rank that hold waves in [first_wave, last_wave], newest first."""
    rows = conn.execute(
        f"{_block_select(table)} WHERE rank = ? AND first_wave <= ? ORDER BY first_wave DESC",
        (rank_id, last_wave),
    )
    yield from _holding(first_wave, (BlockRow(table, *row) for row in rows))


def _holding(first_wave: int, newest_first: Iterable[BlockRow]) -> Iterator[BlockRow]:
    """The blocks of a walk down the (rank, first_wave) key (each starting at or before the
    range's last wave) that reach `first_wave`: the walk stops after OVERLAP_LOOKBACK blocks
    in a row that end before it."""
    before = 0
    for block in newest_first:
        if block.last_wave < first_wave:
            before += 1
            if before >= OVERLAP_LOOKBACK:
                return
            continue
        yield block


class BlockDirectory:
    """One rank's blocks of one table, read down the (rank, first_wave) key a page at a time
    and kept: the blocks `blocks_by_wave` gives, for look-ups that walk back through nearby
    waves (a search loading trace after trace, newest first) without a query each. A look-up
    above what was read starts the directory again from there. Pages grow from FIRST_PAGE
    (about what one look-up reads: a block and the lookback) to MAX_PAGE."""

    FIRST_PAGE, MAX_PAGE = 16, 64  # first_wave is unique per rank: pages cannot overlap

    def __init__(self, conn: sqlite3.Connection, table: str, rank_id: int) -> None:
        self._conn, self._table, self._rank = conn, table, rank_id
        self._select = (
            f"{_block_select(table)} WHERE rank = ? AND first_wave <= ? "
            "ORDER BY first_wave DESC LIMIT ?"
        )
        self._top: int | None = None  # every block starting at or below it, down to _rows[-1]
        self._rows: list[BlockRow] = []
        self._keys: list[int] = []  # -first_wave of each row (ascending, for bisect)
        self._page = self.FIRST_PAGE
        self._complete = False  # the rank has no block below _rows[-1]
        self._last: tuple = (None, [])  # the last look-up's (range, answer)

    def blocks_by_wave(self, first_wave: int, last_wave: int) -> list[BlockRow]:
        if self._top is None or last_wave > self._top:
            self._top, self._rows, self._keys = last_wave, [], []
            self._page, self._complete = self.FIRST_PAGE, False
        if self._last[0] != (first_wave, last_wave):  # a trace asks twice: read ahead, read
            start = bisect.bisect_left(self._keys, -last_wave)
            self._last = ((first_wave, last_wave), self._holding_from(start, first_wave))
        return list(self._last[1])

    def _holding_from(self, i: int, first_wave: int) -> list[BlockRow]:
        """`_holding(first_wave, ...)` over the kept rows from row i down, reading pages as
        the walk needs them, as one loop (a search makes this look-up for every rank of every
        trace it builds)."""
        out: list[BlockRow] = []
        before = 0
        rows = self._rows
        while True:
            if i >= len(rows):
                if self._complete:
                    return out
                self._read_page()
                rows = self._rows
                continue
            block = rows[i]
            i += 1
            if block.last_wave < first_wave:
                before += 1
                if before >= OVERLAP_LOOKBACK:
                    return out
                continue
            out.append(block)

    def _read_page(self) -> None:
        below = self._rows[-1].first_wave - 1 if self._rows else self._top
        rows = self._conn.execute(self._select, (self._rank, below, self._page)).fetchall()
        table = self._table
        self._rows += [BlockRow(table, *row) for row in rows]
        self._keys += [-row[2] for row in rows]  # first_wave: the third column selected
        self._complete = len(rows) < self._page
        self._page = min(2 * self._page, self.MAX_PAGE)


def blocks_by_rowid(conn: sqlite3.Connection, table: str, rowids: Sequence[int]) -> list[BlockRow]:
    """The blocks with these row ids (as another reader listed them)."""
    select = _block_select(table)
    return [
        BlockRow(table, *row)
        for rowid in rowids
        for row in conn.execute(f"{select} WHERE rowid = ?", (rowid,))
    ]


def block_blob(conn: sqlite3.Connection, block: BlockRow) -> bytes:
    (blob,) = conn.execute(
        f"SELECT columns FROM {block.table} WHERE rowid = ?", (block.rowid,)
    ).fetchone()
    return blob


def block_columns(conn: sqlite3.Connection, block: BlockRow):
    """A block's decoded columns: `WaveColumns` or `CollectiveColumns` by its table."""
    blob = block_blob(conn, block)
    return decode_waves(blob) if block.table == WAVE_BLOCKS else decode_collectives(blob)


def wave_blocks(
    conn: sqlite3.Connection,
    rank_ids: Sequence[int],
    *,
    since_ns: int | None = None,
    until_ns: int | None = None,
    min_step_ns: int | None = None,
    wave: int | None = None,
) -> Iterator[tuple[int, guard_pb2.WaveColumns]]:
    """(rank id, columns) of the blocks that may hold matching waves."""
    for rank_id in rank_ids:
        if wave is not None:
            found = blocks_by_wave(conn, WAVE_BLOCKS, rank_id, wave, wave)
        else:
            found = blocks_by_time(
                conn, WAVE_BLOCKS, (rank_id,), since_ns, until_ns, min_ns=min_step_ns
            )
        for block in found:
            if wave is not None and not (
                (since_ns is None or (block.end_ns or 0) >= since_ns)
                and (until_ns is None or block.start_ns <= until_ns)
                and (min_step_ns is None or block.max_ns >= min_step_ns)
            ):
                continue
            yield rank_id, decode_waves(block_blob(conn, block))


def wave_range(
    conn: sqlite3.Connection, rank_id: int, since_ns: int, until_ns: int
) -> tuple[int, int] | None:
    """The waves a rank ran in [since, until] by its blocks' own bounds (no block decoded)."""
    blocks = list(blocks_by_time(conn, WAVE_BLOCKS, (rank_id,), since_ns, until_ns))
    if not blocks:
        return None
    return min(b.first_wave for b in blocks), max(b.last_wave for b in blocks)


def time_bounds(
    conn: sqlite3.Connection, rank_ids: Iterable[int], table: str = WAVE_BLOCKS
) -> tuple[int, int] | None:
    """(earliest block start, latest block end) of these ranks, from each rank's ends of the
    (rank, start_ns) index."""
    lows, highs = [], []
    for rank_id in rank_ids:
        (low,) = conn.execute(
            f"SELECT MIN(start_ns) FROM {table} WHERE rank = ?", (rank_id,)
        ).fetchone()
        if low is None:
            continue
        lows.append(low)
        newest = next(blocks_by_time(conn, table, (rank_id,), None, None))
        recent = [newest.end_ns or newest.start_ns]
        recent += [
            b.end_ns or b.start_ns
            for b in blocks_by_time(conn, table, (rank_id,), newest.start_ns, None)
        ]
        highs.append(max(recent))
    if not lows:
        return None
    return min(lows), max(highs)


def time_of_waves(
    conn: sqlite3.Connection, rank_ids: Iterable[int], first_wave: int, last_wave: int
) -> tuple[int, int] | None:
    """(earliest start, latest end) of the ranks' blocks that hold waves first..last."""
    blocks = [
        b
        for rank_id in rank_ids
        for b in blocks_by_wave(conn, WAVE_BLOCKS, rank_id, first_wave, last_wave)
    ]
    if not blocks:
        return None
    return min(b.start_ns for b in blocks), max(b.end_ns for b in blocks)


def collective_blocks(
    conn: sqlite3.Connection, rank_id: int, first_wave: int, last_wave: int
) -> Iterator[guard_pb2.CollectiveColumns]:
    """The collective columns of one rank's blocks that hold waves in [first, last]."""
    for block in blocks_by_wave(conn, COLLECTIVE_BLOCKS, rank_id, first_wave, last_wave):
        yield decode_collectives(block_blob(conn, block))


def collective_waves(
    conn: sqlite3.Connection, rank_id: int, wave: int
) -> list[guard_pb2.CollectiveWave]:
    """The collective records of one rank in one wave (as `CollectiveWave` messages, made
    from the stored columns)."""
    out: list[guard_pb2.CollectiveWave] = []
    for cols in collective_blocks(conn, rank_id, wave, wave):
        out += to_waves(cols, (wave,))
    return out


@dataclasses.dataclass(frozen=True)
class SlowCallRow:
    """One `slow_calls` row (CollectiveCall's fields, plus its rank and wave)."""

    rank: int
    group: str
    seq: int
    wave: int
    op: str
    backend: str
    dtype: str
    bytes: int
    start_unix_nano: int
    host_ns: int


def slow_calls_in(
    conn: sqlite3.Connection, rank_ids: Sequence[int], lo: int, hi: int
) -> list[SlowCallRow]:
    """The slow calls of these ranks that started in [lo, hi] (down the start_ns index)."""
    if not rank_ids:
        return []
    rows = conn.execute(
        "SELECT rank, group_name, seq, wave, op, backend, dtype, bytes, start_ns, host_ns "
        f"FROM slow_calls WHERE start_ns >= ? AND start_ns <= ? "
        f"AND rank IN ({','.join('?' * len(rank_ids))})",
        (lo, hi, *rank_ids),
    )
    return [SlowCallRow(*row) for row in rows]


def wave_block_by_rowid(conn: sqlite3.Connection, rowid: int) -> guard_pb2.WaveColumns:
    (blob,) = conn.execute("SELECT columns FROM wave_blocks WHERE rowid = ?", (rowid,)).fetchone()
    return decode_waves(blob)


def count_waves(conn: sqlite3.Connection) -> int:
    """Wave records stored (block sizes summed)."""
    (total,) = conn.execute("SELECT COALESCE(SUM(waves), 0) FROM wave_blocks").fetchone()
    return total
