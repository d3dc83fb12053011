"""The attach-point registry, the binder on the real upstream vLLM classes installed here, and
`ascend-guard doctor` in live mode (a fresh interpreter, as an operator runs it)."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from ascend_runtime.attach import actions, detect
from ascend_runtime.attach.binder import BINDINGS, bind_point
from ascend_runtime.attach.points import (
    ACTIONS,
    ATTACH_POINTS,
    COMPONENTS,
    RUNTIMES,
    AttachPoint,
    points_for,
)
from guard.config.runtime_guard import GuardConfig
from guard.decorators import install, is_guarded, unwrap
from guard.processor import GuardProcessor
from telemetry.wire.proto import guard_pb2
from tests.support.side_by_side import side_by_side

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.timeout(300)


def test_registry_is_consistent():
    assert len(set(ATTACH_POINTS)) == len(ATTACH_POINTS)
    assert len({(p.target, p.runtimes) for p in ATTACH_POINTS}) == len(ATTACH_POINTS)
    for point in ATTACH_POINTS:
        assert point.component in COMPONENTS, point
        assert point.action in ACTIONS and point.action in actions.WRAPPERS, point
        assert point.runtimes and set(point.runtimes) <= set(RUNTIMES), point
    for runtime in RUNTIMES:
        components = {p.component for p in points_for(runtime)}
        required = {"worker", "model_runner", "kv_cache", "communicator"}
        if not runtime.startswith("cpu"):
            required |= {"graph", "speculator"}
        assert required <= components, runtime
        actions_here = {p.action for p in points_for(runtime)}
        assert {"step", "sample", "dummy_step", "kv_init"} <= actions_here, runtime
    with pytest.raises(ValueError, match="unknown runtime 'tpu'"):
        points_for("tpu")


def test_every_ascend_speculator_method_has_a_point():
    """EAGLE, MTP, DFlash, DSpark (MRV2) and one V1 entry that covers every V1 proposer."""
    names = {p.qualname for p in points_for("ascend-mrv2", "speculator")}
    assert names == {
        "AscendAutoRegressiveSpeculator", "AscendDFlashSpeculator", "AscendDSparkSpeculator",
    }  # fmt: skip
    (v1,) = points_for("ascend-v1", "speculator")
    assert v1.method == "propose_draft_token_ids"


LIVE_CHECK = textwrap.dedent(
    """
    import importlib, inspect, json, sys
    from ascend_runtime.attach.points import points_for
    from ascend_runtime.doctor.coverage import live_rows
    from guard.decorators import is_guarded, unwrap

    runtime = sys.argv[1]
    rows = live_rows(points_for(runtime), "cpu")
    checked = []
    for row in rows:
        p = row.point
        if row.status == "not in this version":
            checked.append({"target": p.target, "status": row.status, "detail": row.detail})
            continue
        cls = getattr(importlib.import_module(p.module), p.qualname)
        method = getattr(cls, p.method)
        bare = inspect.unwrap(unwrap(method))  # through torch.inference_mode too
        checked.append({
            "target": p.target, "status": row.status, "guarded": is_guarded(method),
            "bare_from": inspect.getsourcefile(bare), "bare_name": bare.__name__,
            "owner_defines": p.method in cls.__dict__,
        })
    print(json.dumps(checked))
    """
)


def _fresh(args, **env_extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASCEND_GUARD_")}
    env.update(PYTHONPATH=str(REPO), VLLM_TARGET_DEVICE="cpu", **env_extra)
    return subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=240, cwd=REPO
    )


# every fresh interpreter this module's tests read: each is some 11 s of importing vLLM on one
# core, so they run side by side, from the first test that asks for one
FRESH_RUNS = {
    **{
        runtime: ["-c", LIVE_CHECK, runtime]
        for runtime in ("cpu-v1", "cpu-mrv2", "cuda-v1", "cuda-mrv2")
    },
    "doctor-cpu": ["-m", "telemetry.cli", "doctor", "--json"],
    "doctor-ascend": ["-m", "telemetry.cli", "doctor", "--runtime", "ascend-v1"],
}


@pytest.fixture(scope="module")
def fresh_runs():
    yield from side_by_side(_fresh, {key: (args,) for key, args in FRESH_RUNS.items()})


@pytest.mark.parametrize("runtime", ["cpu-v1", "cpu-mrv2", "cuda-v1", "cuda-mrv2"])
def test_real_upstream_classes_are_bound(runtime, fresh_runs):
    """Binds the real installed vLLM classes (CPU runners and worker; the GPU V1 and MRV2
    runners, graph managers and speculators import on a CPU host) and checks each one
    independently: the class attribute is a guard wrapper around vLLM's own function of the same
    name. A point whose class the installed release cannot hold (the table's spans: the
    standalone MRV2 CPU runner came in 0.34) is "not in this version", and only such a point."""
    pytest.importorskip("vllm")
    from ascend_runtime.attach.detect import installed_versions

    out = fresh_runs[runtime].result()
    assert out.returncode == 0, out.stderr[-3000:]
    checked = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(checked) == len(points_for(runtime))
    absent = {p.target for p in points_for(runtime) if p.absent_from(installed_versions())}
    assert {r["target"] for r in checked if r["status"] == "not in this version"} == absent
    if runtime == "cpu-mrv2":
        assert absent == {
            p.target for p in points_for(runtime) if p.qualname == "StandaloneCPUModelRunner"
        }
    for row in checked:
        if row["target"] in absent:
            continue
        assert row["status"] == "bound", row
        assert row["guarded"], row
        # the device graph class's capture/replay rows wrap torch's own methods
        package = "torch" if row["target"].startswith("torch.") else "vllm"
        assert f"/site-packages/{package}/" in row["bare_from"], row
        assert row["bare_name"] == row["target"].rsplit(".", 1)[1], row


def test_doctor_live_cpu_reports_everything_bound(fresh_runs):
    """`ascend-guard doctor` as an operator runs it on this CPU host."""
    pytest.importorskip("vllm")
    out = fresh_runs["doctor-cpu"].result()
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    document = json.loads(out.stdout)
    assert document["platform"] == "cpu" and document["ok"] is True
    assert document["runtime"] == document["detected_runtime"] == "cpu-v1"
    assert document["versions"]["vllm"] == __import__("vllm").__version__
    statuses = {(p["class"], p["method"]): p["status"] for p in document["attach_points"]}
    assert statuses[("CPUModelRunner", "execute_model")] == "bound"
    assert statuses[("CPUWorker", "execute_dummy_batch")] == "bound"
    assert statuses[("CPUModelRunner", "initialize_kv_cache")] == "bound"
    assert set(statuses.values()) == {"bound"}


def test_doctor_live_for_ascend_here_says_not_installed_and_exits_1(fresh_runs):
    pytest.importorskip("vllm")
    out = fresh_runs["doctor-ascend"].result()
    assert out.returncode == 1, out.stderr[-2000:]
    assert "not installed (vllm_ascend)" in out.stdout
    assert "next: install the missing package" in out.stdout
    summary = [line for line in out.stdout.splitlines() if "attach points bound" in line]
    n = len(points_for("ascend-v1"))
    upstream = len([p for p in points_for("ascend-v1") if p.package == "vllm"])
    assert summary == [
        f"{upstream} of {n} attach points bound for runtime ascend-v1; {n - upstream} not "
        "(not installed)"
    ]


def test_version_skew_is_skipped_with_one_log_line(tmp_path, monkeypatch):
    """A class whose method was renamed in the installed version: skipped, logged once, the
    process carries on; the other attach point of the same class is bound."""
    from structlog.testing import capture_logs

    name = f"agskew_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "class Runner:\n"
        "    def execute_model_v2(self, so):\n        return so\n"
        "    def sample_tokens(self, go):\n        return go\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    module = __import__(name)
    rt = ("cpu-v1",)
    step = AttachPoint("model_runner", name, "Runner", "execute_model", "step", rt)
    sample = AttachPoint("model_runner", name, "Runner", "sample_tokens", "sample", rt)
    with capture_logs() as logged:
        assert bind_point(step, module).status == "missing"
        assert bind_point(sample, module).status == "bound"
    skipped = [e for e in logged if e["event"] == "attach_point_skipped"]
    assert len(skipped) == 1
    assert skipped[0]["target"] == f"{name}.Runner.execute_model"
    assert skipped[0]["reason"] == "Runner defines no execute_model"
    assert skipped[0]["log_level"] == "warning"
    assert BINDINGS[step].status == "missing"
    sys.modules.pop(name, None)


class _Streamer:
    def __init__(self):
        self.waves = []

    def start(self, rank=None, spool=None):
        pass

    def offer_probe(self, name, value, labels):
        pass

    def offer(self, wave):
        self.waves.append(wave)

    def stop(self):
        pass


def _processor():
    streamer = _Streamer()
    processor = GuardProcessor(
        GuardConfig(sidecar="localhost:1"),
        lambda runner: guard_pb2.RankInfo(run_id="r", runner=type(runner).__name__),
        lambda *a, **k: streamer,
    )
    return processor, streamer


def test_idle_dp_rank_dummy_batch_is_a_dummy_wave():
    """vLLM's real `Worker.execute_dummy_batch`, bound as the binder binds it; the model runner
    is a stand-in recording the `_dummy_run` the worker asks for (no model loads here)."""
    pytest.importorskip("vllm")
    from vllm.v1.worker.gpu_worker import Worker

    point = next(
        p for p in ATTACH_POINTS if p.qualname == "Worker" and p.method == "execute_dummy_batch"
    )
    original = Worker.__dict__["execute_dummy_batch"]
    wrapped = actions.WRAPPERS[point.action](original, point)
    assert is_guarded(wrapped) and unwrap(wrapped) is original
    assert inspect.signature(wrapped) == inspect.signature(original)

    calls = []
    runner = SimpleNamespace(
        uniform_decode_query_len=3,
        _dummy_run=lambda n, **kw: calls.append((n, kw)),
    )
    worker = SimpleNamespace(model_runner=runner, randomize_dummy_inputs=False)
    install(None)
    assert wrapped(worker) is None and len(calls) == 1  # guard off: the bare call
    processor, streamer = _processor()
    install(processor)
    try:
        wrapped(worker)
        wrapped(worker)
        processor.close()
    finally:
        install(None)
    assert calls[1:] == [(3, {"uniform_decode": True, "randomize_inputs": False})] * 2
    assert [w.wave for w in streamer.waves] == [1, 2]
    assert all(w.dummy and w.num_reqs == 0 and not w.sampled for w in streamer.waves)


def _device_time_worker():
    """A worker base class with its step and sample bound as the binder binds `device_time`
    points, and a subclass that inherits them (as vLLM's CPUWorker inherits the GPU worker's)."""

    class Worker:
        def execute_model(self, scheduler_output):
            return ("ran", scheduler_output)

        def sample_tokens(self, grammar_output):
            return ("sampled", grammar_output)

    class CPUWorker(Worker):
        pass

    originals = {}
    for method in ("execute_model", "sample_tokens"):
        point = AttachPoint("worker", __name__, "Worker", method, "device_time", ("cpu",))
        originals[method] = Worker.__dict__[method]
        setattr(Worker, method, actions.WRAPPERS["device_time"](originals[method], point))
    return Worker, CPUWorker, originals


def test_device_time_steps_aside_where_there_is_no_device_clock(monkeypatch):
    """On a platform with no device clock (CPU) each wrapper puts the bare method back at its
    first guarded call, the one that finds the clock missing and the one after it alike, so
    later steps pay no frame of the guard's; with the guard off they stay."""
    monkeypatch.setitem(detect._detected, "platform", "cpu")
    monkeypatch.delitem(actions._state, "timer", raising=False)
    Worker, CPUWorker, originals = _device_time_worker()
    install(None)
    assert CPUWorker().execute_model(1) == ("ran", 1)
    assert is_guarded(Worker.__dict__["execute_model"])  # guard off: nothing decided yet
    processor, _ = _processor()
    install(processor)
    try:
        worker = CPUWorker()
        assert worker.execute_model(2) == ("ran", 2)  # finds no clock, steps aside
        assert Worker.__dict__["execute_model"] is originals["execute_model"]
        assert is_guarded(Worker.__dict__["sample_tokens"])
        assert worker.sample_tokens(3) == ("sampled", 3)  # the clock known missing
        assert Worker.__dict__["sample_tokens"] is originals["sample_tokens"]
        assert not {"execute_model", "sample_tokens"} & set(CPUWorker.__dict__)
        assert worker.execute_model(4) == ("ran", 4)
    finally:
        install(None)
    assert processor.errors.total == 0


