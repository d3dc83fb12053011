"""Version-aware attach points: which vLLM releases hold which runner, and what the binder, the
doctor and its source scan make of a point a release cannot hold.

The source trees are built by the tests, without downloading anything: from the attach-point
table itself, laid out as the vLLM wheels lay them out (0.33 holds both runners; 0.34 dropped
`gpu_model_runner.py`, `cpu_model_runner.py` and the V1 samplers and added
`cpu/standalone_model_runner.py`), and from tests/data/vllm_layouts.json, which
`tools/compat_scan.py --record` read from the real 0.33.0 and 0.34.0 wheels' Python source
(module, class and the table's methods each class defines; no vLLM code)."""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import pytest

from ascend_runtime.attach import detect
from ascend_runtime.attach.binder import BINDINGS, bind_point
from ascend_runtime.attach.points import (
    ATTACH_POINTS,
    NOT_IN_VERSION,
    VLLM_STANDALONE_CPU_RUNNER,
    VLLM_V1_RUNNER,
    AttachPoint,
    Span,
    release_of,
    runner_generations,
)
from ascend_runtime.doctor.source_scan import scan_tree
from telemetry.cli.main import main as cli_main

VLLM_POINTS = [p for p in ATTACH_POINTS if p.package == "vllm"]
LAYOUTS = json.loads((Path(__file__).parents[2] / "data" / "vllm_layouts.json").read_text())
# the modules the 0.34.0 wheel no longer has (checked against its file list)
GONE_IN_034 = {
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.v1.sample.sampler",
    "vllm.v1.sample.rejection_sampler",
}
NEW_IN_034 = {"vllm.v1.worker.cpu.standalone_model_runner"}


@pytest.fixture(autouse=True)
def keep_logging(monkeypatch):
    """The doctor CLI sets up logging for its process; in pytest that would bind structlog to
    this test's captured stderr, which later tests' loggers would then write to."""
    from telemetry.wire import logs

    monkeypatch.setattr(logs, "configure", lambda **kwargs: None)


def vllm_tree(root: Path, version: str, *, drop=(), rename_method=None) -> Path:
    """A `vllm` package declaring `version` in `_version.py` (as the wheels do) that holds every
    vLLM attach point of the table except the modules in `drop`; `rename_method` =
    (module, class, method, new name) breaks one point."""
    classes: dict[str, dict[str, set[str]]] = {}
    for p in VLLM_POINTS:
        methods = classes.setdefault(p.module, {}).setdefault(p.qualname, set())
        if not p.inherited:
            methods.add(p.method)
    for module, by_class in classes.items():
        if module in drop:
            continue
        parts = module.split(".")
        for i in range(1, len(parts)):
            init = root.joinpath(*parts[:i], "__init__.py")
            init.parent.mkdir(parents=True, exist_ok=True)
            init.touch()
        lines = ["class Base:", "    pass", ""]
        for cls, methods in sorted(by_class.items()):
            lines.append(f"class {cls}(Base):")
            for method in sorted(methods) or ["unrelated"]:
                if rename_method and rename_method[:3] == (module, cls, method):
                    method = rename_method[3]
                lines.append(f"    def {method}(self, *args, **kwargs):\n        pass")
        root.joinpath(*parts[:-1], parts[-1] + ".py").write_text("\n".join(lines) + "\n")
    (root / "vllm" / "_version.py").write_text(
        f"__version__ = version = '{version}'\n"
        f"__version_tuple__ = version_tuple = {tuple(release_of(version))}\n"
    )
    return root


def statuses(results) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for r in results:
        out.setdefault(r.status, set()).add(r.point.module)
    return out


# -- the table's version logic --------------------------------------------------------------


@pytest.mark.parametrize(
    "version, release",
    [
        ("0.34.0", (0, 34, 0)),
        ("v0.27.1", (0, 27, 1)),
        ("0.34.0rc1.dev12+gabcdef", (0, 34, 0)),
        ("0.33.1.dev3+g1234.cpu", (0, 33, 1)),
        ("0.32.0+cpu", (0, 32, 0)),
        ("0.10", (0, 10)),
        ("main", ()),
    ],
)
def test_release_of(version, release):
    assert release_of(version) == release


