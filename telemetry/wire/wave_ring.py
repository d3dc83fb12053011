"""A rank's wave ring: the engine thread writes each wave's record in place into a shared-memory
file in the liveness directory, and the sidecar on the same node drains it.

No protobuf, no gRPC and no Python object per record in the worker: a write is one `struct`
pack into a preallocated slot between two word stores. The layout is declared once, here, from
the proto (`WaveRecord` is the wave's schema; `CollectiveWave`'s scalars and
`CollectiveStatColumns`' numeric columns are the collectives'), so a field added to the proto
reaches the ring as it reaches the wire.

File (native byte order and word size: writer and reader share one machine), 64-bit words:

    header (HEADER_BYTES; words 0-7 keep their meaning in every layout version)
      0 magic  1 layout version  2 header bytes  3 slot bytes  4 slots (a power of two)
      5 committed: records committed so far (record n, counted from 1, is committed when
        this word reaches n)
      6 dropped: records the writer gave up on (never written)  7 pid
      8 process start time (clock ticks, /proc/<pid>/stat field 22)  9 dp  10 tp  11 pp
      12 records whose arrays did not fit their slot (written without them)
    slots, `slots` of `slot bytes` each; record n lives in slot (n - 1) % slots
      word 0: the slot's sequence, a seqlock: 2n - 1 while record n is written, 2n once it is
      then the fixed fields (`FIXED_FIELDS`, packed), then one count per array section
      then the array sections (`SECTIONS`), each from an 8-byte boundary, in declared order

A full ring overwrites the oldest slot: the writer never waits for a reader. A reader keeps its
own cursor; it never reads past the committed word, and takes a record only when its slot's
sequence reads 2n before and after the copy. A sequence above 2n means the writer lapped the
reader (the record was overwritten: counted); one below 2n inside the committed range, or an odd
one left behind by a writer that died mid-write, is a torn record (counted, never decoded). A
reader refuses a file whose magic or layout version it does not know, and says which. Each store
of the sequence and committed words is one aligned 8-byte word; x86's store order makes the
seqlock exact, as for the liveness record (telemetry/wire/liveness_record.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
import struct
from collections.abc import Mapping, Sequence

import numpy as np
import structlog
from google.protobuf.descriptor import FieldDescriptor

from telemetry.wire import liveness_record
from telemetry.wire.proto import guard_pb2
from telemetry.wire.schema import COLLECTIVE_STAT_COLUMNS, COLLECTIVE_WAVE_COLUMNS, WAVE_FIELDS

log = structlog.get_logger("ascend_guard.wave_ring")

MAGIC = 0x31474E5257474147  # "GAGWRNG1" as little-endian text
LAYOUT_VERSION = 1
KNOWN_VERSIONS = (LAYOUT_VERSION,)
HEADER_BYTES = 4096
DEFAULT_SLOTS = 1024
DEFAULT_SLOT_BYTES = 4096
MIN_SLOT_BYTES = 512
_MAX_FILE = 1 << 31  # a reader maps no more than this
(
    _MAGIC,
    _VERSION,
    _HEADER,
    _SLOT_BYTES,
    _SLOTS,
    _COMMITTED,
    _DROPPED,
    _PID,
    _START,
    _DP,
    _TP,
    _PP,
    _NO_ARRAYS,
) = range(13)

# proto scalar type -> (struct code, numpy type), both little-endian and unpadded
_CODES = {
    FieldDescriptor.TYPE_UINT64: ("Q", "<u8"),
    FieldDescriptor.TYPE_INT64: ("q", "<i8"),
    FieldDescriptor.TYPE_UINT32: ("I", "<u4"),
    FieldDescriptor.TYPE_INT32: ("i", "<i4"),
    FieldDescriptor.TYPE_BOOL: ("?", "?"),
}


def _proto_types(message) -> dict[str, int]:
    return {f.name: f.type for f in message.DESCRIPTOR.fields}


_WAVE_TYPES = _proto_types(guard_pb2.WaveRecord)
_COLL_WAVE_TYPES = _proto_types(guard_pb2.CollectiveWave)
_COLL_STAT_TYPES = _proto_types(guard_pb2.CollectiveStatColumns)

# the collective wave's scalars other than its wave number, as fields of the wave's record
COLLECTIVE_FIELDS: tuple[str, ...] = tuple(
    f"collective_{name}" for name in COLLECTIVE_WAVE_COLUMNS if name != "wave"
)

# Array sections: name -> numpy type. Per request of the wave: its index (as request
# membership names requests), tokens scheduled and tokens sampled; the sampled token ids, flat,
# in request order; membership's joins (index + the request ids as UTF-8, one "\n" after each),
# finishes and preemptions; the collectives' stat rows as columns (`key` indexes the wave's
# keys, "op\tgroup\tbackend\tdtype\n" each, in `collective_keys`).
SECTIONS: dict[str, str] = {
    "req_index": "<u4",
    "scheduled_counts": "<u4",
    "sampled_counts": "<u4",
    "sampled_token_ids": "<i4",
    "joined_index": "<u4",
    "joined_ids": "u1",
    "finished_index": "<u4",
    "preempted_index": "<u4",
    "collective_keys": "u1",
    "collective_key": "<u4",
    **{
        f"collective_{name}": _CODES[_COLL_STAT_TYPES[name]][1]
        for name in COLLECTIVE_STAT_COLUMNS
        if name != "wave_index"
    },
}
SECTION_COUNTS: tuple[str, ...] = tuple(f"n_{name}" for name in SECTIONS)

# the fixed part of a slot after its sequence word: wave fields, collective scalars, counts
FIXED_FIELDS: tuple[tuple[str, str, str], ...] = (
    *((name, *_CODES[_WAVE_TYPES[name]]) for name in WAVE_FIELDS),
    *(
        (f"collective_{name}", *_CODES[_COLL_WAVE_TYPES[name]])
        for name in COLLECTIVE_WAVE_COLUMNS
        if name != "wave"
    ),
    *((name, "I", "<u4") for name in SECTION_COUNTS),
)
_STRUCT = struct.Struct("<" + "".join(code for _, code, _ in FIXED_FIELDS))
FIXED_BYTES = 8 + _STRUCT.size  # the sequence word, then the packed fields
# the reader's view of a slot's start: its sequence and fixed fields
FIXED_DTYPE = np.dtype([("seq", "<u8"), *((name, kind) for name, _, kind in FIXED_FIELDS)])
_ARRAYS_AT = -(-FIXED_BYTES // 8) * 8
_SPOILED = (1 << 64) - 1  # odd and above every record's sequence
_NO_COLLECTIVE = (0,) * len(COLLECTIVE_FIELDS)
_NO_COUNTS = (0,) * len(SECTIONS)
_SECTION_TYPES = {name: np.dtype(kind) for name, kind in SECTIONS.items()}


class RingLayoutError(ValueError):
    """A ring file this reader cannot read; the message names the file and what is wrong."""


def ring_path(directory: str, run_id: str, dp: int, pp: int, tp: int) -> str:
    """Where a rank's ring lives: beside its liveness record, in the same directory."""
    record = liveness_record.record_path(directory, run_id, dp, pp, tp)
    return liveness_record.companion_path(record, "ring")


