"""`ascend-guard sidecar`: the node sidecar (gRPC ingest, /metrics, trace store, query API).

Its flags are generated from the settings table (telemetry/sidecar/settings.py): one flag per
field that names one, with the field's default and help, and the parsed flags go back into a
`SidecarSettings` by the same table.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from telemetry.cli.args import parse_duration_ns, parse_size
from telemetry.spans.query import QueryError
from telemetry.wire import logs, paths


def _octal_mode(text: str) -> int:
    try:
        mode = int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an octal mode such as 0600") from None
    if not 0 <= mode <= 0o777:
        raise argparse.ArgumentTypeError(f"{text!r} is outside 0000-0777")
    return mode


def _seconds_text(seconds: float) -> str:
    """A duration in the largest unit that writes it whole: 24h, 15m, 2s, 50ms."""
    ns = round(seconds * 1e9)
    for unit, scale in (("h", 3600 * 10**9), ("m", 60 * 10**9), ("s", 10**9), ("ms", 10**6)):
        if ns >= scale and ns % scale == 0:
            return f"{ns // scale}{unit}"
    return f"{seconds:g}s"


def _size_text(size: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


# how the command line writes a value of each kind, and how argparse reads it
_TEXT = {"duration": _seconds_text, "size": _size_text}
_TYPE = {"int": int, "port": int, "octal": _octal_mode}


def _flag_fields() -> list[dataclasses.Field]:
    from telemetry.sidecar.settings import SidecarSettings

    return [f for f in dataclasses.fields(SidecarSettings) if f.metadata.get("flag")]


def _cli_default(field: dataclasses.Field) -> Any:
    meta = field.metadata
    if meta["cli_default"] is not None:
        return meta["cli_default"]()
    default = field.default
    return _TEXT[meta["kind"]](default) if meta["kind"] in _TEXT else default


def add_parser(sub: argparse._SubParsersAction) -> None:
    from telemetry.sidecar.settings import SECURITY_FLAGS

    side = sub.add_parser(
        "sidecar", help="run the node sidecar (gRPC ingest, /metrics, trace store)"
    )
    for field in _flag_fields():
        meta = field.metadata
        side.add_argument(
            meta["flag"],
            dest=field.name,
            metavar=meta["flag"].lstrip("-").upper().replace("-", "_"),
            type=_TYPE.get(meta["kind"]),
            default=_cli_default(field),
            help=meta["help"],
        )
    for name, flag, kind, help_text in SECURITY_FLAGS:
        if kind == "flag":
            side.add_argument(flag, dest=name, action="store_true", help=help_text)
        else:
            side.add_argument(flag, dest=name, default="", help=help_text)
    side.add_argument("--log-json", action="store_true", help="log JSON lines instead of key=value")


def _value(field: dataclasses.Field, raw: Any) -> Any:
    """A parsed flag as its field holds it; QueryError names the flag and the value."""
    meta = field.metadata
    flag, kind = meta["flag"], meta["kind"]
    if kind == "duration":
        value: Any = parse_duration_ns(raw, flag) / 1e9
    elif kind == "size":
        value = parse_size(raw, flag)
    else:
        value = raw
    if kind == "port" and value is not None and not 0 <= value <= 65535:
        raise QueryError(f"{flag}: {value} is not a port; use 1-65535, or 0 to turn it off")
    if meta["positive"] and value is not None and value <= 0:
        shown = f"{value:g}s" if kind == "duration" else str(value)
        raise QueryError(f"{flag}: must be above 0, got {shown}")
    return value


def settings_from_args(args: argparse.Namespace):
    """The `SidecarSettings` the parsed flags ask for."""
    from telemetry.sidecar.settings import SECURITY_FLAGS, SidecarSettings
    from telemetry.wire.transport import ServerSecurity

    values = {f.name: _value(f, getattr(args, f.name)) for f in _flag_fields()}
    if values["socket_mode"] is None:  # the default follows --socket-group
        values["socket_mode"] = (
            paths.GROUP_SOCKET_MODE if values["socket_group"] else paths.DEFAULT_SOCKET_MODE
        )
    security = ServerSecurity(**{name: getattr(args, name) for name, *_ in SECURITY_FLAGS})
    return SidecarSettings(**values, security=security)


def run(args: argparse.Namespace) -> int:
    from telemetry.sidecar.app import Sidecar
    from telemetry.sidecar.errors import SidecarStartError

    logs.configure(json_output=args.log_json)
    try:
        settings = settings_from_args(args)
    except QueryError as exc:
        print(f"ascend-guard sidecar: {exc}", file=sys.stderr)
        return 2
    try:
        Sidecar(settings).serve_forever()
    except SidecarStartError as exc:
        print(f"ascend-guard sidecar: {exc}", file=sys.stderr)
        return 1
    return 0
