"""Device time per phase from NPU events (CUDA events on a GPU), read without a sync.

At the start and end of a phase the timer records an event on the current stream. Finished
pairs are resolved later, on the next phase start, only when `end.query()` says the device has
passed the end event: the engine thread never waits for the device. Pending pairs are capped;
when the device falls that far behind, the oldest pair is dropped and counted.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from ascend_runtime.probes import report

MAX_PENDING = 64


class PhaseTimer:
    def __init__(self, new_event: Callable[[], Any], max_pending: int = MAX_PENDING) -> None:
        self._new_event = new_event
        self._pending: collections.deque = collections.deque()
        self._max_pending = max_pending
        self.dropped = 0
        self.resolved = 0
        self._labels: dict[str, dict[str, str]] = {}

    def start(self, phase: str) -> tuple[str, Any]:
        self.poll()
        event = self._new_event()
        event.record()
        return phase, event

    def end(self, started: tuple[str, Any]) -> None:
        event = self._new_event()
        event.record()
        if len(self._pending) >= self._max_pending:
            self._pending.popleft()
            self.dropped += 1
        self._pending.append((started[0], started[1], event))

    def poll(self) -> int:
        """Report every pair the device has finished, oldest first; never blocks."""
        done = 0
        pending = self._pending
        while pending and pending[0][2].query():
            phase, start, end = pending.popleft()
            labels = self._labels.get(phase) or self._labels.setdefault(phase, {"phase": phase})
            report.hot_probe("device_phase_ms", float(start.elapsed_time(end)), labels)
            done += 1
        self.resolved += done
        return done


def event_factory(platform: str) -> Callable[[], Any] | None:
    """Timing events of the platform's device, or None on CPU (no device clock)."""
    if platform == "ascend":
        import torch_npu

        return lambda: torch_npu.npu.Event(enable_timing=True)
    if platform == "cuda":
        import torch

        return lambda: torch.cuda.Event(enable_timing=True)
    return None
