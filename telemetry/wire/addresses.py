"""gRPC addresses the sidecar listens on and the guard sends to: defaults and validation."""

from __future__ import annotations

import re

from telemetry.wire import paths

_HOST_PORT = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):(?P<port>\d{1,5})$")


def default_sidecar_address() -> str:
    """The unix socket the sidecar listens on, and the guard sends to, unless told otherwise."""
    return paths.sidecar_address()


def unix_socket_path(address: str) -> str | None:
    """The socket path of a `unix:` address (`unix:///abs`, `unix:/abs`, `unix:rel`), else None."""
    if address.startswith("unix://"):
        return address[len("unix://") :]
    if address.startswith("unix:"):
        return address[len("unix:") :]
    return None


def address_problem(address: str) -> str | None:
    """Why `address` is not one gRPC can use for the sidecar, or None when it is fine."""
    if address.startswith("unix://"):
        path = address[len("unix://") :]
        if not path.startswith("/"):
            return "unix:// must be followed by an absolute path, as in unix:///run/guard.sock"
        return None
    if address.startswith("unix:"):
        return None if address[len("unix:") :] else "unix: needs a socket path"
    match = _HOST_PORT.match(address)
    if not match:
        return "use unix:///path/guard.sock or HOST:PORT"
    if not 1 <= int(match.group("port")) <= 65535:
        return f"port {match.group('port')} is outside 1-65535"
    return None
