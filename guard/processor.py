"""Per-process wave accounting: what the step and sample decorators call when the guard is on.

One `GuardProcessor` lives in each worker process. The step decorator opens a wave around
`execute_model`, the sample decorator closes it around `sample_tokens`, and the finished wave
goes to the streamer as a plain tuple. The wrapped method's own result and exceptions pass
through untouched; anything that goes wrong in the guard's own code is caught, counted and
logged at a bounded rate, and the engine carries on.

The processor is a minimal shared core, in the manner of vLLM's Model Runner V2: it counts
waves and fans out to a list of wave observers through one protocol (`guard/wave/observers.py`):
the detectors, the collectives observer, probes. A live config change riding on the wave's
schedule (hot reload) is applied first, before any observer sees the wave. The streamer is
built here at start-up with one batch-filler protocol (the processor itself and the incident
reporter) and started as soon as the first wave names the rank.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog

from guard.config.reload import LiveConfig
from guard.config.runtime_guard import RUN_ID_ENV, GuardConfig
from guard.detectors.host import DetectorHost
from guard.stream import identity, placement
from guard.stream.evidence import RankEvidence
from guard.stream.reporter import IncidentReporter
from guard.stream.spool import IncidentSpool
from guard.stream.streamer import HeartbeatState, Streamer, WaveTuple
from guard.wave.errors import ErrorBudget
from guard.wave.observers import Observers
from guard.wave.request_membership import RequestMembership
from guard.wave.schedule import (
    EMPTY_SCHEDULE,
    PrefillTracker,
    ScheduleFields,
    ScheduleSummary,
    read_sampled,
    read_schedule,
)
from telemetry.wire.liveness_record import LivenessRecord
from telemetry.wire.proto import guard_pb2
from telemetry.wire.wave_ring import RingWriter, ring_path

if TYPE_CHECKING:
    from guard.detectors.suite import DetectorSuite

log = structlog.get_logger("ascend_guard.processor")

RankDescriber = Callable[[Any], guard_pb2.RankInfo]


# A wave between execute_model and sample_tokens: (wave, start_perf_ns, execute_ns, schedule,
# the schedule's fields as read, None for a dummy wave). A plain tuple: this is built on every
# step, on the engine thread.
OpenWave = tuple[int, int, int, ScheduleSummary, ScheduleFields | None]

_IDLE = "idle"
_EXECUTE = "execute_model"
_SAMPLE = "sample_tokens"
_new_tuple = tuple.__new__  # builds a WaveTuple without the Python-level __new__ frame


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
        self.errors = ErrorBudget(config.error_log_per_minute)
        self.wave = 0
        self._open: OpenWave | None = None
        self._prefill = PrefillTracker()
        self._depth = 0
        # (phase, since perf_counter_ns), replaced as a whole so the heartbeat reads a pair
        self._phase: tuple[str, int] = (_IDLE, time.perf_counter_ns())
        # wall clock = perf_counter_ns + offset; refreshed by the streamer thread's heartbeat
        self._wall_offset_ns = time.time_ns() - time.perf_counter_ns()
        self.logits_checked = False  # set while a verify sampler runs: skip its inner sampler
        self._runner: Any = None
        self._rank: guard_pb2.RankInfo | None = None
        self.incidents = IncidentReporter(
            config.incidents,
            run_id=run_id or config.run_id or os.environ.get(RUN_ID_ENV) or uuid.uuid4().hex[:16],
            current_wave=lambda: self.wave,
            sink=self._queue_incident,
        )
        # live config: a stamp on the wave's schedule applies before any observer sees it
        self.live_config = LiveConfig(
            self.incidents, self._config_changed, self.offer_probe, self._run_id
        )
        # the wave observers: the detectors (built once the rank is known), then collectives
        # and probes
        self.detector_host = DetectorHost(self.incidents, self.offer_probe, self.errors.record)
        self.observers = Observers(self.errors.record)
        self.observers.add(self.detector_host)  # it calls observers.refresh on a rebuild
        # phase and collective in shared memory, for the sidecar (None = off)
        self.live_record: LivenessRecord | None = None
        # the wave ring the sidecar drains (None: waves go to the streamer)
        self.ring: RingWriter | None = None
        self.evidence: RankEvidence | None = None
        # request membership per wave, on the rank that owns scheduling (None = off); an
        # observer from the start of streaming (its on_record hook)
        self.membership: RequestMembership | None = None
        try:
            security = config.transport.client_security()
        except ValueError as exc:  # checked at start-up; a file may have gone since
            log.error("sidecar_transport_unusable", error=str(exc))
            security = None
        # built now, started by the first wave; what is offered before waits in its buffers
        self.streamer: Streamer = streamer_factory(
            config.sidecar,
            buffer_size=config.buffer_size,
            batch_max=config.batch_max,
            flush_interval_s=config.flush_interval_ms / 1000.0,
            heartbeat_interval_s=config.heartbeat_interval_s,
            max_backoff_s=config.reconnect_max_backoff_s,
            fillers=[self, self.incidents],
            **({"security": security} if security is not None else {}),
            # waves in the ring: batches still follow them, for what the fillers add per wave
            **({"progress": self._wave_count} if config.wave_ring else {}),
        )
        self.streaming = False
        self.streamer.offer_probe("config_generation", float(self.config_generation), {})

    # -- what the decorators and tests read ---------------------------------------------------
    @property
    def wants_logits(self) -> bool:
        return self.detector_host.wants_logits

    @property
    def detectors(self) -> DetectorSuite | None:
        return self.detector_host.suite

    @property
    def config_generation(self) -> int:
        return self.live_config.generation

    def add_observer(self, observer: Any) -> None:
        """Add a wave observer (any subset of `guard.wave.observers.WaveObserver`'s hooks)."""
        self.observers.add(observer)

    # -- decorator entry points ---------------------------------------------------------------
    def run_step(self, fn: Callable[..., Any], runner: Any, args: tuple, kwargs: dict) -> Any:
        """Run `execute_model` and open (or, when it returns output itself, finish) a wave."""
        if self._depth:  # an overriding subclass calling its decorated base: count once
            return fn(runner, *args, **kwargs)
        # Counted first and unconditionally: wave N must name the same step on every rank.
        self.wave = wave = self.wave + 1
        if not self.streaming or self._open is not None:
            self._prepare_step(runner)
        self._runner = runner
        observers = self.observers
        for hook in observers.begin_wave_hooks:  # walked here: no dispatch frame (observers.py)
            try:
                hook(wave)
            except Exception:  # noqa: BLE001 - never break the step
                self.errors.record("observer_begin_wave")
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
                schedule, fields = EMPTY_SCHEDULE, None
            else:
                scheduler_output = args[0] if args else kwargs.get("scheduler_output")
                fields = read_schedule(scheduler_output)  # read once, for all below
                if fields.stamp is not None:  # applied on every rank at this wave, before
                    self._apply_stamp(fields.stamp, wave)  # its sampling and its observers
                for hook in observers.on_schedule_hooks:  # the detectors: finished, drafts
                    try:
                        hook(wave, scheduler_output)
                    except Exception:  # noqa: BLE001
                        self.errors.record("observer_on_schedule")
                schedule = self._prefill.summarize_fields(fields, scheduler_output)
            opened = (wave, start, end - start, schedule, fields)
            if output is None:
                self._open = opened  # sample_tokens finishes this wave
            else:
                tokens, kept, read = read_sampled(output, runner)
                self._emit(opened, 0, 0, tokens, False, output, kept)
                self._run_hooks(
                    observers.on_output_hooks, "observer_on_output", wave, runner, output, read
                )
                self._run_hooks(observers.end_wave_hooks, "observer_end_wave", wave)
        except Exception:  # noqa: BLE001
            self.errors.record("step_end")
        return output

    def run_sample(self, fn: Callable[..., Any], runner: Any, args: tuple, kwargs: dict) -> Any:
        """Run `sample_tokens` and finish the open wave with its timing and sampled tokens."""
        if self._depth:
            return fn(runner, *args, **kwargs)
        start = time.perf_counter_ns()
        self._phase = (_SAMPLE, start)
        wave = self.wave
        record = self.live_record
        if record is not None:
            record.phase(_SAMPLE, start, wave)
        self._depth = 1
        try:
            output = fn(runner, *args, **kwargs)
        finally:
            self._depth = 0
            end = time.perf_counter_ns()
            self._phase = (_IDLE, end)
            if record is not None:
                record.phase(_IDLE, end, wave)
        observers = self.observers
        for hook in observers.end_wave_hooks:
            try:
                hook(wave)
            except Exception:  # noqa: BLE001
                self.errors.record("observer_end_wave")
        opened = self._open
        if opened is None:
            return output
        self._open = None
        try:
            offset = start - opened[1]
            tokens, kept, read = read_sampled(output, self._runner)
            if (
                tokens is None
                and callable(getattr(output, "get_output", None))
                and self._fetches_output()
            ):
                self._finish_on_get_output(opened, output, end - start, offset)
                return output
            self._emit(opened, end - start, offset, tokens, True, output, kept)
            for hook in observers.on_output_hooks:  # _run_hooks, in line: the usual wave's path
                try:
                    hook(opened[0], self._runner, output, read)
                except Exception:  # noqa: BLE001
                    self.errors.record("observer_on_output")
        except Exception:  # noqa: BLE001
            self.errors.record("sample_end")
        return output

    # -- internals ----------------------------------------------------------------------------
    def _prepare_step(self, runner: Any) -> None:
        """Start streaming on the first wave; flush a wave that never reached sample_tokens."""
        try:
            if not self.streaming:
                self._start_streamer(runner)
            opened = self._open
            if opened is not None:
                self._open = None
                self._emit(opened, 0, 0, None, False)
        except Exception:  # noqa: BLE001
            self.errors.record("step_begin")

    def _apply_stamp(self, stamp: Any, wave: int) -> None:
        """A live config change rides on this wave's schedule (guard/config/reload.py). It may
        rebuild the detectors' suite, before the observers' hooks are read for this wave: the
        new suite sees the wave's schedule, and the closed one does not."""
        try:
            self.live_config.apply(stamp, wave)
        except Exception:  # noqa: BLE001
            self.errors.record("live_config")

    def _run_hooks(self, hooks: tuple, where: str, *args: Any) -> None:
        """Call each hook; one that raises is counted under `where` and the others still run.
        The usual wave's paths walk their tuples in line instead (one frame less each): a step
        that returns its output itself and async output come here."""
        for hook in hooks:
            try:
                hook(*args)
            except Exception:  # noqa: BLE001
                self.errors.record(where)

    def _fetches_output(self) -> bool:
        """Whether vLLM fetches this rank's async output (calls its `get_output`). Its
        executors fetch the output of one rank only, the first TP rank of the last PP stage
        (`MultiprocExecutor._get_output_rank`); on every other TP rank MRV2's `AsyncOutput` is
        dropped unread, so a wave waiting for it would never be sent. Those ranks send the wave
        when `sample_tokens` returns, without token counts (the output rank counts them)."""
        rank = self._rank
        return rank is None or rank.tp_rank == 0

    def _finish_on_get_output(
        self, opened: OpenWave, output: Any, sample_ns: int, offset: int
    ) -> None:
        """Async output (GPU/NPU runners): token lists exist only once get_output() resolves,
        which the worker calls right after. Count them then, without forcing a sync here."""
        get_output = output.get_output

        def resolved_get_output(*a: Any, **kw: Any) -> Any:
            result = get_output(*a, **kw)
            try:
                # no trim of drafts past a stop here: by now the runner's request states
                # may have moved on (async scheduling), so every returned token counts; the
                # per-request counts are taken now, before the scheduler cuts any list
                tokens, kept, read = read_sampled(result)
                self._emit(opened, sample_ns, offset, tokens, True, result, kept)
                self._run_hooks(
                    self.observers.on_output_hooks,
                    "observer_on_output",
                    opened[0],
                    self._runner,
                    result,
                    read,
                )
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
        kept: Any = None,
    ) -> None:
        if not self.streaming:
            return
        streamer = self.streamer
        wave, start, execute_ns, schedule, fields = opened
        num_reqs, prefill_reqs, decode_reqs, prefill_tokens, decode_tokens, recompute = schedule
        record = (
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
        )
        ring = self.ring
        if ring is not None:
            ring.write(record)
        else:
            streamer.offer(_new_tuple(WaveTuple, record))
        for hook in self.observers.on_record_hooks:  # request membership, on tp0
            try:
                hook(wave, fields, output, tokens, kept)
            except Exception:  # noqa: BLE001 - never break the step
                self.errors.record("observer_on_record")

    # -- sampling detectors and live config ----------------------------------------------------
    def on_logits(
        self, logits: Any, rows_per_req: list[int] | None, req_ids: list[str] | None = None
    ) -> None:
        """Called by the sampler decorators with the logits about to be sampled; `req_ids`:
        the request id of each row when the sampler is handed its batch (MRV2), else the
        detectors read them off the runner (V1's `input_batch`)."""
        if self.logits_checked or logits is None:
            return
        suite = self.detector_host.suite  # straight to it: one frame less in the sampler
        if suite is None:
            return
        try:
            suite.on_logits(self.wave, self._runner, logits, rows_per_req, req_ids)
        except Exception:  # noqa: BLE001
            self.errors.record("detectors_logits")

    def _config_changed(self, config: GuardConfig) -> None:
        """A live config change (guard/config/reload.py), applied at this wave on every rank."""
        self.config = config
        self.incidents.reconfigure(config.incidents)
        if self._rank is not None:
            self.detector_host.build(config.detectors, self._rank)

    def _wave_count(self) -> int:
        return self.wave

    def _run_id(self) -> str:
        return self._rank.run_id if self._rank is not None else "run"

    def _queue_incident(self, incident: guard_pb2.Incident) -> None:
        self.streamer.offer_incident(incident)

    def offer_probe(self, name: str, value: float, labels: dict[str, str]) -> None:
        self.streamer.offer_probe(name, value, labels)

    def fill_batch(self, batch: guard_pb2.Batch, with_heartbeat: bool) -> None:
        """Streamer thread: this rank's heartbeat, error count, readings, then the observers'."""
        if with_heartbeat:
            self.heartbeat().fill(batch)
            if self.evidence is not None:
                self.evidence.keep_bounded()
            for name, value, labels in identity.readings():  # build_info, attach points
                batch.probes.add(name=name, labels=labels, value=value)
        self.observers.fill_batch(batch, with_heartbeat)  # detectors, collectives, membership
        batch.guard_errors_total += self.errors.total

    def heartbeat(self) -> HeartbeatState:
        """What this rank is doing right now; called on the streamer thread."""
        now = time.perf_counter_ns()
        self._wall_offset_ns = time.time_ns() - now
        phase, since = self._phase
        return HeartbeatState(self.wave, phase, now - since)

    def _start_streamer(self, runner: Any) -> None:
        config = self.config
        rank = self._describe_rank(runner)
        self._rank = rank
        self._start_membership(rank)
        self._start_live_record(rank)
        self._start_ring(rank)  # before the stream: the sidecar opens it when the stream opens
        self.detector_host.build(config.detectors, rank)
        # the device this thread opened and the served model, for the sidecar's workload
        # labels and verdicts (read here: the current device is per thread)
        try:
            self.streamer.device = placement.device_of(runner)
            self.streamer.model_name = placement.model_name_of(runner)
        except Exception:  # noqa: BLE001 - labels must never stop the guard
            self.errors.record("placement")
        self.streamer.start(
            rank,
            IncidentSpool(
                config.incidents.spool_dir, rank.run_id, rank.pid, config.incidents.spool_max_bytes
            ),
        )
        self.streaming = True
        log.info(
            "guard_streaming",
            sidecar=config.sidecar,
            run_id=rank.run_id,
            engine=rank.engine,
            dp=rank.dp_rank,
            tp=rank.tp_rank,
            pp=rank.pp_rank,
            runner=rank.runner,
            device=getattr(self.streamer, "device", ""),
            model_name=getattr(self.streamer, "model_name", ""),
        )

    def _start_membership(self, rank: guard_pb2.RankInfo) -> None:
        """Request membership on tp0 (guard/wave/request_membership.py); fill_batch sends it."""
        if self.config.request_traces and rank.tp_rank == 0:
            self.membership = RequestMembership(
                self.config.buffer_size, on_error=self.errors.record
            )
            self.add_observer(self.membership)

    def _start_live_record(self, rank: guard_pb2.RankInfo) -> None:
        if not self.config.liveness_record:
            return
        record = LivenessRecord.create(
            self.config.liveness_dir, rank.run_id, rank.dp_rank, rank.pp_rank, rank.tp_rank
        )
        self.observers.attach_record(record)  # the collectives' tracker writes its entries
        self.live_record = record
        if record is not None:  # the stack signal and facts for hang bundles, next to it
            self.evidence = RankEvidence.install(record.path)

    def _start_ring(self, rank: guard_pb2.RankInfo) -> None:
        config = self.config
        if not config.wave_ring:
            return
        path = ring_path(config.liveness_dir, rank.run_id, rank.dp_rank, rank.pp_rank, rank.tp_rank)
        try:
            self.ring = RingWriter.create(
                path,
                slots=config.wave_ring_slots,
                slot_bytes=config.wave_ring_slot_bytes,
                rank=(rank.dp_rank, rank.tp_rank, rank.pp_rank),
            )
        except (OSError, ValueError) as exc:  # waves then go over gRPC, as without the ring
            log.warning("wave_ring_unavailable", path=path, error=str(exc))

    def close(self) -> None:
        if self.live_record is not None:
            self.live_record.close()
        if self.evidence is not None:
            self.evidence.close()
        self.observers.close()  # the detectors drain their queued waves
        opened, self._open = self._open, None
        if opened is not None:
            self._emit(opened, 0, 0, None, False)
        if self.streaming:
            self.streamer.stop()
        if self.ring is not None:  # after the stream: the sidecar holds the mapping to drain it
            self.ring.close()
