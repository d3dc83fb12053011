"""`ascend-guard doctor --source`: attach points found by reading a source tree, not importing it.

The trees are written by the test from the attach-point table itself: complete, then with one
method renamed, one class renamed and one module removed."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from ascend_runtime.attach.points import ATTACH_POINTS
from ascend_runtime.doctor.source_scan import scan_tree
from telemetry.cli.main import main as cli_main

ASCEND_POINTS = [p for p in ATTACH_POINTS if p.package == "vllm_ascend"]


@pytest.fixture(autouse=True)
def keep_logging(monkeypatch):
    """The doctor CLI sets up logging for its process; in pytest that would bind structlog to
    this test's captured stderr, which later tests' loggers would then write to after it closed."""
    from telemetry.wire import logs

    monkeypatch.setattr(logs, "configure", lambda **kwargs: None)


def write_tree(root: Path, *, rename_method=None, rename_class=None, drop_module=None) -> Path:
    """A vllm_ascend package holding every attach point, optionally with one thing broken.
    Classes sit under a version check, as vllm-ascend defines some of them."""
    classes: dict[str, dict[str, set[str]]] = {}
    for p in ASCEND_POINTS:
        methods = classes.setdefault(p.module, {}).setdefault(p.qualname, set())
        if not p.inherited:
            methods.add(p.method)
    for module, by_class in classes.items():
        if module == drop_module:
            continue
        parts = module.split(".")
        for i in range(1, len(parts)):
            init = root.joinpath(*parts[:i], "__init__.py")
            init.parent.mkdir(parents=True, exist_ok=True)
            init.touch()
        lines = ["import sys", "", "class Base:", "    pass", "", "if sys.version_info >= (3, 0):"]
        for cls, methods in sorted(by_class.items()):
            name = (
                cls
                if rename_class is None or rename_class[:2] != (module, cls)
                else rename_class[2]
            )
            lines.append(f"    class {name}(Base):")
            for method in sorted(methods) or ["unrelated"]:
                if rename_method and rename_method[:3] == (module, cls, method):
                    method = rename_method[3]
                lines.append(f"        def {method}(self, *args, **kwargs):\n            pass")
        root.joinpath(*parts[:-1], parts[-1] + ".py").write_text("\n".join(lines) + "\n")
    return root


def rows(results):
    return {r.point.target: r for r in results}


def test_complete_tree_finds_every_attach_point(tmp_path):
    results = scan_tree(write_tree(tmp_path))
    assert {r.point for r in results} == set(ASCEND_POINTS)
    assert all(r.status == "found" for r in results), [r for r in results if r.status != "found"]
    inherited = [r for r in results if r.point.inherited]
    assert inherited and all(r.detail.startswith("inherited") for r in inherited)


def test_renamed_method_is_missing_and_named(tmp_path):
    module, cls = "vllm_ascend.worker.model_runner_v1", "NPUModelRunner"
    tree = write_tree(tmp_path, rename_method=(module, cls, "execute_model", "execute_model_v2"))
    by_target = rows(scan_tree(tree))
    row = by_target[f"{module}.{cls}.execute_model"]
    assert row.status == "missing"
    assert "defines no execute_model" in row.detail
    assert [t for t, r in by_target.items() if r.status == "missing"] == [row.point.target]


def test_renamed_class_and_removed_module(tmp_path):
    tree = write_tree(
        tmp_path,
        rename_class=("vllm_ascend.worker.worker", "NPUWorker", "AscendWorker"),
        drop_module="vllm_ascend.worker.v2.aclgraph_utils",
    )
    missing = {t: r.detail for t, r in rows(scan_tree(tree)).items() if r.status == "missing"}
    worker = {t for t in missing if ".NPUWorker." in t}
    assert worker == {p.target for p in ASCEND_POINTS if p.qualname == "NPUWorker"}
    assert all("no class NPUWorker" in missing[t] for t in worker)
    graph = "vllm_ascend.worker.v2.aclgraph_utils.ModelAclGraphManager.capture"
    assert missing[graph] == "no module file for vllm_ascend.worker.v2.aclgraph_utils"
    assert len(missing) == len(worker) + 1


def test_doctor_source_exit_status_table_and_json(tmp_path, capsys):
    tree = write_tree(tmp_path / "good")
    assert cli_main(["doctor", "--source", str(tree)]) == 0
    out = capsys.readouterr().out
    assert f"{len(ASCEND_POINTS)} of {len(ASCEND_POINTS)} attach points found" in out
    assert "next: " in out
    assert "vllm_ascend.worker.worker.NPUWorker.execute_dummy_batch" in out

    bad = write_tree(
        tmp_path / "bad",
        rename_method=("vllm_ascend.worker.worker", "NPUWorker", "execute_dummy_batch", "idle"),
    )
    assert cli_main(["doctor", "--source", str(bad), "--json"]) == 1
    document = json.loads(capsys.readouterr().out)
    assert document["ok"] is False
    (missing,) = [p for p in document["attach_points"] if p["status"] != "found"]
    assert (missing["class"], missing["method"]) == ("NPUWorker", "execute_dummy_batch")


def test_doctor_source_only_one_runtime(tmp_path, capsys):
    tree = write_tree(tmp_path)
    assert cli_main(["doctor", "--source", str(tree), "--runtime", "ascend-mrv2", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert {tuple(p["runtimes"]) for p in document["attach_points"]} <= {
        ("ascend-mrv2",),
        ("ascend-mrv2", "ascend-v1"),
        ("ascend-mrv2", "cuda-mrv2", "cpu-mrv2"),
    }
    assert len(document["attach_points"]) == len(
        [p for p in ASCEND_POINTS if "ascend-mrv2" in p.runtimes]
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--source", "/nonexistent/tree"], "not a directory"),
        (["--source", "{empty}"], "holds none of the packages"),
        (["--runtime", "tpu-v3"], "invalid choice"),
    ],
)
def test_doctor_bad_arguments_exit_2(tmp_path, capsys, argv, message):
    argv = [a.replace("{empty}", str(tmp_path)) for a in argv]
    assert cli_main(["doctor", *argv]) == 2
    assert message in capsys.readouterr().err


def test_unparsable_module_is_missing_with_the_reason(tmp_path):
    tree = write_tree(tmp_path)
    (tree / "vllm_ascend" / "worker" / "worker.py").write_text(textwrap.dedent("def broken(:\n"))
    missing = [r for r in scan_tree(tree) if r.status == "missing"]
    assert missing and all("cannot parse" in r.detail for r in missing)


def test_hang_deadline_is_read_from_the_watchdog_section_and_checked(monkeypatch):
    import dataclasses

    from ascend_runtime.doctor import coverage as doctor

    @dataclasses.dataclass(frozen=True)
    class Collectives:
        deadline_s: float = 3.0

    @dataclasses.dataclass(frozen=True)
    class Config:
        sidecar: str = "unix:///x.sock"
        collectives: Collectives = dataclasses.field(default_factory=Collectives)

    assert doctor.hang_deadline(Config()) == (3.0, "runtime_guard.collectives.deadline_s")
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "60")
    lines, problem = doctor.hccl_lines(Config())
    assert problem is None
    assert lines["hang deadline"].startswith("3 s (runtime_guard.collectives.deadline_s)")
    assert "HCCL_EXEC_TIMEOUT=60" in lines["hccl"]
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "20")
    _, problem = doctor.hccl_lines(Config())
    assert "above 0.1 x HCCL_EXEC_TIMEOUT (20 s)" in problem


def test_doctor_exits_1_when_the_hang_deadline_is_not_below_hccl(tmp_path, monkeypatch, capsys):
    from ascend_runtime.doctor import coverage as doctor

    tree = write_tree(tmp_path)
    monkeypatch.setattr(doctor, "hang_deadline", lambda config=None: (30.0, "runtime_guard.x"))
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "120")
    assert cli_main(["doctor", "--source", str(tree)]) == 1
    out = capsys.readouterr().out
    assert "hang deadline: hang deadline 30 s is above 0.1 x HCCL_EXEC_TIMEOUT (120 s)" in out
    assert "next: lower the hang deadline or raise HCCL_EXEC_TIMEOUT" in out
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "1836")
    assert cli_main(["doctor", "--source", str(tree)]) == 0


def test_tree_info_names_commit_and_the_vllm_release(tmp_path, capsys):
    tree = write_tree(tmp_path)
    (tree / ".github").mkdir()
    (tree / ".github" / "vllm-release-tag.commit").write_text("v0.27.1\n")
    (tree / ".git" / "refs" / "heads").mkdir(parents=True)
    (tree / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (tree / ".git" / "refs" / "heads" / "main").write_text("182b75e" + "0" * 33 + "\n")
    (tree / "vllm_ascend" / "_version.py").write_text("__version__ = version = '0.23.0rc1'\n")
    assert cli_main(["doctor", "--source", str(tree)]) == 0
    header = capsys.readouterr().out.splitlines()[2]
    assert header == (
        "versions: vllm_ascend 0.23.0rc1  commit 182b75e"
        + "0" * 33
        + "  verified with vllm v0.27.1"
    )
