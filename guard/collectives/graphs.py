"""Collectives inside device graphs, as the tracker keeps them: what a captured graph noted at
capture, what a torch.compile'd graph holds, and the replay in flight. Engine thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from guard.collectives.records import META_ATTR, GroupMeta

# a finished wave waits at most this many waves for the device times of its replays
PARK_WAVES = 4


# Stat list layout, per (op, group) and wave:
# [calls, bytes, host_ns, max_host_ns, first_seq, last_seq, backend, dtype, replayed,
#  graph_counted]
REPLAYED = 8


GRAPH_COUNTED = 9


class CapturedGraph:
    """The collectives one captured device graph holds, noted while it was captured."""

    __slots__ = ("calls", "label", "replays")

    def __init__(self, label: str) -> None:
        self.label = label
        # (op, group meta, bytes, dtype) in program order
        self.calls: list[tuple[str, GroupMeta, int, str]] = []
        self.replays = 0

    def holds(self) -> str:
        """The collective list as text: "all_reduce tp x5 (20480 B), all_gather tp x1 (...)"."""
        counts: dict[tuple[str, str], list[int]] = {}
        for op, meta, nbytes, _ in self.calls:
            entry = counts.setdefault((op, meta.label), [0, 0])
            entry[0] += 1
            entry[1] += nbytes
        return ", ".join(f"{op} {group} x{n} ({b} B)" for (op, group), (n, b) in counts.items())


class CompiledGraph:
    """The collectives one torch.compile'd graph holds, found in its FX graph at compile time.

    `entries` are the collectives in program order, each (op, group, dtype, constant bytes,
    terms, exact): the bytes of one call are `constant + sum(coef * sizes[k])` over the terms
    (k, coef), where `sizes` are the graph's symbolic sizes (the batch size) read from the
    call's arguments at `locations` (argument index, dimension or -1 for a SymInt argument).
    `exact` is a function of `sizes` for a size that is not linear in them (None otherwise).
    `group` is the GroupCoordinator; its guard meta is bound at the first call (`bind`).

    `bypass` is (a coordinator's `__dict__`, method name, that method unwrapped and bound to
    it) for each guard-wrapped method that the graph's collectives reach through Python (vLLM's
    custom ops call `_all_reduce_out_place` and its kin). For the length of a counted call
    these shadow the class's wrappers, which would only step aside: one Python frame fewer per
    collective. The coordinator's other callers are the engine thread's, which is inside the
    call.
    """

    __slots__ = (
        "label",
        "entries",
        "locations",
        "rows",
        "groups",
        "first",
        "last_sizes",
        "longest_ns",
        "bypass",
    )

    def __init__(self, label: str, entries: list[tuple], locations: list[tuple[int, int]]) -> None:
        self.label = label
        self.entries = entries
        self.locations = locations
        # per (op, group label): [key, n, constant, terms, meta, dtype, first_off, last_off,
        # exacts] once bound; None until then
        self.rows: list[list] | None = None
        self.groups: list[tuple[GroupMeta, int]] = []  # seq advance per group and call
        self.first: tuple[str, GroupMeta] | None = None
        self.last_sizes: list[int] = []
        # the longest call in a wave so far: compute runs inside the call too, so the
        # watchdog gives a call this much on top of its deadline
        self.longest_ns = 0
        self.bypass: tuple[tuple[dict, str, Callable[..., Any]], ...] = ()

    def bind(self, meta_of: Callable[[Any], GroupMeta]) -> list[list]:
        """Resolve each entry's group meta and fold the entries into per-key rows."""
        rows: dict[tuple[str, str], list] = {}
        per_group: dict[int, list] = {}
        first = None
        for op, group, dtype, constant, terms, exact in self.entries:
            meta = meta_of(group)
            if meta.world_size <= 1:  # vLLM short-cuts these: nothing is communicated
                continue
            count = per_group.setdefault(id(meta), [meta, 0])
            count[1] += 1
            offset = count[1]
            if first is None:
                first = (op, meta)
            row = rows.get((op, meta.label))
            if row is None:
                row = rows[(op, meta.label)] = [
                    (op, meta.label),
                    0,
                    0,
                    {},
                    meta,
                    dtype,
                    offset,
                    offset,
                    [],
                ]
            row[1] += 1
            row[2] += constant
            for k, coef in terms:
                row[3][k] = row[3].get(k, 0) + coef
            if exact is not None:
                row[8].append(exact)
            row[7] = offset
        for row in rows.values():
            row[3] = tuple(row[3].items())
            row[8] = tuple(row[8])
        self.groups = [(meta, n) for meta, n in per_group.values()]
        self.first = first
        self.rows = list(rows.values())
        return self.rows

    def sizes(self, args: tuple) -> list[int]:
        """The symbolic sizes' values in one call, read from its arguments."""
        return [int(args[i]) if dim < 0 else int(args[i].shape[dim]) for i, dim in self.locations]

    def calls_at(self, sizes: list[int]) -> list[tuple[str, GroupMeta, int, str]]:
        """(op, group meta, bytes, dtype) of each collective at these sizes, in program order
        (what a device graph captured around this call holds)."""
        rows = self.rows or []
        metas = {row[0]: row[4] for row in rows}
        out = []
        for op, group, dtype, constant, terms, exact in self.entries:
            meta = getattr(group, META_ATTR, None)
            if meta is None or (op, meta.label) not in metas:
                continue
            nbytes = constant + sum(coef * sizes[k] for k, coef in terms)
            if exact is not None:
                nbytes += exact(sizes)
            out.append((op, meta, int(nbytes), dtype))
        return out

    def holds(self) -> str:
        """The collective list at the last call's sizes: "all_reduce tp x5 (20480 B)"."""
        sizes = self.last_sizes
        parts = []
        for key, n, constant, terms, _meta, _dtype, _f, _l, exacts in self.rows or []:
            nbytes = constant + sum(coef * sizes[k] for k, coef in terms if k < len(sizes))
            if sizes:
                nbytes += sum(exact(sizes) for exact in exacts)
            parts.append(f"{key[0]} {key[1]} x{n} ({int(nbytes)} B)")
        return ", ".join(parts)


class InReplay(NamedTuple):
    """A replay of a graph holding collectives that the device may not have finished."""

    graph: CapturedGraph | CompiledGraph
    op: str  # the graph's first collective, as the heartbeat's current collective
    group: str
    backend: str
    seq: int
    start_ns: int  # perf_counter_ns at the replay call
    end_event: Any  # device event after the replay (None: no device clock, host call only)
