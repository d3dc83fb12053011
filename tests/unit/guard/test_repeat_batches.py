"""The batched, array-backed repeat detector against a plain Python model of the same rules.

`Reference` keeps each request's tokens in a list and counts its n-grams in a dict, one token
at a time (as the detector did before its state moved into arrays). It follows the documented
batch rules: loops are looked for at a batch's end in requests with `CHECK_EVERY` new tokens;
an n-gram episode that starts inside a batch is reported unless the request is in a loop at
the batch's end; an episode open when a batch begins is judged at the batch's end (still a
repeat, or over), with no new start inside that batch. The streams mix random text, loops of every period, repeated phrases
between fillers, spec-decode waves of 1-4 tokens, empty rows, and requests that come and go.
"""

from __future__ import annotations

import collections
import json
import random
import types

import pytest

from guard.config.detectors import (
    DetectorsConfig,
    DumpConfig,
    TokenRangeConfig,
    TokenRepeatConfig,
)
from guard.config.runtime_guard import IncidentsConfig
from guard.detectors import compiled
from guard.detectors.host import DetectorHost
from guard.detectors.slots import batch_waves
from guard.detectors.suite import IDLE_FLUSH_S
from guard.detectors.tokens import CHECK_EVERY, OVERDUE_BATCHES, RepeatDetector, find_loop
from guard.stream.reporter import IncidentReporter
from guard.wave.schedule import WaveTokens
from telemetry.wire.proto import guard_pb2


class Reference:
    def __init__(self, config: TokenRepeatConfig) -> None:
        self.config = config
        self.grams = config.window - config.ngram_size + 1
        self.requests: dict[str, dict] = {}
        self.waves = 0
        self.finished: list[str] = []

    def add_wave(self, wave: int, req_ids, sampled) -> list:
        if self.waves == 0:  # a batch begins
            for state in self.requests.values():
                state["open"] = state["in_ngram"]
        for req_id, tokens in zip(req_ids, sampled, strict=True):
            state = self.requests.setdefault(req_id, self._new())
            started = None
            for token in tokens:
                self._token(state, token)
                if state["started_now"] is not None:
                    started, state["started_now"] = state["started_now"], None
            if not state["open"]:  # an open episode is judged at the batch's end
                if started is not None:
                    state["starts"].append((wave, started))
                state["in_ngram"] = state["hot"] > 0
            state["since"] += len(tokens)
            state["new"] += len(tokens)
            if tokens:
                state["last_wave"] = wave
        self.waves += 1
        return self.flush() if self.waves >= batch_waves(len(req_ids)) else []

    def finish(self, req_id: str) -> None:
        if req_id in self.requests:
            self.finished.append(req_id)

    def flush(self) -> list:
        config, found = self.config, []
        for req_id, state in self.requests.items():
            if state["new"] and state["since"] >= CHECK_EVERY:
                state["since"] = 0
                loop = find_loop(
                    state["tokens"][-config.window :],
                    config.max_period,
                    config.min_repeats,
                    config.min_span,
                )
                if loop is not None and not state["in_loop"]:
                    found.append((state["last_wave"], req_id, ("loop", *loop)))
                state["in_loop"] = loop is not None
            if state["open"]:
                state["in_ngram"], state["open"] = state["hot"] > 0, False
            if not state["in_loop"]:
                found += [(w, req_id, ("ngram", config.ngram_size, config.ngram_max_count, g))
                          for w, g in state["starts"]]  # fmt: skip
            state["starts"], state["new"] = [], 0
        for req_id in self.finished:
            del self.requests[req_id]
        self.finished, self.waves = [], 0
        return found

    def _new(self) -> dict:
        return {"tokens": [], "grams": collections.deque(), "counts": collections.Counter(),
                "hot": 0, "in_ngram": False, "in_loop": False, "since": 0, "new": 0,
                "starts": [], "started_now": None, "last_wave": 0, "open": False}  # fmt: skip

    def _token(self, state: dict, token: int) -> None:
        size, limit = self.config.ngram_size, self.config.ngram_max_count
        tokens = state["tokens"]
        tokens.append(token)
        if len(tokens) < size:
            return
        gram = tuple(tokens[-size:])
        counts = state["counts"]
        counts[gram] += 1
        state["grams"].append(gram)
        if counts[gram] == limit:
            state["hot"] += 1
            if state["hot"] == 1 and not state["in_ngram"]:
                state["started_now"] = list(gram)
        if len(state["grams"]) > self.grams:
            old = state["grams"].popleft()
            counts[old] -= 1
            if counts[old] == limit - 1:
                state["hot"] -= 1


