"""Sampling detectors on real torch tensors and token lists (no vLLM needed)."""

from __future__ import annotations

import dataclasses
import json
import re
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from guard.config.detectors import (
    DetectorsConfig,
    DumpConfig,
    LogitsFiniteConfig,
    LogitsStatsConfig,
    SpecAcceptanceConfig,
    TokenRepeatConfig,
)
from guard.config.runtime_guard import IncidentsConfig, parse_config
from guard.detectors import compiled
from guard.detectors import logits as checks
from guard.detectors.evidence import EvidenceDumper
from guard.detectors.host import DetectorHost
from guard.detectors.slots import packed_batch
from guard.detectors.spec import AcceptanceTracker
from guard.detectors.suite import HOST_READ_WAVES, HOST_STATS_QUEUED, DetectorSuite
from guard.detectors.tokens import (
    SMALL_WAVE,
    RepeatDetector,
    find_loop,
    out_of_range,
    rows_out_of_range,
)
from guard.stream.reporter import IncidentReporter
from guard.wave.schedule import WaveTokens
from telemetry.wire.proto import guard_pb2


# -- logits checks --------------------------------------------------------------------------
@pytest.mark.parametrize("rows", [6, checks.SMALL_BATCH + 6])  # summed in Python, as a tensor
def test_row_max_finds_nan_pos_inf_and_all_neg_inf_rows_but_passes_masked_rows(rows):
    logits = torch.randn(rows, 50)
    logits[1, 7] = float("nan")
    logits[2, 3] = float("inf")
    logits[3, :] = float("-inf")
    logits[4, :40] = float("-inf")  # a grammar mask: fine
    assert checks.bad_rows(checks.row_max(logits)) == [1, 2, 3]
    assert checks.bad_rows(checks.row_max(torch.randn(rows, 50))) == []
    logits[5, :] = float("-inf")  # a +Inf row and a -Inf row alone: their sum is NaN, found
    assert checks.bad_rows(checks.row_max(logits[[2, 5]])) == [0, 1]
    evidence = checks.describe_row(logits[1])
    assert evidence == {"nan": 1, "pos_inf": 0, "neg_inf": 0, "width": 50}


def test_rows_map_to_requests_on_the_verify_path():
    # request a has 2 drafts (3 rows), b has 0 (1 row), c has 1 (2 rows)
    mapping = checks.rows_to_requests([1, 3, 5], ["a", "b", "c"], [3, 1, 2])
    assert mapping == {"a": [1], "b": [3], "c": [5]}
    assert checks.rows_to_requests([0, 2], ["x", "y", "z"], None) == {"x": [0], "z": [2]}


def test_health_stats_match_a_direct_computation():
    logits = torch.randn(3, 20) * 4
    logits[1, 0] = float("nan")  # left out
    max_abs, entropy = checks.health_summary(checks.health_rows(logits).tolist())
    finite = logits[[0, 2]]
    p = torch.softmax(finite, -1)
    assert max_abs == pytest.approx(float(finite.abs().max()))
    assert entropy == pytest.approx(float(-(p * p.log()).sum(-1).mean()), rel=1e-5)


# -- token detectors ------------------------------------------------------------------------
def test_find_loop_needs_min_repeats_and_min_span():
    assert find_loop([1, 2, 3] * 4, 8, 4, 12) == (3, 12, [1, 2, 3])
    assert find_loop([1, 2, 3] * 3, 8, 4, 9) is None  # only 3 repeats
    assert find_loop([9] * 31, 8, 4, 32) is None and find_loop([9] * 32, 8, 4, 32)[0] == 1
    assert find_loop(list(range(64)), 16, 4, 32) is None


def test_ngram_repeats_count_non_contiguous_occurrences():
    window = []
    for filler in range(8):
        window += [7, 8, 9, 100 + filler, 200 + filler]

    def findings(max_count):
        detector = RepeatDetector(TokenRepeatConfig(ngram_size=3, ngram_max_count=max_count))
        return [f for i in range(0, len(window), 5) for f in detector.add("r", window[i : i + 5])]

    assert findings(8) == [("ngram", 3, 8, [7, 8, 9])]
    assert findings(9) == []


def test_repeat_detector_reports_episodes_not_every_token():
    detector = RepeatDetector(TokenRepeatConfig(window=64, min_span=16))
    findings = []
    for _ in range(20):  # 160 tokens of one loop
        findings += detector.add("r", [5, 6, 7, 8, 5, 6, 7, 8])
    assert [f[0] for f in findings] == ["loop"]
    # leave the loop, then loop again: a second episode
    for n in range(10):
        findings += detector.add("r", list(range(1000 + 8 * n, 1008 + 8 * n)))
    for _ in range(10):
        findings += detector.add("r", [42] * 8)
    assert [f[0] for f in findings] == ["loop", "loop"]
    detector.forget("r")
    assert "r" not in detector.requests


def test_random_streams_are_not_flagged():
    gen = torch.Generator().manual_seed(0)
    detector = RepeatDetector(TokenRepeatConfig())
    hits = 0
    for req in range(50):
        stream = torch.randint(0, 512, (512,), generator=gen).tolist()
        for i in range(0, 512, 4):
            hits += len(detector.add(str(req), stream[i : i + 4]))
    assert hits == 0


def test_out_of_range():
    assert out_of_range([1, 2, 3], 10) == []
    assert out_of_range([1, 10, -1, 3], 10) == [10, -1]