def file_size(slots: int, slot_bytes: int) -> int:
    return HEADER_BYTES + slots * slot_bytes


def _check_shape(slots: int, slot_bytes: int) -> None:
    if slots < 2 or slots & (slots - 1):
        raise ValueError(f"slots: {slots} is not a power of two of at least 2")
    if slot_bytes < max(MIN_SLOT_BYTES, _ARRAYS_AT) or slot_bytes % 8:
        raise ValueError(
            f"slot_bytes: {slot_bytes} must be a multiple of 8, at least {MIN_SLOT_BYTES}"
        )


class RingWriter:
    """The engine thread's side. `write` never blocks and never raises on a record."""

    def __init__(self, path: str, mm: mmap.mmap, slots: int, slot_bytes: int) -> None:
        self.path = path
        self._mm = mm
        self._words = memoryview(mm).cast("Q")
        self._mask = slots - 1
        self._slot_bytes = slot_bytes
        self._n = self._words[_COMMITTED]
        self._pack = _STRUCT.pack_into

    @classmethod
    def create(
        cls,
        path: str,
        *,
        slots: int = DEFAULT_SLOTS,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        rank: tuple[int, int, int] = (0, 0, 0),
        version: int = LAYOUT_VERSION,
    ) -> RingWriter:
        """Make the ring file at `path` (replacing one left by an earlier process of the rank);
        `rank`: (dp, tp, pp). Raises OSError or ValueError; `version` is for tests only."""
        _check_shape(slots, slot_bytes)
        pid = os.getpid()
        stat = liveness_record.proc_stat(pid)
        size = file_size(slots, slot_bytes)
        # in a shared directory, as the liveness records
        tmp, mm = liveness_record.map_new_file(path, size)
        try:
            words = memoryview(mm).cast("Q")
            words[_VERSION], words[_HEADER] = version, HEADER_BYTES
            words[_SLOT_BYTES], words[_SLOTS] = slot_bytes, slots
            words[_PID], words[_START] = pid, stat[1] if stat else 0
            words[_DP], words[_TP], words[_PP] = rank
            words[_MAGIC] = MAGIC  # last: a reader sees a whole header or none
            words.release()
            # touch every page now, so that no first write of a slot pays a page fault
            for at in range(HEADER_BYTES, size, mmap.PAGESIZE):
                mm[at] = 0
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return cls(path, mm, slots, slot_bytes)

    @property
    def committed(self) -> int:
        return self._n

    def write(
        self,
        fields: Sequence,
        collective: Sequence = _NO_COLLECTIVE,
        arrays: Mapping[str, object] | None = None,
    ) -> None:
        """Write one wave: `fields` in `WAVE_FIELDS` order, `collective` in `COLLECTIVE_FIELDS`
        order, `arrays` by section name (anything numpy turns into the section's type)."""
        n = self._n + 1
        words = self._words
        base = ((n - 1) & self._mask) * self._slot_bytes + HEADER_BYTES
        at = base >> 3
        words[at] = 2 * n - 1
        try:
            if arrays:
                counts = self._write_arrays(base, arrays)
                self._pack(self._mm, base + 8, *fields, *collective, *counts)
            else:
                self._pack(self._mm, base + 8, *fields, *collective, *_NO_COUNTS)
        except (struct.error, TypeError, ValueError, OverflowError):
            # a value the layout cannot hold: the record is lost, counted, and its number is
            # used by the next one; the slot's old record reads as overwritten (a sequence
            # above any), and `finish` does not take the slot for a torn record
            words[at] = _SPOILED
            words[_DROPPED] += 1
            return
        words[at] = 2 * n
        words[_COMMITTED] = self._n = n

    def _write_arrays(self, base: int, arrays: Mapping[str, object]) -> tuple[int, ...]:
        """Write the arrays after the fixed part; their counts (none written: all zero, and
        the record counted as one without arrays: too large, or not convertible)."""
        values = []
        need = _ARRAYS_AT
        try:
            for name, kind in _SECTION_TYPES.items():
                value = arrays.get(name)
                if value is None:
                    values.append(None)
                    continue
                if isinstance(value, (bytes, bytearray)):
                    value = np.frombuffer(value, dtype=np.uint8)
                array = np.ascontiguousarray(value, dtype=kind).reshape(-1)
                values.append(array)
                need += -(-array.nbytes // 8) * 8
        except (TypeError, ValueError, OverflowError):
            need = self._slot_bytes + 1
        if need > self._slot_bytes:
            self._words[_NO_ARRAYS] += 1
            return _NO_COUNTS
        at = base + _ARRAYS_AT
        mm = self._mm
        counts = []
        for array in values:
            if array is None or not array.size:
                counts.append(0)
                continue
            mm[at : at + array.nbytes] = array.tobytes()
            at += -(-array.nbytes // 8) * 8
            counts.append(array.size)
        return tuple(counts)

    def close(self) -> None:
        """Remove the file; the mapping stays (a reader that has it open drains the rest)."""
        with contextlib.suppress(OSError):
            os.unlink(self.path)


@dataclasses.dataclass
class Drained:
    """What one `RingReader.drain` took: the records' fixed fields (a structured array in
    `FIXED_DTYPE`, oldest first), and their arrays when asked for."""

    fields: np.ndarray
    arrays: list[dict[str, np.ndarray]] | None = None

    def __len__(self) -> int:
        return len(self.fields)


class RingReader:
    """The sidecar's side of one rank's ring. Counts what it could not take: `overwritten`
    (lapped by the writer before it was read), `torn` (a half-written slot), and the writer's
    own `dropped`; `lost` is their sum, cumulative, as a worker's dropped count on the wire."""

    def __init__(self, path: str, mm: mmap.mmap, *, start: int | None = None) -> None:
        self.path = path
        self._mm = mm
        words = np.frombuffer(mm, dtype="<u8", count=HEADER_BYTES // 8)
        self._header = words
        self.slots = int(words[_SLOTS])
        self.slot_bytes = int(words[_SLOT_BYTES])
        self.pid = int(words[_PID])
        self.start_ticks = int(words[_START])
        self.rank = (int(words[_DP]), int(words[_TP]), int(words[_PP]))
        # every slot's sequence and fixed fields, as one strided view
        # every slot as raw bytes (rows copied as bytes, then viewed as FIXED_DTYPE: numpy
        # copies a packed structured type field by field, much slower), and their sequences
        self._raw = np.ndarray(
            (self.slots, self.slot_bytes), dtype=np.uint8, buffer=mm, offset=HEADER_BYTES
        )
        self._seqs = np.ndarray(
            (self.slots,), dtype="<u8", buffer=mm, offset=HEADER_BYTES, strides=(self.slot_bytes,)
        )
        committed = int(words[_COMMITTED])
        # a reader that attaches late starts at the oldest record the ring still holds
        self.cursor = max(0, committed - self.slots) if start is None else start
        # records before that are gone: counted (a `start` given names where this reader's
        # business begins)
        self.overwritten = self.cursor if start is None else 0
        self.torn = 0
        self.read = 0
        self._finished = False

    @classmethod
    def open(cls, path: str, *, pid: int | None = None, start: int | None = None) -> RingReader:
        """Map the ring at `path`; with `pid`, the ring must be that process's. Raises
        RingLayoutError (a magic, layout version or size this reader does not know), or
        OSError (no such file)."""
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                raise RingLayoutError(f"ring {path}: {size} bytes, shorter than its header")
            head = np.frombuffer(os.pread(fd, 8 * (_NO_ARRAYS + 1), 0), dtype="<u8")
            if int(head[_MAGIC]) != MAGIC:
                raise RingLayoutError(f"ring {path}: magic {int(head[_MAGIC]):#x} is not a ring's")
            version = int(head[_VERSION])
            if version not in KNOWN_VERSIONS:
                raise RingLayoutError(
                    f"ring {path}: layout version {version}; this sidecar reads "
                    f"{', '.join(map(str, KNOWN_VERSIONS))} (upgrade the sidecar to match the worker)"
                )
            slots, slot_bytes = int(head[_SLOTS]), int(head[_SLOT_BYTES])
            try:
                _check_shape(slots, slot_bytes)
            except ValueError as exc:
                raise RingLayoutError(f"ring {path}: {exc}") from None
            if int(head[_HEADER]) != HEADER_BYTES or size < file_size(slots, slot_bytes):
                raise RingLayoutError(
                    f"ring {path}: {size} bytes, header {int(head[_HEADER])}: not the size "
                    f"its {slots} slots of {slot_bytes} bytes need"
                )
            if file_size(slots, slot_bytes) > _MAX_FILE:
                raise RingLayoutError(f"ring {path}: larger than {_MAX_FILE} bytes")
            if pid is not None and int(head[_PID]) != pid:
                raise OSError(f"ring {path}: written by pid {int(head[_PID])}, not {pid}")
            mm = mmap.mmap(fd, file_size(slots, slot_bytes), prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        return cls(path, mm, start=start)

    @property
    def committed(self) -> int:
        return int(self._header[_COMMITTED])

    @property
    def writer_dropped(self) -> int:
        return int(self._header[_DROPPED])

    @property
    def arrays_dropped(self) -> int:
        """Records written without their arrays (they did not fit a slot)."""
        return int(self._header[_NO_ARRAYS])

    @property
    def lost(self) -> int:
        return self.overwritten + self.torn + self.writer_dropped

    def drain(self, limit: int = 0, *, arrays: bool = False) -> Drained:
        """Take the records committed since the last drain (at most `limit`; 0: all),
        oldest first. Never reads past the committed word; every record in the range is
        either returned or counted."""
        committed = self.committed  # read first: every slot up to it was committed
        cursor = self.cursor
        if committed - cursor > self.slots:  # lapped: the oldest are gone
            self.overwritten += committed - self.slots - cursor
            cursor = committed - self.slots
        end = committed if not limit else min(committed, cursor + limit)
        if end <= cursor:
            return Drained(np.empty(0, FIXED_DTYPE), [] if arrays else None)
        numbers = np.arange(cursor + 1, end + 1, dtype=np.uint64)
        index = ((numbers - 1) & np.uint64(self.slots - 1)).astype(np.intp)
        seqs = self._seqs
        before = seqs[index]
        rows = self._raw[index, :FIXED_BYTES]  # a copy
        taken = rows.view(FIXED_DTYPE).reshape(-1)
        bodies = (
            [self._arrays_of(int(i), taken[k]) for k, i in enumerate(index)] if arrays else None
        )
        after = seqs[index]
        want = numbers * np.uint64(2)
        good = (before == want) & (after == want) & (taken["seq"] == want)
        lapped = ~good & ((before > want) | (after > want))
        self.overwritten += int(np.count_nonzero(lapped))
        self.torn += int(np.count_nonzero(~good & ~lapped))
        self.cursor = end
        self.read += int(np.count_nonzero(good))
        # masked as raw rows: numpy masks a packed structured type field by field, slowly
        fields = taken if good.all() else rows[good].view(FIXED_DTYPE).reshape(-1)
        if bodies is not None:
            bodies = [body for body, keep in zip(bodies, good.tolist(), strict=True) if keep]
        return Drained(fields, bodies)

    def _arrays_of(self, slot: int, fixed: np.void) -> dict[str, np.ndarray]:
        base = HEADER_BYTES + slot * self.slot_bytes + _ARRAYS_AT
        limit = HEADER_BYTES + (slot + 1) * self.slot_bytes
        out: dict[str, np.ndarray] = {}
        for name, kind in _SECTION_TYPES.items():
            count = int(fixed[f"n_{name}"])
            nbytes = count * kind.itemsize
            if base + nbytes > limit:  # a count a torn slot left: the seqs will say so
                break
            if count:
                out[name] = np.frombuffer(self._mm, dtype=kind, count=count, offset=base).copy()
            base += -(-nbytes // 8) * 8
        return out

    def finish(self) -> int:
        """The writer is gone: count a record it began and never committed as torn (once).
        Returns how many that was (0 or 1)."""
        if self._finished:
            return 0
        self._finished = True
        n = self.committed + 1
        slot = (n - 1) & (self.slots - 1)
        if int(self._seqs[slot]) == 2 * n - 1:
            self.torn += 1
            return 1
        return 0

    def close(self) -> None:
        self._raw = self._seqs = None  # type: ignore[assignment]
        self._header = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):
            self._mm.close()


def header_of(path: str) -> dict[str, int]:
    """The version-independent header words of a ring file (for tools and error messages)."""
    with open(path, "rb") as handle:
        head = np.frombuffer(handle.read(8 * 8), dtype="<u8")
    names = ("magic", "version", "header_bytes", "slot_bytes", "slots", "committed", "dropped")
    return {name: int(head[i]) for i, name in enumerate(names)}
