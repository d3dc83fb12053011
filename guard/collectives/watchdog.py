"""Rank-local watchdog: a thread that raises `hang_suspected` once a collective overruns.

It reads the tracker's `current` call (replaced as a whole tuple by the engine thread), so it
keeps judging while the engine thread is blocked inside the collective. It is armed only after
`arm_after_waves` finished waves: model load and the first (warm-up) wave legitimately keep one
rank waiting for its peer for seconds. One incident per stuck call; a later call that overruns
gets its own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from guard.collectives.tracker import CollectiveTracker

log = structlog.get_logger("ascend_guard.watchdog")

IncidentSink = Callable[..., None]


def _default_sink(*args: Any, **kwargs: Any) -> None:
    from guard.incidents import report_incident

    report_incident(*args, **kwargs)


class CollectiveWatchdog:
    def __init__(
        self,
        tracker: CollectiveTracker,
        *,
        deadline_s: float,
        interval_s: float,
        arm_after_waves: int,
        report: IncidentSink = _default_sink,
        wave_source: Callable[[], int] = lambda: 0,
    ) -> None:
        self._tracker = tracker
        self._deadline_ns = int(deadline_s * 1e9)
        self._interval_s = interval_s
        self._arm_after = arm_after_waves
        self._report = report
        self._wave_source = wave_source
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fired: tuple[str, int] | None = None  # (group, seq) already reported
        self._last_tick = time.monotonic()
        self.fired = 0

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="ascend-guard-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)

    def _run(self) -> None:
        self._last_tick = time.monotonic()
        while not self._stop.wait(self._interval_s):
            try:
                self.tick(time.monotonic())
            except Exception:  # noqa: BLE001 - the watchdog must never take the worker down
                log.exception("watchdog_error")

    def tick(self, now: float, now_ns: int | None = None) -> bool:
        """One wake-up of the thread at monotonic time `now`; True when it reported.

        A tick far later than asked means this process itself was frozen (SIGSTOP, a VM
        pause) or starved: its own call looks old only because of that, and finishes at once
        now that the process runs again. Then it looks again at the next tick.
        """
        frozen = now - self._last_tick > max(1.0, 5 * self._interval_s)
        self._last_tick = now
        return False if frozen else self.check(now_ns)

    def check(self, now_ns: int | None = None) -> bool:
        """One look at the current call; True when it raised an incident."""
        tracker = self._tracker
        current = tracker.current
        if tracker.completed_waves < self._arm_after:
            return False
        replaying = tracker.in_replay
        if current is None and replaying is not None:
            replaying = tracker.replay_pending()  # the device is still inside a replayed graph
            if replaying is not None:
                # a table: one row per line, columns aligned (fmt: skip)
                current = (
                    replaying.op, replaying.group, replaying.backend, replaying.seq,
                    replaying.start_ns,
                )  # fmt: skip
        if current is None:
            return False
        op, group, backend, seq, start = current
        age = (now_ns if now_ns is not None else time.perf_counter_ns()) - start
        deadline = self._deadline_ns
        if replaying is not None and replaying.seq == seq:  # a compiled call: its compute too
            deadline += 2 * getattr(replaying.graph, "longest_ns", 0)
        if age < deadline or self._fired == (group, seq):
            return False
        self._fired = (group, seq)
        self.fired += 1
        age_s = round(age / 1e9, 3)
        # a table: one row per line, columns aligned (fmt: skip)
        evidence = {
            "op": op, "group": group, "backend": backend, "seq": seq, "age_s": age_s,
            "deadline_s": self._deadline_ns / 1e9, "wave": self._wave_source(),
        }  # fmt: skip
        where = f"{op} on group {group} (seq {seq}, {backend})"
        if replaying is not None and replaying.seq == seq:
            holds = replaying.graph.holds()
            evidence.update(graph=replaying.graph.label, graph_holds=holds)
            where = f"replay of graph {replaying.graph.label} (holds {holds}) at {where}"
        self._report(
            "hang_suspected",
            "critical",
            f"{where} has not returned after {age_s}s",
            evidence=evidence,
        )
        log.warning("hang_suspected", op=op, group=group, seq=seq, age_s=age_s)
        return True
