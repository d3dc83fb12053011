"""Request membership columns (`RequestColumns`, guard/wave/request_membership.py): checks and reads.

A batch's rows name waves; each row's requests are a run of entries in the flat lists, or the
previous row's (`same_members`), and its tokens are listed or the same for every member
(`scheduled_each`, `sampled_each`). `entries` expands them with numpy into one entry per
(wave, request): what the store's readers and the request traces work on.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from telemetry.wire.proto import guard_pb2
from telemetry.wire.schema import INT64_MAX, InvalidBatch

MAX_ROWS = 100_000
MAX_ENTRIES = 10_000_000  # (wave, request) entries of one batch
MAX_REQUEST_ID = 256
ROW_COLUMNS = (
    "wave",
    "members",
    "same_members",
    "scheduled_each",
    "scheduled_count",
    "sampled",
    "sampled_each",
    "sampled_count",
    "finished_count",
    "preempted_count",
)
FLAT = (
    "req_index",
    "scheduled_index",
    "scheduled_tokens",
    "sampled_index",
    "sampled_tokens",
    "finished_index",
    "preempted_index",
)


def _error(message: str) -> Exception:
    return InvalidBatch(f"request_columns.{message}")


def _u32(values) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def validate_request_columns(cols: guard_pb2.RequestColumns) -> None:
    """Equal lengths, runs that add up, storable values; the error names the column."""
    if len(cols.name_index) != len(cols.name_request_id):
        raise _error(
            f"name_request_id: {len(cols.name_request_id)} ids for "
            f"{len(cols.name_index)} name_index values"
        )
    for i, req_id in enumerate(cols.name_request_id):
        if not 1 <= len(req_id) <= MAX_REQUEST_ID:
            raise _error(f"name_request_id[{i}]: {len(req_id)} characters, 1-{MAX_REQUEST_ID}")
    if len(cols.traceparent_index) != len(cols.traceparent):
        raise _error(
            f"traceparent: {len(cols.traceparent)} values for "
            f"{len(cols.traceparent_index)} traceparent_index values"
        )
    if len(cols.traceparent_index):
        named = set(cols.name_index)
        for i, idx in enumerate(cols.traceparent_index):
            if idx not in named:
                raise _error(f"traceparent_index[{i}]: {idx} is not named in this batch")
    n = len(cols.wave)
    if n > MAX_ROWS:
        raise _error(f"wave: {n} rows, at most {MAX_ROWS}")
    for name in ROW_COLUMNS:
        if len(getattr(cols, name)) != n:
            raise _error(f"{name}: {len(getattr(cols, name))} values, wave has {n}")
    if cols.dropped_rows_total > INT64_MAX or cols.dropped_names_total > INT64_MAX:
        raise _error(f"dropped_rows_total/dropped_names_total: exceed {INT64_MAX}")
    if not n:
        for name in FLAT:
            if len(getattr(cols, name)):
                raise _error(f"{name}: values without a wave column")
        return
    waves = np.array(cols.wave, dtype=np.uint64)
    bad = np.flatnonzero((waves < 1) | (waves > INT64_MAX))
    if bad.size:
        raise _error(f"wave[{int(bad[0])}]: {int(waves[bad[0]])} is outside [1, {INT64_MAX}]")
    members = _u32(cols.members)
    same = np.array(cols.same_members, dtype=bool)
    if int(members.sum()) > MAX_ENTRIES:
        raise _error(f"members: {int(members.sum())} entries, at most {MAX_ENTRIES}")
    if same[0]:
        raise _error("same_members[0]: the first row has no previous row")
    source = _sources(same)
    differ = np.flatnonzero(same & (members != members[source]))
    if differ.size:
        i = int(differ[0])
        raise _error(
            f"members[{i}]: {int(members[i])}, but same_members names row {int(source[i])} "
            f"with {int(members[source[i]])}"
        )
    known = np.array(cols.sampled, dtype=bool)
    for kind in ("scheduled", "sampled"):
        each = _u32(getattr(cols, f"{kind}_each"))
        count = _u32(getattr(cols, f"{kind}_count"))
        over = np.flatnonzero(
            (count > members)
            | ((each == 0) & (count != members) & (known if kind == "sampled" else True))
        )
        if over.size:
            i = int(over[0])
            raise _error(
                f"{kind}_count[{i}]: {int(count[i])} listed, the row has {int(members[i])} "
                f"members and {kind}_each {int(each[i])} (0: every member listed)"
            )
        if kind == "sampled":
            unknown = np.flatnonzero(~known & (count > 0))
            if unknown.size:
                raise _error(f"sampled_count[{int(unknown[0])}]: listed, but sampled is false")
        total = int(count.sum())
        for flat in (f"{kind}_index", f"{kind}_tokens"):
            if len(getattr(cols, flat)) != total:
                raise _error(
                    f"{flat}: {len(getattr(cols, flat))} values, the rows add up to {total}"
                )
    expected = {
        "req_index": int(members[~same].sum()),
        "finished_index": int(_u32(cols.finished_count).sum()),
        "preempted_index": int(_u32(cols.preempted_count).sum()),
    }
    for name, count in expected.items():
        if len(getattr(cols, name)) != count:
            raise _error(f"{name}: {len(getattr(cols, name))} values, the rows add up to {count}")


def _sources(same: np.ndarray) -> np.ndarray:
    """Per row, the row whose request list it uses (itself unless same_members)."""
    rows = np.arange(len(same))
    return np.maximum.accumulate(np.where(same, 0, rows))


@dataclasses.dataclass
class Entries:
    """One element per (wave, request) of a batch's rows."""

    wave: np.ndarray  # int64
    index: np.ndarray  # the worker's request index
    scheduled: np.ndarray  # tokens scheduled
    sampled: np.ndarray  # tokens sampled, -1: not known for that wave
    row: np.ndarray  # the row of each entry


