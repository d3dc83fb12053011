"""GET a JSON document from the sidecar's liveness/API endpoint, with its bearer token (CLI side)."""

from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.request
from typing import Any

from telemetry.wire import paths
from telemetry.wire.transport import TOKEN_HEADER, TransportConfigError, read_token


class Unreachable(Exception):
    """The endpoint did not answer with JSON; the message says why."""


def add_token_argument(parser: argparse.ArgumentParser) -> None:
    """`--token-file`: what a subcommand that reads the sidecar's HTTP endpoints sends."""
    parser.add_argument(
        "--token-file",
        default=os.environ.get(paths.TOKEN_FILE_ENV) or None,
        metavar="FILE",
        help="bearer token for a sidecar started with --token-file "
        f"(default: ${paths.TOKEN_FILE_ENV})",
    )


def token_of(args: argparse.Namespace) -> str | None:
    """The token named by `--token-file`; raises Unreachable naming the file when unreadable."""
    path = getattr(args, "token_file", None)
    if not path:
        return None
    try:
        return read_token(path, "--token-file")
    except TransportConfigError as exc:
        raise Unreachable(str(exc)) from exc


def refusal_hint(status: int) -> str:
    """What to do about a 401/403 from the sidecar ('' for other statuses)."""
    if status not in (401, 403):
        return ""
    return f"; next: pass the sidecar's token with --token-file or ${paths.TOKEN_FILE_ENV}"


def get_json(
    url: str, timeout: float = 5.0, token: str | None = None
) -> tuple[int, dict[str, Any]]:
    """(HTTP status, body) of `url`; non-2xx answers are returned, not raised."""
    headers = {TOKEN_HEADER: f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=headers), timeout=timeout
        ) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read())
        except ValueError:
            return exc.code, {}
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise Unreachable(f"cannot read {url}: {getattr(exc, 'reason', exc)}") from exc
