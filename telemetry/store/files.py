"""The store's file: where it lives, its health at start, opening it, and moving a bad one aside.

At start the sidecar checks the file (`prepare_store`: header, truncation, a time-boxed
`PRAGMA quick_check`); a file SQLite cannot use is moved aside to `<store>.corrupt-<UTC time>`
(with its -wal and -shm) and a fresh store begins (docs/operations.md). `failure_reason` names
the drop reason of a write that fails later (`disk_full`, `io_error`, `corrupt`, ...).
"""

from __future__ import annotations

import os
import sqlite3
import struct
import time
from pathlib import Path

import structlog

from telemetry.store.schema import PAGE_SIZE, REQUEST_SCHEMA, SCHEMA, _add_block_columns

log = structlog.get_logger("ascend_guard.store")

# time the start-up integrity check may take: a whole 16 GiB store takes minutes to check, and
# the ranks' records are dropped while the sidecar is not up; the header and size checks are O(1)
DEFAULT_CHECK_BUDGET_S = 2.0


_SQLITE_MAGIC = b"SQLite format 3\x00"


def default_store_path() -> str:
    from telemetry.wire import paths

    return paths.default_store()


def store_file_problem(
    path: str | os.PathLike, *, check_budget_s: float = DEFAULT_CHECK_BUDGET_S
) -> str | None:
    """Why the file at `path` cannot be used as a store, or None (also for no file at all).

    O(1) checks first (the SQLite header, the file shorter than its header says), then
    `PRAGMA quick_check` for at most `check_budget_s` (a check cut short is no verdict).
    """
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return None
    if size == 0:
        return None  # SQLite's own empty database
    with open(path, "rb") as handle:
        header = handle.read(100)
    if len(header) < 100 or not header.startswith(_SQLITE_MAGIC):
        return (
            f"not an SQLite database (header of {len(header)} bytes does not start with its magic)"
        )
    (page_size,) = struct.unpack(">H", header[16:18])
    page_size = 65536 if page_size == 1 else page_size
    (change, pages) = struct.unpack(">II", header[24:32])
    (valid_for,) = struct.unpack(">I", header[92:96])
    wal = Path(f"{path}-wal")
    wal_pending = wal.exists() and wal.stat().st_size > 0  # a checkpoint cut short extends it
    if valid_for == change and pages and size < pages * page_size and not wal_pending:
        return f"truncated: its header says {pages * page_size} bytes, the file has {size}"
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
    except sqlite3.Error as exc:
        return f"SQLite cannot open it: {exc}"
    deadline = time.monotonic() + check_budget_s
    conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 10_000)
    try:
        rows = [row[0] for row in conn.execute("PRAGMA quick_check(5)")]
    except sqlite3.OperationalError as exc:
        if "interrupted" in str(exc):
            log.info("store_check_cut_short", path=str(path), budget_s=check_budget_s)
            return None
        return f"SQLite cannot read it: {exc}"
    except sqlite3.DatabaseError as exc:
        return f"SQLite cannot read it: {exc}"
    finally:
        conn.close()
    if rows != ["ok"]:
        return "integrity check failed: " + "; ".join(map(str, rows))
    return None


def move_aside(path: str | os.PathLike, *, now: float | None = None) -> Path:
    """Rename the store (and its -wal, -shm) to `<store>.corrupt-<UTC time>`; return the name."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    target = Path(f"{path}.corrupt-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = Path(f"{path}.corrupt-{stamp}-{n}")
    for suffix in ("-wal", "-shm", ""):
        source = Path(f"{path}{suffix}")
        if source.exists():
            os.replace(source, f"{target}{suffix}")
    return target


def prepare_store(
    path: str | os.PathLike, *, check_budget_s: float = DEFAULT_CHECK_BUDGET_S
) -> Path | None:
    """Check the store file before the sidecar opens it; move a bad one aside (returns where)."""
    problem = store_file_problem(path, check_budget_s=check_budget_s)
    if problem is None:
        return None
    moved = move_aside(path)
    log.error(
        "store_moved_aside",
        path=str(path),
        moved_to=str(moved),
        problem=problem,
        action="starting a fresh store; the old file is kept for inspection",
    )
    return moved


def connect(path: str | os.PathLike, *, readonly: bool = False) -> sqlite3.Connection:
    """Open the store; read-only connections fail clearly when the file does not exist."""
    path = Path(path)
    if readonly:
        if not path.exists():
            raise FileNotFoundError(
                f"no trace store at {path}; is the sidecar running with --store {path}?"
            )
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(path, timeout=5.0, check_same_thread=False)
        conn.execute(f"PRAGMA page_size={PAGE_SIZE}")  # only takes effect on a new file
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.executescript(SCHEMA)
        conn.executescript(REQUEST_SCHEMA)
        _add_block_columns(conn)
    conn.row_factory = sqlite3.Row
    return conn


def failure_reason(exc: BaseException) -> str:
    """The drop reason of a failed store write (a label value from a fixed set)."""
    if isinstance(exc, sqlite3.Error):
        name = getattr(exc, "sqlite_errorname", "") or ""
        text = str(exc).lower()
        if name.startswith("SQLITE_FULL") or "disk is full" in text:
            return "disk_full"
        if name.startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB")) or "malformed" in text:
            return "corrupt"
        if name.startswith("SQLITE_IOERR") or "disk i/o error" in text:
            return "io_error"
        if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "locked" in text:
            return "busy"
        if name.startswith(("SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_PERM")):
            return "not_writable"
        return "sqlite_error"
    if isinstance(exc, OSError):
        return "io_error"
    return "error"