@pytest.mark.parametrize("rows", [3, SMALL_WAVE + 5])  # the list path and the array path
def test_rows_out_of_range_names_each_bad_row_once(rows):
    sampled = [[1]] * rows
    assert rows_out_of_range(WaveTokens(sampled), 10) == []
    sampled = [[1], [2, 10, 11], [], [-1], *[[3]] * (rows - 4)]
    assert rows_out_of_range(WaveTokens(sampled), 10) == [1, 3]


@pytest.mark.parametrize("bad", [-1, 10, 2**40])
def test_rows_out_of_range_finds_a_bad_id_in_a_large_decode_wave(bad):
    """The array path reads the ids as unsigned: a negative id must still be out of range."""
    sampled = [[1]] * (SMALL_WAVE + 5)
    sampled[7] = [bad]
    assert rows_out_of_range(WaveTokens(sampled), 10) == [7]


def test_wave_tokens_read_decode_and_mixed_waves_alike():
    decode = WaveTokens([[5], [7], [9]])
    assert decode.uniform and decode.ids == [5, 7, 9] and decode.width == 1
    assert decode.flat.tolist() == [5, 7, 9] and decode.row_of_each().tolist() == [0, 1, 2]
    mixed = WaveTokens([[5], [], [1, 2, 3]])
    assert not mixed.uniform and mixed.lengths == [1, 0, 3] and mixed.width == 3
    assert mixed.ids == [5, 1, 2, 3] and mixed.row_of_each().tolist() == [0, 2, 2, 2]
    empty = WaveTokens([])
    assert empty.uniform and empty.width == 0 and empty.flat.size == 0
    rows = [[4], [6]]
    copied = WaveTokens(rows)
    rows[0].append(9)  # the scheduler trims or extends its own lists later
    assert copied.ids == [4, 6] and copied.uniform
    arrays = WaveTokens([np.array([3]), np.array([8])])  # rows that are arrays, not lists
    assert arrays.uniform and arrays.flat.tolist() == [3, 8]
    assert packed_batch([decode, mixed]).tolist() == [5, 7, 9, 5, 1, 2, 3]


# -- spec acceptance ------------------------------------------------------------------------
def test_acceptance_uses_vllms_rule_and_judges_windows_once_per_episode():
    config = SpecAcceptanceConfig(min_rate=0.5, min_drafts=6, window_waves=4, jump_above=0.0)
    tracker = AcceptanceTracker(config)  # the band alone (jumps: the tests below)
    drafts = {"a": [1, 2, 3], "b": [4, 5, 6], "c": []}
    # a: 3 drafted, 2 accepted (3 tokens back); b: 3 drafted, none accepted; c: no drafts
    tracker.add_wave(1, ["a", "b", "c"], drafts, WaveTokens([[1, 2, 9], [7], [8]]))
    low = tracker.flush()
    assert (tracker.drafted_total, tracker.accepted_total) == (6, 2)
    assert (tracker.window("a"), tracker.window("b"), tracker.window("c")) == (
        (3, 2),
        (3, 0),
        (0, 0),
    )
    assert [j.key for j in low] == [""]  # the wave window (2/6); a and b have < 6 drafts
    tracker.add_wave(2, ["a"], drafts, WaveTokens([[1, 2, 9]]))
    assert tracker.flush() == []  # the wave window at 4/9, a at 4/6: same episode, not again
    for wave in range(3, 7):
        tracker.add_wave(wave, ["a"], {"a": [1, 2, 3]}, WaveTokens([[1, 2, 3, 4]]))
    assert tracker.flush() == [] and tracker.waves.rate == 1.0


def _waves(tracker, n, accepted_of_4, req="a"):
    """n waves of one request with 4 drafts each, `accepted_of_4` of them accepted, each judged
    on its own (a batch of one wave)."""
    found = []
    for _ in range(n):
        tokens = WaveTokens([[0] * (accepted_of_4 + 1)])
        tracker.add_wave(0, [req], {req: [1, 2, 3, 4]}, tokens)
        found += tracker.flush()
    return found


def test_acceptance_far_above_the_engines_baseline_is_a_jump_once_per_episode():
    """Degenerate, repetitive output makes drafts easy to accept: a window rising far above
    the baseline is reported once, in band or not, and again only after it came back."""
    config = SpecAcceptanceConfig(window_waves=8, request_window=8, min_drafts=16)
    tracker = AcceptanceTracker(config)  # jump_above 0.4 and baseline_waves 512 by default
    assert _waves(tracker, 40, 1) == []  # a steady 0.25
    assert tracker.baseline == pytest.approx(0.25) and tracker.baseline_ready
    found = _waves(tracker, 12, 4)  # all 4 accepted: 1.0, inside the default band [0.05, 1]
    assert [(j.key, j.kind) for j in found] == [("", "jump"), ("a", "jump")]
    wave_jump = found[0]
    assert wave_jump.window.rate - wave_jump.baseline >= 0.4
    assert wave_jump.baseline == pytest.approx(0.25, abs=0.02)  # slow: 12 of ~512 waves
    assert _waves(tracker, 12, 4) == []  # the same episode: not again
    assert _waves(tracker, 40, 1) == []  # back down: the episode ends
    assert [(j.key, j.kind) for j in _waves(tracker, 12, 4)] == [("", "jump"), ("a", "jump")]


