"""Binding the guard to the real upstream runner classes, and the post-import hooks."""

from __future__ import annotations

import importlib
import inspect
import sys
import uuid
from types import SimpleNamespace

import pytest

from ascend_runtime.attach import import_hooks
from ascend_runtime.attach.binder import BINDINGS, bind_all, bind_runner_class
from ascend_runtime.attach.points import AttachPoint
from guard.config.runtime_guard import GuardConfig
from guard.decorators import install, is_guarded, unwrap
from guard.processor import GuardProcessor
from telemetry.wire.proto import guard_pb2

METHODS = ("execute_model", "sample_tokens")


def _v1_runner():
    pytest.importorskip("vllm")
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return GPUModelRunner


def _mrv2_runner():
    pytest.importorskip("vllm")
    import vllm.v1.worker.cpu.shm  # noqa: F401 - MRV2 imports on CPU only after this (notes §1.11)
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    return GPUModelRunner


RUNNERS = {"v1": _v1_runner, "mrv2": _mrv2_runner}


@pytest.fixture(params=sorted(RUNNERS))
def upstream(request):
    """(kind, real class, {name: original function}) — the real class is checked untouched after."""
    cls = RUNNERS[request.param]()
    originals = {name: cls.__dict__[name] for name in METHODS}
    for name, fn in originals.items():
        assert not is_guarded(fn), f"{cls.__qualname__}.{name} is already guarded before the test"
    yield request.param, cls, originals
    install(None)
    for name, fn in originals.items():
        assert cls.__dict__[name] is fn, f"the test changed the real {cls.__qualname__}.{name}"


def throwaway(cls):
    return type(f"Guarded{cls.__name__}", (cls,), {name: cls.__dict__[name] for name in METHODS})


class Sentinel(Exception):
    pass


class Stub:
    """A `self` that raises on the first attribute the bare method reads, naming it. What the
    guard itself reads of a runner when streaming starts (guard/stream/placement.py: the device
    it opened, its model config) is there, as on every vLLM runner."""

    device = None
    vllm_config = None

    def __getattr__(self, name):
        raise Sentinel(name)


class RaisingOutput:
    def __getattr__(self, name):
        raise Sentinel(f"scheduler_output.{name}")


def _first_error(call):
    try:
        call()
    except Exception as exc:  # noqa: BLE001
        return type(exc), exc.args
    return None


def test_bind_guards_both_methods(upstream):
    _, cls, originals = upstream
    sub = throwaway(cls)
    assert bind_runner_class(sub) == list(METHODS)
    for name in METHODS:
        wrapper = sub.__dict__[name]
        assert is_guarded(wrapper)
        assert unwrap(wrapper) is originals[name]
        assert wrapper.__wrapped__ is originals[name]
        assert wrapper.__name__ == name
        assert inspect.signature(wrapper) == inspect.signature(originals[name])
        # the subclass sees the guard, the real class does not
        assert getattr(sub, name) is wrapper
        assert getattr(cls, name) is originals[name]


def test_signature_binds_the_worker_arguments(upstream):
    kind, cls, _ = upstream
    sub = throwaway(cls)
    bind_runner_class(sub)
    step = inspect.signature(sub.execute_model)
    sample = inspect.signature(sub.sample_tokens)
    runner, so = object(), object()
    bound = step.bind(runner, so, intermediate_tensors=None)
    assert bound.arguments["scheduler_output"] is so
    assert step.bind(runner, so, None).arguments["intermediate_tensors"] is None
    assert sample.bind(runner, None).arguments["grammar_output"] is None
    assert sample.bind(runner, grammar_output=so).arguments["grammar_output"] is so
    if kind == "mrv2":
        # the worker's dummy / profile runs
        bound = step.bind(runner, so, dummy_run=True, skip_attn_for_dummy_run=True, is_profile=True)
        assert bound.arguments["dummy_run"] is True
        assert bound.arguments["is_profile"] is True
    else:
        with pytest.raises(TypeError):
            step.bind(runner, so, dummy_run=True)
    with pytest.raises(TypeError):
        step.bind(runner, so, not_an_argument=1)


def test_guard_off_call_reaches_the_bare_function(upstream):
    _, cls, originals = upstream
    sub = throwaway(cls)
    bind_runner_class(sub)
    install(None)
    for name in METHODS:
        arg = RaisingOutput()
        direct = _first_error(lambda n=name, a=arg: originals[n](Stub(), a))
        via_guard = _first_error(lambda n=name, a=arg: getattr(sub, n)(Stub(), a))
        assert direct is not None
        assert via_guard == direct


