"""Hot reload of the `runtime_guard` config file, applied at the same wave on every rank.

The engine core process (one per engine, home of the scheduler) watches the file named by
`ASCEND_GUARD_CONFIG`. When it changes, the new text is validated there — with the
`--additional-config` keys still on top — and the verdict is stamped onto the scheduler's output:
`(generation, config JSON, error)`. Every worker receives that same scheduler output for the
same step, so every rank applies (or refuses) the new config at the same wave, without any
extra messages between ranks. A broken edit keeps the old config; each rank reports it as a
`config_reload_failed` incident with one shared id, which the sidecar stores once.

Only the `detectors` and `incidents` sections change live; a change to any other key is
reported as needing a restart and otherwise ignored.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import structlog

from guard import trace_context
from guard.config.runtime_guard import (
    CONFIG_FILE_ENV,
    CONFIG_KEY,
    GuardConfig,
    GuardConfigError,
    _load_file,
    config_from_env,
    config_from_json,
    parse_config,
)
from guard.decorators import step_aside

log = structlog.get_logger("ascend_guard.reload")

F = TypeVar("F", bound=Callable[..., Any])

STAMP_ATTR = "ascend_guard_config"
INLINE_ENV = "ASCEND_GUARD_INLINE_CONFIG"
RELOADABLE = ("detectors", "incidents")
# a stamp rides on this many scheduler outputs after a change (workers apply it once)
STAMP_WAVES = 64

# (generation, resolved config JSON or "", error or "", keys that need a restart)
Stamp = tuple[int, str, str, tuple[str, ...]]


def changed_keys(old: GuardConfig, new: GuardConfig) -> tuple[str, ...]:
    a, b = json.loads(old.to_json()), json.loads(new.to_json())
    return tuple(sorted(k for k in a if a[k] != b.get(k)))


def merge_reloadable(current: GuardConfig, new: GuardConfig) -> GuardConfig:
    """`current` with the live-changeable sections taken from `new`."""
    raw = json.loads(current.to_json())
    fresh = json.loads(new.to_json())
    for key in RELOADABLE:
        raw[key] = fresh[key]
    return parse_config(raw)


class ConfigWatcher:
    """Polls the config file; turns each change into a stamp for the next scheduler outputs."""

    def __init__(
        self,
        path: str,
        current: GuardConfig,
        inline: Mapping[str, Any] | None = None,
        interval_s: float = 0.5,
    ) -> None:
        self.path = path
        self.current = current
        self.inline = dict(inline or {})
        self.interval_s = interval_s
        self.generation = 1
        self.stamp: Stamp | None = None
        self._stamps_left = 0
        self._signature = self._stat()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _stat(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ascend-guard-reload", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - the watcher must not die on a surprise
                log.exception("config_watch_failed", path=self.path)

    def poll(self) -> Stamp | None:
        """Check the file once; returns the new stamp when it changed."""
        signature = self._stat()
        if signature == self._signature:
            return None
        self._signature = signature
        try:
            raw = dict(_load_file(self.path))
            raw.update(self.inline)
            new = parse_config(raw)
        except GuardConfigError as exc:
            return self._publish("", str(exc), ())
        restart = tuple(k for k in changed_keys(self.current, new) if k not in RELOADABLE)
        merged = merge_reloadable(self.current, new)
        self.current = merged
        return self._publish(merged.to_json(), "", restart)

    def _publish(self, config_json: str, error: str, restart: tuple[str, ...]) -> Stamp:
        with self._lock:
            self.generation += 1
            self.stamp = (self.generation, config_json, error, restart)
            self._stamps_left = STAMP_WAVES
        if error:
            log.error(
                "config_reload_refused", path=self.path, generation=self.generation, error=error
            )
        else:
            log.info(
                "config_reload_staged",
                path=self.path,
                generation=self.generation,
                needs_restart=list(restart),
            )
        return self.stamp

    def stamp_output(self, scheduler_output: Any) -> None:
        if not self._stamps_left:
            return
        with self._lock:
            if not self._stamps_left:
                return
            self._stamps_left -= 1
            stamp = self.stamp
        try:
            setattr(scheduler_output, STAMP_ATTR, stamp)
        except AttributeError:  # a scheduler output type with __slots__: nothing to ride on
            self._stamps_left = 0
            log.warning("config_stamp_unsupported", type=type(scheduler_output).__name__)


_watcher: dict[str, ConfigWatcher | None] = {}


def engine_watcher(environ: Mapping[str, str] | None = None) -> ConfigWatcher | None:
    """The watcher of this engine-core process, started on first use (None: nothing to watch)."""
    if "w" in _watcher:
        return _watcher["w"]
    environ = os.environ if environ is None else environ
    watcher = None
    path = environ.get(CONFIG_FILE_ENV)
    current = config_from_env(environ)
    if path and current is not None:
        inline_text = environ.get(INLINE_ENV) or "{}"
        try:
            inline = json.loads(inline_text)
        except json.JSONDecodeError:
            inline = {}
        watcher = ConfigWatcher(path, current, inline.get(CONFIG_KEY, inline))
        watcher.start()
        log.info("config_watch_started", path=path)
    _watcher["w"] = watcher
    return watcher


def guard_schedule(fn: F) -> F:
    """Decorate the scheduler's `schedule()`: stamp pending config changes onto its output, and
    new requests' W3C `traceparent` onto their NewRequestData (guard/trace_context.py) when
    vLLM's tracing is on."""

    tried_aside = False  # once: a wrapper that is not where it was bound stays

    @functools.wraps(fn)
    def guarded_schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal tried_aside
        output = fn(self, *args, **kwargs)
        try:
            tracing = trace_context.tracing_enabled(self)
            if tracing:
                trace_context.stamp_new(self, output)
            watcher = engine_watcher()
            if watcher is not None:
                watcher.stamp_output(output)
            elif not tracing and not tried_aside:
                # no config file to watch and no trace headers kept in this engine, ever: no
                # frame on later steps
                tried_aside = True
                if step_aside(type(self), fn.__name__, guarded_schedule):
                    log.info(
                        "config_stamp_stepped_aside",
                        reason="no config file is watched and vLLM's tracing is off",
                    )
        except Exception:  # noqa: BLE001 - never break scheduling
            log.exception("config_stamp_failed")
        return output

    guarded_schedule.__ascend_guard_wrapped__ = fn  # type: ignore[attr-defined]
    return guarded_schedule  # type: ignore[return-value]