def test_no_jump_before_the_baseline_has_seen_a_window_or_when_off():
    config = SpecAcceptanceConfig(window_waves=8, request_window=8, min_drafts=8)
    early = AcceptanceTracker(config)
    _waves(early, 4, 1)
    # waves 5-7 jump to 1.0, but the baseline has seen fewer than window_waves waves
    assert _waves(early, 3, 4) == [] and not early.baseline_ready
    off = AcceptanceTracker(dataclasses.replace(config, jump_above=0.0))
    _waves(off, 40, 1)
    assert not off.baseline_ready and _waves(off, 12, 4) == []


def test_a_window_outside_the_band_is_a_band_hit_not_a_jump():
    # baseline 0.25, so a jump needs 0.65; above max_rate 0.6 that is outside the band already
    config = SpecAcceptanceConfig(window_waves=8, request_window=8, min_drafts=8, max_rate=0.6)
    tracker = AcceptanceTracker(config)
    _waves(tracker, 40, 1)
    found = _waves(tracker, 12, 4)
    assert [(j.key, j.kind) for j in found] == [("", "band"), ("a", "band")]


# -- the suite with a real reporter ---------------------------------------------------------
class Runner:
    """Stands in for a V1 runner: only the attributes the suite reads."""

    def __init__(self, req_ids):
        self.input_batch = types.SimpleNamespace(req_ids=req_ids)
        self.model_config = types.SimpleNamespace(get_vocab_size=lambda: 50)
        self.speculative_config = types.SimpleNamespace(method="ngram")


def make_suite(tmp_path, **sections):
    sent, probes = [], []
    reporter = IncidentReporter(
        IncidentsConfig(), run_id="r", current_wave=lambda: 1, sink=sent.append
    )
    config = DetectorsConfig(dump=DumpConfig(directory=str(tmp_path), min_free_bytes=0), **sections)
    suite = DetectorSuite(
        config, reporter, EvidenceDumper(config.dump, "r", "dp0tp0pp0"),
        probe=lambda n, v, lab: probes.append((n, v, lab)),
    )  # fmt: skip
    return suite, sent, probes


def test_suite_names_the_nan_request_and_dumps_evidence(tmp_path):
    suite, sent, _ = make_suite(tmp_path, logits_finite=LogitsFiniteConfig(action="dump"))
    runner = Runner(["a", "b", "c"])
    logits = torch.randn(3, 50)
    logits[1, 4] = float("nan")
    suite.on_logits(3, runner, logits, None)
    output = types.SimpleNamespace(req_ids=["a", "b", "c"], sampled_token_ids=[[1], [0], [2]])
    suite.on_output(3, runner, output)
    (incident,) = [i for i in sent if i.type == "logits_finite"]
    assert incident.request_id == "b" and incident.wave == 3
    assert json.loads(incident.evidence_json)["nan"] == 1
    dump = [a for a in incident.actions if a.startswith("dump")][0]
    assert dump.startswith("dump:"), dump
    bundle = dump[len("dump:") :]
    row = torch.load(f"{bundle}/logits.pt")
    assert torch.isnan(row[4]) and row.shape == (50,)
    meta = json.loads(Path(bundle, "meta.json").read_text())
    assert meta["request_id"] == "b" and meta["kv"] == "not exposed by this runtime"


def test_a_batch_left_by_an_idle_engine_is_screened_by_the_streamer_thread(tmp_path):
    """The suite's idle flush (called with each heartbeat) reports a finding queued when the
    waves stopped, with its own wave; while waves keep coming it leaves the batch alone."""
    suite, sent, _ = make_suite(tmp_path)
    runner = Runner(["a"])
    for wave in range(1, 6):  # 40 tokens of one id: a loop, in a batch not yet full
        output = types.SimpleNamespace(req_ids=["a"], sampled_token_ids=[[11] * 8])
        suite.on_output(wave, runner, output)
    suite.flush_idle(idle_s=3600.0)  # waves came within the hour: not idle
    assert sent == []
    suite.flush_idle(idle_s=0.0)
    assert [(i.type, i.request_id, i.wave) for i in sent] == [("token_repeat", "a", 5)]
    assert "loop of period 1" in sent[0].summary


def test_dump_is_skipped_with_a_reason_when_the_disk_is_short(tmp_path):
    config = DumpConfig(directory=str(tmp_path), min_free_bytes=1 << 60)
    action = EvidenceDumper(config, "r", "x").dump("t", 1, "q", meta={}, tokens=[1, 2])
    assert action.startswith("dump_skipped:only ") and "min_free_bytes" in action
    tiny = DumpConfig(directory=str(tmp_path), min_free_bytes=0, max_bytes=4096)
    action = EvidenceDumper(tiny, "r", "x").dump(
        "t", 1, "q", meta={}, logits_row=torch.zeros(100_000)
    )
    assert action.startswith("dump_skipped:bundle of") and "max_bytes 4096" in action


