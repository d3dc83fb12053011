"""One protocol for per-wave work on a worker, and the list the processor fans out to.

The processor counts waves and calls each observer at the wave's boundaries (engine thread);
the streamer calls `fill_batch` on its thread. An observer implements any subset of the hooks:
detectors, hot reload, collectives (guard/collective_guard.py), probes. A hook that raises is
counted as a guard-internal error and the others still run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from telemetry.proto import guard_pb2

HOOKS = ("begin_wave", "on_schedule", "on_output", "end_wave", "fill_batch", "close")


class WaveObserver(Protocol):
    """Every hook is optional; the processor calls those an observer has."""

    def begin_wave(self, wave: int) -> None: ...  # before execute_model
    def on_schedule(self, wave: int, scheduler_output: Any) -> None: ...  # before sampling
    def on_output(self, wave: int, runner: Any, output: Any) -> None: ...  # the wave's tokens
    def end_wave(self, wave: int) -> None: ...  # after sample_tokens
    def fill_batch(self, batch: guard_pb2.Batch, with_heartbeat: bool) -> None: ...  # streamer
    def close(self) -> None: ...


class Observers:
    """The observers of one processor, as one bound-method list per hook (cheap to call)."""

    def __init__(self, on_error: Callable[[str], None]) -> None:
        self._on_error = on_error
        self.members: list[Any] = []
        self._hooks: dict[str, list[Callable[..., None]]] = {name: [] for name in HOOKS}

    def add(self, observer: Any) -> None:
        self.members.append(observer)
        self._rebuild()

    def _rebuild(self) -> None:
        self._hooks = {
            name: [getattr(m, name) for m in self.members if callable(getattr(m, name, None))]
            for name in HOOKS
        }

    def begin_wave(self, wave: int) -> None:
        for hook in self._hooks["begin_wave"]:
            try:
                hook(wave)
            except Exception:  # noqa: BLE001 - never break the step
                self._on_error("observer_begin_wave")

    def on_schedule(self, wave: int, scheduler_output: Any) -> None:
        for hook in self._hooks["on_schedule"]:
            try:
                hook(wave, scheduler_output)
            except Exception:  # noqa: BLE001
                self._on_error("observer_on_schedule")

    def on_output(self, wave: int, runner: Any, output: Any) -> None:
        for hook in self._hooks["on_output"]:
            try:
                hook(wave, runner, output)
            except Exception:  # noqa: BLE001
                self._on_error("observer_on_output")

    def end_wave(self, wave: int) -> None:
        for hook in self._hooks["end_wave"]:
            try:
                hook(wave)
            except Exception:  # noqa: BLE001
                self._on_error("observer_end_wave")

    def fill_batch(self, batch: guard_pb2.Batch, with_heartbeat: bool) -> None:
        for hook in self._hooks["fill_batch"]:
            try:
                hook(batch, with_heartbeat)
            except Exception:  # noqa: BLE001
                self._on_error("observer_fill_batch")

    def close(self) -> None:
        for hook in self._hooks["close"]:
            try:
                hook()
            except Exception:  # noqa: BLE001
                self._on_error("observer_close")