def test_guard_on_exception_from_the_real_method_propagates(upstream):
    _, cls, originals = upstream
    sub = throwaway(cls)
    bind_runner_class(sub)
    processor = GuardProcessor(
        GuardConfig(sidecar="localhost:1"),
        lambda runner: guard_pb2.RankInfo(run_id="r"),
        lambda *a, **k: SimpleNamespace(
            start=lambda rank=None, spool=None: None,
            offer=lambda r: None,
            stop=lambda: None,
            offer_probe=lambda *a: None,
            offer_incident=lambda i: None,
        ),
    )
    install(processor)
    arg = RaisingOutput()
    direct = _first_error(lambda: originals["execute_model"](Stub(), arg))
    assert _first_error(lambda: sub.execute_model(Stub(), arg)) == direct
    assert processor.wave == 1
    assert processor.errors.total == 0


def test_binding_twice_is_a_no_op(upstream):
    _, cls, originals = upstream
    sub = throwaway(cls)
    bind_runner_class(sub)
    first = {name: sub.__dict__[name] for name in METHODS}
    assert bind_runner_class(sub) == list(METHODS)
    for name in METHODS:
        assert sub.__dict__[name] is first[name]
        assert unwrap(sub.__dict__[name]) is originals[name]


def test_subclass_without_own_methods_is_left_alone(upstream):
    _, cls, _ = upstream
    empty = type("NoOverrides", (cls,), {})
    assert bind_runner_class(empty) == []
    assert not set(METHODS) & set(empty.__dict__)


def test_runner_attach_points_name_the_installed_classes():
    from ascend_runtime.attach.points import ATTACH_POINTS

    pytest.importorskip("vllm")
    import vllm.v1.worker.cpu.shm  # noqa: F401

    from ascend_runtime.attach.detect import installed_versions

    found = {}
    for point in ATTACH_POINTS:
        if point.component != "model_runner" or not point.module.startswith("vllm."):
            continue
        if point.absent_from(installed_versions()) is not None:
            continue  # a runner this release does not hold (the table's spans)
        cls = getattr(importlib.import_module(point.module), point.qualname)
        found[(point.module, point.qualname)] = cls
        assert isinstance(cls, type)
        assert callable(getattr(cls, point.method, None)), point
        # an owned point's class defines the method; an inherited one's does not
        assert (point.method in cls.__dict__) is (not point.inherited), point
    assert ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner") in found
    assert ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner") in found
    # classes that only inherit the methods are covered by the attach point of a base class
    for key, cls in found.items():
        owners = {next(k for k in cls.__mro__ if method in k.__dict__) for method in METHODS}
        assert owners <= set(found.values()), key


# -- import hooks ---------------------------------------------------------------------------


