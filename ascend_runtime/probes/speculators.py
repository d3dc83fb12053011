"""Speculative decoding: which speculator the runtime dispatched, drafts proposed and accepted.

Counts are kept per method and reported on every proposal (a dict update in the streamer).
Proposed drafts come from the shape of what `propose` returns (no device read). Accepted drafts come from the tokens the
target sampled in the step the drafts were verified in: a request that sampled n tokens accepted
n - 1 drafts. Host lists (V1) are counted directly; device counts (MRV2 `num_sampled`) are summed
on the device, copied back at most once a second, and read only once the device has finished
the copy, never with a sync.
"""

from __future__ import annotations

import time
from typing import Any

from ascend_runtime.probes import report

REPORT_INTERVAL_S = 1.0


def count_drafts(drafts: Any) -> int:
    if drafts is None:
        return 0
    numel = getattr(drafts, "numel", None)
    if callable(numel):
        return int(numel())
    return sum(map(len, drafts))


def accepted_from_host(sampled_token_ids: Any) -> int:
    """Accepted drafts in a step from per-request sampled tokens (lists): the sum of n - 1 over
    requests that sampled n >= 1 tokens (C-level loops: this runs on every proposal)."""
    if not sampled_token_ids:
        return 0
    return sum(map(len, sampled_token_ids)) - sum(map(bool, sampled_token_ids))


class SpeculatorStats:
    def __init__(self) -> None:
        self.proposed: dict[str, int] = {}
        self.accepted: dict[str, int] = {}
        self.dispatched: dict[str, str] = {}  # method -> speculator class
        self._device_accepted: dict[str, Any] = {}  # method -> device scalar being summed
        self._reads: list[tuple[str, Any, Any]] = []  # (method, host copy, ready event)
        self._last_report = 0.0
        self._sent_accepted: dict[str, int] = {}
        self._labels: dict[str, dict[str, str]] = {}

    def on_propose(
        self,
        method: str,
        speculator: str,
        drafts: Any,
        *,
        sampled_token_ids: Any = None,
        num_sampled: Any = None,
        new_event: Any = None,
    ) -> None:
        if method not in self.dispatched:
            self.dispatched[method] = speculator
            report.probe("speculator_info", 1, method=method, speculator=speculator)
        self.proposed[method] = self.proposed.get(method, 0) + count_drafts(drafts)
        if sampled_token_ids is not None:
            self.accepted[method] = self.accepted.get(method, 0) + accepted_from_host(
                sampled_token_ids
            )
        elif num_sampled is not None:
            self._add_device(method, num_sampled, new_event)
        now = time.monotonic()
        if self._device_accepted and now - self._last_report >= REPORT_INTERVAL_S:
            self._last_report = now
            self.flush(new_event)
        else:
            self.flush(None)

    def _add_device(self, method: str, num_sampled: Any, new_event: Any) -> None:
        step = (num_sampled - 1).clamp(min=0).sum()
        if getattr(step, "is_cpu", True) or new_event is None:
            self.accepted[method] = self.accepted.get(method, 0) + int(step)
            return
        total = self._device_accepted.get(method)
        self._device_accepted[method] = step if total is None else total + step

    def flush(self, new_event: Any = None) -> None:
        still = []
        for method, host, event in self._reads:
            if event.query():
                self.accepted[method] = self.accepted.get(method, 0) + int(host)
            else:
                still.append((method, host, event))
        self._reads = still
        if new_event is not None:
            for method, total in self._device_accepted.items():
                host = total.to("cpu", non_blocking=True)
                event = new_event()
                event.record()
                self._reads.append((method, host, event))
            self._device_accepted.clear()
        for method, count in self.proposed.items():
            labels = self._labels.get(method)
            if labels is None:
                labels = self._labels[method] = {"method": method}
            report.hot_probe("spec_drafts_proposed", count, labels)
            accepted = self.accepted.get(method, 0)
            if self._sent_accepted.get(method) != accepted:
                self._sent_accepted[method] = accepted
                report.hot_probe("spec_drafts_accepted", accepted, labels)


STATS = SpeculatorStats()