def test_an_acceptance_jump_through_the_suite_names_the_baseline(tmp_path):
    spec = SpecAcceptanceConfig(window_waves=8, request_window=8, min_drafts=8)
    suite, sent, _ = make_suite(tmp_path, spec_acceptance=spec)
    runner = Runner(["a"])
    for wave in range(1, 61):
        accepted = 1 if wave <= 40 else 4  # 0.25 for 40 waves, then every draft accepted
        scheduled = types.SimpleNamespace(
            finished_req_ids=None, scheduled_spec_decode_tokens={"a": [1, 2, 3, 4]}
        )
        suite.on_schedule(wave, scheduled)
        output = types.SimpleNamespace(req_ids=["a"], sampled_token_ids=[[5] * (accepted + 1)])
        suite.on_output(wave, runner, output)
    suite.flush_idle(idle_s=0.0)  # waves 33-60 are still a batch: judged as the engine idles
    hits = [i for i in sent if i.type == "spec_acceptance"]
    assert [(i.request_id, i.wave) for i in hits] == [("", 45), ("a", 45)]
    evidence = json.loads(hits[1].evidence_json)
    assert evidence["kind"] == "jump" and evidence["scope"] == "request"
    assert evidence["baseline"] == pytest.approx(0.25, abs=0.01)
    assert evidence["rate"] - evidence["baseline"] >= 0.4
    wanted = r"acceptance 0\.\d\d in the request a jumped \+0\.4\d above the baseline 0\.2\d"
    assert re.search(wanted, hits[1].summary), hits[1].summary


def test_token_range_and_stats_through_the_suite(tmp_path):
    suite, sent, probes = make_suite(tmp_path)
    runner = Runner(["a"])
    suite.on_logits(16, runner, torch.randn(1, 50), None)  # every 16 waves by default
    suite.on_output(16, runner, types.SimpleNamespace(req_ids=["a"], sampled_token_ids=[[77]]))
    assert [i.type for i in sent] == ["token_range"]
    assert json.loads(sent[0].evidence_json) == {"ids": [77], "vocab_size": 50}
    assert {p[0] for p in probes} == {"logits_max_abs", "logits_entropy_nats"}


def test_detectors_config_round_trips_and_rejects_bad_bands():
    config = parse_config({"detectors": {"spec_acceptance": {"min_rate": 0.2, "max_rate": 0.9}}})
    assert config.detectors.spec_acceptance.min_rate == 0.2
    with pytest.raises(ValueError, match=r"spec_acceptance\.min_rate: 0\.9 is above max_rate 0\.2"):
        parse_config({"detectors": {"spec_acceptance": {"min_rate": 0.9, "max_rate": 0.2}}})


def test_health_stats_skip_masked_tokens_not_whole_rows():
    """A grammar bitmask or min_tokens sets -Inf on masked tokens: the stats read the rest.

    Before this, every row of a structured-output batch was left out, the stats came back NaN
    and the sidecar refused the whole batch (with its wave records) over the NaN probe.
    """
    logits = torch.randn(3, 20) * 4
    logits[0, 5:] = float("-inf")  # grammar: 5 tokens allowed
    logits[1, 0] = float("-inf")  # min_tokens: EOS masked
    logits[2, :] = float("-inf")  # nothing allowed: left out
    max_abs, entropy = checks.health_summary(checks.health_rows(logits).tolist())
    rows = [logits[0, :5], logits[1, 1:]]
    assert max_abs == pytest.approx(max(float(r.abs().max()) for r in rows))
    expected = [float(-(torch.softmax(r, -1) * torch.log_softmax(r, -1)).sum()) for r in rows]
    assert entropy == pytest.approx(sum(expected) / 2, rel=1e-5)
    all_masked = torch.full((2, 20), float("-inf"))
    assert checks.health_summary(checks.health_rows(all_masked).tolist()) is None


class _HostReads(TorchDispatchMode):
    """Records the aten ops that read device data back to the host (a sync on CUDA or NPU)."""

    SYNCING = {"aten::nonzero", "aten::_local_scalar_dense", "aten::masked_select"}

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        bool_index = name == "aten::index" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or [])
        )
        if name in self.SYNCING or bool_index:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def test_health_stats_read_nothing_back_to_the_host():
    """No boolean-mask indexing or scalar read: on an accelerator either is a device sync.

    CPU stand-in for the sync check (no CUDA or NPU here): the ops that would sync are seen
    at the dispatcher. A mix of healthy, NaN, +Inf and wholly masked rows takes every branch.
    """
    logits = torch.randn(6, 20)
    logits[1, 3] = float("nan")
    logits[2, 4] = float("inf")
    logits[3, :] = float("-inf")
    logits[4, :10] = float("-inf")
    with _HostReads() as reads:
        readings = checks.health_rows(logits)
    assert reads.seen == []
    rows = [logits[0], logits[4, 10:], logits[5]]
    max_abs, _ = checks.health_summary(readings.tolist())
    assert max_abs == pytest.approx(max(float(r.abs().max()) for r in rows))


class _CopyInFlight:
    """Stands in for an accelerator's copy event (no CUDA or NPU here): not done until told."""

    def __init__(self) -> None:
        self.done = False
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = self.done = True


def _copies_in_flight(monkeypatch):
    """The suite's copies come back with an event, as on a device; returns the events made."""
    events = []

    def start_copy(tensor):
        events.append(_CopyInFlight())
        return tensor.clone(), events[-1]

    monkeypatch.setattr(checks, "start_copy", start_copy)
    return events


def test_a_check_read_in_a_later_wave_names_the_request_of_its_own_wave(tmp_path, monkeypatch):
    """Read after the batch changed (the copy was still in flight at the wave's output), a
    finding names the request that held the row when the logits were checked."""
    events = _copies_in_flight(monkeypatch)
    suite, sent, _ = make_suite(tmp_path)
    runner = Runner(["a", "b"])
    logits = torch.randn(2, 50)
    logits[1, 3] = float("nan")
    suite.on_logits(4, runner, logits, None)
    suite.on_output(4, runner, types.SimpleNamespace(req_ids=["a", "b"], sampled_token_ids=[]))
    assert sent == [] and not events[0].waited  # not ready: left pending, nothing waited on
    runner.input_batch.req_ids = ["c", "a"]  # the next wave's batch
    events[0].done = True
    suite.on_output(5, runner, types.SimpleNamespace(req_ids=["c", "a"], sampled_token_ids=[]))
    (incident,) = sent
    assert (incident.type, incident.request_id, incident.wave) == ("logits_finite", "b", 4)


