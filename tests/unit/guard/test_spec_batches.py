"""The batched, array-backed acceptance tracker against a plain Python model of the same rules.

`Reference` judges every wave on its own, with a deque per request (as the tracker did before
its state moved into arrays): add the wave's entries, judge the wave window and each request's
window that got an entry, then fold the wave into the baseline. The tracker queues waves and
judges a batch at once; its findings, their order, the windows' sums, the baselines and the
totals must be the same, wherever the batches end. The runs mix draft counts of 0-5, rows with
no tokens back, small windows that fill and slide, bands and jumps that open and close, and
requests that come and go.
"""

from __future__ import annotations

import collections
import random

import pytest

from guard.config.detectors import SpecAcceptanceConfig
from guard.detectors.spec import AcceptanceTracker
from guard.wave.schedule import WaveTokens


class Sums:
    def __init__(self, size: int) -> None:
        self.entries: collections.deque = collections.deque(maxlen=size)

    @property
    def drafted(self) -> int:
        return sum(d for d, _ in self.entries)

    @property
    def accepted(self) -> int:
        return sum(a for _, a in self.entries)


class Reference:
    def __init__(self, config: SpecAcceptanceConfig) -> None:
        self.config = config
        self.wave_window = Sums(config.window_waves)
        self.requests: dict[str, Sums] = {}
        self.out_of_band: set[str] = set()
        self.jumped: set[str] = set()
        self.baseline, self.baseline_waves = 0.0, 0
        self.drafted_total = self.accepted_total = 0

    def forget(self, req_id: str) -> None:
        self.requests.pop(req_id, None)
        self.out_of_band.discard(req_id)
        self.jumped.discard(req_id)

    def wave(self, wave: int, req_ids, drafts, sampled) -> list[tuple]:
        config = self.config
        got = {}
        for req_id, tokens in zip(req_ids, sampled, strict=True):
            if drafts.get(req_id) and tokens:
                got[req_id] = (len(drafts[req_id]), len(tokens) - 1)
                window = self.requests.setdefault(req_id, Sums(config.request_window))
                window.entries.append(got[req_id])
        drafted = sum(d for d, _ in got.values())
        accepted = sum(a for _, a in got.values())
        if not drafted:
            return []
        self.wave_window.entries.append((drafted, accepted))
        self.drafted_total += drafted
        self.accepted_total += accepted
        ready = config.jump_above > 0 and self.baseline_waves >= config.window_waves
        found = []
        for key in ("", *got):
            window = self.wave_window if key == "" else self.requests[key]
            if window.drafted < config.min_drafts:
                continue
            rate = window.accepted / window.drafted
            outside = not config.min_rate <= rate <= config.max_rate
            sums = (window.drafted, window.accepted)
            if outside and key not in self.out_of_band:
                found.append((wave, key, "band", sums, self.baseline))
            (self.out_of_band.add if outside else self.out_of_band.discard)(key)
            if ready:
                jump = rate - self.baseline >= config.jump_above
                if jump and not outside and key not in self.jumped:
                    found.append((wave, key, "jump", sums, self.baseline))
                (self.jumped.add if jump else self.jumped.discard)(key)
        rate = accepted / drafted
        if self.baseline_waves == 0:
            self.baseline = rate
        else:
            self.baseline += (1.0 / config.baseline_waves) * (rate - self.baseline)
        self.baseline_waves += 1
        return found


def as_tuples(found) -> list[tuple]:
    return [
        (j.wave, j.key, j.kind, (j.window.drafted, j.window.accepted), j.baseline) for j in found
    ]


