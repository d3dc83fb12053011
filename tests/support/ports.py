"""Free loopback ports for test servers.

A port found free with bind(0) comes from the kernel's ephemeral range, the same range it
draws the source ports of outgoing connections from: between the check and the server's own
bind, a connection elsewhere in the suite can take it, and two calls can get the same port.
(A sidecar of tests/integration/test_transport_security.py once exited 1 at start in a full
run, most likely so; its log was not kept.) So ports here come from below that range, where
only explicit binds land, and none is handed out twice in one process.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10_000  # below this sit the well-known services a machine may run
_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(_EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that binds now, outside the ephemeral range where there is room."""
    high = _ephemeral_low()
    if high - _LOWEST >= 1_000:
        for _ in range(500):
            port = random.randrange(_LOWEST, high)
            if port not in _handed_out and _bindable(host, port):
                _handed_out.add(port)
                return port
    while True:  # no room below the ephemeral range: the kernel's pick, never twice
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
