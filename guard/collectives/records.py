"""The small records the collective tracker keeps and hands on: a group's cached meta, the call a
rank is in, a finished wave's aggregates.
"""

from __future__ import annotations

from typing import Any, NamedTuple

META_ATTR = "_ascend_guard_collective_meta"


class GroupMeta:
    """What the guard caches on a `GroupCoordinator`: label, backend, the sequence counter."""

    __slots__ = ("backend", "label", "rank_in_group", "seq", "world_size")

    def __init__(self, label: str, backend: str, rank_in_group: int, world_size: int) -> None:
        self.label = label
        self.backend = backend
        self.rank_in_group = rank_in_group
        self.world_size = world_size
        self.seq = 0


# What a rank is inside right now: (op, group, backend, seq, start perf_counter_ns).
CurrentCall = tuple[str, str, str, int, int]


_new_tuple = tuple.__new__


class FinishedWave(NamedTuple):
    """One wave's collectives on this rank, handed to the streamer thread."""

    wave: int
    first_arrival_unix_nano: int
    wait_ns: int
    # (op, group) -> [calls, bytes, host_ns, max_host_ns, first_seq, last_seq, backend, dtype]
    stats: dict[tuple[str, str], list]
    # (op, group, backend, dtype, seq, bytes, start_unix_nano, host_ns)
    slow_calls: list[tuple]
    slow_calls_dropped: int
    injected_delay_ns: int
    replay_device_ns: int = 0  # device time of graph replays holding collectives (events)


def _describe_group_generic(group: Any) -> GroupMeta:
    """Label from `unique_name` ("tp:0" -> "tp"); backend from the object if it says."""
    name = str(getattr(group, "unique_name", "") or "unknown")
    return GroupMeta(
        name.split(":", 1)[0],
        str(getattr(group, "backend", "") or "unknown"),
        int(getattr(group, "rank_in_group", 0) or 0),
        int(getattr(group, "world_size", 1) or 1),
    )
