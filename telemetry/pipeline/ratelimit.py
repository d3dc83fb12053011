"""Rate-limited logging for what a client can make the sidecar say (refusals): at most `burst`
lines per `window_s` per kind; the lines held back are counted and named in the next line."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


class RateLimitedLog:
    def __init__(
        self,
        emit: Callable[..., Any],
        *,
        burst: int = 10,
        window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._emit = emit
        self._burst = burst
        self._window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._windows: dict[str, list] = {}  # kind -> [window start, lines in it, held back]

    def __call__(self, event: str, kind: str = "", **fields: Any) -> bool:
        """Log `event` unless `kind` has used up its lines in this window; True if logged."""
        now = self._clock()
        with self._lock:
            window = self._windows.get(kind)
            if window is None or now - window[0] >= self._window_s:
                held = window[2] if window is not None else 0
                window = self._windows[kind] = [now, 0, 0]
                if len(self._windows) > 1024:  # kinds come from a fixed set; cap regardless
                    self._windows.clear()
                    self._windows[kind] = window
            else:
                held = 0
            if window[1] >= self._burst:
                window[2] += 1
                return False
            window[1] += 1
        if held:
            fields["suppressed_before"] = held
        self._emit(event, **fields)
        return True
