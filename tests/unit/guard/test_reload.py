"""Hot reload: the engine-core watcher's stamps, and how a rank applies or refuses them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import guard.config.reload
from guard.config.reload import STAMP_ATTR, STAMP_WAVES, ConfigWatcher, guard_schedule
from guard.config.runtime_guard import GuardConfig, parse_config
from guard.decorators import is_guarded
from guard.processor import GuardProcessor
from telemetry.wire.proto import guard_pb2


def write(path, obj) -> None:
    text = obj if isinstance(obj, str) else json.dumps({"runtime_guard": obj})
    path.write_text(text)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # a visible change


def test_watcher_stages_valid_edits_refuses_broken_ones_and_keeps_inline_keys(tmp_path):
    path = tmp_path / "guard.json"
    write(path, {"engine": "a"})
    current = parse_config({"engine": "a", "buffer_size": 1024})
    watcher = ConfigWatcher(str(path), current, inline={"buffer_size": 1024})
    assert watcher.poll() is None  # unchanged

    write(path, {"engine": "a", "detectors": {"token_repeat": {"enabled": False}}})
    generation, config_json, error, restart = watcher.poll()
    assert (generation, error, restart) == (2, "", ())
    applied = parse_config(json.loads(config_json))
    assert applied.detectors.token_repeat.enabled is False
    assert applied.buffer_size == 1024  # the inline key still wins

    write(path, {"engine": "b", "sidecar": "localhost:7000"})
    generation, config_json, error, restart = watcher.poll()
    assert generation == 3 and restart == ("engine", "sidecar")
    assert parse_config(json.loads(config_json)).engine == "a"  # not applied live

    write(path, {"detectors": {"token_repeat": {"window": 0}}})
    generation, config_json, error, _ = watcher.poll()
    assert generation == 4 and config_json == ""
    assert "runtime_guard.detectors.token_repeat.window: 0 is outside" in error
    write(path, "{broken")
    assert "not valid JSON" in watcher.poll()[2]


def test_schedule_decorator_stamps_a_bounded_number_of_outputs(tmp_path, monkeypatch):
    path = tmp_path / "guard.json"
    write(path, {})
    watcher = ConfigWatcher(str(path), GuardConfig())
    monkeypatch.setattr("guard.config.reload.engine_watcher", lambda: watcher)

    class Scheduler:
        @guard_schedule
        def schedule(self):
            return types.SimpleNamespace()

    assert not hasattr(Scheduler().schedule(), STAMP_ATTR)
    write(path, {"detectors": {"logits_stats": {"every_n_waves": 2}}})
    stamp = watcher.poll()
    outputs = [Scheduler().schedule() for _ in range(STAMP_WAVES + 3)]
    assert all(getattr(o, STAMP_ATTR) == stamp for o in outputs[:STAMP_WAVES])
    assert not any(hasattr(o, STAMP_ATTR) for o in outputs[STAMP_WAVES:])
    assert is_guarded(Scheduler.__dict__["schedule"])  # a watched file: it stays


def test_a_stamp_wrapper_wrapped_again_stays_and_tries_to_step_aside_once(monkeypatch):
    """Another plugin wrapped the scheduler over ours: ours is not on the class, so it stays
    in the chain, and looks for itself there only once, not on every step."""
    monkeypatch.setattr("guard.config.reload.engine_watcher", lambda: None)
    looks = []
    search = guard.config.reload.step_aside
    monkeypatch.setattr("guard.config.reload.step_aside", lambda *a: looks.append(search(*a)))

    class Scheduler:
        def schedule(self):
            return types.SimpleNamespace(step=True)

    ours = guard_schedule(Scheduler.__dict__["schedule"])
    Scheduler.schedule = lambda self: ours(self)  # another plugin's wrapper over ours
    other = Scheduler.__dict__["schedule"]
    assert all(Scheduler().schedule().step for _ in range(3))
    assert looks == [False]  # one look, which did not find it
    assert Scheduler.__dict__["schedule"] is other


def test_schedule_decorator_steps_aside_when_no_config_file_is_watched(monkeypatch):
    """No config file in this engine (the usual `vllm serve`): the first schedule() puts the
    bare method back on the class that holds it, so later steps pay no frame of the guard's."""
    monkeypatch.setattr("guard.config.reload.engine_watcher", lambda: None)

    class Scheduler:
        def schedule(self):
            return types.SimpleNamespace(step=True)

    class AsyncScheduler(Scheduler):
        pass

    original = Scheduler.__dict__["schedule"]
    Scheduler.schedule = guard_schedule(original)
    first = AsyncScheduler().schedule()
    assert first.step and not hasattr(first, STAMP_ATTR)
    assert Scheduler.__dict__["schedule"] is original
    assert "schedule" not in AsyncScheduler.__dict__
    assert AsyncScheduler().schedule().step