def test_device_time_that_cannot_learn_the_platform_counts_an_error_and_steps_aside(monkeypatch):
    """Detecting the platform fails (a broken driver library, say): the step still runs, the
    error is counted, and there is no device time in this process from then on."""

    def broken_detection():
        raise RuntimeError("driver library failed to load")

    monkeypatch.delitem(actions._state, "timer", raising=False)
    monkeypatch.setattr(actions, "_timer", broken_detection)
    Worker, CPUWorker, originals = _device_time_worker()
    processor, _ = _processor()
    install(processor)
    try:
        assert CPUWorker().execute_model(1) == ("ran", 1)
        assert CPUWorker().sample_tokens(2) == ("sampled", 2)
    finally:
        install(None)
    assert processor.errors.total == 1
    assert Worker.__dict__["execute_model"] is originals["execute_model"]
    assert Worker.__dict__["sample_tokens"] is originals["sample_tokens"]


def test_device_time_stays_and_times_each_phase_with_a_device_clock(monkeypatch):
    phases = []

    class Timer:  # stands in for device_time.PhaseTimer over a device's events
        def start(self, phase):
            phases.append(phase)
            return phase

        def end(self, started):
            phases.append(("end", started))

    monkeypatch.setitem(actions._state, "timer", Timer())
    Worker, CPUWorker, _ = _device_time_worker()
    processor, _ = _processor()
    install(processor)
    try:
        for step in range(2):
            assert CPUWorker().execute_model(step) == ("ran", step)
            assert CPUWorker().sample_tokens(step) == ("sampled", step)
    finally:
        install(None)
    assert is_guarded(Worker.__dict__["execute_model"])
    assert is_guarded(Worker.__dict__["sample_tokens"])
    timed = ["execute_model", ("end", "execute_model"), "sample_tokens", ("end", "sample_tokens")]
    assert phases == timed * 2