def stream(rng: random.Random, length: int) -> list[int]:
    """Random text with stretches of loops and of a phrase repeated between fillers."""
    out: list[int] = []
    while len(out) < length:
        kind = rng.random()
        if kind < 0.5:
            out += [rng.randrange(40) for _ in range(rng.randrange(5, 60))]  # small vocabulary
        elif kind < 0.8:
            block = [rng.randrange(1000) for _ in range(rng.randrange(1, 20))]
            out += block * rng.randrange(2, 8)
        else:
            phrase = [rng.randrange(1000) for _ in range(4)]
            for _ in range(rng.randrange(4, 12)):
                out += phrase + [rng.randrange(1000) for _ in range(rng.randrange(0, 6))]
    return out[:length]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "config",
    [TokenRepeatConfig(), TokenRepeatConfig(window=64, min_span=16, ngram_size=3,
                                            ngram_max_count=5, max_period=8)],
    ids=["defaults", "small-window"],
)  # fmt: skip
def test_batched_arrays_find_what_the_plain_model_finds(seed, config):
    rng = random.Random(seed)
    detector, reference = RepeatDetector(config), Reference(config)
    streams: dict[str, list[int]] = {}
    got, want = [], []
    for wave in range(1, 400):
        for req_id in [r for r, s in streams.items() if not s]:  # done: finished this wave
            del streams[req_id]
            detector.forget(req_id)
            reference.finish(req_id)
        while len(streams) < 24 and rng.random() < 0.3:  # up to 90+ slots over the run
            streams[f"s{seed}-{wave}-{len(streams)}"] = stream(rng, rng.randrange(20, 600))
        req_ids, sampled = [], []
        for req_id, rest in streams.items():
            take = rng.choice((0, 1, 1, 1, 1, 2, 4)) if seed % 2 else 1
            sampled.append(rest[:take])
            del rest[:take]
            req_ids.append(req_id)
        got += detector.add_wave(wave, req_ids, WaveTokens(sampled))
        want += reference.add_wave(wave, req_ids, sampled)
    got += detector.flush()
    want += reference.flush()

    def order(found):
        return sorted(found, key=repr)

    assert len(want) > 10, "the streams were meant to raise findings"
    assert {f[2][0] for f in want} == {"loop", "ngram"}
    assert order(got) == order(want)


def test_a_finding_names_the_wave_its_token_came_in_not_the_batch_end():
    config = TokenRepeatConfig(ngram_size=2, ngram_max_count=3)
    detector = RepeatDetector(config)
    found = []
    # the third (7, 9) arrives at wave 6; the batch is screened at its last wave
    tokens = [7, 9, 7, 9, 7, 9] + list(range(200, 200 + batch_waves(2) - 6))
    for wave, token in enumerate(tokens, start=1):
        found += detector.add_wave(wave, ["a", "b"], WaveTokens([[token], [5000 + wave]]))
        if wave < batch_waves(2):
            assert found == []  # nothing reported before the batch's end
    assert found == [(6, "a", ("ngram", 2, 3, [7, 9]))]


def test_a_slot_freed_by_a_finished_request_starts_clean():
    detector = RepeatDetector(TokenRepeatConfig(window=64, min_span=16))
    loop = [5, 6, 7, 8] * 8
    for wave in range(8):
        assert detector.add_wave(wave, ["old"], WaveTokens([loop[wave * 4 : wave * 4 + 4]])) == []
    found = detector.flush()
    assert [(f[1], f[2][0]) for f in found] == [("old", "loop")]
    slot = detector.requests.lookup("old")
    detector.forget("old")
    assert "old" not in detector.requests
    # the new request gets the freed slot, and none of the old loop's state
    detector.add_wave(9, ["new"], WaveTokens([[1, 2, 3, 4]]))
    assert detector.requests.lookup("new") == slot
    assert detector.recent_tokens("new") == [1, 2, 3, 4]  # writes the queued wave
    assert int(detector.total[slot]) == 4 and not detector.in_loop[slot]


def test_a_request_finished_inside_a_batch_still_has_its_tokens_screened():
    detector = RepeatDetector(TokenRepeatConfig(window=64, min_span=16))
    for wave in range(4):
        detector.add_wave(wave, ["a", "b"], WaveTokens([[42] * 4, [wave]]))
    detector.forget("a")  # finished: its slot is held until the batch is screened
    detector.add_wave(4, ["b", "c"], WaveTokens([[9], [10]]))
    assert detector.requests.lookup("c") != 0 and len(detector.requests) == 2
    found = detector.flush()
    assert [(f[0], f[1], f[2][:2]) for f in found] == [(3, "a", ("loop", 1))]
    assert "a" not in detector.requests