def test_spans_hold_the_releases_they_name():
    assert [VLLM_V1_RUNNER.holds(v) for v in ("0.32.0", "0.33.9", "0.34.0rc1", "0.34.0", "1.0")] == [
        True, True, False, False, False,
    ]  # fmt: skip
    assert [VLLM_STANDALONE_CPU_RUNNER.holds(v) for v in ("0.33.0", "0.34.0", "0.35.1")] == [
        False, True, True,
    ]  # fmt: skip
    assert VLLM_V1_RUNNER.why_not("0.34.0") == "V1 runner removed in 0.34"
    assert (
        VLLM_STANDALONE_CPU_RUNNER.why_not("0.33.0") == "standalone MRV2 CPU runner added in 0.34"
    )
    window = Span("thing", since="0.30", removed_in="0.31.2")
    assert [window.holds(v) for v in ("0.29.9", "0.30.0", "0.31.1", "0.31.2")] == [
        False, True, True, False,
    ]  # fmt: skip


def test_runner_generations_by_release():
    assert runner_generations("vllm", "0.32.0") == ("mrv2", "v1")
    assert runner_generations("vllm", "0.33.0") == ("mrv2", "v1")
    assert runner_generations("vllm", "0.34.0") == ("mrv2",)
    assert runner_generations("vllm", None) == ("mrv2", "v1")
    assert runner_generations("vllm_ascend", "0.99.0") == ("mrv2", "v1")


def test_the_removed_points_are_exactly_the_v1_runner_and_samplers():
    """The ten points the 0.34.0 wheel lacks are the ones the table marks removed in 0.34, and
    every one of them belongs to a V1 runtime only."""
    removed = [p for p in ATTACH_POINTS if p.absent_from({"vllm": "0.34.0"})]
    assert {p.module for p in removed} == GONE_IN_034
    assert len(removed) == 10
    assert all(all(r.endswith("-v1") for r in p.runtimes) for p in removed)
    assert not [
        p for p in ATTACH_POINTS if p.absent_from({"vllm": "0.33.0"}) and p.span is VLLM_V1_RUNNER
    ]
    # vllm-ascend points are judged by vllm-ascend's release, not vLLM's
    ascend = [p for p in ATTACH_POINTS if p.package == "vllm_ascend"]
    assert not [p for p in ascend if p.absent_from({"vllm": "0.34.0", "vllm_ascend": "0.34.0"})]
    # unknown or unparsable versions never excuse a point
    assert not [p for p in ATTACH_POINTS if p.absent_from({}) or p.absent_from({"vllm": "main"})]


def test_cpu_mrv2_has_both_mrv2_cpu_runners():
    runners = {
        (p.module, p.qualname)
        for p in ATTACH_POINTS
        if "cpu-mrv2" in p.runtimes and p.component == "model_runner"
    }
    assert runners == {
        ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner"),
        ("vllm.v1.worker.cpu.model_runner", "CPUModelRunner"),
        ("vllm.v1.worker.cpu.standalone_model_runner", "StandaloneCPUModelRunner"),
    }


# -- source scan and doctor on trees laid out like each release ------------------------------


def test_034_tree_without_the_v1_runner_counts_none_missing(tmp_path, capsys):
    tree = vllm_tree(tmp_path, "0.34.0", drop=GONE_IN_034)
    by_status = statuses(scan_tree(tree))
    assert by_status[NOT_IN_VERSION] == GONE_IN_034
    assert "missing" not in by_status
    assert by_status["found"] >= NEW_IN_034

    assert cli_main(["doctor", "--source", str(tree)]) == 0
    out = capsys.readouterr().out
    assert "runners: vllm 0.34.0 holds mrv2 (V1 runner removed in 0.34)" in out
    n = len(VLLM_POINTS)
    assert f"{n - 10} of {n - 10} attach points found for runtime all; 0 not (none); " in out
    assert "10 not in this version (V1 runner removed in 0.34)" in out
    assert "update ascend_runtime/attach/points.py" not in out


def test_a_point_really_missing_from_034_still_fails(tmp_path, capsys):
    module, cls = "vllm.v1.worker.gpu.model_runner", "GPUModelRunner"
    tree = vllm_tree(
        tmp_path, "0.34.0", drop=GONE_IN_034,
        rename_method=(module, cls, "sample_tokens", "sample_tokens_v3"),
    )  # fmt: skip
    missing = [r for r in scan_tree(tree) if r.status == "missing"]
    assert [r.point.target for r in missing] == [f"{module}.{cls}.sample_tokens"]

    assert cli_main(["doctor", "--source", str(tree), "--json"]) == 1
    document = json.loads(capsys.readouterr().out)
    assert document["ok"] is False
    by_status: dict[str, int] = {}
    for p in document["attach_points"]:
        by_status[p["status"]] = by_status.get(p["status"], 0) + 1
    assert by_status["missing"] == 1 and by_status[NOT_IN_VERSION] == 10
    assert cli_main(["doctor", "--source", str(tree)]) == 1
    assert "update ascend_runtime/attach/points.py" in capsys.readouterr().out


