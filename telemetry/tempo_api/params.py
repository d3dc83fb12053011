"""Query parameters as Grafana's Tempo datasource sends them, parsed with errors naming them."""

from __future__ import annotations

import datetime as dt
import re
from decimal import Decimal, InvalidOperation

# Go's time.ParseDuration units (Tempo parses minDuration, maxDuration and step with it)
_GO_UNIT_NS = {
    "ns": 1,
    "us": 10**3,
    "µs": 10**3,
    "μs": 10**3,
    "ms": 10**6,
    "s": 10**9,
    "m": 60 * 10**9,
    "h": 3600 * 10**9,
}
_GO_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_GO_DURATION = re.compile(rf"^(?:{_GO_PART.pattern})+$")
_HEX = re.compile(r"^[0-9A-Fa-f]{1,32}$")
UINT32_MAX = 2**32 - 1


class BadParameter(ValueError):
    """A parameter the API cannot use: answered 400, naming it."""

    def __init__(self, name: str, problem: str) -> None:
        super().__init__(f"invalid parameter {name!r}: {problem}")
        self.name = name


def go_duration_ns(name: str, text: str) -> int:
    """'100ms', '1.5s', '1h30m' (Go's duration syntax, no sign) -> nanoseconds."""
    if text == "0":
        return 0
    if not _GO_DURATION.match(text):
        raise BadParameter(name, f"{text!r} is not a duration; use e.g. 100ms, 1.5s, 1m30s")
    total = Decimal(0)
    for number, unit in _GO_PART.findall(text):
        total += Decimal(number) * _GO_UNIT_NS[unit]
    return int(total)


def positive_int(name: str, text: str, maximum: int = UINT32_MAX) -> int:
    if not text.isdigit() or not 0 < int(text) <= maximum:
        raise BadParameter(name, f"{text!r} is not a whole number from 1 to {maximum}")
    return int(text)


def unix_seconds(name: str, text: str) -> int:
    """Search and trace-by-id bounds: unix seconds (uint32, as Tempo reads them)."""
    if not text.isdigit() or int(text) > UINT32_MAX:
        raise BadParameter(name, f"{text!r} is not a unix time in whole seconds")
    return int(text)


def search_window(start: str | None, end: str | None) -> tuple[int | None, int | None]:
    """`start`/`end` in unix seconds -> ns bounds, `end` inclusive of its whole second."""
    start_ns = unix_seconds("start", start) * 10**9 if start else None
    end_s = unix_seconds("end", end) if end else None
    if start_ns is not None and end_s is not None and end_s * 10**9 <= start_ns:
        raise BadParameter("end", f"{end} is not after start {start}")
    return start_ns, (end_s + 1) * 10**9 - 1 if end_s is not None else None


def metrics_time_ns(name: str, text: str) -> int:
    """query_range bounds as Tempo takes them: unix seconds (up to 10 digits), unix ns,
    fractional seconds, or RFC 3339."""
    if text.isdigit():
        return int(text) * 10**9 if len(text) <= 10 else int(text)
    try:
        seconds = Decimal(text)
    except InvalidOperation:
        pass
    else:
        if seconds.is_finite() and 0 <= seconds < 10**11:
            return int(seconds * 10**9)
        raise BadParameter(name, f"{text!r} is not a unix time")
    try:
        parsed = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise BadParameter(
            name, f"{text!r} is not a time; use unix seconds, unix ns or RFC 3339"
        ) from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=dt.timezone.utc)
    return int(Decimal(str(parsed.timestamp())) * 10**9)


def step_ns(text: str) -> int:
    """query_range `step`: a Go duration or (fractional) seconds; must be positive."""
    try:
        value = int(Decimal(text) * 10**9)
    except InvalidOperation:
        value = go_duration_ns("step", text)
    if value <= 0:
        raise BadParameter("step", f"{text!r} must be above 0")
    return value


def trace_id(text: str) -> str:
    """A hex trace id, short or zero-trimmed ones left-padded: 32 lowercase hex digits."""
    if not _HEX.match(text):
        raise BadParameter("traceID", f"{text!r} is not a trace id of 1 to 32 hex digits")
    return text.lower().rjust(32, "0")


def logfmt(name: str, text: str) -> list[tuple[str, str]]:
    """`key=value key2="quoted value"` (the legacy `tags` search) -> pairs."""
    out: list[tuple[str, str]] = []
    i, n = 0, len(text)
    while i < n:
        if text[i].isspace():
            i += 1
            continue
        eq = text.find("=", i)
        key = text[i:eq] if eq > i else text[i:].split()[0]
        if eq <= i or any(c.isspace() or c == '"' for c in key):
            raise BadParameter(name, f"{text!r} is not logfmt (key=value pairs) near {key!r}")
        i = eq + 1
        if i < n and text[i] == '"':
            value, i = _quoted(name, text, i)
        else:
            j = i
            while j < n and not text[j].isspace():
                j += 1
            value, i = text[i:j], j
        out.append((key, value))
    return out


def _quoted(name: str, text: str, i: int) -> tuple[str, int]:
    out, i = [], i + 1
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text):
            out.append(text[i + 1])
            i += 2
        elif c == '"':
            return "".join(out), i + 1
        else:
            out.append(c)
            i += 1
    raise BadParameter(name, f"{text!r}: a quoted value is not closed")
