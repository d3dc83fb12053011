"""`ascend-guard config check`: validate a runtime_guard config file offline."""

from __future__ import annotations

import argparse
import json
import sys

from telemetry.cli.table import render_table


def add_parser(sub: argparse._SubParsersAction) -> None:
    config = sub.add_parser("config", help="work with runtime_guard config files")
    config_sub = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    check = config_sub.add_parser("check", help="validate a config file offline")
    check.add_argument("file", help='JSON file: {"runtime_guard": {...}} or the bare object')
    check.add_argument(
        "--show", action="store_true", help="print every resolved key, not only changes"
    )


def _flatten(prefix: str, value: object) -> list[tuple[str, object]]:
    if isinstance(value, dict):
        out = []
        for key in sorted(value):
            out += _flatten(f"{prefix}.{key}" if prefix else key, value[key])
        return out
    return [(prefix, value)]


def run(args: argparse.Namespace) -> int:
    from guard.config.runtime_guard import GuardConfig, GuardConfigError, _load_file, parse_config

    try:
        config = parse_config(_load_file(args.file))
    except GuardConfigError as exc:
        print(f"{args.file}: invalid\n  {exc}", file=sys.stderr)
        print("fix that key and run `ascend-guard config check` again", file=sys.stderr)
        return 1
    defaults = dict(_flatten("", json.loads(GuardConfig().to_json())))
    rows = [
        (key, json.dumps(val), json.dumps(defaults.get(key)))
        for key, val in _flatten("", json.loads(config.to_json()))
        if args.show or defaults.get(key) != val
    ]
    print(f"{args.file}: valid")
    if rows:
        print(render_table(("key", "value", "default"), rows))
    else:
        print("(every key at its default)")
    return 0
