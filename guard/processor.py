"""Per-process wave accounting: what the step and sample decorators call when the guard is on.

One `GuardProcessor` lives in each worker process. The step decorator opens a wave around
`execute_model`, the sample decorator closes it around `sample_tokens`, and the finished wave
goes to the streamer as a plain tuple. The wrapped method's own result and exceptions pass
through untouched; anything that goes wrong in the guard's own code is caught, counted and
logged at a bounded rate, and the engine carries on.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from guard import identity
from guard.config import RUN_ID_ENV, GuardConfig, config_from_json
from guard.incidents import IncidentReporter
from guard.liveness_record import LivenessRecord
from guard.reload import STAMP_ATTR
from guard.request_membership import RequestMembership, chain_fillers
from guard.schedule import (
    EMPTY_SCHEDULE,
    PrefillTracker,
    ScheduleSummary,
    sampled_counts,
)
from guard.spool import IncidentSpool
from guard.streamer import HeartbeatState, Streamer, WaveTuple
from telemetry.proto import guard_pb2

if TYPE_CHECKING:
    from guard.detectors.suite import DetectorSuite

log = structlog.get_logger("ascend_guard.processor")

RankDescriber = Callable[[Any], guard_pb2.RankInfo]


class WaveObserver(Protocol):
    """Extra per-wave work (guard/collective_guard.py): called on the engine thread at the
    wave's boundaries, and on the streamer thread to add its fields to each batch."""

    def begin_wave(self, wave: int) -> None: ...
    def end_wave(self, wave: int) -> None: ...
    def fill_batch(self, batch: guard_pb2.Batch, with_heartbeat: bool) -> None: ...


# A wave between execute_model and sample_tokens: (wave, start_perf_ns, execute_ns, schedule).
# A plain tuple: this is built on every step, on the engine thread.
OpenWave = tuple[int, int, int, ScheduleSummary]

_IDLE = "idle"
_EXECUTE = "execute_model"
_SAMPLE = "sample_tokens"
_new_tuple = tuple.__new__  # builds a WaveTuple without the Python-level __new__ frame


class _RateLimitedErrors:
    """Counts every guard-internal error; logs at most `per_minute` of them a minute."""

    def __init__(self, per_minute: int) -> None:
        self.total = 0
        self._per_minute = per_minute
        self._window_start = 0.0
        self._in_window = 0

    def record(self, where: str) -> None:
        self.total += 1
        now = time.monotonic()
        if now - self._window_start >= 60.0:
            self._window_start, self._in_window = now, 0
        if self._in_window < self._per_minute:
            self._in_window += 1
            log.exception("guard_internal_error", where=where, errors_total=self.total)


