"""The checker thread: judges every replica several times a second, never while starved.

A sidecar that was itself starved or paused (a crowded host, SIGSTOP, a VM pause) has not
been reading the streams either: every rank looks silent to it for as long as it slept. So
after a late wake-up (more than `late_wake_s` since the previous one) it judges nothing, no
verdict and no recovery, until ingest has caught up: every open stream has delivered a batch
read since the wake-up, or `stale_s` passed (a rank that truly stopped never delivers). Each
late wake-up is counted in `ascend_guard_hang_check_late_seconds_total`; long ones are logged
(`hang_check_late`). Runs on its own thread, `hang-detector`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import structlog

from telemetry.crossrank.rank_state import HangSettings
from telemetry.metrics.collectives import CollectiveMetrics

log = structlog.get_logger("ascend_guard.hangs")


class Checker:
    def __init__(
        self,
        settings: HangSettings,
        metrics: CollectiveMetrics,
        check: Callable[[], object],
        caught_up: Callable[[float], bool],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self._check = check
        self._caught_up = caught_up
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last = clock()
        self.holding_since = 0.0  # a late wake-up at this time: no judging until caught up
        self.holds = 0

    def start(self) -> None:
        self._last = self._clock()
        self._thread = threading.Thread(target=self._run, name="hang-detector", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)

    def _run(self) -> None:
        while not self._stop.wait(self.settings.check_interval_s):
            if not self.tick():
                continue
            try:
                self._check()
            except Exception:  # noqa: BLE001 - the sidecar keeps serving
                log.exception("hang_check_failed")

    def tick(self) -> bool:
        """One wake-up of the checker: True when it may judge now."""
        now = self._clock()
        gap, self._last = now - self._last, now
        interval = self.settings.check_interval_s
        if gap > 2 * interval:  # woken late: any verdict due meanwhile comes that much later
            self.metrics.hang_check_late.inc(gap - interval)
        if gap > max(self.settings.late_wake_s, 5 * interval):
            if gap > max(1.0, 10 * interval):
                log.warning("hang_check_late", gap_s=round(gap, 3))
            self.holding_since = now  # a later gap restarts the wait
            self.holds += 1
        if not self.holding_since:
            return True
        if self._caught_up(self.holding_since):
            log.info("hang_check_caught_up", held_s=round(now - self.holding_since, 3))
            self.holding_since = 0.0
            return True
        return False