def test_probe_wrappers_pass_through_when_the_guard_is_off():
    calls = []

    class Runner:
        def initialize_kv_cache(self, kv_cache_config):
            calls.append(kv_cache_config)
            return "done"

    point = AttachPoint(
        "kv_cache", __name__, "Runner", "initialize_kv_cache", "kv_init", ("cpu-v1",)
    )
    wrapped = actions.WRAPPERS["kv_init"](Runner.initialize_kv_cache, point)
    install(None)
    assert wrapped(Runner(), "cfg") == "done" and calls == ["cfg"]


def test_a_failing_probe_is_counted_and_the_call_still_returns():
    class Runner:
        vllm_config = None  # the KV probe cannot read a config: it fails inside

        def initialize_kv_cache(self, kv_cache_config):
            return "done"

    point = AttachPoint(
        "kv_cache", __name__, "Runner", "initialize_kv_cache", "kv_init", ("cpu-v1",)
    )
    wrapped = actions.WRAPPERS["kv_init"](Runner.initialize_kv_cache, point)
    processor, _ = _processor()
    install(processor)
    try:
        assert wrapped(Runner(), SimpleNamespace(kv_cache_groups=[], num_blocks=1)) == "done"
    finally:
        install(None)
    assert processor.errors.total == 1


def test_idle_dp_rank_dummy_batch_on_mrv2_is_one_dummy_wave():
    """An idle DP rank on Model Runner V2: vLLM's real `Worker.execute_dummy_batch`, bound as
    the binder binds it, calls the runner's `_dummy_run`, which on MRV2 runs the runner's own
    guarded `execute_model(..., dummy_run=True)`; that returns None and no `sample_tokens`
    follows (`_dummy_run` takes the step's state itself). Each dummy batch is one dummy wave,
    not two, and it is sent though no sample phase closes it.

    The runner is a stand-in with MRV2's call structure, its `execute_model` bound with the
    step point's real wrapper: vLLM runs dummy batches only for DP engines in lockstep (MoE
    with expert parallelism), and this host runs neither a MoE model on MRV2's Triton kernels
    in the interpreter in test time nor a DP group of dense engines (they are independent
    replicas, tests/e2e/test_data_parallel.py). The real MRV2 signatures are checked to take
    the calls the stand-in makes."""
    pytest.importorskip("vllm")
    import vllm.v1.worker.cpu.shm  # noqa: F401 - MRV2 imports on CPU only after this
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    (worker_point,) = [
        p for p in ATTACH_POINTS if p.qualname == "Worker" and p.method == "execute_dummy_batch"
    ]
    (step_point,) = [
        p for p in ATTACH_POINTS
        if p.module == "vllm.v1.worker.gpu.model_runner" and p.method == "execute_model"
    ]  # fmt: skip
    execute_dummy_batch = actions.WRAPPERS[worker_point.action](
        Worker.__dict__["execute_dummy_batch"], worker_point
    )
    real_step = inspect.signature(GPUModelRunner.execute_model)
    real_dummy = inspect.signature(GPUModelRunner._dummy_run)
    calls = []

    def bare_execute_model(self, scheduler_output, intermediate_tensors=None, **kwargs):
        real_step.bind(self, scheduler_output, intermediate_tensors, **kwargs)
        calls.append(("execute_model", kwargs.get("dummy_run", False)))

    class Mrv2Runner:
        uniform_decode_query_len = decode_query_len = 1
        execute_model = actions.WRAPPERS["step"](bare_execute_model, step_point)

        def _dummy_run(self, num_tokens, *args, **kwargs):
            real_dummy.bind(self, num_tokens, *args, **kwargs)
            calls.append(("_dummy_run", num_tokens))
            self.execute_model(SchedulerOutput.make_empty(), dummy_run=True)

    worker = SimpleNamespace(model_runner=Mrv2Runner(), randomize_dummy_inputs=False)
    processor, streamer = _processor()
    install(processor)
    try:
        execute_dummy_batch(worker)
        execute_dummy_batch(worker)
        processor.close()
    finally:
        install(None)
    assert calls == [("_dummy_run", 1), ("execute_model", True)] * 2
    assert [w.wave for w in streamer.waves] == [1, 2]
    assert all(w.dummy and w.num_reqs == 0 and not w.sampled for w in streamer.waves)
