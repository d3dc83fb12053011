"""Sampling detectors on real torch tensors and token lists (no vLLM needed)."""

from __future__ import annotations

import collections
import json
import math
import types
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from guard.config import IncidentsConfig, parse_config
from guard.detectors import logits as checks
from guard.detectors.config import (
    DetectorsConfig,
    DumpConfig,
    LogitsFiniteConfig,
    SpecAcceptanceConfig,
    TokenRepeatConfig,
)
from guard.detectors.evidence import EvidenceDumper
from guard.detectors.spec import AcceptanceTracker
from guard.detectors.suite import DetectorSuite
from guard.detectors.tokens import RepeatDetector, find_loop, out_of_range, rows_out_of_range
from guard.reporter import IncidentReporter


# -- logits checks --------------------------------------------------------------------------
def test_row_max_finds_nan_pos_inf_and_all_neg_inf_rows_but_passes_masked_rows():
    logits = torch.randn(6, 50)
    logits[1, 7] = float("nan")
    logits[2, 3] = float("inf")
    logits[3, :] = float("-inf")
    logits[4, :40] = float("-inf")  # a grammar mask: fine
    assert checks.bad_rows(checks.row_max(logits)) == [1, 2, 3]
    assert checks.bad_rows(checks.row_max(torch.randn(4, 50))) == []
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
    max_abs, entropy = checks.health_stats(logits).tolist()
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


# -- spec acceptance ------------------------------------------------------------------------
def test_acceptance_uses_vllms_rule_and_judges_windows_once_per_episode():
    tracker = AcceptanceTracker(SpecAcceptanceConfig(min_rate=0.5, min_drafts=6, window_waves=4))
    drafts = {"a": [1, 2, 3], "b": [4, 5, 6], "c": []}
    # a: 3 drafted, 2 accepted (3 tokens back); b: 3 drafted, none accepted; c: no drafts
    out = tracker.observe(drafts, ["a", "b", "c"], [[1, 2, 9], [7], [8]])
    assert out == (6, 2, {"a": (3, 2), "b": (3, 0)})
    assert (tracker.drafted_total, tracker.accepted_total) == (6, 2)
    low = tracker.newly_out_of_band(["a", "b"])
    assert [key for key, _ in low] == [""]  # the wave window (2/6); a and b have < 6 drafts
    assert tracker.newly_out_of_band(["a", "b"]) == []  # same episode: not again
    for _ in range(4):
        tracker.observe({"a": [1, 2, 3]}, ["a"], [[1, 2, 3, 4]])
    assert tracker.waves.rate == 1.0 and tracker.newly_out_of_band(["a"]) == []


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


def test_dump_is_skipped_with_a_reason_when_the_disk_is_short(tmp_path):
    config = DumpConfig(directory=str(tmp_path), min_free_bytes=1 << 60)
    action = EvidenceDumper(config, "r", "x").dump("t", 1, "q", meta={}, tokens=[1, 2])
    assert action.startswith("dump_skipped:only ") and "min_free_bytes" in action
    tiny = DumpConfig(directory=str(tmp_path), min_free_bytes=0, max_bytes=4096)
    action = EvidenceDumper(tiny, "r", "x").dump(
        "t", 1, "q", meta={}, logits_row=torch.zeros(100_000)
    )
    assert action.startswith("dump_skipped:bundle of") and "max_bytes 4096" in action


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
    max_abs, entropy = checks.health_stats(logits).tolist()
    rows = [logits[0, :5], logits[1, 1:]]
    assert max_abs == pytest.approx(max(float(r.abs().max()) for r in rows))
    expected = [float(-(torch.softmax(r, -1) * torch.log_softmax(r, -1)).sum()) for r in rows]
    assert entropy == pytest.approx(sum(expected) / 2, rel=1e-5)
    all_masked = torch.full((2, 20), float("-inf"))
    assert all(math.isnan(v) for v in checks.health_stats(all_masked).tolist())


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
        stats = checks.health_stats(logits)
    assert reads.seen == []
    rows = [logits[0], logits[4, 10:], logits[5]]
    assert stats[0].item() == pytest.approx(max(float(r.abs().max()) for r in rows))


def test_no_probe_is_sent_when_no_row_was_healthy(tmp_path):
    suite, sent, probes = make_suite(tmp_path)
    runner = Runner(["a"])
    suite.on_logits(16, runner, torch.full((1, 50), float("nan")), None)
    suite.on_output(16, runner, types.SimpleNamespace(req_ids=["a"], sampled_token_ids=[[7]]))
    assert [i.type for i in sent] == ["logits_finite"]  # the gate still reports the NaN
    assert probes == []


