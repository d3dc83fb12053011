"""All sampling detectors of one rank, driven by the processor at three points of a wave.

    on_schedule(wave, scheduler_output)   execute_model entry: finished requests, drafts
    on_logits(wave, runner, logits, rows) Sampler / RejectionSampler entry (inside sample_tokens)
                                          (MRV2's sampler also hands over its batch's request ids)
    on_output(wave, runner, output)       the runner's output: token lists per request

Each hit goes to the `IncidentReporter` (caps, backoff, counting). Only ranks that sample run
the output-side detectors' reports: every TP rank of a V1 runner samples the same tokens, so
the reports of non-driver ranks are left to the driver (tp 0) to avoid N copies of one finding;
logits checks run on every rank, since a NaN may appear on one rank only."""

from __future__ import annotations

import collections
import contextlib
import math
import threading
import time
from typing import Any

from guard.config.detectors import DetectorsConfig
from guard.detectors import compiled
from guard.detectors import logits as logit_checks
from guard.detectors.evidence import EvidenceDumper, request_kv_blocks
from guard.detectors.findings import repeat_finding, spec_finding, stats_finding
from guard.detectors.runner_reads import request_ids, requests_in_rows, vocab_size
from guard.detectors.spec import AcceptanceTracker, Judged
from guard.detectors.token_log import LoggedFinish, LoggedWave, all_in_range, overdue_waves
from guard.detectors.tokens import RepeatDetector, out_of_range, rows_out_of_range
from guard.stream.reporter import IncidentReporter
from guard.wave.schedule import WaveTokens

# a token batch left queued this long with no new wave is screened by the streamer thread, so a
# finding does not wait for the next request
IDLE_FLUSH_S = 1.0


# host logits checks made with torch (the compiled pass not loaded yet, or logits it does not
# take) are read this many waves at a time: one sum over all their row maxima, finite in the
# common case (`DetectorSuite._read_host_checks`)
HOST_READ_WAVES = 16


# host stats waves queued for the streamer thread; past this many the engine thread reads them
HOST_STATS_QUEUED = 8


# a wave's host row maxima kept to be read later: (wave, row maxima, request ids as of the
# wave, rows per request on the verify path)
DeferredRows = tuple[int, Any, list[str], list[int] | None]


