"""The command line's argument forms: durations, times, rank filters, and what `query`'s filter
flags accept. Each parse error names the flag and the value (`QueryError`).
"""

from __future__ import annotations

import datetime as dt
import re
import time
from decimal import Decimal, InvalidOperation

from telemetry.spans.query import QueryError

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ns|us|µs|ms|s|m|h|d)\s*$")


_UNIT_NS = {
    "ns": 1,
    "us": 10**3,
    "µs": 10**3,
    "ms": 10**6,
    "s": 10**9,
    "m": 60 * 10**9,
    "h": 3600 * 10**9,
    "d": 86400 * 10**9,
}


SORT_KEYS = ("duration", "start", "wave")


def parse_duration_ns(text: str, what: str) -> int:
    """'250us', '5ms', '1.5s', '10m' → nanoseconds."""
    match = _DURATION.match(text)
    if not match:
        raise QueryError(
            f"{what}: {text!r} is not a duration; use a number and a unit, e.g. 5ms, 1.5s, 10m"
        )
    return int(Decimal(match.group(1)) * _UNIT_NS[match.group(2)])  # exact: 1.005s → 1005000000


def parse_time_ns(text: str, what: str, now_ns: int | None = None) -> int:
    """A relative age ('15m' = 15 minutes ago), 'now', a unix time in seconds, or ISO 8601."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    text = text.strip()
    if text == "now":
        return now_ns
    if _DURATION.match(text):
        return now_ns - parse_duration_ns(text, what)
    try:
        seconds = Decimal(text)
    except InvalidOperation:
        pass
    else:
        if not seconds.is_finite() or not 0 <= seconds < 10**11:
            raise QueryError(f"{what}: {text!r} is not a unix time in seconds")
        return int(seconds * 10**9)
    try:
        parsed = dt.datetime.fromisoformat(text)
    except ValueError:
        raise QueryError(
            f"{what}: {text!r} is not a time; use an age like 15m, 'now', unix seconds or ISO 8601"
        ) from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=dt.timezone.utc)
    return int(parsed.timestamp() * 1e9)


def parse_rank(text: str) -> dict[str, int]:
    """'tp=1', 'dp=0,tp=1,pp=0' or 'DP/TP/PP' such as '0/1/0' → {coordinate: rank}."""
    text = text.strip()
    if re.fullmatch(r"\d+/\d+/\d+", text):
        dp, tp, pp = (int(x) for x in text.split("/"))
        return {"dp": dp, "tp": tp, "pp": pp}
    out: dict[str, int] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in ("dp", "tp", "pp") or not value.strip().isdigit():
            raise QueryError(
                f"--rank: {part.strip()!r} is not a rank filter; use tp=1, dp=0,tp=1 or 0/1/0 (dp/tp/pp)"
            )
        out[key] = int(value)
    return out


_SIZE = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str, what: str) -> int:
    """'8GiB', '500MB', '1048576' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _SIZE or float(match.group(1)) <= 0:
        raise QueryError(f"{what}: {text!r} is not a size; use e.g. 8GiB, 500MB or bytes")
    return int(float(match.group(1)) * _SIZE[unit])