# -- vectorised state against per-request references ----------------------------------------
class ReferenceRepeat:
    """The per-request algorithm the arrays replace, checking loops on every token: a dict of
    exact n-gram counts and `find_loop` on the list of recent tokens."""

    def __init__(self, config: TokenRepeatConfig) -> None:
        self.config = config
        self.state: dict[str, dict] = {}

    def add(self, req: str, new_tokens: list[int]) -> list:
        c = self.config
        st = self.state.setdefault(
            req, {"tokens": [], "counts": {}, "grams": [], "hot": 0, "loop": False, "ngram": False}
        )
        started = None
        for token in new_tokens:
            st["tokens"].append(token)
            if len(st["tokens"]) < c.ngram_size:
                continue
            key = tuple(st["tokens"][-c.ngram_size :])
            st["counts"][key] = st["counts"].get(key, 0) + 1
            st["grams"].append(key)
            if st["counts"][key] == c.ngram_max_count:
                st["hot"] += 1
                if st["hot"] == 1 and not st["ngram"]:
                    started = list(key)
            if len(st["grams"]) > c.window - c.ngram_size + 1:
                old = st["grams"].pop(0)
                st["counts"][old] -= 1
                if st["counts"][old] == c.ngram_max_count - 1:
                    st["hot"] -= 1
        loop = find_loop(st["tokens"], c.max_period, c.min_repeats, c.min_span)
        findings = []
        if loop is not None and not st["loop"]:
            findings.append(("loop", *loop))
        st["loop"] = loop is not None
        if started is not None and not st["loop"]:
            findings.append(("ngram", c.ngram_size, c.ngram_max_count, started))
        st["ngram"] = st["hot"] > 0
        return findings


def _streams(gen, count: int, length: int) -> list[list[int]]:
    """Random streams over a small alphabet with loops and repeated phrases spliced in."""
    out = []
    for _ in range(count):
        stream: list[int] = []
        while len(stream) < length:
            kind = int(torch.randint(0, 3, (1,), generator=gen))
            if kind == 0:
                stream += torch.randint(
                    0, 40, (int(torch.randint(5, 40, (1,), generator=gen)),), generator=gen
                ).tolist()
            elif kind == 1:
                block = torch.randint(
                    0, 40, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen
                ).tolist()
                stream += block * int(torch.randint(2, 12, (1,), generator=gen))
            else:
                phrase = [1, 2, 3, 4]
                for _ in range(int(torch.randint(2, 6, (1,), generator=gen))):
                    stream += phrase + torch.randint(0, 40, (3,), generator=gen).tolist()
        out.append(stream[:length])
    return out


@pytest.mark.parametrize("width", [1, 3])
def test_array_repeat_detector_matches_the_per_request_reference(width):
    """Many requests in one batch, joining and finishing at different waves, one token a wave
    (or 1..width with drafts): every finding equals the reference's, request by request."""
    from guard.detectors.slots import SlotMap, WaveTokens

    config = TokenRepeatConfig(window=64, min_span=16, ngram_size=3, ngram_max_count=5)
    gen = torch.Generator().manual_seed(width)
    streams = _streams(gen, 40, 300)
    slots = SlotMap(capacity=4)  # grows while requests join
    detector = RepeatDetector(config, slots)
    reference = ReferenceRepeat(config)
    positions = {f"r{i}": 0 for i in range(len(streams))}
    begin = {f"r{i}": 3 * i for i in range(len(streams))}
    got, want = [], []
    for wave in range(600):
        live = [r for r in positions if begin[r] <= wave and positions[r] < 300]
        if not live:
            continue
        batch = []
        for r in live:
            n = 1 + (wave + int(r[1:])) % width
            stream = streams[int(r[1:])]
            batch.append(stream[positions[r] : positions[r] + n])
            positions[r] += n
        for row, findings in detector.add_wave(slots.slots(live), WaveTokens(batch)):
            got += [(wave, live[row], f) for f in findings]
        for r, tokens in zip(live, batch, strict=True):
            want += [(wave, r, f) for f in reference.add(r, tokens)]
        done = [r for r in live if positions[r] >= 300]
        slots.release(done)
    assert len(want) > 40 and {f[2][0] for f in want} == {"loop", "ngram"}
    assert got == want
    assert len(slots) == 0 and slots.capacity >= 16


def test_wave_tokens_and_out_of_range_rows_on_a_ragged_wave():
    from guard.detectors.slots import WaveTokens

    wave = WaveTokens([[1, 2], [], [60, 3, 4], [-1]])
    assert wave.lengths.tolist() == [2, 0, 3, 1] and not wave.uniform
    assert wave.padded.tolist() == [[1, 2, 0], [0, 0, 0], [60, 3, 4], [-1, 0, 0]]
    assert rows_out_of_range(wave, 50).tolist() == [2, 3]
    assert rows_out_of_range(WaveTokens([[1], [2]]), 50).tolist() == []


