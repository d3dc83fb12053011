"""A rank's liveness record: what its engine thread does now, in shared memory, readable by the
sidecar on the same node while no thread of the rank can run Python.

Heartbeats travel on the gRPC stream from the streamer thread. A wait that holds the GIL (vLLM's
CPU shared-memory all-reduce spins in a custom op; a driver call on NPU or GPU can do the same)
starves that thread, and a waiting rank then looks as silent as a frozen one. So the engine
thread also writes its phase and the collective it is in (op, group, sequence number, entry
time) into a small memory-mapped file, one aligned 8-byte word at a time, and the sidecar reads
it directly (`read`), together with `/proc/<pid>/stat`: state T (stopped) is a process frozen
whole, anything else is a process that runs (and waits).

Layout: native byte order and word size (writer and reader are on one machine), 64-bit words.

    header (written once, before the file is renamed into place)
      0 magic  1 version  2 pid  3 start time (clock ticks, /proc/<pid>/stat field 22)
      4 dp  5 tp  6 pp
    body (a seqlock: word 8 is odd while the engine thread writes words 9-16)
      8 counter  9 wave  10 phase name id  11 phase since (CLOCK_MONOTONIC ns)
      12 call number  13 op name id  14 group name id  15 seq  16 call since (CLOCK_MONOTONIC ns)
      17 number of the call that returned last (one word, outside the seqlock)
    names (from byte 256): a count word, then 48-byte NUL-padded names; id = index + 1
    ring (from byte 4096, past what a reader of the first layout maps; absent in older files)
      a header of 8 words (ring magic, slots, words per slot), then `slots` slots of 6 words:
      call number, op id << 32 | group id, seq, start, end, bytes

The ring holds the last `slots` collectives of the engine thread, so an evidence bundle can list
them while the rank is frozen or waits holding the GIL (telemetry/crossrank/bundle.py). The
engine thread writes a slot's call number last and its end before word 17, so the reader needs
no lock: it keeps a slot whose call number reads the same before and after its other words and
lies within the last `slots` calls entered (word 12, read after the slots: a slot being refilled
still shows the number of the call `slots` before); a call is returned when its number is at
most word 17, and only then is its end word its own.
A reader retries while the counter is odd or changed under it. Each store is one aligned word
(memoryview of format "Q"), so no word is ever torn; x86's store order makes the seqlock exact,
and on weaker orders (aarch64) a rare mixed read lasts one look: every judgement that uses it
needs the same answer over a second or more of looks.

Cost on the engine thread: a handful of word stores per collective (enter + leave, ring
included) and per phase change (bench/liveness.py measures both, ring on and off). Files live in `DEFAULT_DIR` unless configured; one per
(run, dp, pp, tp), replaced when the worker restarts and removed when it closes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import mmap
import os
import signal
import time

import structlog

from telemetry.wire import paths

log = structlog.get_logger("ascend_guard.liveness_record")

DEFAULT_DIR = paths.DEFAULT_LIVENESS_DIR  # the sidecar's --liveness-dir default too
MAGIC = 0x31564C4741  # "AGLV1", little-endian text
VERSION = 1
SIZE = 4096
_COUNTER, _WAVE, _PHASE, _PHASE_SINCE = 8, 9, 10, 11
_CALL, _OP, _GROUP, _SEQ, _CALL_SINCE, _LEFT = 12, 13, 14, 15, 16, 17
_NAMES_AT = 256
_NAME_BYTES = 48
MAX_NAMES = (SIZE - _NAMES_AT - 8) // _NAME_BYTES
RING_MAGIC = 0x31474E5247  # "GRNG1"
RING_SLOTS = 64  # a power of two: the slot is the call number's low bits
_RING_AT = SIZE  # byte offset of the ring header
_RING_HEADER_WORDS = 8
_SLOT_WORDS = 6
_MAX_MAP = 1 << 20  # a reader maps no more of a record than this


def _file_size(slots: int) -> int:
    """The record's size with a ring of `slots` (0: the first layout alone), in whole pages."""
    if not slots:
        return SIZE
    raw = _RING_AT + 8 * (_RING_HEADER_WORDS + slots * _SLOT_WORDS)
    return -(-raw // mmap.PAGESIZE) * mmap.PAGESIZE


def _nbytes(data: object) -> int:
    """Bytes of a tensor, or of a list / dict of tensors; 0 for anything else."""
    if isinstance(data, dict):
        data = data.values()
    elif not isinstance(data, (list, tuple)):
        return 0
    return sum(int(getattr(item, "nbytes", 0) or 0) for item in data)


def record_path(directory: str, run_id: str, dp: int, pp: int, tp: int) -> str:
    """Where the record of one rank lives; the run id is hashed (any text is safe in a name)."""
    run = hashlib.sha1(run_id.encode()).hexdigest()[:16]
    return os.path.join(directory or DEFAULT_DIR, f"rank-{run}-dp{dp}-pp{pp}-tp{tp}.live")


def companion_path(path: str, kind: str) -> str:
    """A file that goes with a record (`stacks`, `facts.json`: guard/stream/evidence.py)."""
    return f"{path.removesuffix('.live')}.{kind}"


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of a process, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            text = handle.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after the last ")"
    fields = text[text.rfind(b")") + 2 :].split()
    try:
        return fields[0].decode(), int(fields[19])
    except (IndexError, ValueError):
        return None


def process_exit(pid: int, start_ticks: int) -> dict[str, object] | None:
    """How the process that was `pid` (started at `start_ticks`) ended, or None while it
    exists. The exit status is known only while it is a zombie (/proc/<pid>/stat field 52);
    once its parent reaped it, only that it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            text = handle.read()
    except OSError:
        return {"how": "gone", "detail": "process gone; exit status not known (already reaped)"}
    fields = text[text.rfind(b")") + 2 :].split()
    try:
        state, started = fields[0].decode(), int(fields[19])
    except (IndexError, ValueError):
        return None
    if started != start_ticks:
        return {"how": "gone", "detail": "process gone (its pid now names another process)"}
    if state not in ("Z", "X"):
        return None
    try:
        code = int(fields[49])
    except (IndexError, ValueError):
        return {"how": "gone", "detail": "process exited; exit status not readable"}
    if code & 0x7F:
        number = code & 0x7F
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = str(number)
        return {"how": "signal", "signal": number, "detail": f"killed by {name}"}
    return {"how": "exit", "status": code >> 8, "detail": f"exited with status {code >> 8}"}


def _make_shared_dir(directory: str) -> None:
    """Like /tmp (sticky, writable by all): workers and sidecar may run as different users."""
    if not directory or os.path.isdir(directory):
        return
    os.makedirs(directory, exist_ok=True)
    with contextlib.suppress(OSError):
        os.chmod(directory, 0o1777)


def map_new_file(path: str, size: int) -> tuple[str, mmap.mmap]:
    """A file of `size` zero bytes beside `path`, in its shared directory (made if missing),
    mapped: (its name, the mapping). The caller fills it and moves it onto `path`, so that a
    reader never opens a half-made file. Raises OSError."""
    tmp = f"{path}.{os.getpid()}.tmp"
    _make_shared_dir(os.path.dirname(path))
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, size)
        return tmp, mmap.mmap(fd, size)
    finally:
        os.close(fd)


class LivenessRecord:
    """The engine thread's side. Every method is a handful of word stores; none raises."""

    def __init__(self, path: str, mm: mmap.mmap, slots: int = 0) -> None:
        self.path = path
        self._mm = mm
        self._words = memoryview(mm)[:SIZE].cast("Q")
        # the ring's slots as one word array (None: no ring), and the mask that picks a slot
        self._ring = (
            memoryview(mm)[_RING_AT + 8 * _RING_HEADER_WORDS :].cast("Q") if slots else None
        )
        self._mask = slots - 1
        self._ids: dict[str, int] = {}
        self._counter = 0
        self._call = 0

    @classmethod
    def create(
        cls, directory: str, run_id: str, dp: int, pp: int, tp: int, ring_slots: int = RING_SLOTS
    ) -> LivenessRecord | None:
        """Make the record of this process (None, with a warning, if the directory will not
        take it: the sidecar then judges this rank from its stream alone). `ring_slots`: how
        many of the latest collectives it keeps (a power of two; 0: none)."""
        if ring_slots & (ring_slots - 1):
            raise ValueError(f"ring_slots: {ring_slots} is not a power of two (or 0)")
        path = record_path(directory, run_id, dp, pp, tp)
        pid = os.getpid()
        stat = proc_stat(pid)
        tmp = f"{path}.{pid}.tmp"
        try:
            tmp, mm = map_new_file(path, _file_size(ring_slots))
            words = memoryview(mm).cast("Q")
            words[1], words[2], words[3] = VERSION, pid, stat[1] if stat else 0
            words[4], words[5], words[6] = dp, tp, pp
            words[_PHASE_SINCE] = time.monotonic_ns()
            if ring_slots:
                at = _RING_AT // 8
                words[at + 1], words[at + 2] = ring_slots, _SLOT_WORDS
                words[at] = RING_MAGIC
            words[0] = MAGIC
            words.release()
            os.replace(tmp, path)
        except (OSError, ValueError) as exc:
            log.warning("liveness_record_unavailable", path=path, error=str(exc))
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return None
        return cls(path, mm, ring_slots)

    def _name(self, name: str) -> int:
        """The id of a name, adding it to the table on first use (0 when the table is full)."""
        ident = self._ids.get(name)
        if ident is not None:
            return ident
        words = self._words
        count = words[_NAMES_AT // 8]
        if count >= MAX_NAMES:
            return 0
        at = _NAMES_AT + 8 + count * _NAME_BYTES
        self._mm[at : at + _NAME_BYTES] = name.encode()[:_NAME_BYTES].ljust(_NAME_BYTES, b"\0")
        words[_NAMES_AT // 8] = count + 1  # after the bytes: a reader sees whole names only
        self._ids[name] = count + 1
        return count + 1

    def phase(self, name: str, since_ns: int, wave: int) -> None:
        """The engine thread entered phase `name` at `since_ns` (perf_counter_ns, which is
        CLOCK_MONOTONIC on Linux, as the reader's clock)."""
        ident = self._ids.get(name) or self._name(name)
        words = self._words
        n = self._counter
        words[_COUNTER] = n + 1
        words[_WAVE] = wave
        words[_PHASE] = ident
        words[_PHASE_SINCE] = since_ns
        words[_COUNTER] = self._counter = n + 2

    def enter(self, op: str, group: str, seq: int, since_ns: int, data: object = None) -> None:
        """The engine thread entered collective (op, group, seq) at `since_ns`, carrying `data`
        (a tensor, a list or dict of them, or None: its bytes go into the ring)."""
        ids = self._ids
        op_id = ids.get(op) or self._name(op)
        group_id = ids.get(group) or self._name(group)
        words = self._words
        n = self._counter
        self._call = call = self._call + 1
        words[_COUNTER] = n + 1
        words[_CALL] = call
        words[_OP] = op_id
        words[_GROUP] = group_id
        words[_SEQ] = seq
        words[_CALL_SINCE] = since_ns
        words[_COUNTER] = self._counter = n + 2
        ring = self._ring
        if ring is not None:
            at = (call & self._mask) * _SLOT_WORDS
            ring[at + 1] = op_id << 32 | group_id
            ring[at + 2] = seq
            ring[at + 3] = since_ns
            try:
                nbytes = getattr(data, "nbytes", None)
                ring[at + 5] = nbytes if nbytes is not None else _nbytes(data)
            except (TypeError, ValueError, OverflowError):  # not a plain size: never raise here
                ring[at + 5] = 0
            ring[at] = call

    def leave(self, end_ns: int = 0) -> None:
        """The collective entered last returned (at `end_ns`, perf_counter_ns; 0: now)."""
        call = self._call
        ring = self._ring
        if ring is not None:
            ring[(call & self._mask) * _SLOT_WORDS + 4] = end_ns or time.perf_counter_ns()
        self._words[_LEFT] = call

    def close(self) -> None:
        """Remove the file. The mapping stays until the process exits: the engine thread may
        still be in a collective that writes to it."""
        with contextlib.suppress(OSError):
            os.unlink(self.path)


@dataclasses.dataclass(frozen=True)
class RingEntry:
    """One collective from a rank's ring, oldest first in `RecordReader.ring`."""

    call: int  # the rank's call number (every collective it entered, counted from 1)
    op: str
    group: str
    seq: int
    nbytes: int
    start_unix: float  # wall clock, converted from the rank's monotonic clock
    end_unix: float | None  # None: not returned (yet)

    @property
    def returned(self) -> bool:
        return self.end_unix is not None


@dataclasses.dataclass(frozen=True)
class RecordView:
    """One consistent look at a rank's record, and at its process."""

    state: str  # /proc/<pid>/stat state letter: R, S, D, T (stopped), t (traced), Z, ...
    wave: int
    phase: str
    phase_age_s: float
    in_call: bool
    op: str
    group: str
    seq: int
    call_age_s: float  # how long the current call has run (0 when not in one)
    moves: tuple[int, int]  # (counter, call that returned last): changes while the rank moves
    start_ticks: int = 0  # the process's start time (/proc/<pid>/stat field 22)

    @property
    def stopped(self) -> bool:
        return self.state in ("T", "t")


class RecordReader:
    """The sidecar's side: open records by rank, check they belong to the process that streams,
    and read them without locks."""

    def __init__(self, directory: str = "") -> None:
        self.directory = directory or DEFAULT_DIR
        self._open: dict[str, tuple[int, mmap.mmap, memoryview]] = {}  # path -> (pid, ...)

    def read(self, run_id: str, dp: int, pp: int, tp: int, pid: int) -> RecordView | None:
        """The record of this rank and the state of its process, or None when there is none
        this sidecar can trust (another node, another pid namespace, another owner, a record
        of an older process)."""
        path = record_path(self.directory, run_id, dp, pp, tp)
        stat = proc_stat(pid)
        if stat is None:
            return None
        words = self._words(path, pid)
        if words is None or words[3] != stat[1]:
            self._forget(path)  # a reused pid, or a pid of another namespace
            return None
        for _ in range(8):
            before = words[_COUNTER]
            if before & 1:
                continue
            body = words[_WAVE:_LEFT].tolist()
            left = words[_LEFT]
            if words[_COUNTER] == before:
                break
        else:
            return None  # the writer kept writing under us: look again next time
        wave, phase, phase_since, call, op, group, seq, call_since = body
        now = time.monotonic_ns()
        in_call = call > left and call > 0
        return RecordView(
            state=stat[0],
            wave=wave,
            phase=self._name(path, phase),
            phase_age_s=max(0, now - phase_since) / 1e9,
            in_call=in_call,
            op=self._name(path, op) if in_call else "",
            group=self._name(path, group) if call else "",
            seq=seq if call else 0,
            call_age_s=max(0, now - call_since) / 1e9 if in_call else 0.0,
            moves=(before, left),
            start_ticks=stat[1],
        )

    def ring(self, run_id: str, dp: int, pp: int, tp: int, pid: int) -> list[RingEntry] | None:
        """The rank's latest collectives, oldest first (None: no record this sidecar can trust,
        or a record without a ring). Readable while the rank is stopped: no help from it."""
        path = record_path(self.directory, run_id, dp, pp, tp)
        stat = proc_stat(pid)
        words = self._words(path, pid) if stat is not None else None
        if words is None or words[3] != stat[1]:
            return None
        at = _RING_AT // 8
        if len(words) <= at + _RING_HEADER_WORDS or words[at] != RING_MAGIC:
            return None
        slots, width = words[at + 1], words[at + 2]
        first = at + _RING_HEADER_WORDS
        if width < _SLOT_WORDS or first + slots * width > len(words):
            return None
        mono, wall = time.monotonic_ns(), time.time()
        seen = []
        for slot in range(slots):
            base = first + slot * width
            call = words[base]
            body = words[base + 1 : base + _SLOT_WORDS].tolist()
            if call and words[base] == call:
                seen.append((call, body))
        latest, left = words[_CALL], words[_LEFT]  # after the slots: see the module docstring
        entries = []
        for call, (ids, seq, start, end, nbytes) in seen:
            if not latest - slots < call <= latest:
                continue  # being refilled for a newer call right now
            end = end if call <= left else 0
            entries.append(
                RingEntry(
                    call=call,
                    op=self._name(path, ids >> 32),
                    group=self._name(path, ids & 0xFFFFFFFF),
                    seq=seq,
                    nbytes=nbytes,
                    start_unix=wall - (mono - start) / 1e9,
                    end_unix=wall - (mono - end) / 1e9 if end else None,
                )
            )
        entries.sort(key=lambda e: e.call)
        return entries

    def exit_of(self, pid: int, start_ticks: int) -> dict[str, object] | None:
        """How the process `pid` started at `start_ticks` ended; None while it exists."""
        return process_exit(pid, start_ticks)

    def owner(self, run_id: str, dp: int, pp: int, tp: int) -> int | None:
        """The pid of the live process whose record this rank has, or None (no record, or its
        process is gone): how a sidecar that restarted finds a rank that cannot reconnect."""
        path = record_path(self.directory, run_id, dp, pp, tp)
        try:
            with open(path, "rb") as handle:
                head = memoryview(handle.read(64)).cast("Q")
        except (OSError, TypeError, ValueError):
            return None
        if len(head) < 4 or head[0] != MAGIC or head[1] != VERSION:
            return None
        pid = head[2]
        stat = proc_stat(pid)
        if stat is None or stat[1] != head[3] or stat[0] in ("Z", "X"):
            return None
        return pid

    def _words(self, path: str, pid: int) -> memoryview | None:
        held = self._open.get(path)
        if held is not None and held[0] == pid:
            return held[2]
        self._forget(path)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            info = os.fstat(fd)
            # the record must be written by the streaming process's owner
            if info.st_size < SIZE or info.st_uid != os.stat(f"/proc/{pid}").st_uid:
                return None
            # the whole file: the ring lies past the first layout's SIZE
            size = min(info.st_size, _MAX_MAP) // 8 * 8
            mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        except OSError:
            return None
        finally:
            os.close(fd)
        words = memoryview(mm).cast("Q")
        if words[0] != MAGIC or words[1] != VERSION or words[2] != pid:
            words.release()
            mm.close()
            return None
        self._open[path] = (pid, mm, words)
        return words

    def _name(self, path: str, ident: int) -> str:
        held = self._open.get(path)
        if held is None or not 0 < ident <= MAX_NAMES:
            return ""
        at = _NAMES_AT + 8 + (ident - 1) * _NAME_BYTES
        return held[1][at : at + _NAME_BYTES].rstrip(b"\0").decode(errors="replace")

    def _forget(self, path: str) -> None:
        held = self._open.pop(path, None)
        if held is not None:
            held[2].release()
            held[1].close()

    def forget(self, run_id: str, dp: int, pp: int, tp: int) -> None:
        """The rank is forgotten (its process is gone): let go of its record."""
        self._forget(record_path(self.directory, run_id, dp, pp, tp))

    def close(self) -> None:
        for path in list(self._open):
            self._forget(path)
