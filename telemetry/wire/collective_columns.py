"""Collective aggregates as columns (wire v3 `CollectiveColumns`), and back to messages.

The sidecar works on a batch's collectives as columns: one numpy array per field, a small
per-batch dictionary of (op, group, backend, dtype) keys referenced by index. A v2 worker's
`CollectiveWave` messages are converted into columns at ingest (`columns_of`); readers that
want one wave as a `CollectiveWave` (spans, `ascend-guard trace`, tests) get it from
`to_waves`, so `CollectiveWave` stays the one schema of what a rank's collectives did.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Collection, Iterable

import numpy as np

from telemetry.wire.proto import guard_pb2
from telemetry.wire.schema import (
    COLLECTIVE_KEY_FIELDS,
    COLLECTIVE_STAT_COLUMNS,
    COLLECTIVE_STAT_FIELDS,
    COLLECTIVE_WAVE_COLUMNS,
)

# numpy dtype of each column, from the proto type (uint64 stays unsigned: validation must see
# a value above 2^63 as such, not wrapped)
_UNSIGNED = {"wave", "calls", "bytes", "first_seq", "last_seq", "replayed", "graph_counted"}


def dtype(name: str):
    return np.uint64 if name in _UNSIGNED else np.int64


def array(cols, name: str) -> np.ndarray:
    """One column as a numpy array (a copy out of the packed field: ~6 ns a value)."""
    return np.array(getattr(cols, name), dtype=dtype(name))


def from_waves(waves: Iterable[guard_pb2.CollectiveWave], cols: guard_pb2.CollectiveColumns):
    """Append `CollectiveWave` messages (wire v2) to `cols`."""
    keys: dict[tuple, int] = {
        tuple(getattr(k, f) for f in COLLECTIVE_KEY_FIELDS): i for i, k in enumerate(cols.keys)
    }
    per_wave: dict[str, list] = {name: [] for name in COLLECTIVE_WAVE_COLUMNS}
    per_stat: dict[str, list] = {
        name: [] for name in ("wave_index", "key", *COLLECTIVE_STAT_COLUMNS)
    }
    slow_rows: list[int] = []
    row = len(cols.wave)
    for cw in waves:
        for name, values in per_wave.items():
            values.append(getattr(cw, name))
        for stat in cw.stats:
            key = (stat.op, stat.group, stat.backend, stat.dtype)
            index = keys.get(key)
            if index is None:
                index = keys[key] = len(keys)
                cols.keys.add(op=stat.op, group=stat.group, backend=stat.backend, dtype=stat.dtype)
            per_stat["wave_index"].append(row)
            per_stat["key"].append(index)
            for name in COLLECTIVE_STAT_COLUMNS:
                per_stat[name].append(getattr(stat, name))
        if cw.slow_calls:
            cols.slow_calls.extend(cw.slow_calls)
            slow_rows += [row] * len(cw.slow_calls)
        row += 1
    for name, values in per_wave.items():
        getattr(cols, name).extend(values)
    for name, values in per_stat.items():
        getattr(cols.stats, name).extend(values)
    cols.slow_call_wave_index.extend(slow_rows)
    return cols


def columns_of(batch: guard_pb2.Batch) -> guard_pb2.CollectiveColumns:
    """The batch's collective columns; a v2 batch's `collective_waves` are moved into them
    (in place, once: later calls find them already there)."""
    if batch.collective_waves:
        from_waves(batch.collective_waves, batch.collective_columns)
        del batch.collective_waves[:]
    return batch.collective_columns


def wave_rows(cols: guard_pb2.CollectiveColumns) -> tuple[np.ndarray, np.ndarray]:
    """(wave of each wave row, wave row of each stat row): what `to_waves` looks rows up in,
    made once for a block read for many waves."""
    return array(cols, "wave"), np.array(cols.stats.wave_index, dtype=np.int64)


def to_waves(
    cols: guard_pb2.CollectiveColumns,
    waves: Collection[int] | None = None,
    rows_of: tuple[np.ndarray, np.ndarray] | None = None,
) -> list[guard_pb2.CollectiveWave]:
    """The columns as `CollectiveWave` messages (only those whose wave is in `waves`);
    `rows_of`: the columns' `wave_rows`, when the caller keeps them."""
    if waves is not None and len(waves) == 1:  # one wave of a trace: no Python loop per row
        (wanted,) = waves
        numbers = rows_of[0] if rows_of is not None else array(cols, "wave")
        rows = np.flatnonzero(numbers == wanted).tolist()
    else:
        rows = [i for i, w in enumerate(cols.wave) if waves is None or w in waves]
    if not rows:
        return []
    stats = cols.stats
    wave_index = rows_of[1] if rows_of is not None else np.array(stats.wave_index, dtype=np.int64)
    slow_index = np.array(cols.slow_call_wave_index, dtype=np.int64) if cols.slow_calls else None
    keys: dict[int, dict] = {}  # key index -> the stat fields it stands for, made when used
    out = []
    for i in rows:
        cw = guard_pb2.CollectiveWave(
            **{name: getattr(cols, name)[i] for name in COLLECTIVE_WAVE_COLUMNS}
        )
        for j in np.flatnonzero(wave_index == i).tolist():
            k = stats.key[j]
            key = keys.get(k)
            if key is None:
                key = keys[k] = {f: getattr(cols.keys[k], f) for f in COLLECTIVE_KEY_FIELDS}
            cw.stats.add(
                **key, **{name: getattr(stats, name)[j] for name in COLLECTIVE_STAT_COLUMNS}
            )
        if slow_index is not None:
            for j in np.flatnonzero(slow_index == i).tolist():
                cw.slow_calls.add().CopyFrom(cols.slow_calls[j])
        out.append(cw)
    return out


