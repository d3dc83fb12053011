"""The `runtime_guard.fault_injection` config section: the fire drill's rank, wave, delay and where
it strikes. Off by default; never enable it in production serving.
"""

from __future__ import annotations

import dataclasses

from guard.config.schema import value_range

ANY_RANK = -1


@dataclasses.dataclass(frozen=True)
class FaultInjectionConfig:
    """`runtime_guard.fault_injection`: a fire drill. Never enable it in production serving."""

    enabled: bool = False
    # which rank sleeps; -1 = any value of that coordinate
    tp_rank: int = dataclasses.field(default=1, metadata=value_range(-1, 65_535))
    dp_rank: int = dataclasses.field(default=-1, metadata=value_range(-1, 65_535))
    pp_rank: int = dataclasses.field(default=-1, metadata=value_range(-1, 65_535))
    at_wave: int = dataclasses.field(default=20, metadata=value_range(1, 10**12))
    # consecutive waves, starting at at_wave, that get the delay
    waves: int = dataclasses.field(default=1, metadata=value_range(1, 1_000_000))
    delay_ms: float = dataclasses.field(default=300.0, metadata=value_range(0.0, 3_600_000.0))
    where: str = dataclasses.field(
        default="execute_model",
        metadata={"choices": ("execute_model", "collective", "inside_collective")},
    )
    op: str = "all_reduce"
    group: str = "tp"
