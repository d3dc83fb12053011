"""telemetry/cli/main.py assembles one module per subcommand: each module's add_parser(sub) and
run(args), one line of COMMANDS each; `python -m telemetry.cli` and the console script work."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import types
from pathlib import Path

from telemetry.cli import main as cli

ROOT = Path(__file__).resolve().parents[3]
EXPECTED = {
    "sidecar",
    "query",
    "trace",
    "incidents",
    "hangs",
    "timeline",
    "request",
    "doctor",
    "ready",
    "config",
}


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_every_subcommand_runs_its_own_modules_handler():
    subs = _subcommands(cli._parser())
    assert set(subs) == EXPECTED
    for name in cli.COMMANDS:
        module = importlib.import_module(name)
        assert module.__name__.startswith("telemetry.cli.commands."), name
        mine = [cmd for cmd, p in subs.items() if p.get_default("handler") is module.run]
        assert mine, f"{name} registered no subcommand"
    assert len((ROOT / "telemetry" / "cli" / "main.py").read_text().splitlines()) < 120


def test_a_new_subcommand_module_takes_one_line(monkeypatch, capsys):
    """What a new subcommand module needs: add_parser(sub) and run(args), and its name in
    COMMANDS."""
    module = types.ModuleType("fake_example_cli")

    def add_parser(sub):
        sub.add_parser("example", help="an example").add_argument("item_id")

    module.add_parser = add_parser
    module.run = lambda args: print(f"example {args.item_id}") or 7
    monkeypatch.setitem(sys.modules, "fake_example_cli", module)
    monkeypatch.setattr(cli, "COMMANDS", (*cli.COMMANDS, "fake_example_cli"))
    assert cli.main(["example", "req-1"]) == 7
    assert capsys.readouterr().out == "example req-1\n"
    assert cli.main(["query", "--limit", "0"]) == 2  # the others still there


def test_the_console_script_and_python_dash_m():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '\n[project.scripts]\nascend-guard = "telemetry.cli.main:main"\n' in pyproject
    out = subprocess.run(
        [sys.executable, "-m", "telemetry.cli", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    for name in EXPECTED:
        assert f"    {name} " in out.stdout or f"    {name}\n" in out.stdout, name
    out = subprocess.run(
        [sys.executable, "-m", "telemetry.cli", "query", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"COLUMNS": "300", "PATH": "/usr/bin:/bin"},
    )
    flat = " ".join(out.stdout.split())
    for text in (
        "--follow",
        "--tree",
        "--json",
        "--spans",
        "--sidecar URL",
        "(default: auto)",
        "(default: 1h)",
        "filter flags",
    ):
        assert text in flat, text


def test_doctor_live_names_only_the_next_steps_its_problems_need():
    from telemetry.cli.commands.doctor import next_steps

    covered = {"connected_ranks": 2, "expected_ranks": 2, "skipped_attach_points": 0,
               "unreported_attach_points": []}  # fmt: skip
    assert next_steps([covered]) == []
    unreported = {**covered, "unreported_attach_points": ["dp0/tp1/pp0"]}
    (only,) = next_steps([unreported])
    assert "no attach-point report yet" in only and "skipped" not in only
    both = next_steps([{**covered, "connected_ranks": 1, "skipped_attach_points": 2}])
    assert [s.split(" ")[1] for s in both] == ["missing", "skipped"]
    assert next_steps([{**covered, "connected_ranks": 1}], expect_local=1) == []