class DetectorSuite:
    def __init__(
        self,
        config: DetectorsConfig,
        reporter: IncidentReporter,
        dumper: EvidenceDumper,
        *,
        report_tokens: bool = True,
        probe=None,
        load_in_background: bool = False,
    ) -> None:
        """`load_in_background`: token_repeat's compiled kernel loads on a thread of its own
        (in a worker, so that no wave waits for it); else the constructor loads it."""
        self.config = config
        self.reporter = reporter
        self.dumper = dumper
        self._probe = probe or (lambda name, value, labels: None)
        # A rank that does not report token incidents (TP rank > 0 sees the driver's tokens)
        # keeps no token_repeat or acceptance state; its evidence bundles carry no tokens (the
        # driver's do), and it exports no acceptance readings (the driver does).
        self.repeat = (
            RepeatDetector(config.token_repeat, load_in_background=load_in_background)
            if config.token_repeat.enabled and report_tokens
            else None
        )
        self.spec = (
            AcceptanceTracker(config.spec_acceptance)
            if config.spec_acceptance.enabled and report_tokens
            else None
        )
        # a worker's full token batches are screened by the streamer thread (`screen_ready`),
        # unless a finding's evidence needs the runner as of its batch (`action: dump`)
        self.screen_on_streamer = load_in_background and config.token_repeat.action != "dump"
        # The token detectors' waves and finished requests, in order, until `_hand_over` gives
        # them to token_range and token_repeat. In a worker the streamer thread does that with
        # each batch it sends (`screen_ready`), so that the engine thread's share of a wave is
        # one append: a hand-over there was the engine thread's largest single cost
        # (bench/README.md, the token log's hand-over). The engine thread hands
        # over itself only when `OVERDUE_BATCHES` batches wait (the streamer is not keeping
        # up), which bounds the log. Elsewhere, or when a finding's evidence reads the runner
        # as of its wave (`action: dump`), every wave, on the engine thread.
        self.logs_tokens = bool(self.repeat) or config.token_range.enabled
        dumps = "dump" in (config.token_repeat.action, config.token_range.action)
        self._batches_tokens = load_in_background and not dumps
        self._hand_over_at = overdue_waves(1) if self._batches_tokens else 1
        # waves in the log (a streamer's idle hand-over racing a wave only moves the next one)
        self._logged_waves = 0
        self._token_log: collections.deque[LoggedWave | LoggedFinish] = collections.deque()
        self.check_finite = config.logits_finite.enabled
        if self.check_finite and self.repeat is None:  # else the repeat detector loads them
            if load_in_background:
                compiled.load_in_background()
            else:
                with contextlib.suppress(Exception):  # torch checks the rows meanwhile
                    compiled.load()
        self.stats_every = config.logits_stats.every_n_waves if config.logits_stats.enabled else 0
        self.needs_logits = self.check_finite or bool(self.stats_every)
        self.needs_output = bool(self.repeat or self.spec or config.token_range.enabled)
        self.vocab_size: int | None = None
        self.spec_method = ""
        self._drafts: dict[str, list[int]] = {}
        self._drafts_wave = 0
        self._pending: list[logit_checks.PendingCheck] = []
        # host row maxima not read yet (the engine thread's, read by either thread)
        self._unread: list[DeferredRows] = []
        # known from the first wave: its logits are on the host, and nothing asks for more
        # than a report; from then on a wave is checked the host way (`_check_host_rows`)
        self._on_host = False
        # the compiled host row check: None until the kernels are in, False when the logits
        # are not what it takes
        self._row_check: Any = None
        # host stats waves' rows waiting for the streamer thread: (wave, a copy of the rows)
        self._host_stats: collections.deque[tuple[int, Any]] = collections.deque()
        self._kept_ids: list[str] = []  # the request ids the deferred waves share
        # the engine thread's token batches and the streamer thread's idle flush
        self._tokens_lock = threading.Lock()
        self._last_tokens = time.monotonic()

    # -- execute_model entry ----------------------------------------------------------------
    def on_schedule(self, wave: int, scheduler_output: Any) -> None:
        finished = getattr(scheduler_output, "finished_req_ids", None)
        if finished:
            if self.repeat is not None:  # after their last tokens, in the log's order
                self._token_log.append((wave, tuple(finished)))
            if self.spec is not None:
                with self._tokens_lock:
                    self.spec.forget_requests(finished)
            self.reporter.forget_requests(finished)
        if self.spec is not None:
            drafts = getattr(scheduler_output, "scheduled_spec_decode_tokens", None)
            self._drafts = drafts or {}
            self._drafts_wave = wave

    # -- sampler entry ----------------------------------------------------------------------
    def on_logits(
        self,
        wave: int,
        runner: Any,
        logits: Any,
        rows_per_req: list[int] | None,
        batch_ids: list[str] | None = None,
    ) -> None:
        """`batch_ids`: the request id of each row, from the batch the sampler was handed (an
        MRV2 runner has no batch of its own to read them from; its batch's list is built for
        the step and never changed after, so it is kept, not copied). None: read off the
        runner (`runner_reads.request_ids`)."""
        stats_wave = bool(self.stats_every) and wave % self.stats_every == 0
        if self._on_host:  # every wave after the first on a CPU engine
            checked = None
            if self.check_finite:
                checked = self._check_host_rows(wave, runner, logits, rows_per_req, batch_ids)
            if stats_wave:
                self._queue_host_stats(wave, logits, checked)
            return
        if self.vocab_size is None:
            self.vocab_size = vocab_size(runner, logits)
        row_max = logit_checks.row_max(logits) if self.check_finite else None
        stats = logit_checks.health_rows(logits) if stats_wave else None
        if row_max is None and stats is None:
            return
        config = self.config.logits_finite
        host, event = logit_checks.start_copy(row_max) if row_max is not None else (None, None)
        stats_host, stats_event = (
            logit_checks.start_copy(stats) if stats is not None else (None, None)
        )
        # on the host (no copy made) and reported only (no evidence from this wave's logits,
        # no gate): this wave is read now, and the next ones the host way
        on_host = event is None and stats_event is None and host is row_max and stats_host is stats
        if on_host and (
            not self.check_finite or (config.action == "report" and not config.sync_gate)
        ):
            self._on_host = True
            if stats is None:
                self._check_host_rows(wave, runner, logits, rows_per_req, batch_ids)
                return
        event = stats_event or event  # recorded last on the same stream: covers both copies
        keep_logits = config.action == "dump"
        # read in this wave (on the host, or the sync gate), the runner's request ids are
        # still this batch's: they are looked up only for a finding
        read_now = event is None or config.sync_gate
        req_ids = batch_ids
        if req_ids is None and not read_now:
            req_ids = request_ids(runner, requests_in_rows(rows_per_req, logits))
        check = logit_checks.PendingCheck(
            wave,
            host,
            event,
            req_ids,
            rows_per_req,
            logits if keep_logits else None,
            stats_host,
            runner if read_now or keep_logits else None,
        )
        if read_now:
            check.wait()  # the sync gate: the host waits for the copy (no-op without an event)
            self._resolve(check)
        else:
            self._pending.append(check)

    def _check_host_rows(
        self,
        wave: int,
        runner: Any,
        logits: Any,
        rows_per_req: list[int] | None,
        batch_ids: list[str] | None = None,
    ) -> Any:
        """A host wave's row check: the compiled pass, read at once (one integer back). Until
        the kernels are in, or for logits it does not take (bfloat16, a strided view), the
        torch row max, read with the next waves' (`_defer_host_check`). Returns the logits
        as the compiled pass read them (float32 rows in one block, no copy), else None."""
        row_check = self._row_check
        if row_check is None:  # not known yet: the kernels may have come in since
            row_check = self._row_check = self._host_row_check()
        if row_check:
            try:
                rows = logits.numpy()
                bad = row_check(rows)
            except (TypeError, RuntimeError):  # not float32 rows in one block: torch for good
                self._row_check = False
            else:
                if bad >= 0:  # rare: the row maxima, read in this wave
                    self._resolve(
                        logit_checks.PendingCheck(
                            wave,
                            logit_checks.row_max(logits),
                            None,
                            batch_ids,
                            rows_per_req,
                            None,
                            None,
                            runner,
                        )
                    )
                return rows
        self._defer_host_check(wave, runner, logit_checks.row_max(logits), rows_per_req, batch_ids)
        return None

    def _host_row_check(self) -> Any:
        """The compiled row check once the kernels are in (the waves kept for torch's read
        are read first, so findings keep their order), else None."""
        kernels = compiled.loaded()
        if kernels is None:
            return None
        if self._unread:
            self._read_host_checks()
        return kernels.logits.first_bad_row

    def _queue_host_stats(self, wave: int, logits: Any, checked: Any = None) -> None:
        """A stats wave on a host engine: a copy of its sampled rows goes to the streamer
        thread (`read_host_stats`), made from the row check's read of them when there is one
        (`checked`: no second slice and read of the tensor in this wave)."""
        if checked is None:
            rows = logit_checks.host_rows(logits)
        else:  # float32 rows in one block: the copy is too
            rows = checked[: logit_checks.STATS_ROWS].copy()
        self._host_stats.append((wave, rows))
        if len(self._host_stats) > HOST_STATS_QUEUED:  # the streamer is not keeping up
            self.read_host_stats(with_torch=True)

    def read_host_stats(self, with_torch: bool = False) -> None:
        """The queued host stats waves' readings, each probed and judged as of its own wave:
        one compiled call per wave. The streamer thread (with each batch) reads them only with
        the kernel; torch's ops (`with_torch`: the kernels are not in) run on the engine thread
        alone, when too many wait or at the close, since on another thread they slowed every
        later wave of a CPU engine (`logits_kernel.health_readings`)."""
        queued = self._host_stats
        kernels = compiled.loaded()
        if kernels is None and not with_torch:
            return
        while queued:
            try:
                wave, rows = queued.popleft()
            except IndexError:  # the other thread took the last one
                return
            if kernels is None:
                self._report_stats(wave, logit_checks.host_health_summary(rows))
                continue
            max_abs, entropy, healthy = kernels.logits.health_readings(rows)
            finite = healthy and math.isfinite(max_abs) and math.isfinite(entropy)
            self._report_stats(wave, (max_abs, entropy) if finite else None)

    def _defer_host_check(
        self,
        wave: int,
        runner: Any,
        row_max: Any,
        rows_per_req: list[int] | None,
        batch_ids: list[str] | None = None,
    ) -> None:
        """Keep a host wave's row maxima, with its request ids as of now, to be read with the
        next `HOST_READ_WAVES - 1` waves' (or by the streamer thread when the engine idles)."""
        if batch_ids is None:
            batch_ids = self._ids_as_of_now(runner, requests_in_rows(rows_per_req, row_max))
        deferred = (wave, row_max, batch_ids, rows_per_req)
        with self._tokens_lock:
            self._unread.append(deferred)
            full = len(self._unread) >= HOST_READ_WAVES
        if full:
            self._read_host_checks()

    def _ids_as_of_now(self, runner: Any, count: int) -> list[str]:
        """The batch's request ids, kept for a check read later: the previous wave's copy
        while the batch is the same (a pass of identity compares, no copy of 256 ids)."""
        ids = getattr(getattr(runner, "input_batch", None), "req_ids", None)
        kept = self._kept_ids
        if type(ids) is list and len(ids) == count and ids == kept:
            return kept
        self._kept_ids = request_ids(runner, count)
        return self._kept_ids

    def _read_host_checks(self) -> None:
        """Read the deferred host waves' row maxima: one sum over all of them, and each wave's
        own check only when that sum is not finite."""
        with self._tokens_lock:
            unread, self._unread = self._unread, []
        if not unread:
            return
        if logit_checks.all_finite([row_max for _, row_max, _, _ in unread]):
            return
        for wave, row_max, req_ids, rows_per_req in unread:
            self._resolve(
                logit_checks.PendingCheck(wave, row_max, None, req_ids, rows_per_req, None, None)
            )

    # -- output -----------------------------------------------------------------------------
    def on_output(
        self, wave: int, runner: Any, output: Any, tokens: WaveTokens | None = None
    ) -> None:
        """The wave's sampled tokens: `tokens` as the processor read them (`read_sampled`),
        or read here from `output` when not given or when its rows are not the request ids'."""
        if self._pending:
            self.resolve_ready()
        if not self.needs_output:
            return
        req_ids = getattr(output, "req_ids", None)
        if not req_ids:
            return
        if tokens is None or tokens.rows != len(req_ids):  # else the processor's read serves
            sampled = getattr(output, "sampled_token_ids", None)
            if not sampled or not isinstance(sampled, list):
                return
            if len(sampled) != len(req_ids):  # the rows past the request ids are left out
                count = min(len(sampled), len(req_ids))
                req_ids, sampled = req_ids[:count], sampled[:count]
            tokens = WaveTokens(sampled)  # read once at C speed: no Python pass per request
        if self.vocab_size is None:  # the first output: what the runner says of itself
            self.vocab_size = vocab_size(runner, None)
            if getattr(runner, "speculative_config", "") is None:
                self.spec = None  # no drafts will come: spec_acceptance has nothing to judge
        if self.logs_tokens:
            # the runner's request ids are a list of the wave's own (V1 hands a copy of its
            # batch's, MRV2 builds a batch per step): kept, not copied
            self._token_log.append((wave, req_ids, tokens))
            self._logged_waves += 1
            if self._logged_waves >= self._hand_over_at:
                self._hand_over(runner)
        if self.spec is not None and self._drafts and self._drafts_wave == wave:
            if not self.spec_method:
                config = getattr(runner, "speculative_config", None)
                self.spec_method = str(getattr(config, "method", "") or "unknown")
            with self._tokens_lock:
                judged = self.spec.add_wave(wave, req_ids, self._drafts, tokens)
            self._last_tokens = time.monotonic()
            self._report_spec(runner, judged)

    def _hand_over(self, runner: Any) -> None:
        """Give the logged waves to token_range and token_repeat, in order, and report what
        they find (each finding names its own wave). In a worker the streamer thread calls
        this with each batch and when the engine idles, and the engine thread only when the
        log is overdue; elsewhere, or with `action: dump`, the engine thread calls it every
        wave. `runner` is read only by a dump's evidence, whose waves are handed over as they
        come."""
        log = self._token_log
        repeats: list = []
        failed: Exception | None = None
        with self._tokens_lock:  # one consumer at a time; the engine thread only appends
            entries = [log.popleft() for _ in range(len(log))]
            self._logged_waves = 0
            self._last_tokens = time.monotonic()
            if self.repeat is not None:
                try:
                    repeats = self._queue_repeats(entries)
                except Exception as exc:  # noqa: BLE001 - raised below, after the range check
                    failed = exc
        waves = [entry for entry in entries if len(entry) == 3]
        if self._batches_tokens and waves:  # the engine thread's bound, for batches this size
            self._hand_over_at = overdue_waves(waves[-1][2].rows)
        vocab = self.vocab_size if self.config.token_range.enabled else 0
        if vocab and not all_in_range(waves, vocab):
            for wave, req_ids, tokens in waves:
                for row in rows_out_of_range(tokens, vocab):
                    self._out_of_range(wave, runner, req_ids[row], tokens.row(row), vocab)
        if repeats:
            self._report_repeats(runner, repeats)
        if failed is not None:  # token_repeat's kernel did not load: counted by the caller
            raise failed

    def _queue_repeats(self, entries: list[LoggedWave | LoggedFinish]) -> list:
        """token_repeat's share of a hand-over (under the lock): the waves queued in order,
        and a finished request forgotten only after its last tokens are in."""
        repeat = self.repeat
        screen_full = not self.screen_on_streamer
        found = []
        waves: list[LoggedWave] = []
        for entry in entries:
            if len(entry) == 3:
                waves.append(entry)
                continue
            if waves:
                found += repeat.add_waves(waves, screen_full=screen_full)
                waves = []
            for req_id in entry[1]:
                repeat.forget(req_id)
        if waves:
            found += repeat.add_waves(waves, screen_full=screen_full)
        return found

    def _out_of_range(self, wave: int, runner: Any, req_id: str, tokens, vocab: int) -> None:
        bad = out_of_range(tokens, vocab)
        self._hit(
            "token_range",
            "critical",
            wave,
            req_id,
            f"sampled id {bad[0]} outside the vocabulary [0, {vocab})",
            {"ids": bad[:16], "vocab_size": vocab},
            self.config.token_range.action,
            runner,
        )

    def _report_repeats(self, runner: Any, found) -> None:
        """A screened batch's findings, each with the wave it belongs to."""
        action = self.config.token_repeat.action
        for wave, req_id, finding in found:
            summary, evidence = repeat_finding(*finding)
            self._hit("token_repeat", "warning", wave, req_id, summary, evidence, action, runner)

    def _report_spec(self, runner: Any, found: list[Judged]) -> None:
        """A judged batch's windows found out of line, each with the wave it belongs to."""
        if not found:
            return
        action = self.config.spec_acceptance.action
        for wave, key, window, kind, baseline in found:
            summary, evidence = spec_finding(
                self.spec_method, self.spec.config, key, window, kind, baseline
            )
            self._hit("spec_acceptance", "warning", wave, key, summary, evidence, action, runner)

    # -- logits checks resolved after sampling ----------------------------------------------
    def resolve_ready(self, force: bool = False) -> None:
        pending = self._pending
        while pending and (force or pending[0].ready() or len(pending) > 2):
            check = pending.pop(0)
            if not check.ready():  # waiting on a done event is a sync too (sync debug mode)
                check.wait()
            self._resolve(check)

    def _resolve(self, check: logit_checks.PendingCheck) -> None:
        if check.stats is not None:
            self._report_stats(check.wave, logit_checks.health_summary(check.stats.tolist()))
        if check.host is None:
            return
        bad = logit_checks.bad_rows(check.host)
        if not bad:
            return
        req_ids = check.req_ids
        if req_ids is None:  # read in its own wave: the runner's list is still the batch's
            req_ids = request_ids(check.runner, requests_in_rows(check.rows_per_req, check.host))
        for req_id, rows in logit_checks.rows_to_requests(bad, req_ids, check.rows_per_req).items():
            evidence: dict[str, Any] = {
                "rows": rows[:16],
                "row_max": [float(check.host[r]) for r in rows[:4]],
            }
            if check.logits is not None:
                evidence.update(logit_checks.describe_row(check.logits[rows[0]]))
            self._hit(
                "logits_finite",
                "error",
                check.wave,
                req_id,
                f"non-finite logits in {len(rows)} row(s) of request {req_id}",
                evidence,
                self.config.logits_finite.action,
                check.runner,
                logits_row=check.logits[rows[0]] if check.logits is not None else None,
                row=rows[0],
            )

    def _report_stats(self, wave: int, summary: tuple[float, float] | None) -> None:
        """A stats wave's readings (None: no healthy row was sampled, so there is none)."""
        if summary is None:
            return
        max_abs, entropy = summary
        self._probe("logits_max_abs", max_abs, {})
        self._probe("logits_entropy_nats", entropy, {})
        limit = self.config.logits_stats.max_abs_limit
        if limit and max_abs >= limit:
            summary, evidence = stats_finding(max_abs, entropy, limit)
            self._hit("logits_stats", "warning", wave, "", summary, evidence, "report", None)

    # -- reporting --------------------------------------------------------------------------
    def _hit(
        self,
        type_: str,
        severity: str,
        wave: int,
        req_id: str,
        summary: str,
        evidence: dict[str, Any],
        action: str,
        runner: Any,
        *,
        logits_row: Any = None,
        row: int | None = None,
    ) -> None:
        actions = ["report"]
        if action == "dump" and self.reporter.would_report(type_, req_id):
            actions.append(self._dump(type_, wave, req_id, evidence, runner, logits_row, row))
        self.reporter.report(
            type_,
            severity,
            summary,
            wave=wave,
            request_id=req_id,
            evidence=evidence,
            actions=actions,
        )

    def _dump(self, type_, wave, req_id, evidence, runner, logits_row, row) -> str:
        tokens = None
        if self.repeat is not None:
            with self._tokens_lock:  # the streamer thread's idle flush may be screening
                tokens = self.repeat.recent_tokens(req_id) or None
        kv = request_kv_blocks(runner, req_id, row) if runner is not None else None
        return self.dumper.dump(
            type_,
            wave,
            req_id,
            meta={"evidence": evidence},
            tokens=tokens,
            logits_row=logits_row,
            kv_blocks=kv,
        )

    def probe_values(self) -> list[tuple[str, float, dict[str, str]]]:
        """Readings taken by the streamer thread with each heartbeat: nothing on the hot path."""
        spec = self.spec
        if spec is None or not spec.drafted_total:
            return []
        method = {"method": self.spec_method}
        return [
            ("spec_draft_tokens", float(spec.drafted_total), method),
            ("spec_accepted_tokens", float(spec.accepted_total), method),
            ("spec_acceptance_rate", spec.waves.rate, method),
        ]

    def screen_ready(self) -> None:
        """Streamer thread, with each batch: take the waves the engine thread logged since
        the last batch (token_range checks them, token_repeat queues them), then screen the
        queued token waves once they make a full batch. The kernel holds no GIL; the engine
        thread waits for the lock only when its wave ends during the screen."""
        if self._batches_tokens and self._token_log:
            self._hand_over(None)
        repeat = self.repeat
        if repeat is None or not repeat.batch_ready:
            return
        with self._tokens_lock:
            found = repeat.flush()
        self._report_repeats(None, found)

    def flush_idle(self, idle_s: float = IDLE_FLUSH_S) -> None:
        """Streamer thread: judge the token batches that have waited `idle_s` with no new wave."""
        if not self._batches_pending() or time.monotonic() - self._last_tokens < idle_s:
            return
        self._flush_batches()

    def _batches_pending(self) -> bool:
        return bool(
            self._unread
            or self._token_log
            or (self.repeat is not None and self.repeat.pending)
            or (self.spec is not None and self.spec.pending)
        )

    def _flush_batches(self, wait: bool = False) -> None:
        self._read_host_checks()
        self._hand_over(None)
        repeats, judged = [], []
        with self._tokens_lock:
            if self.repeat is not None:
                repeats = self.repeat.flush(wait)
            if self.spec is not None:
                judged = self.spec.flush()
        self._report_repeats(None, repeats)
        self._report_spec(None, judged)

    def close(self) -> None:
        self.resolve_ready(force=True)
        self.read_host_stats(with_torch=True)
        self._flush_batches(wait=True)