def test_a_long_single_add_is_cut_to_fit_the_ring():
    detector = RepeatDetector(TokenRepeatConfig())
    found = detector.add("r", list(range(1024)) + [3] * 64)  # in pieces of 256
    assert [f[:2] for f in found] == [("loop", 1)]
    assert detector.recent_tokens("r")[-3:] == [3, 3, 3]


def test_the_detector_host_screens_an_idle_batch_with_the_heartbeat(tmp_path):
    """The processor's detector observer runs the idle flush on the streamer thread's
    heartbeat batches (and only those), so a queued finding goes out with the next one."""
    sent = []
    reporter = IncidentReporter(
        IncidentsConfig(), run_id="r", current_wave=lambda: 0, sink=sent.append
    )
    host = DetectorHost(reporter, lambda *a: None, lambda where: None)
    compiled.load()  # a worker loads it in the background: done before these waves
    config = DetectorsConfig(dump=DumpConfig(directory=str(tmp_path)))
    host.build(config, guard_pb2.RankInfo(run_id="r"))
    runner = types.SimpleNamespace(input_batch=types.SimpleNamespace(req_ids=["a"]))
    for wave in range(1, 6):  # the processor calls the host's wave delegate: its suite
        host.wave_delegate().on_output(
            wave, runner, types.SimpleNamespace(req_ids=["a"], sampled_token_ids=[[11] * 8])
        )
    host.fill_batch(guard_pb2.Batch(), with_heartbeat=False)  # hands the five waves over
    assert sent == [] and host.suite.repeat.pending  # less than a batch: not screened yet
    host.suite._last_tokens -= 2 * IDLE_FLUSH_S  # as if the engine had been idle since
    host.fill_batch(guard_pb2.Batch(), with_heartbeat=False)
    assert sent == []
    host.fill_batch(guard_pb2.Batch(), with_heartbeat=True)
    assert [(i.type, i.wave) for i in sent] == [("token_repeat", 5)]


def _worker_host(
    tmp_path, sent: list, token_range: TokenRangeConfig | None = None, **token_repeat
) -> DetectorHost:
    """The detectors as a worker builds them (kernels loaded in the background: here, in
    already), reporting into `sent`."""
    reporter = IncidentReporter(
        IncidentsConfig(), run_id="r", current_wave=lambda: 0, sink=sent.append
    )
    host = DetectorHost(reporter, lambda *a: None, lambda where: None)
    compiled.load()
    config = DetectorsConfig(
        dump=DumpConfig(directory=str(tmp_path), min_free_bytes=0),
        token_repeat=TokenRepeatConfig(**token_repeat),
        token_range=token_range or TokenRangeConfig(),
    )
    host.build(config, guard_pb2.RankInfo(run_id="r"))
    return host


def _loop_waves(host: DetectorHost, waves: range) -> None:
    runner = types.SimpleNamespace(input_batch=types.SimpleNamespace(req_ids=["a"]))
    for wave in waves:  # the processor calls the host's wave delegate: its suite
        host.wave_delegate().on_output(
            wave, runner, types.SimpleNamespace(req_ids=["a"], sampled_token_ids=[[11] * 8])
        )


def test_a_workers_full_token_batches_are_screened_by_the_streamer_thread(tmp_path):
    """In a worker the engine thread only logs: the streamer thread's next batch (any
    batch, not only a heartbeat) hands the waves over and screens a full batch, and the
    finding names its own wave."""
    sent: list = []
    host = _worker_host(tmp_path, sent)
    full = batch_waves(1)
    _loop_waves(host, range(1, full + 1))
    assert sent == [] and not host.suite.repeat.pending  # logged, left for the streamer
    host.fill_batch(guard_pb2.Batch(), with_heartbeat=False)
    # a loop is looked for at the batch's end: it names the batch's last wave
    assert [(i.type, i.wave) for i in sent] == [("token_repeat", full)]
    assert not host.suite.repeat.pending


def test_a_streamer_that_does_not_come_leaves_the_screen_to_the_engine_thread(tmp_path):
    sent: list = []
    # a window that holds the overdue batches' 8 tokens a wave (else their bound screens first)
    host = _worker_host(tmp_path, sent, window=1024)
    full = batch_waves(1)
    _loop_waves(host, range(1, OVERDUE_BATCHES * full))
    assert sent == []
    _loop_waves(host, range(OVERDUE_BATCHES * full, OVERDUE_BATCHES * full + 1))
    assert [(i.type, i.wave) for i in sent] == [("token_repeat", OVERDUE_BATCHES * full)]
    assert not host.suite.repeat.pending


