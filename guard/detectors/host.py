"""The sampling detectors' lifecycle on one rank, as one wave observer.

Built once the first wave names the rank (the evidence directory and the reporting rank need
it), rebuilt when a live config change arrives, closed with the processor. The wave's schedule
and output go to the `DetectorSuite` straight from the processor (the host names the suite as
its `wave_delegate`, and calls `on_change` when it builds or closes one, so the processor's
hook tuples follow), as do the sampler decorators' logits. The host adds the detectors'
readings to each heartbeat batch.
"""

from __future__ import annotations

from collections.abc import Callable

from guard.config.detectors import DetectorsConfig
from guard.detectors.evidence import EvidenceDumper
from guard.detectors.suite import DetectorSuite
from guard.stream.reporter import IncidentReporter
from telemetry.wire.proto import guard_pb2

ProbeSink = Callable[[str, float, dict[str, str]], None]


class DetectorHost:
    def __init__(
        self, reporter: IncidentReporter, probe: ProbeSink, on_error: Callable[[str], None]
    ) -> None:
        self._reporter = reporter
        self._probe = probe
        self._on_error = on_error
        self.suite: DetectorSuite | None = None
        self.wants_logits = False  # read by the sampler decorators on every sample
        self.on_change: Callable[[], None] = lambda: None  # the suite was built or closed

    def build(self, config: DetectorsConfig, rank: guard_pb2.RankInfo) -> None:
        """(Re)build the suite for `config`; the old one drains and closes first."""
        old, self.suite = self.suite, None
        self.wants_logits = False
        if old is not None:
            self.on_change()
            old.close()
        suite = DetectorSuite(
            config,
            self._reporter,
            EvidenceDumper(
                config.dump, rank.run_id, f"dp{rank.dp_rank}tp{rank.tp_rank}pp{rank.pp_rank}"
            ),
            report_tokens=rank.tp_rank == 0,
            probe=self._probe,
            load_in_background=True,
        )
        if suite.needs_logits or suite.needs_output:
            self.suite = suite
            self.wants_logits = suite.needs_logits
            self.on_change()

    # -- wave observer hooks ----------------------------------------------------------------
    def wave_delegate(self) -> DetectorSuite | None:
        """Whose wave hooks stand for this observer's: the suite's (on_schedule, on_output)."""
        return self.suite

    def fill_batch(self, batch: guard_pb2.Batch, with_heartbeat: bool) -> None:
        """Streamer thread: a host engine's stats waves and the full token batches are read
        with every batch; the idle flush and the detectors' readings ride on heartbeat
        batches."""
        suite = self.suite
        if suite is None:
            return
        try:
            suite.read_host_stats()  # a host engine's stats waves, read off its thread
        except Exception:  # noqa: BLE001 - the rest of the batch still goes out
            self._on_error("detectors_host_stats")
        try:
            suite.screen_ready()  # the engine's full token batches, screened off its thread
        except Exception:  # noqa: BLE001 - the rest of the batch still goes out
            self._on_error("detectors_screen")
        if with_heartbeat:
            try:
                suite.flush_idle()  # a finding left queued when the engine went idle
            except Exception:  # noqa: BLE001 - the readings below still go out
                self._on_error("detectors_idle_flush")
            for name, value, labels in suite.probe_values():
                batch.probes.add(name=name, labels=labels, value=value)

    def close(self) -> None:
        suite, self.suite = self.suite, None
        self.wants_logits = False
        if suite is not None:
            self.on_change()
            suite.close()
