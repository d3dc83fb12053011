"""Fire drill: delay one chosen rank at one chosen wave, so alerts and dashboards can be tested.

OFF BY DEFAULT. When enabled, every process that turns the guard on logs a loud warning, and
each injected delay is logged and reported with the wave's collective record
(`injected_delay_ns`), so a drill is never mistaken for a real straggler afterwards.

`where="execute_model"` sleeps at the start of the wave (before the model runs);
`where="collective"` sleeps right before the first call of `op` on `group` in that wave;
`where="inside_collective"` sleeps right after entering it (the call is numbered, and reported
by heartbeats and the liveness record as the one the rank is in): with `tp_rank=-1`, every rank
stuck inside one collective for `delay_ms`, the transport's hang rather than a late rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

from guard.collectives.tracker import CollectiveTracker
from guard.config.fault_injection import ANY_RANK, FaultInjectionConfig

log = structlog.get_logger("ascend_guard.fault_injection")


RankSource = Callable[[], tuple[int, int, int]]  # (dp, tp, pp)


class FaultInjector:
    def __init__(
        self,
        config: FaultInjectionConfig,
        tracker: CollectiveTracker,
        rank_source: RankSource,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.config = config
        self._tracker = tracker
        self._rank_source = rank_source
        self._sleep = sleep
        self._targeted: bool | None = None  # resolved on the first wave (distributed is up)
        self._armed_wave = 0  # wave whose first matching collective still gets the delay
        self.injected = 0

    def warn(self) -> None:
        c = self.config
        log.warning(
            "FAULT_INJECTION_ENABLED",
            message="fire drill: this server will be delayed on purpose; do not use in production",
            tp_rank=c.tp_rank,
            dp_rank=c.dp_rank,
            pp_rank=c.pp_rank,
            at_wave=c.at_wave,
            waves=c.waves,
            delay_ms=c.delay_ms,
            where=c.where,
            op=c.op,
            group=c.group,
        )

    def _is_target(self) -> bool:
        if self._targeted is None:
            dp, tp, pp = self._rank_source()
            c = self.config
            self._targeted = all(
                want in (ANY_RANK, have)
                for want, have in ((c.dp_rank, dp), (c.tp_rank, tp), (c.pp_rank, pp))
            )
        return self._targeted

    def begin_wave(self, wave: int) -> None:
        c = self.config
        if not c.at_wave <= wave < c.at_wave + c.waves or not self._is_target():
            return
        if c.where == "execute_model":
            self._delay(wave, "execute_model")
        elif c.where == "inside_collective":
            self._armed_wave = wave
            self._tracker.inside_call = self.inside_call
        else:
            self._armed_wave = wave
            self._tracker.before_call = self.before_call

    def before_call(self, op: str, group: str) -> None:
        c = self.config
        if op == c.op and group == c.group and self._tracker.wave == self._armed_wave:
            self._armed_wave = 0
            self._tracker.before_call = None
            self._delay(self._tracker.wave, f"{op}/{group}")

    def inside_call(self, op: str, group: str) -> None:
        c = self.config
        if op == c.op and group == c.group and self._tracker.wave == self._armed_wave:
            self._armed_wave = 0
            self._tracker.inside_call = None
            self._delay(self._tracker.wave, f"inside {op}/{group}")

    def _delay(self, wave: int, where: str) -> None:
        seconds = self.config.delay_ms / 1000.0
        log.warning("fault_injected", wave=wave, where=where, delay_ms=self.config.delay_ms)
        start = time.perf_counter_ns()
        self._sleep(seconds)
        self._tracker.injected_delay_ns += time.perf_counter_ns() - start
        self.injected += 1