def run(seed: int, waves: int = 400, grid: bool = False) -> tuple[int, int]:
    """One random run; returns how many (bands, jumps) it found, so the caller can check the
    run exercised both. `grid`: the same requests every wave, each with drafts and tokens
    back (the tracker's sort-free path)."""
    rng = random.Random(seed)
    config = SpecAcceptanceConfig(
        min_rate=rng.choice([0.05, 0.2, 0.35]),
        max_rate=rng.choice([0.6, 0.8, 1.0]),
        window_waves=rng.randint(2, 10),
        request_window=rng.randint(1, 9),
        min_drafts=rng.randint(1, 16),
        jump_above=rng.choice([0.0, 0.15, 0.3]),
        baseline_waves=rng.randint(2, 24),
    )
    tracker, reference = AcceptanceTracker(config), Reference(config)
    active: list[str] = []
    bias: dict[str, float] = {}  # each request's current chance that a draft is accepted
    next_id, got, expected = 0, [], []
    for wave in range(1, waves + 1):
        finished = [r for r in active if not grid and rng.random() < 0.03]
        tracker.forget_requests(finished)  # a wave's finished requests, together
        for req_id in finished:
            active.remove(req_id)
            reference.forget(req_id)
        while (not grid or wave == 1) and len(active) < rng.randint(1, 12):
            active.append(f"r{next_id}")
            bias[f"r{next_id}"] = rng.random()
            next_id += 1
        for req_id in active:
            if rng.random() < 0.05:  # the stream turns easy or hard to draft for
                bias[req_id] = rng.choice([0.0, 0.1, 0.9, 1.0, rng.random()])
        if grid:
            req_ids = list(active)
            drafts = {r: [7] * rng.randint(1, 5) for r in req_ids}
        else:
            req_ids = rng.sample(active, rng.randint(1, len(active)))
            drafts = {r: [7] * rng.choice([0, 0, 1, 2, 3, 4, 5]) for r in req_ids}
            if rng.random() < 0.05:
                drafts = {}  # a wave without drafts
        sampled = []
        for req_id in req_ids:
            k = len(drafts.get(req_id, ()))
            accepted = sum(rng.random() < bias[req_id] for _ in range(k))
            empty = not grid and rng.random() < 0.03
            sampled.append([] if empty else [1] * (accepted + 1))
        got += as_tuples(tracker.add_wave(wave, req_ids, drafts, WaveTokens(sampled)))
        expected += reference.wave(wave, req_ids, drafts, sampled)
        if rng.random() < 0.05:  # an idle flush, or the run's end, between batches
            got += as_tuples(tracker.flush())
    got += as_tuples(tracker.flush())
    assert got == expected
    assert (tracker.drafted_total, tracker.accepted_total) == (
        reference.drafted_total,
        reference.accepted_total,
    )
    assert tracker.baseline == reference.baseline
    for req_id in active:
        window = reference.requests.get(req_id)
        sums = (window.drafted, window.accepted) if window else (0, 0)
        assert tuple(tracker.window(req_id) or (0, 0)) == sums, req_id  # None: never in a wave
    return sum(f[2] == "band" for f in got), sum(f[2] == "jump" for f in got)


@pytest.mark.parametrize("seed", range(16))
def test_batched_judgement_equals_judging_each_wave_alone(seed):
    run(seed)


@pytest.mark.parametrize("seed", range(4))
def test_the_same_requests_every_wave_judge_alike(seed):
    run(seed, grid=True)


def test_the_runs_open_band_and_jump_episodes_for_requests_and_the_wave_window():
    """The random runs above must exercise what they compare: both kinds of finding, for the
    wave window and for requests."""
    bands = jumps = 0
    for seed in range(16):
        b, j = run(seed)
        bands, jumps = bands + b, jumps + j
    assert bands > 50 and jumps > 20, (bands, jumps)


def test_a_request_that_finishes_mid_batch_is_still_judged_and_its_slot_starts_clean():
    config = SpecAcceptanceConfig(request_window=4, min_drafts=4, window_waves=64, min_rate=0.5)
    tracker = AcceptanceTracker(config)
    for wave in (1, 2):  # 0 of 4 accepted, twice: the request is outside [0.5, 1]
        tracker.add_wave(wave, ["a"], {"a": [1, 2, 3, 4]}, WaveTokens([[5]]))
    tracker.forget_requests(["a"])  # finished while its waves are queued
    assert [(j.wave, j.key, j.kind) for j in tracker.flush()] == [(1, "", "band"), (1, "a", "band")]
    assert tracker.window("a") is None
    tracker.add_wave(3, ["b"], {"b": [1, 2, 3, 4]}, WaveTokens([[5, 5, 5, 5, 5]]))
    tracker.flush()
    assert tracker.window("b") == (4, 4)  # the reused slot kept nothing of a's
