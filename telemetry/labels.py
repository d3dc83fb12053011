"""Bounded label values for everything that comes off the wire.

Prometheus keeps one series per distinct label set, so a misbehaving or hostile client must not
be able to mint new values without bound. Engine names are cleaned to a safe alphabet and capped
in number; rank coordinates are small integers by validation (see `validation.py`).
"""

from __future__ import annotations

import re
import threading

OVERFLOW_ENGINE = "_other"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.:-]")


class EngineLabels:
    """Maps raw engine names to at most `max_engines` label values; later ones share one value."""

    def __init__(self, max_engines: int = 32) -> None:
        self._max = max_engines
        self._seen: dict[str, str] = {}
        self._lock = threading.Lock()

    def label(self, raw: str) -> str:
        known = self._seen.get(raw)
        if known is not None:
            return known
        with self._lock:
            known = self._seen.get(raw)
            if known is not None:
                return known
            clean = _UNSAFE.sub("_", raw)[:64] or "default"
            value = clean if len(self._seen) < self._max else OVERFLOW_ENGINE
            self._seen[raw] = value
            return value