def test_the_sync_gate_waits_for_the_copy_and_reads_it_in_its_wave(tmp_path, monkeypatch):
    events = _copies_in_flight(monkeypatch)
    suite, sent, _ = make_suite(tmp_path, logits_finite=LogitsFiniteConfig(sync_gate=True))
    runner = Runner(["a", "b"])
    logits = torch.randn(2, 50)
    logits[0, 9] = float("inf")
    suite.on_logits(6, runner, logits, None)
    assert events[0].waited  # the gate's promise: the host waited for the device
    (incident,) = sent
    assert (incident.request_id, incident.wave) == ("a", 6)


def kernels_loading(monkeypatch) -> None:
    """As in a worker's first waves, while the compiled kernels load in the background."""
    monkeypatch.setattr(compiled, "_kernels", None)
    monkeypatch.setattr(compiled, "_loading", True)


def test_host_logits_checks_are_read_a_batch_of_waves_at_a_time(tmp_path, monkeypatch):
    """On the host, reported only, with torch (the compiled check still loading): a wave's
    row maxima wait for the next waves', and one sum reads them all. A NaN found that way
    names its own wave and the request that held the row then, though the batch changed."""
    suite, sent, _ = make_suite(tmp_path, logits_stats=LogitsStatsConfig(enabled=False))
    kernels_loading(monkeypatch)
    runner = Runner(["a", "b"])
    logits = torch.randn(2, 50)
    logits[1, 3] = float("nan")
    suite.on_logits(3, runner, logits, None)
    runner.input_batch.req_ids = ["c", "a"]
    for wave in range(4, 3 + HOST_READ_WAVES - 1):
        suite.on_logits(wave, runner, torch.randn(2, 50), None)
    assert sent == []
    suite.on_logits(3 + HOST_READ_WAVES - 1, runner, torch.randn(2, 50), None)
    (incident,) = sent
    assert (incident.type, incident.request_id, incident.wave) == ("logits_finite", "b", 3)
    assert json.loads(incident.evidence_json)["rows"] == [1]


def test_host_logits_checks_left_when_the_engine_idles_are_read_by_the_idle_flush(tmp_path):
    suite, sent, _ = make_suite(tmp_path)
    runner = Runner(["a"])
    suite.on_logits(5, runner, torch.full((1, 50), float("inf")), None)
    suite.on_logits(6, runner, torch.randn(1, 50), None)
    suite.flush_idle(idle_s=0.0)  # the streamer thread, with the engine idle
    assert [(i.type, i.wave) for i in sent] == [("logits_finite", 5)]
    suite.flush_idle(idle_s=0.0)
    assert len(sent) == 1  # read once


def test_a_stats_wave_reads_the_waves_deferred_before_it_first(tmp_path):
    suite, sent, _ = make_suite(tmp_path)
    runner = Runner(["a"])
    suite.on_logits(15, runner, torch.full((1, 50), float("nan")), None)
    suite.on_logits(16, runner, torch.full((1, 50), float("nan")), None)  # stats: read now
    assert [i.wave for i in sent if i.type == "logits_finite"] == [15, 16]


def test_with_logits_finite_off_a_stats_wave_starts_no_row_check(tmp_path):
    """logits_stats alone: its waves read no row maxima, and a NaN is not a finding."""
    suite, sent, _ = make_suite(tmp_path, logits_finite=LogitsFiniteConfig(enabled=False))
    runner = Runner(["a"])
    for wave in range(16, 16 + HOST_READ_WAVES + 1):
        suite.on_logits(wave, runner, torch.full((1, 50), float("nan")), None)
    suite.close()
    assert sent == [] and suite._unread == []


NAN, INF = float("nan"), float("inf")


def spoil_rows(logits: torch.Tensor, gen: torch.Generator, faults: tuple[str, ...]) -> None:
    """Give each row one of `faults` (drawn with `gen`, a column too), in place: "healthy",
    "nan", "inf", "all_masked", "masked" (-Inf up to the column; all of it at the last),
    "masked_then_inf", "near_limit" (±3e38)."""
    width = logits.shape[1]
    for row in range(logits.shape[0]):
        fault = faults[int(torch.randint(0, len(faults), (1,), generator=gen))]
        col = int(torch.randint(0, width, (1,), generator=gen))
        if fault == "nan":
            logits[row, col] = NAN
        elif fault == "inf":
            logits[row, col] = INF
        elif fault == "all_masked":
            logits[row, :] = -INF
        elif fault == "masked":
            logits[row, : col + 1] = -INF
        elif fault == "masked_then_inf":
            logits[row, :col] = -INF
            logits[row, col] = INF
        elif fault == "near_limit":
            logits[row, col] = 3.0e38 if col % 2 else -3.0e38