class Streamer:
    def __init__(self, *a, **kw):
        self.incidents, self.probes = [], []

    def start(self, rank=None, spool=None):
        pass

    def offer(self, record):
        pass

    def offer_incident(self, incident):
        self.incidents.append(incident)

    def offer_probe(self, name, value, labels):
        self.probes.append((name, value))

    def stop(self):
        pass


def test_a_rank_applies_a_stamp_once_and_reports_a_refused_one_with_a_shared_id():
    rank = guard_pb2.RankInfo(run_id="run9", tp_rank=1, tp_size=2)
    processor = GuardProcessor(GuardConfig(), lambda runner: rank, Streamer)

    def step(stamp=None):
        output = types.SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=None,
                                       num_scheduled_tokens={}, finished_req_ids=set())  # fmt: skip
        if stamp is not None:
            setattr(output, STAMP_ATTR, stamp)
        processor.run_step(lambda runner, so: None, object(), (output,), {})

    step()
    assert processor.detectors is not None and processor.detectors.config.token_repeat.enabled
    new = parse_config({"detectors": {"token_repeat": {"enabled": False}}})
    step((2, new.to_json(), "", ()))
    assert processor.config_generation == 2 and not processor.detectors.config.token_repeat.enabled
    step((2, GuardConfig().to_json(), "", ()))  # the same stamp again: ignored
    assert not processor.detectors.config.token_repeat.enabled
    step((3, "", "runtime_guard.x: unknown key", ()))
    (refused,) = [i for i in processor.streamer.incidents if i.type == "config_reload_failed"]
    assert refused.id == "run9:config:3"  # every rank uses this id: stored once
    assert not processor.detectors.config.token_repeat.enabled and processor.config_generation == 3
    assert ("config_generation", 2.0) in processor.streamer.probes
    assert processor.errors.total == 0


def test_a_suite_rebuilt_by_a_stamp_sees_the_stamped_wave_schedule():
    """The stamp applies before the wave's sampling: the suite it builds gets that wave's
    schedule (here, a finished request logged for the repeat screen), and the old suite,
    closed by then, does not."""
    rank = guard_pb2.RankInfo(run_id="run9", tp_rank=0, tp_size=1)
    processor = GuardProcessor(GuardConfig(), lambda runner: rank, Streamer)

    def step(stamp=None, finished=()):
        output = types.SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=None,
                                       num_scheduled_tokens={}, finished_req_ids=set(finished))  # fmt: skip
        if stamp is not None:
            setattr(output, STAMP_ATTR, stamp)
        processor.run_step(lambda runner, so: None, object(), (output,), {})

    step()
    old = processor.detectors
    new = parse_config({"detectors": {"token_repeat": {"window": 64}}})
    step((2, new.to_json(), "", ()), finished=["done-1"])
    suite = processor.detectors
    assert suite is not old and suite.config.token_repeat.window == 64
    assert list(suite._token_log) == [(2, ("done-1",))]
    assert (2, ("done-1",)) not in list(old._token_log)  # the closed suite is not called
    assert processor.errors.total == 0


def test_config_check_cli(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"runtime_guard": {"detectors": {"token_repeat": {"window": 256}}}}))
    out = subprocess.run(
        [sys.executable, "-m", "telemetry.cli", "config", "check", str(good)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0 and "valid" in out.stdout
    assert "detectors.token_repeat.window  256" in out.stdout
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"detectors": {"logits_finite": {"action": "panic"}}}))
    out = subprocess.run(
        [sys.executable, "-m", "telemetry.cli", "config", "check", str(bad)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 1
    assert (
        "runtime_guard.detectors.logits_finite.action: 'panic' is not one of report, dump"
        in out.stderr
    )
