"""The collective side of one guarded worker: tracker, watchdog and fire drill together.

The processor calls `begin_wave` / `end_wave` at the wave's boundaries on the engine thread,
and the streamer calls `fill_batch` on its own thread for every batch it sends.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from guard.collectives import CollectivesConfig, CollectiveTracker, GroupMeta
from guard.fault_injection import FaultInjectionConfig, FaultInjector, RankSource
from guard.watchdog import CollectiveWatchdog
from telemetry.proto import guard_pb2

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
    ) -> None:
        self.tracker = CollectiveTracker(config, wave_source, describe_group, new_event)
        self.watchdog: CollectiveWatchdog | None = None
        if config.watchdog:
            self.watchdog = CollectiveWatchdog(
                self.tracker, deadline_s=config.deadline_s,
                interval_s=config.watchdog_interval_ms / 1000.0,
                arm_after_waves=config.arm_after_waves, wave_source=wave_source,
            )  # fmt: skip
        self.injector: FaultInjector | None = None
        if fault_config.enabled:
            self.injector = FaultInjector(fault_config, self.tracker, rank_source)
            self.injector.warn()
        # the first wave starts the watchdog (this process runs a model); then None
        self._start_watchdog = self.watchdog.start if self.watchdog is not None else None
        self.errors = 0

    # The wave hooks run twice a wave on the engine thread, with or without collectives in
    # the wave: no frame beyond the tracker's roll.
    def begin_wave(self, wave: int) -> None:
        try:
            self.tracker.roll(wave)
            start = self._start_watchdog
            if start is not None:
                self._start_watchdog = None
                start()
            if self.injector is not None:
                self.injector.begin_wave(wave)
        except Exception:  # noqa: BLE001 - never break the step
            self.errors += 1

    def end_wave(self, wave: int) -> None:
        try:
            tracker = self.tracker
            if wave == tracker.wave:  # tracker.end_wave, in line
                tracker.roll(0)
        except Exception:  # noqa: BLE001
            self.errors += 1

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
