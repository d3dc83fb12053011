"""Readings every rank repeats with its heartbeats: its build and its attach-point coverage.

They are re-sent about once a second (with the probe snapshot), so a sidecar that restarts
knows them again within a second. The runtime layer adds the attach-point source
(`ascend_runtime.plugin`); guard/ itself knows no runtime.
"""

from __future__ import annotations

from collections.abc import Callable

from telemetry.wire.build_info import build_labels

Reading = tuple[str, float, dict[str, str]]
_sources: list[Callable[[], list[Reading]]] = []


def add_source(source: Callable[[], list[Reading]]) -> None:
    if source not in _sources:
        _sources.append(source)


def readings() -> list[Reading]:
    """build_info, then whatever the registered sources report (a failing source is skipped)."""
    out: list[Reading] = [("build_info", 1.0, build_labels("worker"))]
    for source in list(_sources):
        try:
            out.extend(source())
        except Exception:  # noqa: BLE001 - a probe must never break the stream
            continue
    return out