@pytest.fixture
def modules(tmp_path, monkeypatch):
    """Write throwaway modules on sys.path; forget them (and pending hooks) afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    created: list[str] = []

    def write(source: str, package: bool = False) -> str:
        name = f"agtest_{uuid.uuid4().hex[:10]}"
        if package:
            (tmp_path / name).mkdir()
            (tmp_path / name / "__init__.py").write_text("")
            (tmp_path / name / "sub.py").write_text(source)
            created.extend([name, f"{name}.sub"])
        else:
            (tmp_path / f"{name}.py").write_text(source)
            created.append(name)
        importlib.invalidate_caches()
        return name

    yield write
    for name in created:
        sys.modules.pop(name, None)
        import_hooks._finder.pending.pop(name, None)


def test_when_imported_fires_at_once_for_an_imported_module():
    calls = []
    import_hooks.when_imported("json", calls.append)
    import json

    assert calls == [json]
    assert "json" not in import_hooks._finder.pending


def test_when_imported_fires_once_on_a_later_import(modules):
    name = modules("VALUE = 41\n")
    calls, other = [], []
    import_hooks.when_imported(name, calls.append)
    import_hooks.when_imported(name, lambda m: other.append(m.VALUE))
    assert calls == [] and other == []
    assert name not in sys.modules
    module = importlib.import_module(name)
    assert calls == [module]
    assert other == [41]  # fired after the module body ran
    importlib.import_module(name)
    importlib.reload(module)
    assert calls == [module] and other == [41]
    assert name not in import_hooks._finder.pending
    # and once imported, a new hook fires immediately, once
    late = []
    import_hooks.when_imported(name, late.append)
    assert late == [sys.modules[name]]


def test_when_imported_for_a_submodule(modules):
    package = modules("X = 1\n", package=True)
    calls = []
    import_hooks.when_imported(f"{package}.sub", calls.append)
    importlib.import_module(package)
    assert calls == []
    sub = importlib.import_module(f"{package}.sub")
    assert calls == [sub]


def test_when_imported_for_a_missing_module_never_fires(modules):
    calls = []
    name = f"agtest_missing_{uuid.uuid4().hex[:8]}"
    import_hooks.when_imported(name, calls.append)
    try:
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(name)
        assert calls == []
    finally:
        import_hooks._finder.pending.pop(name, None)


def test_bind_all_binds_a_runner_when_its_module_is_imported(modules):
    name = modules(
        "class Runner:\n"
        "    def execute_model(self, scheduler_output, intermediate_tensors=None):\n"
        "        return ('ran', scheduler_output)\n"
        "    def sample_tokens(self, grammar_output):\n"
        "        return grammar_output\n"
        "class Other:\n"
        "    pass\n"
    )
    rt = ("cpu-v1",)
    points = [
        AttachPoint("model_runner", name, "Runner", "execute_model", "step", rt),
        AttachPoint("model_runner", name, "Runner", "sample_tokens", "sample", rt),
        AttachPoint("model_runner", name, "NotThere", "execute_model", "step", rt),
        AttachPoint("model_runner", name, "Other", "execute_model", "step", rt),
    ]
    bind_all(points)
    module = importlib.import_module(name)
    assert is_guarded(module.Runner.execute_model)
    assert is_guarded(module.Runner.sample_tokens)
    assert not is_guarded(getattr(module.Other, "execute_model", None))
    assert [BINDINGS[p].status for p in points] == ["bound", "bound", "missing", "missing"]
    assert BINDINGS[points[2]].reason == f"no class NotThere in {name}"
    assert BINDINGS[points[3]].reason == "Other defines no execute_model"
    install(None)
    assert module.Runner().execute_model(5) == ("ran", 5)


def test_mrv2_sampler_hands_the_detectors_the_request_ids_of_its_batch():
    """MRV2's real `Sampler.__call__(self, logits, input_batch)`, wrapped as its attach point
    says: the logits and the batch's `req_ids` reach the processor before the real call runs
    (MRV2's runner has no `input_batch` for the detectors to read them from)."""
    pytest.importorskip("vllm")
    import torch
    import vllm.v1.worker.cpu.shm  # noqa: F401
    from vllm.v1.worker.gpu.sample.sampler import Sampler

    from ascend_runtime.attach.actions import WRAPPERS
    from ascend_runtime.attach.points import ATTACH_POINTS

    assert list(inspect.signature(Sampler.__call__).parameters)[:3] == [
        "self", "logits", "input_batch"
    ]  # fmt: skip
    (point,) = [p for p in ATTACH_POINTS if p.module == "vllm.v1.worker.gpu.sample.sampler"]
    assert (point.method, point.action) == ("__call__", "batch_logits")
    wrapped = WRAPPERS[point.action](Sampler.__call__, point)
    seen = []

    class Processor:
        wants_logits = True

        def on_logits(self, logits, rows_per_req, req_ids=None):
            seen.append((logits, rows_per_req, req_ids))

    logits = torch.zeros(2, 5)
    batch = SimpleNamespace(req_ids=["a", "b"])  # the real call fails on what it lacks
    install(Processor())
    try:
        assert _first_error(lambda: wrapped(Stub(), logits, batch)) is not None
        assert _first_error(lambda: wrapped(Stub(), logits=logits, input_batch=batch)) is not None
    finally:
        install(None)
    assert seen == [(logits, None, ["a", "b"])] * 2
    assert unwrap(wrapped) is Sampler.__call__


def test_mrv2_rejection_sampler_hands_the_detectors_each_requests_rows_and_id():
    """MRV2's real `RejectionSampler.__call__(self, logits, input_batch, draft_logits, ...)`,
    wrapped as its attach point says. MRV2 calls it instead of the sampler on a wave with drafts;
    the target logits hold drafts + 1 rows per request, laid out by the batch's
    `cu_num_logits_np`, which is built here as MRV2's `prepare_inputs` builds it (cumsum of
    drafts + 1 bonus). The detectors get those rows per request and the batch's ids: the rows
    past one per request are the draft tokens vLLM's spec-decode counters count
    (`num_draft_tokens`), and a bad row maps to the request whose draft it verifies. Logits
    compacted by adaptive verification (rows not adding up) name no request rather than a
    wrong one; an inner sampler is not checked twice."""
    pytest.importorskip("vllm")
    import numpy as np
    import torch
    import vllm.v1.worker.cpu.shm  # noqa: F401
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler

    from ascend_runtime.attach.actions import WRAPPERS
    from ascend_runtime.attach.points import ATTACH_POINTS
    from guard.detectors.logits import rows_to_requests

    assert list(inspect.signature(RejectionSampler.__call__).parameters)[:4] == [
        "self", "logits", "input_batch", "draft_logits"
    ]  # fmt: skip
    (point,) = [p for p in ATTACH_POINTS if p.qualname == "RejectionSampler" and "gpu" in p.module]
    assert (point.module, point.method, point.action) == (
        "vllm.v1.worker.gpu.spec_decode.rejection_sampler", "__call__", "batch_verify_logits"
    )  # fmt: skip
    wrapped = WRAPPERS[point.action](RejectionSampler.__call__, point)
    seen = []

    class Processor:
        wants_logits = True
        logits_checked = False

        def on_logits(self, logits, rows_per_req, req_ids=None):
            seen.append((logits, rows_per_req, req_ids, self.logits_checked))

    drafts = np.array([2, 0, 3], dtype=np.int32)  # scheduled_spec_decode_tokens per request
    cu_num_logits_np = np.empty(len(drafts) + 1, dtype=np.int32)
    cu_num_logits_np[0] = 0
    np.cumsum(drafts + 1, out=cu_num_logits_np[1:])
    # the real call fails on what this batch lacks, after the hook
    batch = SimpleNamespace(
        req_ids=["a", "b", "c"], cu_num_logits_np=cu_num_logits_np,
        num_draft_tokens=int(drafts.sum()), num_draft_tokens_per_req=drafts,
    )  # fmt: skip
    logits = torch.zeros(int(cu_num_logits_np[-1]), 7)
    compacted = torch.zeros(5, 7)
    processor = Processor()
    install(processor)
    try:
        assert _first_error(lambda: wrapped(Stub(), logits, batch, None)) is not None
        assert processor.logits_checked is False, "reset after the call, even a failed one"
        assert _first_error(lambda: wrapped(Stub(), logits=logits, input_batch=batch)) is not None
        assert _first_error(lambda: wrapped(Stub(), compacted, batch)) is not None
    finally:
        install(None)
    assert seen[0] == seen[1] == (logits, [3, 1, 4], ["a", "b", "c"], False)
    rows, ids = seen[0][1], seen[0][2]
    assert sum(rows) - len(ids) == batch.num_draft_tokens == 5
    assert [r - 1 for r in rows] == drafts.tolist()
    # row 6 verifies request c's second draft; row 3 is b's only (bonus) row
    assert rows_to_requests([3, 6], ids, rows) == {"b": [3], "c": [6]}
    assert seen[2] == (compacted, None, None, False)
    assert unwrap(wrapped) is RejectionSampler.__call__


def test_the_guard_runs_beneath_the_runners_inference_mode(upstream):
    """Bound as the binder binds a runner's step and sample points, the guard runs inside
    the method's own `@torch.inference_mode()`, as a runner carrying the decorators in source
    has it (`@torch.inference_mode()` outside, the guard inside); `unwrap` gives vLLM's method."""
    import torch

    from ascend_runtime.attach.actions import WRAPPERS

    _, cls, originals = upstream
    seen = []

    class Processor:
        def run_step(self, fn, runner, args, kwargs):
            seen.append(("step", torch.is_inference_mode_enabled()))
            raise Sentinel("step")

        def run_sample(self, fn, runner, args, kwargs):
            seen.append(("sample", torch.is_inference_mode_enabled()))
            raise Sentinel("sample")

    for name, action in (("execute_model", "step"), ("sample_tokens", "sample")):
        point = AttachPoint("model_runner", cls.__module__, cls.__qualname__, name, action, ("x",))
        wrapped = WRAPPERS[action](originals[name], point)
        assert is_guarded(wrapped) and unwrap(wrapped) is originals[name]
        assert inspect.signature(wrapped) == inspect.signature(originals[name])
        install(Processor())
        try:
            with pytest.raises(Sentinel):
                wrapped(Stub(), None)
        finally:
            install(None)
    assert not torch.is_inference_mode_enabled()
    assert seen == [("step", True), ("sample", True)]