@pytest.mark.parametrize("seed", range(12))
def test_the_compiled_row_check_finds_the_first_row_the_row_max_rule_finds(seed):
    """Rows of every kind (healthy, NaN, +Inf, -Inf everywhere, masked in part, a mask with a
    +Inf, values near the float32 limit) at widths below, at and past a vector's lanes: the
    kernel's answer is the first row whose torch row max is not finite, from every start."""
    gen = torch.Generator().manual_seed(seed)
    width = [1, 7, 8, 50, 513, 4099][seed % 6]
    logits = torch.randn(16, width, generator=gen)
    faults = ("healthy", "nan", "inf", "all_masked", "masked", "masked_then_inf", "near_limit")
    spoil_rows(logits, gen, (*faults, "healthy"))
    first_bad_row = compiled.load().logits.first_bad_row
    bad = checks.bad_rows(checks.row_max(logits))
    for start in range(16):
        wanted = next((row - start for row in bad if row >= start), -1)
        assert first_bad_row(logits[start:].contiguous().numpy()) == wanted, (seed, start)


@pytest.mark.parametrize("seed", range(8))
def test_the_compiled_health_readings_match_torchs(seed):
    """The streamer thread's one-pass readings against `health_rows` + `health_summary`
    (torch's log_softmax): healthy, NaN, +Inf, partly and wholly masked rows, bf16 logits."""
    gen = torch.Generator().manual_seed(seed)
    width = [5, 50, 513, 32000][seed % 4]
    logits = torch.randn(10, width, generator=gen) * (1 + seed)
    spoil_rows(logits, gen, ("healthy", "nan", "inf", "masked", "healthy"))
    if seed % 2:
        logits = logits.bfloat16()
    rows = checks.host_rows(logits)
    assert rows.dtype == np.float32 and rows.flags.c_contiguous and rows.shape[0] == 8
    wanted = checks.health_summary(checks.health_rows(logits).tolist())
    max_abs, entropy, healthy = compiled.load().logits.health_readings(rows)
    if wanted is None:
        assert healthy == 0
    else:
        assert (max_abs, entropy) == pytest.approx(wanted, rel=1e-4)
        assert checks.host_health_summary(rows) == pytest.approx(wanted, rel=1e-6)


def test_host_logits_are_checked_in_their_own_wave_by_the_compiled_check(tmp_path):
    """Once the kernels are in, a host wave's rows are read in that wave: a NaN names its
    wave and its request (on the verify path, the request that owns the row) at once."""
    suite, sent, _ = make_suite(tmp_path, logits_stats=LogitsStatsConfig(enabled=False))
    runner = Runner(["a", "b"])
    suite.on_logits(1, runner, torch.randn(2, 50), None)  # the first wave: the host way on
    masked = torch.randn(2, 50)
    masked[0, :40] = -INF
    suite.on_logits(2, runner, masked, None)
    assert sent == []
    verify = torch.randn(3, 50)  # request a owns rows 0-1, b row 2
    verify[2, 9] = NAN
    suite.on_logits(3, runner, verify, [2, 1])
    (incident,) = sent
    assert (incident.type, incident.request_id, incident.wave) == ("logits_finite", "b", 3)
    assert json.loads(incident.evidence_json)["rows"] == [2]


@pytest.mark.parametrize("layout", ["bfloat16", "strided"])
def test_logits_the_compiled_check_does_not_take_are_checked_with_torch(tmp_path, layout):
    suite, sent, _ = make_suite(tmp_path, logits_stats=LogitsStatsConfig(enabled=False))
    runner = Runner(["a", "b"])
    suite.on_logits(1, runner, torch.randn(2, 50), None)
    logits = torch.randn(2, 50)
    logits[0, 5] = NAN
    logits = logits.bfloat16() if layout == "bfloat16" else torch.cat([logits, logits], 1)[:, :50]
    suite.on_logits(2, runner, logits, None)
    assert sent == []  # kept for torch's read with the next waves
    suite.close()
    (incident,) = sent
    assert (incident.type, incident.request_id, incident.wave) == ("logits_finite", "a", 2)


def test_waves_checked_with_torch_while_the_kernels_load_are_read_when_they_come_in(
    tmp_path, monkeypatch
):
    suite, sent, _ = make_suite(tmp_path, logits_stats=LogitsStatsConfig(enabled=False))
    kernels = compiled.load()
    kernels_loading(monkeypatch)
    runner = Runner(["a"])
    suite.on_logits(1, runner, torch.full((1, 50), NAN), None)
    suite.on_logits(2, runner, torch.randn(1, 50), None)
    assert sent == []  # kept for torch's read
    monkeypatch.setattr(compiled, "_kernels", kernels)
    monkeypatch.setattr(compiled, "_loading", False)
    suite.on_logits(3, runner, torch.full((1, 50), INF), None)
    assert [(i.type, i.wave) for i in sent] == [("logits_finite", 1), ("logits_finite", 3)]


@pytest.mark.parametrize("rows", [1, checks.STATS_ROWS + 4])
def test_host_stats_waves_are_read_off_the_engine_thread_from_their_own_rows(tmp_path, rows):
    """A host engine's stats wave keeps a copy of its first `STATS_ROWS` rows (made from
    the row check's read of them); the streamer thread reads it (with the next batch), and a
    reading past the limit names the stats wave."""
    stats = LogitsStatsConfig(max_abs_limit=5.0)
    suite, sent, probes = make_suite(tmp_path, logits_stats=stats)
    runner = Runner([f"r{i}" for i in range(rows)])
    suite.on_logits(1, runner, torch.randn(rows, 50), None)  # the first wave: the host way on
    # clamped (a draw past 3 sigma came out at 9.05 once), so the spike below is the max
    logits = (torch.randn(rows, 50) * 3).clamp(-8.9, 8.9)
    logits[0, 7] = 9.0
    max_abs, entropy = checks.health_summary(checks.health_rows(logits).tolist())
    suite.on_logits(16, runner, logits, None)
    logits.fill_(NAN)  # the sampler may change the logits in place after the hook
    assert probes == [] and sent == []  # nothing read on the engine thread
    host = DetectorHost(suite.reporter, lambda *a: None, lambda where: None)
    host.suite = suite
    host.fill_batch(guard_pb2.Batch(), with_heartbeat=False)  # the streamer thread's batch
    assert probes == [
        ("logits_max_abs", pytest.approx(max_abs), {}),
        ("logits_entropy_nats", pytest.approx(entropy), {}),
    ]
    (incident,) = sent
    assert (incident.type, incident.wave) == ("logits_stats", 16)
    assert json.loads(incident.evidence_json)["max_abs"] == pytest.approx(9.0)


