"""The collective side of one guarded worker: tracker, watchdog and fire drill together.

The processor calls `begin_wave` / `end_wave` at the wave's boundaries on the engine thread,
and the streamer calls `fill_batch` on its own thread for every batch it sends.

A worker whose every group spans one rank (a TP=1, PP=1, DP=1 engine) never communicates:
vLLM short-cuts each collective. At the first wave, once vLLM's groups exist, the guard asks
(`world_size`); with no fire drill to run it then takes its wave hooks away
(`wave_delegate`) and starts no watchdog, so such an engine pays nothing per wave for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog

from guard.collectives.fault_injection import FaultInjector, RankSource
from guard.collectives.records import GroupMeta
from guard.collectives.tracker import CollectiveTracker
from guard.collectives.watchdog import CollectiveWatchdog
from guard.config.collectives import CollectivesConfig
from guard.config.fault_injection import FaultInjectionConfig
from telemetry.wire.proto import guard_pb2

log = structlog.get_logger("ascend_guard.collective_guard")


class CollectiveGuard:
    def __init__(
        self,
        config: CollectivesConfig,
        fault_config: FaultInjectionConfig,
        *,
        wave_source: Callable[[], int],
        rank_source: RankSource,
        describe_group: Callable[[object], GroupMeta] | None = None,
        new_event: Callable[[], object] | None = None,
        world_size: Callable[[], int] | None = None,
    ) -> None:
        self.tracker = CollectiveTracker(config, wave_source, describe_group, new_event)
        self.watchdog: CollectiveWatchdog | None = None
        if config.watchdog:
            self.watchdog = CollectiveWatchdog(
                self.tracker,
                deadline_s=config.deadline_s,
                interval_s=config.watchdog_interval_ms / 1000.0,
                arm_after_waves=config.arm_after_waves,
                wave_source=wave_source,
            )
        self.injector: FaultInjector | None = None
        if fault_config.enabled:
            self.injector = FaultInjector(fault_config, self.tracker, rank_source)
            self.injector.warn()
        # the most ranks any group of this process spans, read at the first wave (0: unknown)
        self._world_size = world_size
        # the first wave starts the watchdog where collectives can run (`_first`)
        self._first_wave = True
        self.communicates = True  # until the first wave finds every group of one rank
        self.on_change: Callable[[], None] = lambda: None  # set by the observers' list
        self.errors = 0

    def wave_delegate(self) -> CollectiveGuard | None:
        """Whose wave hooks stand for this observer's: its own, or none in a worker that
        never communicates and runs no drill."""
        return self if self.communicates or self.injector is not None else None

    # The wave hooks run twice a wave on the engine thread, with or without collectives in
    # the wave: no frame beyond the tracker's roll.
    def begin_wave(self, wave: int) -> None:
        try:
            self.tracker.roll(wave)
            if self._first_wave:
                self._first_wave = False
                self._first(wave)
            if self.injector is not None:
                self.injector.begin_wave(wave)
        except Exception:  # noqa: BLE001 - never break the step
            self.errors += 1

    def _first(self, wave: int) -> None:
        """The first wave: vLLM's groups exist now. Start the watchdog where collectives
        can run; where none can, take the wave hooks away (see the module's docstring)."""
        try:
            size = self._world_size() if self._world_size is not None else 0
        except Exception:  # noqa: BLE001 - not known: the hooks stay, and the watchdog starts
            size = 0
        if size == 1:
            self.communicates = False
            self.tracker.roll(0)  # nothing will be recorded: close the wave it opened
            log.info("collectives_none_in_this_worker", wave=wave, drill=self.injector is not None)
            self.on_change()
            return
        if self.watchdog is not None:
            self.watchdog.start()

    def end_wave(self, wave: int) -> None:
        try:
            tracker = self.tracker
            if wave == tracker.wave:  # tracker.end_wave, in line
                tracker.roll(0)
        except Exception:  # noqa: BLE001
            self.errors += 1

    def attach_record(self, record: Any) -> None:
        """The rank's liveness record: the tracker writes each collective's entry to it."""
        self.tracker.record = record

    def fill_batch(self, batch: guard_pb2.Batch, with_heartbeat: bool) -> None:
        try:
            self.tracker.fill_batch(batch, with_heartbeat)
        except Exception:  # noqa: BLE001
            self.errors += 1
            log.exception("collective_fill_batch_failed")
        # both counts are cumulative, so their sum with the processor's is too
        batch.guard_errors_total += self.errors + self.tracker.errors

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
