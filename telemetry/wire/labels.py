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


MAX_LABEL_VALUES = 64
OVERFLOW = "_other"
_SAFE_VALUE = re.compile(r"^[A-Za-z0-9_.:-]{1,48}$")


class BoundedValues:
    """At most `limit` distinct values of one label; later ones become `_other`."""

    def __init__(self, limit: int = MAX_LABEL_VALUES) -> None:
        self._limit = limit
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, raw: str) -> str:
        if raw in self._seen:
            return raw
        if not _SAFE_VALUE.match(raw):
            return OVERFLOW
        with self._lock:
            if len(self._seen) >= self._limit:
                return OVERFLOW
            self._seen.add(raw)
        return raw