def test_with_action_dump_the_engine_thread_screens_its_own_batches(tmp_path):
    """A dump's evidence reads the runner as of the batch, so the screen stays in place."""
    sent: list = []
    host = _worker_host(tmp_path, sent, action="dump")
    _loop_waves(host, range(1, batch_waves(1) + 1))
    (incident,) = sent
    assert (incident.type, incident.wave) == ("token_repeat", batch_waves(1))
    assert any(a.startswith("dump") for a in incident.actions)


class _Runner:
    """Stands in for a V1 runner: the attributes the suite reads (a vocabulary of 100)."""

    def __init__(self, req_ids: list[str]) -> None:
        self.input_batch = types.SimpleNamespace(req_ids=req_ids)
        self.model_config = types.SimpleNamespace(get_vocab_size=lambda: 100)


def _wave(host: DetectorHost, wave: int, sampled: dict[str, list[int]], finished=()) -> None:
    """One wave through the processor's two detector hooks, on the host's wave delegate (its
    suite): the schedule (with the requests that finished before it), then the output."""
    req_ids = list(sampled)
    suite = host.wave_delegate()
    suite.on_schedule(wave, types.SimpleNamespace(finished_req_ids=set(finished)))
    output = types.SimpleNamespace(req_ids=req_ids, sampled_token_ids=list(sampled.values()))
    suite.on_output(wave, _Runner(req_ids), output)


def test_a_workers_logged_tokens_are_handed_over_by_the_streamer_thread(tmp_path):
    """The engine thread only logs a wave's tokens, however many waves come; the streamer
    thread's next batch hands them over together, and an id out of the vocabulary is
    reported then, at its own wave, with its request and ids."""
    sent: list = []
    host = _worker_host(tmp_path, sent)
    full = batch_waves(2)
    for wave in range(1, full + 1):
        _wave(host, wave, {"a": [5], "b": [150 if wave == 3 else 6]})
    assert sent == [] and not host.suite.repeat.pending  # logged, not handed over yet
    host.fill_batch(guard_pb2.Batch(), with_heartbeat=False)
    (incident,) = [i for i in sent if i.type == "token_range"]  # and token_repeat's loops
    assert (incident.wave, incident.request_id) == (3, "b")
    assert json.loads(incident.evidence_json) == {"ids": [150], "vocab_size": 100}
    assert not host.suite._token_log and not host.suite.repeat.pending  # and screened


def test_a_streamer_that_does_not_come_leaves_the_hand_over_to_the_engine_thread(tmp_path):
    """With `OVERDUE_BATCHES` batches' worth logged and no streamer batch, the engine thread
    hands them over itself at the wave that fills them: the log stays bounded, and a finding
    still names its own wave."""
    sent: list = []
    host = _worker_host(tmp_path, sent)
    overdue = OVERDUE_BATCHES * batch_waves(2)
    for wave in range(1, overdue):
        _wave(host, wave, {"a": [5], "b": [150 if wave == 7 else 6]})
    assert sent == [] and len(host.suite._token_log) == overdue - 1
    _wave(host, overdue, {"a": [5], "b": [6]})
    ranges = [(i.wave, i.request_id) for i in sent if i.type == "token_range"]
    assert ranges == [(7, "b")] and not host.suite._token_log


def test_a_request_that_finished_between_logged_waves_is_screened_under_its_own_id(tmp_path):
    """A request's end is logged after its last tokens: the hand-over gives the detector its
    tokens first and only then frees its slot, so its loop is still found under its id, the
    request that comes after gets a slot of its own, and the finished one keeps none."""
    sent: list = []
    host = _worker_host(tmp_path, sent, window=64, min_span=16)
    for wave in range(1, 6):
        _wave(host, wave, {"a": [42] * 4, "b": [wave]})
    for wave in range(6, batch_waves(2) + 1):
        _wave(host, wave, {"b": [wave], "c": [7, wave]}, finished=("a",) if wave == 6 else ())
    host.fill_batch(guard_pb2.Batch(), with_heartbeat=False)  # the streamer's screen
    assert [(i.type, i.wave, i.request_id) for i in sent] == [("token_repeat", 5, "a")]
    requests = host.suite.repeat.requests
    assert "a" not in requests and sorted(requests.slot_of) == ["b", "c"]


