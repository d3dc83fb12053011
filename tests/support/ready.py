"""Waiting: for a child process's HTTP endpoint to answer 200, or for any condition to hold."""

from __future__ import annotations

import subprocess
import time
import urllib.request
from collections.abc import Callable
from typing import Any, Literal


def wait_http_ok(
    proc: subprocess.Popen,
    url: str,
    timeout: float,
    *,
    interval: float = 0.1,
    also: Callable[[], bool] = lambda: True,
) -> Literal["ready", "exited", "timeout"]:
    """Poll `url` until it answers 200 and `also()` holds, while `proc` keeps running."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            return "exited"
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200 and also():
                    return "ready"
        except OSError:  # URLError and refused connections alike
            pass
        if time.monotonic() > deadline:
            return "timeout"
        time.sleep(interval)


def wait_until(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    """Poll `check()` until it returns something true, and return that; fail the test, naming
    `what`, once `timeout` seconds have passed without it."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(interval)