def test_host_stats_wait_for_the_kernels_and_only_the_engine_thread_reads_them_with_torch(
    tmp_path, monkeypatch
):
    """While the kernels load, the streamer thread leaves the stats waves queued (torch there
    slowed every later wave of a CPU engine); the close reads them with torch."""
    suite, _, probes = make_suite(tmp_path)
    runner = Runner(["a"])
    suite.on_logits(1, runner, torch.randn(1, 50), None)
    kernels_loading(monkeypatch)
    logits = torch.randn(1, 50)
    suite.on_logits(16, runner, logits, None)
    suite.read_host_stats()  # the streamer thread's batch
    assert probes == []
    suite.close()
    max_abs, entropy = checks.health_summary(checks.health_rows(logits).tolist())
    assert [p[:2] for p in probes] == [
        ("logits_max_abs", max_abs),
        ("logits_entropy_nats", entropy),
    ]


def test_host_stats_waves_the_streamer_leaves_are_read_by_the_engine_thread(tmp_path):
    """A streamer that does not keep up (or is not connected) leaves no unbounded queue: past
    `HOST_STATS_QUEUED` waves the engine thread reads them, and the close reads the rest."""
    suite, _, probes = make_suite(tmp_path, logits_stats=LogitsStatsConfig(every_n_waves=1))
    runner = Runner(["a"])
    for wave in range(1, HOST_STATS_QUEUED + 3):
        suite.on_logits(wave, runner, torch.randn(1, 50), None)
    # the first wave read in place; the next HOST_STATS_QUEUED + 1 read once the queue overran
    assert len(probes) == 2 * (HOST_STATS_QUEUED + 2)
    suite.on_logits(HOST_STATS_QUEUED + 3, runner, torch.randn(1, 50), None)
    suite.close()
    assert len(probes) == 2 * (HOST_STATS_QUEUED + 3)


def test_a_device_without_events_is_copied_at_once():
    """No event type to wait on later (a stand-in device): the copy must not be left racing."""
    copied = []
    tensor = types.SimpleNamespace(
        device=types.SimpleNamespace(type="nodevice"),
        to=lambda where: copied.append(where) or torch.ones(2),
    )
    host, event = checks.start_copy(tensor)
    assert copied == ["cpu"] and event is None and host.tolist() == [1.0, 1.0]


def test_the_suite_judges_the_tokens_the_processor_read_and_rereads_rows_cut_to_the_ids(tmp_path):
    """The processor reads a wave's tokens once (`read_sampled`) and hands the read to the
    detectors, which judge that read: the lists may have been cut by the scheduler since.
    When the output has more rows than request ids, the suite reads the rows it keeps again."""
    suite, sent, _ = make_suite(tmp_path)
    runner = Runner(["a"])
    suite.on_logits(1, runner, torch.randn(1, 50), None)  # the vocabulary: 50
    output = types.SimpleNamespace(req_ids=["a"], sampled_token_ids=[[7]])
    suite.on_output(1, runner, output, WaveTokens([[77]]))  # read before a cut, say
    suite.close()
    assert [json.loads(i.evidence_json)["ids"] for i in sent] == [[77]]

    suite, sent, _ = make_suite(tmp_path)
    suite.on_logits(1, runner, torch.randn(1, 50), None)
    output = types.SimpleNamespace(req_ids=["a"], sampled_token_ids=[[7], [99]])
    suite.on_output(1, runner, output, WaveTokens(output.sampled_token_ids))
    suite.close()
    assert sent == []  # 99 belongs to no request id: not judged


def test_no_probe_is_sent_when_no_row_was_healthy(tmp_path):
    suite, sent, probes = make_suite(tmp_path)
    runner = Runner(["a"])
    suite.on_logits(16, runner, torch.full((1, 50), float("nan")), None)
    suite.on_output(16, runner, types.SimpleNamespace(req_ids=["a"], sampled_token_ids=[[7]]))
    assert [i.type for i in sent] == ["logits_finite"]  # the gate still reports the NaN
    assert probes == []


