"""One rank's hang evidence, gathered by the sidecar on the rank's node without the rank's help:
its last collectives (the ring of its liveness record), its process as the kernel sees it
(`/proc/<pid>/status` state, `wchan`, kernel `stack` where readable), the Python stack of every
thread (the rank's stack signal, guard/stream/evidence.py) and a trigger of torch's flight
recorder where the backend has one.

Runs on the bundle thread (telemetry/crossrank/bundle.py), never on the hang checker's.
Signals go only to the process the rank's facts file names (pid and start time match
`/proc/<pid>/stat`, same owner), and only the signal that file says is handled; a stopped
process (state T) is never signalled: it would answer only after SIGCONT, which is on-call's
decision, not the sidecar's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import stat as stat_mod
import time
from typing import Any

from telemetry.wire.liveness_record import RecordReader, companion_path, proc_stat, record_path
from telemetry.wire.proto import guard_pb2

NOT_RETURNED = "not returned"
# a stack dump is complete once the file has not grown for this long
_SETTLE_S = 0.05
_THREAD_LINE = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)")


def _read_text(path: str, limit: int = 16384) -> tuple[str | None, str]:
    """(text, "") or (None, why not)."""
    try:
        with open(path, "rb") as handle:
            return handle.read(limit).decode(errors="replace"), ""
    except PermissionError:
        return None, "not readable by this sidecar (needs root or CAP_SYS_ADMIN)"
    except OSError as exc:
        return None, f"not readable ({exc.strerror or exc})"


def process_view(pid: int) -> dict[str, Any]:
    """The process as the kernel sees it: state line, wchan, kernel stack (or why not)."""
    view: dict[str, Any] = {}
    status, why = _read_text(f"/proc/{pid}/status")
    if status is None:
        return {"state": "gone", "note": why}
    for line in status.splitlines():
        if line.startswith("State:"):
            view["state"] = line.split(":", 1)[1].strip()
            break
    wchan, why = _read_text(f"/proc/{pid}/wchan", 256)
    view["wchan"] = (wchan.strip() if wchan.strip() not in ("", "0") else "-") if wchan else why
    kernel, why = _read_text(f"/proc/{pid}/stack")
    if kernel is None:
        view["kernel_stack_note"] = why
    else:
        view["kernel_stack"] = [line for line in kernel.splitlines() if line.strip()][:64]
    return view


def read_facts(path: str, pid: int) -> tuple[dict[str, Any] | None, str]:
    """The rank's facts file, if it belongs to the living process `pid` (same owner, pid and
    start time); else (None, why)."""
    stat = proc_stat(pid)
    if stat is None:
        return None, "process gone"
    try:
        with open(path, "rb") as handle:
            owner = os.fstat(handle.fileno()).st_uid
            facts = json.loads(handle.read(65536))
        if owner != os.stat(f"/proc/{pid}").st_uid:
            return None, "facts file has another owner than the process"
    except FileNotFoundError:
        return (
            None,
            "the rank wrote no evidence facts (an older guard, or its liveness record is off)",
        )
    except (OSError, ValueError) as exc:
        return None, f"facts file unreadable ({exc})"
    if not isinstance(facts, dict) or facts.get("pid") != pid:
        return None, "facts file of another process"
    if facts.get("start_ticks") != stat[1]:
        return None, "facts file of an earlier process with this pid"
    return facts, ""


def parse_stacks(text: str, engine_thread: str) -> list[dict[str, Any]]:
    """faulthandler's all-threads dump as threads, the engine thread first."""
    threads: list[dict[str, Any]] = []
    for line in text.splitlines():
        found = _THREAD_LINE.match(line)
        if found:
            ident = found.group(2).lower()
            threads.append(
                {
                    "thread": ident,
                    "engine": int(ident, 16) == int(engine_thread or "0", 16),
                    "signalled": found.group(1) == "Current thread",
                    "frames": [],
                }
            )
        elif threads and line.startswith("  "):
            threads[-1]["frames"].append(line.strip())
    threads.sort(key=lambda t: not t["engine"])
    return threads


@dataclasses.dataclass
class StackAsk:
    """A stack dump asked of one rank: the file and where it ended before the signal."""

    path: str
    offset: int
    engine_thread: str
    asked_at: float


def ask_stack(
    facts: dict[str, Any] | None, why: str, state: str, pid: int
) -> tuple[StackAsk | None, str]:
    """Send the rank its stack signal; (ask, "") or (None, why it was not asked)."""
    if facts is None:
        return None, why
    if state[:1] in ("T", "t"):
        return None, (
            "process stopped (state T): it answers only after SIGCONT; not signalled "
            "(see process state, wchan and the collective ring)"
        )
    if state[:1] in ("Z", "X", "g"):
        return None, f"process is {state}: no stack"
    path = str(facts.get("stack_file", ""))
    sig = facts.get("stack_signal")
    if not path or not isinstance(sig, int):
        return None, "facts file names no stack signal"
    try:
        offset = os.stat(path).st_size
        os.kill(pid, sig)
    except PermissionError:
        return None, "not permitted to signal the rank (run the sidecar as its user)"
    except OSError as exc:
        return None, f"cannot ask for a stack ({exc.strerror or exc})"
    return StackAsk(path, offset, str(facts.get("engine_thread", "")), time.monotonic()), ""


