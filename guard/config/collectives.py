"""The `runtime_guard.collectives` config section: what the collective wrappers record and when
the watchdog speaks.
"""

from __future__ import annotations

import dataclasses

from guard.config.schema import value_range


@dataclasses.dataclass(frozen=True)
class CollectivesConfig:
    """`runtime_guard.collectives`: what the collective wrappers record and when the watchdog
    speaks."""

    enabled: bool = True
    # calls slower than this (host time) are also reported one by one
    slow_call_ms: float = dataclasses.field(default=50.0, metadata=value_range(0.0, 3_600_000.0))
    # at most this many slow calls per wave and rank; the rest are counted
    max_slow_calls_per_wave: int = dataclasses.field(default=16, metadata=value_range(0, 10_000))
    # rank-local watchdog: `hang_suspected` once a collective runs longer than deadline_s
    watchdog: bool = True
    deadline_s: float = dataclasses.field(default=3.0, metadata=value_range(0.05, 86_400.0))
    watchdog_interval_ms: int = dataclasses.field(default=100, metadata=value_range(10, 60_000))
    # the watchdog is armed only once this many waves have finished (warm-up and model load
    # legitimately keep one rank waiting for seconds)
    arm_after_waves: int = dataclasses.field(default=1, metadata=value_range(0, 1_000_000))