def entries(cols: guard_pb2.RequestColumns) -> Entries:
    """The rows of validated columns expanded, one entry per (wave, request)."""
    n = len(cols.wave)
    members = _u32(cols.members)
    total = int(members.sum()) if n else 0
    if not total:
        empty = np.zeros(0, np.int64)
        return Entries(empty, empty, empty, empty, empty)
    same = np.array(cols.same_members, dtype=bool)
    row = np.repeat(np.arange(n), members)
    starts = np.cumsum(members) - members
    pos = np.arange(total) - starts[row]
    explicit = np.where(same, 0, members)
    explicit_start = np.cumsum(explicit) - explicit
    index = _u32(cols.req_index)[explicit_start[_sources(same)][row] + pos]
    scheduled = _tokens(cols, "scheduled", row, index, np.ones(n, bool))
    known = np.array(cols.sampled, dtype=bool)
    sampled = np.where(known[row], _tokens(cols, "sampled", row, index, known), -1)
    waves = np.array(cols.wave, dtype=np.int64)
    return Entries(waves[row], index, scheduled, sampled, row)


def _tokens(cols, kind: str, row: np.ndarray, index: np.ndarray, rows_known: np.ndarray):
    """Per entry: the row's `each`, or the listed (index, tokens) pair of its row."""
    out = _u32(getattr(cols, f"{kind}_each"))[row].copy()
    count = _u32(getattr(cols, f"{kind}_count"))
    listed = int(count.sum())
    if not listed:
        return out
    listed_row = np.repeat(np.arange(len(count)), count)
    listed_index = _u32(getattr(cols, f"{kind}_index"))
    listed_tokens = _u32(getattr(cols, f"{kind}_tokens"))
    shift = np.int64(1) << 32
    keys = row * shift + index
    order = np.argsort(keys, kind="stable")
    wanted = listed_row * shift + listed_index
    at = np.searchsorted(keys[order], wanted)
    at = np.minimum(at, len(keys) - 1)
    hit = keys[order][at] == wanted  # a listed index that is not a member is left out
    out[order[at[hit]]] = listed_tokens[hit]
    return out


def flat_per_row(cols: guard_pb2.RequestColumns, counts: str, flat: str) -> list[tuple[int, list]]:
    """(wave, indexes) of the rows with entries in a per-row count + flat list pair
    (finished_count / finished_index, preempted_count / preempted_index)."""
    out = []
    values = list(getattr(cols, flat))
    at = 0
    for wave, count in zip(cols.wave, getattr(cols, counts), strict=True):
        if count:
            out.append((wave, values[at : at + count]))
            at += count
    return out