def test_a_rank_that_does_not_report_tokens_keeps_no_token_state_but_checks_the_range(tmp_path):
    """TP ranks past the driver see the driver's tokens: they keep no repeat or acceptance
    state and export no acceptance readings, but still check each id against the vocab."""
    config = DetectorsConfig(dump=DumpConfig(directory=str(tmp_path), min_free_bytes=0))
    sent = []
    reporter = IncidentReporter(
        IncidentsConfig(), run_id="r", current_wave=lambda: 1, sink=sent.append
    )
    suite = DetectorSuite(
        config, reporter, EvidenceDumper(config.dump, "r", "dp0tp1pp0"), report_tokens=False
    )
    assert suite.repeat is None and suite.spec is None and suite.needs_output
    runner = Runner(["a"])
    for wave in range(1, 65):  # a loop of one id, with drafts none of which is accepted
        drafts = types.SimpleNamespace(
            finished_req_ids=None, scheduled_spec_decode_tokens={"a": [1, 2, 3, 4]}
        )
        suite.on_schedule(wave, drafts)
        ids = [[99]] if wave == 64 else [[11]]  # 99 is outside the vocab of 50
        suite.on_output(wave, runner, types.SimpleNamespace(req_ids=["a"], sampled_token_ids=ids))
    suite.close()
    assert [(i.type, i.wave) for i in sent] == [("token_range", 64)]
    assert suite.probe_values() == []


def test_an_engine_without_speculative_decoding_drops_the_acceptance_tracker(tmp_path):
    """A runner whose `speculative_config` is None gets no drafts: after its first output the
    suite keeps no acceptance state and reads no drafts per wave; one with drafts keeps it."""
    suite, _, _ = make_suite(tmp_path)
    plain = Runner(["a"])
    plain.speculative_config = None
    output = types.SimpleNamespace(req_ids=["a"], sampled_token_ids=[[7]])
    suite.on_schedule(1, types.SimpleNamespace(finished_req_ids=None))
    suite.on_output(1, plain, output)
    assert suite.spec is None and suite.probe_values() == []
    drafting, _, _ = make_suite(tmp_path)
    drafting.on_output(1, Runner(["a"]), output)
    assert drafting.spec is not None


# -- Model Runner V2: the sampler is handed the batch that names the rows ------------------
class Mrv2Runner:
    """Stands in for an MRV2 runner: no `input_batch` (it builds one per step and hands it to
    the sampler); its request states and block tables, as 0.32 and 0.34 name them."""

    def __init__(self, req_states: dict[str, int], blocks: dict[int, list[int]]) -> None:
        self.model_config = types.SimpleNamespace(get_vocab_size=lambda: 50)
        self.speculative_config = None
        self.req_states = types.SimpleNamespace(req_id_to_index=req_states)
        table = torch.zeros((4, 8), dtype=torch.int32)
        num_blocks = np.zeros((1, 4), dtype=np.int32)
        for index, ids in blocks.items():
            table[index, : len(ids)] = torch.tensor(ids)
            num_blocks[0, index] = len(ids)
        self.block_tables = types.SimpleNamespace(
            block_tables=[types.SimpleNamespace(gpu=table)],
            num_blocks=types.SimpleNamespace(np=num_blocks),
        )
        # one layer, K and V stacked in dim 0: [2, blocks, block size, heads x dim]
        self.kv_caches = [torch.arange(2 * 6 * 2 * 3, dtype=torch.float32).view(2, 6, 2, 3)]


def test_mrv2_rows_are_named_by_the_batch_handed_to_the_sampler_on_every_read_path(
    tmp_path, monkeypatch
):
    """The runner has no batch to read ids from: the first (host) wave, the waves torch reads
    later (kernels still loading), and a device copy read in a later wave all name the
    request of the batch the sampler was handed for that wave."""
    runner = Mrv2Runner({}, {})
    suite, sent, _ = make_suite(tmp_path, logits_stats=LogitsStatsConfig(enabled=False))
    logits = torch.randn(2, 50)
    logits[1, 3] = NAN
    suite.on_logits(1, runner, logits, None, ["a", "b"])
    assert [(i.request_id, i.wave) for i in sent] == [("b", 1)]

    kernels_loading(monkeypatch)
    suite, sent, _ = make_suite(tmp_path, logits_stats=LogitsStatsConfig(enabled=False))
    suite.on_logits(1, runner, torch.randn(2, 50), None, ["a", "b"])
    suite.on_logits(2, runner, logits, None, ["c", "d"])
    suite.on_logits(3, runner, torch.randn(2, 50), None, ["e", "f"])
    suite.close()
    assert [(i.request_id, i.wave) for i in sent] == [("d", 2)]

    events = _copies_in_flight(monkeypatch)
    suite, sent, _ = make_suite(tmp_path, logits_stats=LogitsStatsConfig(enabled=False))
    suite.on_logits(4, runner, logits, None, ["g", "h"])
    events[0].done = True
    suite.on_output(5, runner, types.SimpleNamespace(req_ids=["x"], sampled_token_ids=[]))
    assert [(i.request_id, i.wave) for i in sent] == [("h", 4)]
    assert not any(i.request_id.startswith("row") for i in sent)


def test_mrv2_evidence_holds_the_requests_kv_blocks_from_its_request_state(tmp_path):
    """An MRV2 runner's block table has one row per request state, not per batch row: the
    bundle holds the blocks of the request's own state row (index 2 here, batch row 1)."""
    runner = Mrv2Runner({"a": 0, "b": 2}, {0: [1], 2: [4, 5]})
    suite, sent, _ = make_suite(tmp_path, logits_finite=LogitsFiniteConfig(action="dump"))
    logits = torch.randn(2, 50)
    logits[1, 3] = NAN
    suite.on_logits(1, runner, logits, None, ["a", "b"])
    (incident,) = sent
    assert incident.request_id == "b"
    bundle = [a for a in incident.actions if a.startswith("dump:")][0][len("dump:") :]
    kv = torch.load(f"{bundle}/kv.pt")
    assert torch.equal(kv["layer0"], runner.kv_caches[0][:, [4, 5]])