def test_033_tree_must_hold_both_runners(tmp_path):
    """0.33 still has the V1 runner: a 0.33 tree without it is missing those points; the
    standalone CPU runner it does not have yet is not in this version."""
    complete = vllm_tree(tmp_path / "ok", "0.33.0", drop=NEW_IN_034)
    by_status = statuses(scan_tree(complete))
    assert by_status[NOT_IN_VERSION] == NEW_IN_034
    assert "missing" not in by_status

    broken = vllm_tree(tmp_path / "bad", "0.33.0", drop=GONE_IN_034 | NEW_IN_034)
    assert statuses(scan_tree(broken))["missing"] == GONE_IN_034


def test_a_tree_without_a_version_excuses_nothing(tmp_path):
    tree = vllm_tree(tmp_path, "0.34.0", drop=GONE_IN_034)
    (tree / "vllm" / "_version.py").unlink()
    assert statuses(scan_tree(tree))["missing"] == GONE_IN_034


def test_a_034_tree_that_still_has_v1_shows_it_found(tmp_path):
    """The table's span only excuses a point the tree lacks; what is there is reported."""
    tree = vllm_tree(tmp_path, "0.34.0")
    assert set(statuses(scan_tree(tree))) == {"found"}


def test_doctor_runtime_cpu_v1_on_034(tmp_path, capsys):
    tree = vllm_tree(tmp_path, "0.34.0", drop=GONE_IN_034)
    assert cli_main(["doctor", "--source", str(tree), "--runtime", "cpu-v1"]) == 0
    out = capsys.readouterr().out
    v1 = [p for p in VLLM_POINTS if "cpu-v1" in p.runtimes and p.module in GONE_IN_034]
    assert f"{len(v1)} not in this version (V1 runner removed in 0.34)" in out


def layout_tree(root: Path, version: str, *, drop_method=None) -> Path:
    """The tree the recorded layout of `version`'s wheel describes; `drop_method` = (module,
    class, method) leaves one method out."""
    recorded = LAYOUTS[version]
    for module, classes in recorded["modules"].items():
        parts = module.split(".")
        for i in range(1, len(parts)):
            init = root.joinpath(*parts[:i], "__init__.py")
            init.parent.mkdir(parents=True, exist_ok=True)
            init.touch()
        lines = ["class Base:", "    pass", ""]
        for cls, methods in sorted(classes.items()):
            lines.append(f"class {cls}(Base):")
            kept = [m for m in methods if drop_method != (module, cls, m)]
            for method in kept or ["unrelated"]:
                lines.append(f"    def {method}(self, *args, **kwargs):\n        pass")
        root.joinpath(*parts[:-1], parts[-1] + ".py").write_text("\n".join(lines) + "\n")
    (root / "vllm" / "_version.py").write_text(f"__version__ = version = '{recorded['version']}'\n")
    return root


@pytest.mark.parametrize(
    "version, absent, reason",
    [
        ("0.33.0", NEW_IN_034, "standalone MRV2 CPU runner added in 0.34"),
        ("0.34.0", GONE_IN_034, "V1 runner removed in 0.34"),
    ],
)
def test_each_recorded_release_has_no_missing_point(tmp_path, version, absent, reason):
    """The real wheels' layouts: nothing missing for the runners each release holds, and the
    points it cannot hold are exactly the other runner's, with the reason. A table change that
    names a vLLM class these releases lack fails here until `make compat` re-records."""
    results = scan_tree(layout_tree(tmp_path, version))
    missing = [r.point.target for r in results if r.status == "missing"]
    assert not missing, f"{missing}: re-record with tools/compat_scan.py --record if intended"
    gone = [r for r in results if r.status == NOT_IN_VERSION]
    assert {r.point.module for r in gone} == absent
    assert {r.detail for r in gone} == {reason}
    assert {r.point for r in results} == set(VLLM_POINTS)