def collect_stack(ask: StackAsk, deadline: float, max_bytes: int) -> dict[str, Any]:
    """Wait (until `deadline`, monotonic) for the dump to land and settle; then parse it."""
    size, since = -1, time.monotonic()
    while True:
        now = time.monotonic()
        try:
            current = os.stat(ask.path).st_size
        except OSError as exc:
            return {"answered": False, "note": f"stack file gone ({exc.strerror})"}
        if current != size:
            size, since = current, now
        elif size != ask.offset and now - since >= _SETTLE_S:
            break
        if now >= deadline:
            break
        time.sleep(0.01)
    offset = ask.offset if size >= ask.offset else 0  # the rank emptied its file meanwhile
    if size <= offset:
        waited = time.monotonic() - ask.asked_at
        return {
            "answered": False,
            "note": f"no answer in {waited:.1f}s (a process in uninterruptible sleep or not "
            "scheduled answers late; see process state and wchan)",
        }
    try:
        with open(ask.path, "rb") as handle:
            handle.seek(offset)
            text = handle.read(min(size - offset, max_bytes)).decode(errors="replace")
    except OSError as exc:
        return {"answered": False, "note": f"stack file unreadable ({exc.strerror})"}
    return {
        "answered": True,
        "answer_s": round(time.monotonic() - ask.asked_at, 3),
        "threads": parse_stacks(text, ask.engine_thread),
    }


def trigger_flight_recorder(facts: dict[str, Any] | None, why: str) -> dict[str, Any]:
    """Write to the rank's flight-recorder pipe (torch's watchdog thread then dumps its ring of
    collectives to the dump path); or say why not."""
    if facts is None:
        return {"available": False, "note": why}
    fr = facts.get("flight_recorder")
    if not isinstance(fr, dict) or not fr.get("available"):
        note = fr.get("note", "") if isinstance(fr, dict) else "no flight-recorder facts"
        return {"available": False, "note": note or "not available"}
    pipe, dump = str(fr.get("pipe", "")), str(fr.get("dump", ""))
    out: dict[str, Any] = {
        "available": True,
        "backend": fr.get("backend"),
        "pipe": pipe,
        "dump": dump,
    }
    try:
        if not stat_mod.S_ISFIFO(os.stat(pipe).st_mode):
            return {**out, "triggered": False, "note": "the pipe path is not a named pipe"}
        fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
        try:
            os.write(fd, b"dump\n")
        finally:
            os.close(fd)
    except OSError as exc:
        return {**out, "triggered": False, "note": f"pipe not open ({exc.strerror or exc})"}
    return {
        **out,
        "triggered": True,
        "triggered_unix": time.time(),
        "note": "torch's watchdog thread writes the dump; read it with "
        "python -m torch.distributed.flight_recorder.fr_trace",
    }


def dump_state(fr: dict[str, Any]) -> None:
    """After the wait: whether the flight-recorder dump file exists yet, and its size."""
    if not fr.get("triggered"):
        return
    with contextlib.suppress(OSError):
        info = os.stat(fr["dump"])
        fr["dump_bytes"] = info.st_size
        fr["dump_fresh"] = info.st_mtime >= fr["triggered_unix"] - 1
        return
    fr["dump_bytes"] = None


def ring_of(
    reader: RecordReader, rank: guard_pb2.RankInfo, last: int
) -> tuple[list[dict[str, Any]], str]:
    """The rank's last `last` collectives, oldest first, or ([], why none)."""
    entries = reader.ring(rank.run_id, rank.dp_rank, rank.pp_rank, rank.tp_rank, rank.pid)
    if entries is None:
        return [], "no liveness record with a ring on this node (another node, or an older guard)"
    rows = [
        {
            "call": e.call,
            "op": e.op,
            "group": e.group,
            "seq": e.seq,
            "bytes": e.nbytes,
            "start_unix": round(e.start_unix, 6),
            "end_unix": round(e.end_unix, 6) if e.end_unix is not None else NOT_RETURNED,
        }
        for e in entries[-last:]
    ]
    return rows, "" if rows else "no collective yet"


def facts_path(reader: RecordReader, rank: guard_pb2.RankInfo) -> str:
    path = record_path(reader.directory, rank.run_id, rank.dp_rank, rank.pp_rank, rank.tp_rank)
    return companion_path(path, "facts.json")