# one wave's collectives as plain records with `CollectiveWave`'s and `CollectiveStat`'s fields
# (slow calls stay `CollectiveCall` messages): what `to_waves` gives, for readers that only read
# the fields (the span builders), without making a message per wave and per stat
assert (*COLLECTIVE_KEY_FIELDS, *COLLECTIVE_STAT_COLUMNS) == COLLECTIVE_STAT_FIELDS  # key first
StatRecord = namedtuple("StatRecord", COLLECTIVE_STAT_FIELDS)
WaveRecord = namedtuple("WaveRecord", (*COLLECTIVE_WAVE_COLUMNS, "stats", "slow_calls"))


def wave_records(
    cols: guard_pb2.CollectiveColumns, wave: int, rows_of: tuple[np.ndarray, np.ndarray]
) -> list[WaveRecord]:
    """The rows of one wave as `WaveRecord`s, field for field what `to_waves(cols, (wave,))`
    makes (`rows_of`: the columns' `wave_rows`)."""
    numbers, wave_index = rows_of
    rows = np.flatnonzero(numbers == wave).tolist()
    if not rows:
        return []
    stats, keys = cols.stats, cols.keys
    stat_columns = [getattr(stats, name) for name in COLLECTIVE_STAT_COLUMNS]
    wave_columns = [getattr(cols, name) for name in COLLECTIVE_WAVE_COLUMNS]
    slow_index = np.array(cols.slow_call_wave_index, dtype=np.int64) if cols.slow_calls else None
    key_values: dict[int, list] = {}
    out = []
    for i in rows:
        records = []
        for j in np.flatnonzero(wave_index == i).tolist():
            k = stats.key[j]
            key = key_values.get(k)
            if key is None:
                key = key_values[k] = [getattr(keys[k], f) for f in COLLECTIVE_KEY_FIELDS]
            records.append(StatRecord(*key, *(column[j] for column in stat_columns)))
        slow = []
        if slow_index is not None:
            slow = [cols.slow_calls[j] for j in np.flatnonzero(slow_index == i).tolist()]
        out.append(WaveRecord(*(column[i] for column in wave_columns), records, slow))
    return out


def key_rows(cols: guard_pb2.CollectiveColumns) -> list[tuple[int, np.ndarray | None]]:
    """(key index, the stat rows with that key) for each key used; None: every row (a batch
    with one key, the common case of one op on one group, needs no mask)."""
    nkeys = len(cols.keys)
    if not len(cols.stats.key):
        return []
    if nkeys == 1:
        return [(0, None)]
    key = np.array(cols.stats.key, dtype=np.int64)
    out = []
    for k in range(nkeys):
        rows = np.flatnonzero(key == k)
        if rows.size:
            out.append((k, rows))
    return out


def last_seq_by_group(cols: guard_pb2.CollectiveColumns, keys=None) -> dict[str, int]:
    """The highest `last_seq` of each group in the batch."""
    if not len(cols.stats.last_seq):
        return {}
    last = array(cols.stats, "last_seq")
    out: dict[str, int] = {}
    for k, rows in keys if keys is not None else key_rows(cols):
        group = cols.keys[k].group
        seq = int(last.max() if rows is None else last[rows].max())
        if seq > out.get(group, 0):
            out[group] = seq
    return out