def test_a_method_dropped_from_the_recorded_034_is_missing(tmp_path):
    target = ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "execute_model")
    results = scan_tree(layout_tree(tmp_path, "0.34.0", drop_method=target))
    missing = [r for r in results if r.status == "missing"]
    assert [r.point.target for r in missing] == [".".join(target)]
    assert "defines no execute_model" in missing[0].detail


# -- binder and detection in a process whose installed vLLM is a given release ---------------


def test_binder_reports_a_removed_class_as_not_in_this_version(tmp_path, monkeypatch):
    """A module that is still there but lost a V1 class (as a V1 point's module would in a
    release past its span): "not in this version", logged at debug, not counted as skipped."""
    from structlog.testing import capture_logs

    from ascend_runtime.attach.binder import attach_point_readings

    name = f"agspan_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text("class Other:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = __import__(name)
    point = AttachPoint(
        "model_runner", name, "Runner", "execute_model", "step", ("cpu-v1",),
        span=VLLM_V1_RUNNER,
    )  # fmt: skip
    # the span's package is the module's top-level name; key the installed versions on it
    monkeypatch.setattr(detect, "installed_versions", lambda: {name: "0.34.0"})
    before = {k: v for k, v in BINDINGS.items()}
    try:
        with capture_logs() as logged:
            binding = bind_point(point, module)
        assert (binding.status, binding.reason) == (NOT_IN_VERSION, "V1 runner removed in 0.34")
        assert [e["event"] for e in logged] == ["attach_point_not_in_version"]
        assert logged[0]["log_level"] == "debug"
        skipped = [v for _, v, labels in attach_point_readings() if labels["status"] == "skipped"]
        assert skipped == [sum(b.status in ("missing", "failed") for b in before.values())]

        monkeypatch.setattr(detect, "installed_versions", lambda: {name: "0.33.0"})
        assert bind_point(point, module).status == "missing"
    finally:
        BINDINGS.pop(point, None)
        sys.modules.pop(name, None)


def test_detect_generation_is_mrv2_where_the_release_has_no_v1(monkeypatch):
    monkeypatch.setattr(detect, "installed_versions", lambda: {"vllm": "0.34.0"})
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    generation, why = detect.detect_generation("cpu")
    assert generation == "mrv2"
    assert why == "vllm 0.34.0 holds only MRV2 (V1 runner removed in 0.34)"
    monkeypatch.setattr(detect, "installed_versions", lambda: {"vllm": "0.33.0"})
    assert detect.detect_generation("cpu") == ("v1", "VLLM_USE_V2_MODEL_RUNNER=0")


def test_runtime_of_a_standalone_cpu_runner_is_mrv2():
    standalone = type("StandaloneCPUModelRunner", (), {})
    standalone.__module__ = "vllm.v1.worker.cpu.standalone_model_runner"
    v1 = type("CPUModelRunner", (), {})
    v1.__module__ = "vllm.v1.worker.cpu_model_runner"
    assert detect.runtime_of_runner(standalone(), "cpu") == "cpu-mrv2"
    assert detect.runtime_of_runner(v1(), "cpu") == "cpu-v1"


def test_compat_scan_records_what_a_tree_holds(tmp_path):
    """tools/compat_scan.py's record of a tree rebuilds a tree that scans the same, a renamed
    method included (what the recorded layouts of the real wheels rest on)."""
    from tools.compat_scan import layout

    module, cls = "vllm.v1.worker.gpu.model_runner", "GPUModelRunner"
    original = vllm_tree(
        tmp_path / "a", "0.34.0", drop=GONE_IN_034,
        rename_method=(module, cls, "sample_tokens", "sample_tokens_v3"),
    )  # fmt: skip
    recorded = layout(original)
    assert recorded["version"] == "0.34.0"
    assert set(recorded["modules"]) == {p.module for p in VLLM_POINTS} - GONE_IN_034
    assert "sample_tokens" not in recorded["modules"][module][cls]
    saved = dict(LAYOUTS)
    try:
        LAYOUTS["recorded"] = recorded
        rebuilt = layout_tree(tmp_path / "b", "recorded")
    finally:
        LAYOUTS.clear()
        LAYOUTS.update(saved)

    def outcome(tree):
        return {(r.point.target, r.status) for r in scan_tree(tree)}

    assert outcome(rebuilt) == outcome(original)
    assert (f"{module}.{cls}.sample_tokens", "missing") in outcome(rebuilt)
