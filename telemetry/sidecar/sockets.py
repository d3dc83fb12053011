"""The gRPC unix socket's file: claimed from a dead sidecar's leftover, and given its mode and
group so that only the workers that should can connect.
"""

from __future__ import annotations

import grp
import os
import socket
from pathlib import Path

from telemetry.sidecar.errors import SidecarStartError


def claim_socket(path: str) -> None:
    """Remove a stale socket file, but refuse to take over a live sidecar's socket."""
    if not os.path.exists(path):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # nobody listens: a leftover from a sidecar that died
        return
    finally:
        probe.close()
    raise SidecarStartError(
        f"another process is already listening on {path}; stop it or pick another --listen"
    )


def socket_gid(group: str) -> int:
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise SidecarStartError(
            f"--socket-group {group!r}: no such group on this host (create it, or pass a gid)"
        ) from None


def secure_socket(path: str, mode: int, group: str) -> None:
    """Give the socket file its group and mode (workers of that group may then connect)."""
    try:
        if group:
            os.chown(path, -1, socket_gid(group))
        os.chmod(path, mode)
    except OSError as exc:
        raise SidecarStartError(
            f"cannot set mode {mode:o} / group {group or '-'} on {path}: {exc.strerror}"
        ) from exc