class LiveConfig:
    """Worker side of hot reload: applies each new stamp at its wave.

    A stamp rides on the scheduler output, so every rank applies (or refuses) it at the same
    wave, before that wave's sampling: the processor reads it with the schedule's other fields
    (`guard.wave.schedule.read_schedule`) and calls `apply` before any observer sees the schedule.
    `on_change` gets the new config (the processor then rebuilds what depends on it); a refusal
    or keys needing a restart become incidents with one id shared by every rank.
    """

    def __init__(
        self,
        reporter: Any,
        on_change: Callable[[GuardConfig], None],
        offer_probe: Callable[[str, float, dict[str, str]], None],
        run_id: Callable[[], str],
    ) -> None:
        self.generation = 1
        self._reporter = reporter
        self._on_change = on_change
        self._offer_probe = offer_probe
        self._run_id = run_id

    def apply(self, stamp: Stamp, wave: int) -> None:
        generation, config_json, error, restart = stamp
        if generation <= self.generation:
            return
        self.generation = generation
        run_id = self._run_id()
        if error:
            self._reporter.report(
                "config_reload_failed",
                "error",
                f"config edit refused, old config kept: {error}"[:1000],
                evidence={"generation": generation, "error": error},
                incident_id=f"{run_id}:config:{generation}",
            )
            log.error("config_reload_refused", generation=generation, wave=wave, error=error)
            return
        self._on_change(config_from_json(config_json))
        self._offer_probe("config_generation", float(generation), {})
        if restart:
            self._reporter.report(
                "config_needs_restart",
                "warning",
                f"changed keys need a restart and were not applied: {', '.join(restart)}",
                evidence={"generation": generation, "keys": list(restart)},
                incident_id=f"{run_id}:config-restart:{generation}",
            )
        log.info("config_reloaded", generation=generation, wave=wave, needs_restart=list(restart))