class GuardProcessor:
    """Turns decorated runner calls into wave records for one rank.

    The engine thread runs `run_step` / `run_sample` on every step, so they are written for
    cost: one clock read on each side of the call, a tuple per wave, and the schedule summary,
    whose cost does not grow with the batch (see `PrefillTracker`).
    """

    def __init__(
        self,
        config: GuardConfig,
        describe_rank: RankDescriber,
        streamer_factory: Callable[..., Streamer] = Streamer,
        *,
        run_id: str = "",
    ) -> None:
        self.config = config
        self._describe_rank = describe_rank
        self._streamer_factory = streamer_factory
        self.streamer: Streamer | None = None
        self.errors = _RateLimitedErrors(config.error_log_per_minute)
        self.wave = 0
        self._open: OpenWave | None = None
        self._prefill = PrefillTracker()
        self._depth = 0
        # (phase, since perf_counter_ns), replaced as a whole so the heartbeat reads a pair
        self._phase: tuple[str, int] = (_IDLE, time.perf_counter_ns())
        # wall clock = perf_counter_ns + offset; refreshed by the streamer thread's heartbeat
        self._wall_offset_ns = time.time_ns() - time.perf_counter_ns()
        # incidents and probe readings raised before the first wave starts the streamer
        self._early_incidents: list[guard_pb2.Incident] = []
        self._early_probes: list[tuple[str, float, dict[str, str]]] = []
        self._early_lock = threading.Lock()
        # sampling detectors: built with the streamer (they need the rank), rebuilt on reload
        self.detectors: DetectorSuite | None = None
        self.config_generation = 1
        self.wants_logits = False  # read by the sampler decorators on every sample
        self.logits_checked = False  # set while a verify sampler runs: skip its inner sampler
        self._runner: Any = None
        self._rank: guard_pb2.RankInfo | None = None
        self.incidents = IncidentReporter(
            config.incidents,
            run_id=run_id or config.run_id or os.environ.get(RUN_ID_ENV) or uuid.uuid4().hex[:16],
            current_wave=lambda: self.wave,
            sink=self._queue_incident,
        )
        # issue 4: collectives, watchdog, fire drill (guard/collective_guard.py); None = off
        self.observer: WaveObserver | None = None
        # issue 17: phase and collective in shared memory, for the sidecar (None = off)
        self.live_record: LivenessRecord | None = None
        # issue 12: request membership per wave, on the rank that owns scheduling (None = off)
        self.membership: RequestMembership | None = None

    # -- decorator entry points ---------------------------------------------------------------
    def run_step(self, fn: Callable[..., Any], runner: Any, args: tuple, kwargs: dict) -> Any:
        """Run `execute_model` and open (or, when it returns output itself, finish) a wave."""
        if self._depth:  # an overriding subclass calling its decorated base: count once
            return fn(runner, *args, **kwargs)
        # Counted first and unconditionally: wave N must name the same step on every rank.
        self.wave = wave = self.wave + 1
        if self.streamer is None or self._open is not None:
            self._prepare_step(runner)
        self._runner = runner
        observer = self.observer
        if observer is not None:
            observer.begin_wave(wave)
        start = time.perf_counter_ns()
        self._phase = (_EXECUTE, start)
        record = self.live_record
        if record is not None:
            record.phase(_EXECUTE, start, wave)
        self._depth = 1
        try:
            output = fn(runner, *args, **kwargs)
        finally:
            self._depth = 0
            end = time.perf_counter_ns()
            self._phase = (_IDLE, end)
            if record is not None:
                record.phase(_IDLE, end, wave)
        try:
            if kwargs and kwargs.get("dummy_run"):
                schedule = EMPTY_SCHEDULE
            else:
                scheduler_output = args[0] if args else kwargs.get("scheduler_output")
                # a config change rides on the scheduler output: applied on every rank at this
                # wave, before its sampling
                stamp = getattr(scheduler_output, STAMP_ATTR, None)
                if stamp is not None:
                    self._apply_stamp(stamp)
                if self.detectors is not None:
                    self.detectors.on_schedule(wave, scheduler_output)
                schedule = self._prefill.summarize(scheduler_output)
                if self.membership is not None:
                    self.membership.on_schedule(wave, scheduler_output)
            opened = (wave, start, end - start, schedule)
            if output is None:
                self._open = opened  # sample_tokens finishes this wave
            else:
                tokens, kept = sampled_counts(output, runner)
                self._emit(opened, 0, 0, tokens, False, output, runner, kept)
                if self.detectors is not None:
                    self.detectors.on_output(wave, runner, output)
                if observer is not None:
                    observer.end_wave(wave)
        except Exception:  # noqa: BLE001
            self.errors.record("step_end")
        return output

    def run_sample(self, fn: Callable[..., Any], runner: Any, args: tuple, kwargs: dict) -> Any:
        """Run `sample_tokens` and finish the open wave with its timing and sampled tokens."""
        if self._depth:
            return fn(runner, *args, **kwargs)
        start = time.perf_counter_ns()
        self._phase = (_SAMPLE, start)
        record = self.live_record
        if record is not None:
            record.phase(_SAMPLE, start, self.wave)
        self._depth = 1
        try:
            output = fn(runner, *args, **kwargs)
        finally:
            self._depth = 0
            end = time.perf_counter_ns()
            self._phase = (_IDLE, end)
            if record is not None:
                record.phase(_IDLE, end, self.wave)
        observer = self.observer
        if observer is not None:
            observer.end_wave(self.wave)
        opened = self._open
        if opened is not None:
            self._open = None
            try:
                self._finish_sampled(opened, output, start, end)
            except Exception:  # noqa: BLE001
                self.errors.record("sample_end")
        return output

    # -- internals ----------------------------------------------------------------------------
    def _prepare_step(self, runner: Any) -> None:
        """Start streaming on the first wave; flush a wave that never reached sample_tokens."""
        try:
            if self.streamer is None:
                self._start_streamer(runner)
            opened = self._open
            if opened is not None:
                self._open = None
                self._emit(opened, 0, 0, None, False)
        except Exception:  # noqa: BLE001
            self.errors.record("step_begin")

    def _finish_sampled(self, opened: OpenWave, output: Any, start: int, end: int) -> None:
        offset = start - opened[1]
        tokens, kept = sampled_counts(output, self._runner)
        get_output = getattr(output, "get_output", None) if tokens is None else None
        detectors = self.detectors
        if get_output is None or not callable(get_output):
            self._emit(opened, end - start, offset, tokens, True, output, self._runner, kept)
            if detectors is not None:
                detectors.on_output(opened[0], self._runner, output)
            return

        # Async output (GPU/NPU runners): token lists exist only once get_output() resolves,
        # which the worker calls right after. Count them then, without forcing a sync here.
        def resolved_get_output(*a: Any, **kw: Any) -> Any:
            result = get_output(*a, **kw)
            try:
                # no trim of drafts past a stop here: by now the runner's request states
                # may have moved on (async scheduling), so every returned token counts; the
                # per-request counts are taken now, before the scheduler cuts any list
                tokens, kept = sampled_counts(result)
                self._emit(opened, end - start, offset, tokens, True, result, None, kept)
                if detectors is not None:
                    detectors.on_output(opened[0], self._runner, result)
            except Exception:  # noqa: BLE001
                self.errors.record("async_output")
            return result

        output.get_output = resolved_get_output

    def _emit(
        self,
        opened: OpenWave,
        sample_ns: int,
        sample_offset_ns: int,
        tokens: int | None,
        sampled: bool,
        output: Any = None,
        runner: Any = None,
        kept: Any = None,
    ) -> None:
        streamer = self.streamer
        if streamer is None:
            return
        wave, start, execute_ns, schedule = opened
        num_reqs, prefill_reqs, decode_reqs, prefill_tokens, decode_tokens, recompute = schedule
        streamer.offer(
            _new_tuple(
                WaveTuple,
                (
                    wave,
                    start + self._wall_offset_ns,
                    execute_ns,
                    sample_ns,
                    sample_offset_ns,
                    num_reqs,
                    prefill_reqs,
                    decode_reqs,
                    prefill_tokens,
                    decode_tokens,
                    tokens or 0,
                    num_reqs == 0,
                    sampled,
                    recompute,
                ),
            )  # fmt: skip
        )
        if self.membership is not None:
            self.membership.on_wave(wave, output, tokens, kept)

    # -- sampling detectors and live config ----------------------------------------------------
    def on_logits(self, logits: Any, rows_per_req: list[int] | None) -> None:
        """Called by the sampler decorators with the logits about to be sampled."""
        detectors = self.detectors
        if detectors is None or self.logits_checked or logits is None:
            return
        try:
            detectors.on_logits(self.wave, self._runner, logits, rows_per_req)
        except Exception:  # noqa: BLE001
            self.errors.record("detectors_logits")

    def _build_detectors(self, rank: guard_pb2.RankInfo) -> None:
        from guard.detectors.evidence import EvidenceDumper
        from guard.detectors.suite import DetectorSuite

        config = self.config.detectors
        old, self.detectors = self.detectors, None
        if old is not None:
            old.close()
        suite = DetectorSuite(
            config,
            self.incidents,
            EvidenceDumper(
                config.dump, rank.run_id, f"dp{rank.dp_rank}tp{rank.tp_rank}pp{rank.pp_rank}"
            ),
            report_tokens=rank.tp_rank == 0,
            probe=self.offer_probe,
        )
        self.wants_logits = suite.needs_logits
        if suite.needs_logits or suite.needs_output:
            self.detectors = suite

    def _apply_stamp(self, stamp: tuple) -> None:
        """A config change stamped on this wave's scheduler output (see guard/reload.py)."""
        generation, config_json, error, restart = stamp
        if generation <= self.config_generation:
            return
        self.config_generation = generation
        run_id = self._rank.run_id if self._rank is not None else "run"
        if error:
            self.incidents.report(
                "config_reload_failed", "error", f"config edit refused, old config kept: {error}"[:1000],
                evidence={"generation": generation, "error": error}, incident_id=f"{run_id}:config:{generation}",
            )  # fmt: skip
            log.error("config_reload_refused", generation=generation, wave=self.wave, error=error)
            return
        self.config = config_from_json(config_json)
        self.incidents.reconfigure(self.config.incidents)
        if self._rank is not None:
            self._build_detectors(self._rank)
        self.offer_probe("config_generation", float(generation), {})
        if restart:
            self.incidents.report(
                "config_needs_restart", "warning",
                f"changed keys need a restart and were not applied: {', '.join(restart)}",
                evidence={"generation": generation, "keys": list(restart)},
                incident_id=f"{run_id}:config-restart:{generation}",
            )  # fmt: skip
        log.info(
            "config_reloaded", generation=generation, wave=self.wave, needs_restart=list(restart)
        )

    def _queue_incident(self, incident: guard_pb2.Incident) -> None:
        streamer = self.streamer
        if streamer is None:
            with self._early_lock:
                streamer = self.streamer
                if streamer is None:
                    self._early_incidents.append(incident)
                    return
        streamer.offer_incident(incident)

    def offer_probe(self, name: str, value: float, labels: dict[str, str]) -> None:
        streamer = self.streamer
        if streamer is None:
            with self._early_lock:
                streamer = self.streamer
                if streamer is None:
                    self._early_probes.append((name, value, labels))
                    return
        streamer.offer_probe(name, value, labels)

    def _probe_snapshot(self) -> list[tuple[str, float, dict[str, str]]]:
        detectors = self.detectors
        if detectors is not None:
            try:
                detectors.flush_idle()  # a finding left queued when the engine went idle
            except Exception:  # noqa: BLE001
                self.errors.record("detectors_idle_flush")
        found = detectors.probe_values() if detectors is not None else []
        return [*identity.readings(), *found]  # build_info, attach points: every heartbeat

    def heartbeat(self) -> HeartbeatState:
        """What this rank is doing right now; called on the streamer thread."""
        now = time.perf_counter_ns()
        self._wall_offset_ns = time.time_ns() - now
        phase, since = self._phase
        return HeartbeatState(self.wave, phase, now - since)

    def _start_streamer(self, runner: Any) -> None:
        config = self.config
        rank = self._describe_rank(runner)
        try:
            security = config.transport.client_security()
        except ValueError as exc:  # checked at start-up; a file may have gone since
            log.error("sidecar_transport_unusable", error=str(exc))
            security = None
        streamer = self._streamer_factory(
            config.sidecar,
            rank,
            buffer_size=config.buffer_size,
            batch_max=config.batch_max,
            flush_interval_s=config.flush_interval_ms / 1000.0,
            heartbeat_interval_s=config.heartbeat_interval_s,
            max_backoff_s=config.reconnect_max_backoff_s,
            heartbeat_source=self.heartbeat,
            batch_filler=chain_fillers(
                self.observer.fill_batch if self.observer is not None else None,
                self._start_membership(rank),
            ),
            error_counter=lambda: self.errors.total,
            hits_source=self.incidents.hits_snapshot,
            probe_source=self._probe_snapshot,
            spool=IncidentSpool(
                config.incidents.spool_dir, rank.run_id, rank.pid, config.incidents.spool_max_bytes
            ),
            **({"security": security} if security is not None else {}),
        )
        self._rank = rank
        self._start_live_record(rank)
        self._build_detectors(rank)
        if hasattr(streamer, "offer_probe"):
            streamer.offer_probe("config_generation", float(self.config_generation), {})
        with self._early_lock:
            for incident in self._early_incidents:
                streamer.offer_incident(incident)
            for probe in self._early_probes:
                streamer.offer_probe(*probe)
            self._early_incidents, self._early_probes = [], []
            self.streamer = streamer
        streamer.start()
        log.info(
            "guard_streaming",
            sidecar=config.sidecar,
            run_id=rank.run_id,
            engine=rank.engine,
            dp=rank.dp_rank,
            tp=rank.tp_rank,
            pp=rank.pp_rank,
            runner=rank.runner,
        )

    def _start_membership(self, rank: guard_pb2.RankInfo):
        """Request membership on tp0 (guard/request_membership.py); its batch filler."""
        if self.config.request_traces and rank.tp_rank == 0:
            self.membership = RequestMembership(
                self.config.buffer_size, on_error=self.errors.record
            )
            return self.membership.fill_batch
        return None

    def _start_live_record(self, rank: guard_pb2.RankInfo) -> None:
        if not self.config.liveness_record:
            return
        record = LivenessRecord.create(
            self.config.liveness_dir, rank.run_id, rank.dp_rank, rank.pp_rank, rank.tp_rank
        )
        tracker = getattr(self.observer, "tracker", None)
        if tracker is not None:
            tracker.record = record
        self.live_record = record

    def close(self) -> None:
        if self.live_record is not None:
            self.live_record.close()
        if self.detectors is not None:
            try:
                self.detectors.close()
            except Exception:  # noqa: BLE001
                self.errors.record("detectors_close")
        opened, self._open = self._open, None
        if opened is not None:
            self._emit(opened, 0, 0, None, False)
        if self.streamer is not None:
            self.streamer.stop()
