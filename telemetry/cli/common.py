"""Pieces several subcommands share: the time column and the store argument."""

from __future__ import annotations

import argparse
import datetime as dt

from telemetry.wire import paths


def clock(ns: int) -> str:
    """HH:MM:SS.mmm (UTC) of a unix-ns time, as every table's time column shows it."""
    return dt.datetime.fromtimestamp(ns / 1e9, tz=dt.timezone.utc).strftime("%H:%M:%S.%f")[:-3]


def add_store_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", default=paths.cli_store(), help=paths.CLI_STORE_HELP)
