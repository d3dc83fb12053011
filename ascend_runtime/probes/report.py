"""The one way probes report: incidents and probe values through `guard.incidents`.

Probes call `incident(...)` and `probe(...)` here rather than `guard.incidents` directly, so
tests can watch what a probe reports (`capture()`) and so a probe never raises: reporting is
telemetry, and telemetry never stops serving.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import structlog

from guard import decorators

log = structlog.get_logger("ascend_guard.probes")

_local = threading.local()


class Captured:
    """What probes reported while `capture()` was active, in order."""

    def __init__(self) -> None:
        self.incidents: list[dict[str, Any]] = []
        self.probes: list[tuple[str, float, dict[str, str]]] = []

    def probe_values(self, name: str) -> list[tuple[float, dict[str, str]]]:
        return [(value, labels) for n, value, labels in self.probes if n == name]

    def incident_types(self) -> list[str]:
        return [i["type"] for i in self.incidents]


_captures: list[Captured] = []
_warned: set[str] = set()


def _warn_once(event: str, key: str) -> None:
    """Log a failed send once per kind: a missing pipeline must not flood the log."""
    if key not in _warned:
        _warned.add(key)
        log.warning(event, key=key, exc_info=True)


@contextlib.contextmanager
def capture() -> Iterator[Captured]:
    """Record reports made in this process (in addition to sending them) while active."""
    captured = Captured()
    _captures.append(captured)
    try:
        yield captured
    finally:
        _captures.remove(captured)


def incident(
    type: str,
    severity: str,
    summary: str,
    *,
    evidence: Mapping[str, Any] | None = None,
    wave: int | None = None,
) -> None:
    for captured in _captures:
        captured.incidents.append(
            {
                "type": type,
                "severity": severity,
                "summary": summary,
                "evidence": dict(evidence or {}),
            }
        )
    try:
        from guard.incidents import report_incident

        report_incident(type, severity, summary, wave=wave, evidence=evidence)
    except Exception:  # noqa: BLE001
        _warn_once("probe_incident_not_sent", type)


def probe(name: str, value: float, **labels: str) -> None:
    if _captures:  # under test: a name the sidecar would reject is a bug in the probe
        from telemetry.wire.probes import PROBE_METRICS

        labels = {k: str(v) for k, v in labels.items()}
        metric = PROBE_METRICS.get(name)
        assert metric is not None, f"probe {name!r} is not registered in telemetry/wire/probes.py"
        assert set(labels) == set(metric.labels), f"probe {name!r}: labels {sorted(labels)}"
        for captured in _captures:
            captured.probes.append((name, float(value), labels))
    send = _send_probe[0]
    try:
        if send is None:
            from guard.incidents import report_probe as send

            _send_probe[0] = send
        send(name, float(value), **labels)
    except Exception:  # noqa: BLE001
        _warn_once("probe_value_not_sent", name)


_send_probe: list[Any] = [None]  # guard.incidents.report_probe, imported on first use


def hot_probe(name: str, value: float, labels: dict[str, str]) -> None:
    """`probe` for readings taken on every step (speculator counts, device time): `labels` is
    a prepared dict of strings, handed straight to this rank's processor (what `report_probe`
    does, minus its per-call set-up). No-op while the guard is off."""
    if _captures:
        probe(name, value, **labels)
        return
    processor = decorators._processor
    if processor is not None:
        try:
            processor.offer_probe(name, float(value), labels)
        except Exception:  # noqa: BLE001
            _warn_once("probe_value_not_sent", name)
