"""The guard's own error budget: every internal error counted, few of them logged.

Anything that goes wrong in the guard's code on a worker is caught where it happens and
recorded here; the count travels with every batch (`guard_errors_total`), and the log gets at
most `per_minute` of them a minute, so a fault on the hot path cannot flood it.
"""

from __future__ import annotations

import time

import structlog

log = structlog.get_logger("ascend_guard.errors")


class ErrorBudget:
    """Counts every guard-internal error; logs at most `per_minute` of them a minute."""

    def __init__(self, per_minute: int) -> None:
        self.total = 0
        self._per_minute = per_minute
        self._window_start = 0.0
        self._in_window = 0

    def record(self, where: str) -> None:
        """Call from an `except` block: the traceback of the error being handled is logged."""
        self.total += 1
        now = time.monotonic()
        if now - self._window_start >= 60.0:
            self._window_start, self._in_window = now, 0
        if self._in_window < self._per_minute:
            self._in_window += 1
            log.exception("guard_internal_error", where=where, errors_total=self.total)
