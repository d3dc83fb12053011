"""The public façade for code that reports from inside a worker: `report_incident`, `report_probe`.

Detectors, probes and watchdogs call these from any thread. They hand the report to this
process's processor (caps and backoff: `guard/stream/reporter.py`), never raise, and do nothing while
the guard is off. This module imports only the decorators' leaf module, so anything may import
it without pulling in the processor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from guard.decorators import active_processor


def report_incident(
    type: str,  # noqa: A002 - the incident's own field name
    severity: str,
    summary: str,
    *,
    wave: int | None = None,
    request_id: str = "",
    evidence: Mapping[str, Any] | None = None,
    actions: Sequence[str] = ("report",),
    incident_id: str | None = None,
) -> None:
    """Raise an incident on this rank. Never raises; does nothing while the guard is off."""
    processor = active_processor()
    if processor is None:
        return
    try:
        processor.incidents.report(
            type,
            severity,
            summary,
            wave=wave,
            request_id=request_id,
            evidence=evidence,
            actions=actions,
            incident_id=incident_id,
        )
    except Exception:  # noqa: BLE001 - telemetry must never break the caller
        processor.errors.record("report_incident")


def report_probe(name: str, value: float, **labels: str) -> None:
    """Publish a probe reading (latest value wins). Never raises; no-op while the guard is off."""
    processor = active_processor()
    if processor is None:
        return
    try:
        processor.offer_probe(name, float(value), {k: str(v) for k, v in labels.items()})
    except Exception:  # noqa: BLE001
        processor.errors.record("report_probe")