def test_spec_acceptance_alarms_when_acceptance_jumps_above_its_baseline(tmp_path):
    """A healthy engine accepts about a third of its drafts; one request turns repetitive and
    accepts them all: a "jump" incident for that request, once, and none for the others."""
    spec = SpecAcceptanceConfig(window_waves=8, request_window=8, min_drafts=12, jump_above=0.4)
    suite, sent, _ = make_suite(tmp_path, spec_acceptance=spec)
    ids = ["a", "b", "c", "d"]
    runner = Runner(ids)
    drafts = {r: [1, 2, 3] for r in ids}
    for wave in range(1, 81):
        suite.on_schedule(
            wave, types.SimpleNamespace(finished_req_ids=set(), scheduled_spec_decode_tokens=drafts)
        )
        degenerate = wave > 40
        sampled = [[7, 7, 7, 7] if (r == "a" and degenerate) else [5, 6] for r in ids]  # 3/3 or 1/3
        suite.on_output(wave, runner, types.SimpleNamespace(req_ids=ids, sampled_token_ids=sampled))
    jumps = [i for i in sent if i.type == "spec_acceptance"]
    assert [i.request_id for i in jumps] == ["a"], [(i.request_id, i.summary) for i in jumps]
    evidence = json.loads(jumps[0].evidence_json)
    assert evidence["kind"] == "jump" and evidence["rate"] >= 0.75
    assert evidence["baseline"] == pytest.approx(1 / 3, abs=0.1)
    assert 40 < jumps[0].wave <= 48
    assert "jumped" in jumps[0].summary
    assert suite.spec.drafted_total == 80 * 12


def test_deferred_token_detectors_report_on_their_thread_with_the_wave_they_saw(tmp_path):
    """What the processor runs: the engine thread queues each wave's tokens; the repeat
    detector runs on the detector thread and its finding names the wave of the tokens."""
    sent = []
    reporter = IncidentReporter(
        IncidentsConfig(), run_id="r", current_wave=lambda: 999, sink=sent.append
    )
    config = DetectorsConfig(dump=DumpConfig(directory=str(tmp_path), min_free_bytes=0))
    suite = DetectorSuite(
        config, reporter, EvidenceDumper(config.dump, "r", "x"), defer_tokens=True
    )
    suite.start()
    runner = Runner(["a", "b"])
    for wave in range(1, 41):
        out = types.SimpleNamespace(req_ids=["a", "b"], sampled_token_ids=[[5], [wave % 49]])
        suite.on_output(wave, runner, out)
    suite.close()  # drains what is still queued
    hits = [(i.request_id, i.wave, json.loads(i.evidence_json)["kind"]) for i in sent]
    # the 4-gram 5555 is seen 8 times at token 11; a period-1 loop needs min_span 32 tokens
    assert hits == [("a", 11, "ngram"), ("a", 32, "loop")]
    assert suite.deferred.queue == collections.deque()


def test_a_detector_thread_that_falls_behind_drops_the_oldest_waves_and_counts_them(
    tmp_path, monkeypatch
):
    """The queue is bounded: the engine thread never waits for the detectors, and each wave
    they skip is counted in a reading the sidecar exports."""
    from guard.detectors import suite as suite_mod

    monkeypatch.setattr(suite_mod, "MAX_QUEUED", 5)
    reporter = IncidentReporter(
        IncidentsConfig(), run_id="r", current_wave=lambda: 0, sink=list().append
    )
    config = DetectorsConfig(dump=DumpConfig(directory=str(tmp_path), min_free_bytes=0))
    suite = DetectorSuite(
        config, reporter, EvidenceDumper(config.dump, "r", "x"), defer_tokens=True
    )
    runner = Runner(["a"])  # not started: nothing drains the queue
    for wave in range(1, 13):
        suite.on_output(
            wave, runner, types.SimpleNamespace(req_ids=["a"], sampled_token_ids=[[wave]])
        )
    assert len(suite.deferred.queue) == 5 and suite.deferred.dropped == 7
    assert ("detector_waves_dropped", 7.0, {}) in suite.probe_values()
    suite.close()


def test_row_check_is_read_after_sampling_and_never_waited_for_on_the_hot_path(tmp_path):
    """Stand-in for an accelerator (none here): the copy's event says "not done" until the
    test completes it. The suite must not wait for it (no synchronize) while the check is
    young, reads it once the event is done, and names the NaN request of *its* wave."""

    class Event:
        def __init__(self):
            self.done = False
            self.waited = False

        def query(self):
            return self.done

        def synchronize(self):
            self.waited = True
            self.done = True

    events = []

    def copy(self, tensor):
        events.append(Event())
        return tensor.clone(), events[-1]

    suite, sent, _ = make_suite(tmp_path)
    suite._copies.copy = types.MethodType(copy, suite._copies)
    runner = Runner(["a", "b"])
    logits = torch.randn(2, 50)
    logits[1, 3] = float("nan")
    out = types.SimpleNamespace(req_ids=["a", "b"], sampled_token_ids=[[1], [2]])
    suite.on_logits(5, runner, logits, None)
    suite.on_output(5, runner, out)  # the copy is "in flight": not read, not waited for
    assert sent == [] and not events[0].waited
    events[0].done = True
    suite.on_logits(6, runner, torch.randn(2, 50), None)
    suite.on_output(6, runner, out)  # read after wave 6's sampling, reported as wave 5
    (hit,) = [i for i in sent if i.type == "logits_finite"]
    assert (hit.wave, hit.request_id) == (5, "b") and not events[0].waited
    for wave in (7, 8, 9):  # checks that never complete: with three in flight the oldest waits
        suite.on_logits(wave, runner, torch.randn(2, 50), None)
        suite.on_output(wave, runner, out)
    assert [e.waited for e in events] == [False, True, True, False, False]
