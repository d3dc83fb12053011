"""The store's size budget against the file system it sits on, checked once at sidecar start.

A budget (`--max-store-bytes`) larger than what the store's file system can give it is a
promise the store cannot keep: it would fill the volume before its cap rolls anything out. On a
Kubernetes emptyDir that is worse than a full disk, since the kubelet evicts the whole pod, vLLM
included, once the volume passes its sizeLimit. The sidecar therefore refuses such a budget and
names both sizes. What the store may use is the free space plus what its own files (the store,
its -wal and -shm) hold already: a sidecar restarted on a store at its cap still starts.

A statfs cannot see an emptyDir's sizeLimit (the volume reports the node's disk), so deploy/
sizes the cap below the limit itself (tests/unit/deploy/test_deploy.py checks the sum); this check
catches a budget above a real volume: a tmpfs, a PersistentVolume, a node's disk.

Runs on the sidecar's main thread, before the store is opened for writing.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

_OWN_SUFFIXES = ("", "-wal", "-shm")


def _size_text(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _existing_folder(path: Path) -> Path:
    """The store's folder, or the nearest one above it that exists (it may not be made yet)."""
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


def budget_problem(store: str | os.PathLike, max_bytes: int) -> str | None:
    """Why `max_bytes` cannot be the budget of the store at `store` (None when it fits)."""
    path = Path(store)
    folder = _existing_folder(path)
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return None  # nothing to measure against; opening the store reports the real problem
    own = 0
    for suffix in _OWN_SUFFIXES:
        try:
            own += os.stat(f"{path}{suffix}").st_size
        except OSError:
            continue
    room = free + own
    if max_bytes <= room:
        return None
    return (
        f"--max-store-bytes {_size_text(max_bytes)} is above the {_size_text(room)} the store "
        f"can have on {folder} ({_size_text(free)} free plus {_size_text(own)} of its own "
        "files); pass a budget below the volume's free space (leave room for the WAL)"
    )
