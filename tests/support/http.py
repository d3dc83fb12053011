"""JSON over HTTP from the sidecar's endpoints, error statuses included."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def get_json(url: str, timeout: float = 5.0) -> tuple[int, Any]:
    """Status and decoded body of a GET; a 4xx/5xx (a 503 hang verdict, say) still has a body."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
