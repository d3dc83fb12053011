"""One protocol for per-wave work on a worker, and the list the processor fans out to.

The processor counts waves and calls each observer at the wave's boundaries (engine thread);
the streamer calls `fill_batch` on its thread. An observer implements any subset of the hooks:
detectors, collectives (guard/collectives/observer.py), request membership
(guard/wave/request_membership.py), probes. A hook that raises is counted as a guard-internal
error and the others still run. The processor walks these tuples and nothing else: every
participant in a wave is an observer.

The wave hooks run on the engine thread after the model's own work, where every Python frame
costs a microsecond or so (its code and data are out of the caches), so the processor walks
the hook tuples below itself, with no dispatch frame between, and an observer that only
forwards to another object names it (`wave_delegate`) so that object's hooks are called
straight: the detector host's suite, or nothing while no detector is on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from telemetry.wire.proto import guard_pb2

WAVE_HOOKS = ("begin_wave", "on_schedule", "on_output", "end_wave", "on_record")


class WaveObserver(Protocol):
    """Every hook is optional; the processor calls those an observer has."""

    def begin_wave(self, wave: int) -> None: ...  # before execute_model
    def on_schedule(self, wave: int, scheduler_output: Any) -> None: ...  # before sampling
    # the wave's output, and its tokens as the processor read them (`guard.wave.schedule.WaveTokens`,
    # None when the output carries no host-side token lists)
    def on_output(self, wave: int, runner: Any, output: Any, tokens: Any) -> None: ...
    def end_wave(self, wave: int) -> None: ...  # after sample_tokens
    # as the wave's record is handed to the streamer: its schedule as the processor read it
    # (`guard.wave.schedule.ScheduleFields`, None for a dummy wave), its output, its sampled
    # tokens and what each request keeps (`read_sampled`)
    def on_record(self, wave: int, fields: Any, output: Any, tokens: Any, kept: Any) -> None: ...
    def attach_record(self, record: Any) -> None: ...  # the rank's liveness record, at start
    def fill_batch(self, batch: guard_pb2.Batch, with_heartbeat: bool) -> None: ...  # streamer
    def close(self) -> None: ...


class Observers:
    """The observers of one processor, as one tuple of bound methods per wave hook (walked by
    the processor), and the streamer-side hooks, called here."""

    def __init__(self, on_error: Callable[[str], None]) -> None:
        self._on_error = on_error
        self.members: list[Any] = []
        self.begin_wave_hooks: tuple[Callable[[int], None], ...] = ()
        self.on_schedule_hooks: tuple[Callable[[int, Any], None], ...] = ()
        self.on_output_hooks: tuple[Callable[[int, Any, Any, Any], None], ...] = ()
        self.end_wave_hooks: tuple[Callable[[int], None], ...] = ()
        self.on_record_hooks: tuple[Callable[[int, Any, Any, Any, Any], None], ...] = ()
        self._fill_batch: list[Callable[[guard_pb2.Batch, bool], None]] = []
        self._close: list[Callable[[], None]] = []

    def add(self, observer: Any) -> None:
        """Add `observer`; one that names a delegate is told (`on_change`) how to say that
        its delegate changed."""
        self.members.append(observer)
        if callable(getattr(observer, "wave_delegate", None)):
            observer.on_change = self.refresh
        self.refresh()

    def refresh(self) -> None:
        """Rebuild the hook tuples: after an observer is added, or one changes its delegate."""
        targets = [_wave_target(m) for m in self.members]
        for name in WAVE_HOOKS:
            hooks = tuple(getattr(t, name) for t in targets if callable(getattr(t, name, None)))
            setattr(self, name + "_hooks", hooks)  # one assignment: the engine thread reads it
        self._fill_batch = [
            m.fill_batch for m in self.members if callable(getattr(m, "fill_batch", None))
        ]
        self._close = [m.close for m in self.members if callable(getattr(m, "close", None))]

    def attach_record(self, record: Any) -> None:
        """Hand the rank's shared-memory liveness record to the observers that write to it."""
        for member in self.members:
            attach = getattr(member, "attach_record", None)
            if callable(attach):
                attach(record)

    def fill_batch(self, batch: guard_pb2.Batch, with_heartbeat: bool) -> None:
        for hook in self._fill_batch:
            try:
                hook(batch, with_heartbeat)
            except Exception:  # noqa: BLE001
                self._on_error("observer_fill_batch")

    def close(self) -> None:
        for hook in self._close:
            try:
                hook()
            except Exception:  # noqa: BLE001
                self._on_error("observer_close")


def _wave_target(observer: Any) -> Any:
    """The object whose wave hooks stand for `observer`'s (None: no wave hooks now)."""
    delegate = getattr(observer, "wave_delegate", None)
    return delegate() if callable(delegate) else observer
