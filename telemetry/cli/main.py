"""`ascend-guard`: assembles the subcommands of telemetry/cli/commands/ into one command line."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from telemetry.cli.commands import doctor
from telemetry.cli.source import SourceError
from telemetry.spans.query import QueryError
from telemetry.wire import build_info, paths

# The subcommands, in --help order: modules with add_parser(sub), which adds its subcommand(s)
# to the argparse subparsers `sub`, and run(args) -> exit status. One line adds one.
COMMANDS = (
    "telemetry.cli.commands.sidecar",
    "telemetry.cli.commands.query",
    "telemetry.cli.commands.trace",
    "telemetry.cli.commands.incidents",
    "telemetry.cli.commands.hangs",
    "telemetry.cli.commands.timeline",
    "telemetry.cli.commands.request",
    "telemetry.cli.commands.doctor",
    "telemetry.cli.commands.ready",
    "telemetry.cli.commands.config",
)

STORE_MISSING_HINT = (
    f"next: start the sidecar (`ascend-guard sidecar`), or point --store or ${paths.STORE_ENV} "
    "at its store file"
)


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to every option that has a default worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, "", False) or action.default is argparse.SUPPRESS:
            return action.help or ""
        return super()._get_help_string(action) or ""


class _Parser(argparse.ArgumentParser):
    """Every subcommand's --help shows its defaults."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(*args, **kwargs)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="ascend-guard",
        description="Runtime guard and observability for vLLM: node sidecar and on-call queries. "
        f"Paths: socket under ${paths.RUNTIME_DIR_ENV} ({paths.DEFAULT_RUNTIME_DIR}), store, spool "
        f"and dumps under ${paths.STATE_DIR_ENV} ({paths.DEFAULT_STATE_DIR}).",
    )
    parser.add_argument("--version", action="version", version=build_info.version_line())
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=_Parser
    )
    for name in COMMANDS:
        module = importlib.import_module(name)
        before = set(sub.choices)
        module.add_parser(sub)
        for command in set(sub.choices) - before:
            sub.choices[command].set_defaults(handler=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["doctor"]:  # its own parser: options pass through as given
            return doctor.main_raw(argv[1:])
        args = _parser().parse_args(argv)
        return _run(args)
    except KeyboardInterrupt:  # Ctrl-C: stop quietly, with the shell's status for SIGINT
        print("", file=sys.stderr)
        return INTERRUPTED


INTERRUPTED = 128 + 2


def _run(args: argparse.Namespace) -> int:
    try:
        return args.handler(args)
    except BrokenPipeError:  # piped into head and the like: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (QueryError, SourceError) as exc:
        print(f"ascend-guard {args.command}: {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        hint = f"\n{STORE_MISSING_HINT}" if str(exc).startswith("no trace store") else ""
        print(f"ascend-guard {args.command}: {exc}{hint}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
