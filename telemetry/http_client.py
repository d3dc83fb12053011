"""GET a JSON document from the sidecar's liveness/API endpoint (stdlib only; CLI side)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


class Unreachable(Exception):
    """The endpoint did not answer with JSON; the message says why."""


def get_json(url: str, timeout: float = 5.0) -> tuple[int, dict[str, Any]]:
    """(HTTP status, body) of `url`; non-2xx answers are returned, not raised."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read())
        except ValueError:
            return exc.code, {}
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise Unreachable(f"cannot read {url}: {getattr(exc, 'reason', exc)}") from exc
