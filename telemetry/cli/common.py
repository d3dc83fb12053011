"""Pieces several subcommands share: the time column, the store argument, and `--sidecar`,
the one way every command names the sidecar it asks (old spellings kept as aliases)."""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from typing import Any

from telemetry.wire import paths

SIDECAR_METAVAR = "URL"
HEALTH_HELP = (
    "the sidecar to ask: its health endpoint (default: "
    f"${paths.HEALTH_URL_ENV}, else the local sidecar's from ${paths.RUNTIME_DIR_ENV}/"
    f"{paths.DISCOVERY_NAME}, else http://127.0.0.1:{paths.DEFAULT_HEALTH_PORT})"
)
QUERY_HELP = (
    f"the sidecar to ask: its query API (default: ${paths.QUERY_URL_ENV}, else the local "
    f"sidecar's query_url from {paths.DISCOVERY_NAME}, port {paths.DEFAULT_QUERY_PORT} by default)"
)


def clock(ns: int) -> str:
    """HH:MM:SS.mmm (UTC) of a unix-ns time, as every table's time column shows it."""
    return dt.datetime.fromtimestamp(ns / 1e9, tz=dt.timezone.utc).strftime("%H:%M:%S.%f")[:-3]


def add_store_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", default=paths.cli_store(), help=paths.CLI_STORE_HELP)


def deprecated(prog: str, old: str, new: str) -> None:
    """The one line an old spelling prints on stderr (stdout stays the command's output)."""
    print(f"{prog}: {old} is deprecated; use {new}", file=sys.stderr)


class DeprecatedAlias(argparse.Action):
    """An old spelling of an option: stores into the new option's dest and says so on stderr.
    `use` is how the new spelling is written in that line."""

    def __init__(self, option_strings: list[str], dest: str, use: str = "", **kwargs: Any):
        self.use = use
        kwargs.setdefault("help", argparse.SUPPRESS)
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        deprecated(parser.prog, f"{option_string} {self.metavar or ''}".strip(), self.use)
        setattr(namespace, self.dest, values)


class LiveFlag(argparse.Action):
    """`--live`: ask the running sidecar. `--live URL` is the old way to name it (now
    `--live --sidecar URL`): still accepted, with a deprecation line."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any):
        kwargs.update(nargs="?", const=None, default=False, metavar=SIDECAR_METAVAR)
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        namespace.live = True
        if values:
            deprecated(parser.prog, f"{option_string} URL", f"{option_string} --sidecar URL")
            namespace.sidecar = values


def add_sidecar_argument(parser: argparse.ArgumentParser, endpoint: str) -> None:
    """`--sidecar URL`: which sidecar a command asks; `endpoint` is "health" (hangs, doctor,
    ready) or "query" (query, trace), the listener the command reads."""
    parser.add_argument(
        "--sidecar",
        default=None,
        metavar=SIDECAR_METAVAR,
        help=HEALTH_HELP if endpoint == "health" else QUERY_HELP,
    )


def health_base(args: argparse.Namespace) -> str | None:
    """The health endpoint a command asks: --sidecar, else the local one; None when the local
    sidecar runs with its health endpoint off (`paths.health_off_message` says what to do)."""
    if getattr(args, "sidecar", None):
        return str(args.sidecar).rstrip("/")
    if paths.health_off_locally() is not None:
        return None
    return paths.cli_health_url().rstrip("/")