def test_a_hand_over_whose_repeat_screen_fails_still_checks_the_range(tmp_path, monkeypatch):
    """token_repeat's kernel failing to load (no numba) raises out of the hand-over, for the
    caller to count, but only after token_range has checked every wave handed over."""
    sent: list = []
    host = _worker_host(tmp_path, sent)
    monkeypatch.setattr(compiled, "_kernels", None)
    monkeypatch.setattr(compiled, "_error", ImportError("no numba"))
    full = batch_waves(1)
    for wave in range(1, full + 1):  # 16 tokens a wave: the 17th passes a batch's bound
        _wave(host, wave, {"a": [5] * 15 + [150 if wave == 20 else 5]})
    assert sent == []  # logged, for the streamer thread
    with pytest.raises(RuntimeError, match="did not load"):
        host.suite.screen_ready()  # its hand-over screens at the bound
    assert [(i.type, i.wave) for i in sent] == [("token_range", 20)]
    assert host.suite.repeat.off


def test_with_token_range_action_dump_each_wave_is_handed_over_as_it_comes(tmp_path):
    """A dump's evidence reads the runner as of its wave, so nothing waits in the log."""
    sent: list = []
    host = _worker_host(tmp_path, sent, token_range=TokenRangeConfig(action="dump"))
    _wave(host, 1, {"a": [5]})
    _wave(host, 2, {"a": [-1]})
    (incident,) = sent
    assert (incident.type, incident.wave) == ("token_range", 2)
    assert any(a.startswith("dump") for a in incident.actions)
    assert not host.suite._token_log


def _looping_waves(detector: RepeatDetector, waves: range) -> None:
    for wave in waves:
        detector.add_wave(wave, ["a", "b"], WaveTokens([[7] * 4, [wave]]))


def test_waves_stay_queued_while_the_kernel_loads_in_the_background(monkeypatch):
    """A worker's first screens find the kernel still loading (numba compiling it, seconds on
    a machine's first run): the waves wait in the queue, and the screen after the load finds
    what they hold, at their own waves."""
    detector = RepeatDetector(TokenRepeatConfig(window=64, min_span=16))
    loaded = compiled.load()
    monkeypatch.setattr(compiled, "_kernels", None)
    monkeypatch.setattr(compiled, "_loading", True)
    _looping_waves(detector, range(2 * batch_waves(2)))  # past a batch: nothing screened
    assert detector.flush() == [] and detector.pending
    assert int(detector.total.sum()) == 0
    monkeypatch.setattr(compiled, "_kernels", loaded)  # the load finished
    monkeypatch.setattr(compiled, "_loading", False)
    found = detector.flush()  # one batch of them all: a loop is looked for at its end
    last = 2 * batch_waves(2) - 1
    assert [(f[0], f[1], f[2][:2]) for f in found] == [(last, "a", ("loop", 1))]
    assert int(detector.total.sum()) == 2 * batch_waves(2) * 5 and not detector.pending


def test_an_evidence_read_or_a_close_waits_for_a_kernel_still_loading(monkeypatch):
    """The waves queued while the kernel loads are screened by `flush(wait=True)` (the suite's
    close) and by an evidence read, which load the kernel themselves."""
    detector = RepeatDetector(TokenRepeatConfig(window=64, min_span=16))
    monkeypatch.setattr(compiled, "_kernels", None)
    monkeypatch.setattr(compiled, "_loading", True)
    _looping_waves(detector, range(4))
    assert detector.flush() == [] and int(detector.total.sum()) == 0
    assert detector.recent_tokens("a")[-4:] == [7] * 4  # loaded and screened first
    assert compiled._kernels is not None
    assert detector.flush()[0][:2] == (3, "a")  # the finding it held
    _looping_waves(detector, range(4, 8))
    monkeypatch.setattr(compiled, "_kernels", None)
    assert detector.flush(wait=True) == [] and int(detector.total.sum()) == 8 * 5


def test_a_kernel_that_failed_to_load_is_named_by_the_screen(monkeypatch):
    detector = RepeatDetector(TokenRepeatConfig())
    monkeypatch.setattr(compiled, "_kernels", None)
    monkeypatch.setattr(compiled, "_error", ImportError("No module named 'numba'"))
    detector.add_wave(0, ["a"], WaveTokens([[1]]))
    with pytest.raises(RuntimeError, match="the detectors' kernels did not load.*numba"):
        detector.flush()
    # raised once, to be counted; the detector is off and keeps nothing queued
    assert detector.off and not detector.pending
    assert detector.add_wave(1, ["a"], WaveTokens([[1]])) == [] and detector.flush() == []
    assert not detector.pending
