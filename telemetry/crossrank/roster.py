"""Which engines this sidecar serves, when one has left, and how complete its coverage is.

- An engine whose last stream ends cleanly (its workers closed their streams: vLLM shut down, a
  pod was deleted) has left: its `ascend_guard_ranks_connected` series goes at once, so
  `AscendGuardNoRanksConnected` does not fire for a server that is gone.
- An engine whose last stream broke (worker killed, connection lost) keeps that series at 0;
  that is what `AscendGuardNoRanksConnected` sees.
- Either way, every series with the engine's label is removed `linger_s` after its last stream
  ended (its final counts stay readable that long); a rank that reconnects first keeps them.
- `coverage()` answers `ascend-guard doctor --live`: per engine, the ranks connected against the
  engine's TP x PP x DP world, and the attach-point counts each rank reports.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable
from typing import Any

import structlog
from prometheus_client import CollectorRegistry

from telemetry.wire.proto import guard_pb2

log = structlog.get_logger("ascend_guard.roster")

DEFAULT_LINGER_S = 15 * 60.0


def forget_series(collector: Any, label: str, value: str) -> int:
    """Remove every series of one labelled metric whose `label` equals `value`. A custom
    Collector keyed by engine (telemetry/metrics/waves.py WaveStats, telemetry/metrics/collectives.py)
    forgets through its own `forget(engine)`."""
    if label == "engine" and callable(getattr(collector, "forget", None)):
        return collector.forget(value)
    names = getattr(collector, "_labelnames", ())
    if label not in names or not hasattr(collector, "_metrics"):
        return 0
    index = names.index(label)
    with collector._lock:
        keys = [key for key in collector._metrics if key[index] == value]
    removed = 0
    for key in keys:
        with contextlib.suppress(KeyError):
            collector.remove(*key)
            removed += 1
    return removed


def forget_label(registry: CollectorRegistry, label: str, value: str) -> int:
    """Remove every labelled series whose `label` equals `value`; returns how many went."""
    return sum(
        forget_series(collector, label, value)
        for collector in list(getattr(registry, "_collector_to_names", {}))
    )


class EngineRoster:
    """Tracks engines by their connected streams; forgets an engine that has left."""

    def __init__(
        self,
        registry: CollectorRegistry,
        streams: Callable[[], Iterable[tuple[str, guard_pb2.RankInfo]]],
        *,
        linger_s: float = DEFAULT_LINGER_S,
        connected_gauge: Any = None,
        on_forget: Callable[[str], None] | None = None,
        held: Callable[[str], bool] | None = None,
    ) -> None:
        self.registry = registry
        self._connected_gauge = connected_gauge
        self._streams = streams
        self.linger_s = linger_s
        self._on_forget = on_forget
        # whether the hang detector still holds ranks of the engine (a stopped local rank
        # with no stream, a lost remote one): its series, wedged included, stay meanwhile
        self._held = held
        self._timers: dict[str, threading.Timer] = {}
        self._lock = threading.Lock()
        self.forgotten = 0

    def check(self, engine: str, rank: guard_pb2.RankInfo) -> str | None:
        """Engine labels are unique per sidecar: a second server (another run id) may not
        speak under a label a live server holds, or their series would merge into one."""
        holders = {r.run_id for e, r in self._streams() if e == engine and r.run_id != rank.run_id}
        if not holders:
            return None
        return (
            f"engine label {engine!r} is in use by run {sorted(holders)[0]} on this sidecar; give "
            "each server its own runtime_guard.engine (deploy/ sets ASCEND_GUARD_ENGINE to the pod name)"
        )

    def joined(self, engine: str) -> None:
        """A rank of `engine` connected: an engine left to linger stays."""
        with self._lock:
            timer = self._timers.pop(engine, None)
        if timer is not None:
            timer.cancel()

    def idle(self, engine: str, clean: bool) -> None:
        """The last stream of `engine` ended; `clean`: it was closed by the worker."""
        if clean and self._connected_gauge is not None:
            forget_series(self._connected_gauge, "engine", engine)  # every (engine, dp)
        if self.linger_s <= 0:
            self.forget(engine, "linger 0")
            return
        timer = threading.Timer(self.linger_s, self.forget, (engine, "lingered"))
        timer.daemon = True
        with self._lock:
            old = self._timers.pop(engine, None)
            self._timers[engine] = timer
        if old is not None:
            old.cancel()
        timer.start()
        log.info("engine_idle", engine=engine, clean=clean, series_kept_s=self.linger_s)

    def forget(self, engine: str, why: str) -> None:
        with self._lock:
            self._timers.pop(engine, None)
        if any(e == engine for e, _ in self._streams()):
            return  # a rank came back meanwhile
        if self._held is not None and self._held(engine):
            self.idle(engine, clean=False)  # its ranks are still judged: wait another linger
            return
        removed = forget_label(self.registry, "engine", engine)
        if self._on_forget is not None:
            self._on_forget(engine)
        self.forgotten += 1
        log.info("engine_forgotten", engine=engine, why=why, series_removed=removed)

    def stop(self) -> None:
        with self._lock:
            timers, self._timers = list(self._timers.values()), {}
        for timer in timers:
            timer.cancel()

    # -- doctor --live ----------------------------------------------------------------------
    def coverage(self, hangs: dict[str, Any] | None = None) -> dict[str, Any]:
        """Per engine: expected and connected ranks, attach points by status per rank; with
        the hang detector's `snapshot()`, also the ranks it holds with no open stream (a
        local rank whose stream ended, a lost remote one: not missing, and not healthy)
        and whether a verdict stands."""
        points = _attach_point_counts(self.registry)
        engines: dict[str, dict[str, Any]] = {}
        quiet: dict[str, list[dict[str, Any]]] = {}
        for r in (hangs or {}).get("without_stream", []):
            quiet.setdefault(r["engine"], []).append(r)
        wedged = {v["engine"] for v in (hangs or {}).get("standing", [])}
        for engine, rank in self._streams():
            entry = engines.setdefault(
                engine,
                {
                    "engine": engine,
                    "run_ids": set(),
                    "ranks": {},
                    "tp_size": rank.tp_size or 1,
                    "pp_size": rank.pp_size or 1,
                    "dp_size": rank.dp_size or 1,
                },
            )
            entry["run_ids"].add(rank.run_id)
            key = (rank.dp_rank, rank.tp_rank, rank.pp_rank)
            # a table: one row per line, columns aligned (fmt: skip)
            entry["ranks"][key] = {
                "dp": rank.dp_rank, "tp": rank.tp_rank, "pp": rank.pp_rank, "pid": rank.pid,
                "node": rank.node, "runner": rank.runner,
                "attach_points": points.get((engine, *map(str, key)), {}),
            }  # fmt: skip
        out = []
        for entry in engines.values():
            tp, pp, dp = entry["tp_size"], entry["pp_size"], entry["dp_size"]
            ranks = entry.pop("ranks")
            grid = [(d, t, p) for d in range(dp) for t in range(tp) for p in range(pp)]
            held = {(r["dp"], r["tp"], r["pp"]): r for r in quiet.pop(entry["engine"], [])}
            entry["expected_ranks"] = len(grid)
            entry["connected_ranks"] = len(ranks)
            entry["without_stream"] = [
                {k: r.get(k) for k in ("dp", "tp", "pp", "pid", "where", "stream", "state")}
                for key, r in sorted(held.items())
                if key not in ranks
            ]
            entry["hang_verdict"] = entry["engine"] in wedged
            entry["missing"] = [
                f"dp{d}/tp{t}/pp{p}"
                for d, t, p in grid
                if (d, t, p) not in ranks and (d, t, p) not in held
            ]
            entry["ranks"] = [ranks[k] for k in sorted(ranks)]
            entry["run_ids"] = sorted(entry["run_ids"])
            entry["skipped_attach_points"] = sum(
                r["attach_points"].get("skipped", 0) for r in entry["ranks"]
            )
            entry["unreported_attach_points"] = [
                f"dp{r['dp']}/tp{r['tp']}/pp{r['pp']}"
                for r in entry["ranks"]
                if not r["attach_points"]
            ]
            out.append(entry)
        return {"engines": sorted(out, key=lambda e: e["engine"])}


def _attach_point_counts(registry: CollectorRegistry) -> dict[tuple, dict[str, int]]:
    counts: dict[tuple, dict[str, int]] = {}
    for family in registry.collect():
        if family.name != "ascend_guard_attach_points":
            continue
        for sample in family.samples:
            labels = sample.labels
            key = (labels["engine"], labels["dp"], labels["tp"], labels["pp"])
            counts.setdefault(key, {})[labels["status"]] = int(sample.value)
    return counts
