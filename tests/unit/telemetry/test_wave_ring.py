"""The wave ring (telemetry/wire/wave_ring.py): a real shared-memory file, a real writer and
reader, and a real worker process killed with SIGKILL while it writes.

Each test checks that the accounting closes: every record the writer began is either returned
by the reader or counted (overwritten, torn, or dropped by the writer)."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from telemetry.wire import wave_ring
from telemetry.wire.proto import guard_pb2
from telemetry.wire.schema import WAVE_FIELDS
from telemetry.wire.wave_ring import (
    COLLECTIVE_FIELDS,
    HEADER_BYTES,
    RingLayoutError,
    RingReader,
    RingWriter,
)

REPO = Path(__file__).resolve().parents[3]


def fields(n: int) -> tuple:
    """A wave record whose every field is derived from its number (so a mixed slot shows)."""
    return (n, 10**18 + n, 3 * n, 2 * n, n, n % 7, 1, n % 7 - 1 if n % 7 else 0, 5, 6, n % 7,
            False, True, 0)  # fmt: skip


def check(drained, numbers) -> None:
    got = drained.fields
    assert got["wave"].tolist() == list(numbers)
    assert got["start_unix_nano"].tolist() == [10**18 + n for n in numbers]
    assert got["execute_ns"].tolist() == [3 * n for n in numbers]
    assert got["sample_ns"].tolist() == [2 * n for n in numbers]


def closes(reader: RingReader, begun: int) -> None:
    assert reader.read + reader.lost == begun, (reader.read, reader.lost, begun)


@pytest.fixture
def path(tmp_path: Path) -> str:
    return str(tmp_path / "rank.ring")


def test_layout_comes_from_the_proto():
    names = [name for name, _, _ in wave_ring.FIXED_FIELDS]
    assert tuple(names[: len(WAVE_FIELDS)]) == WAVE_FIELDS
    assert tuple(names[len(WAVE_FIELDS) : len(WAVE_FIELDS) + len(COLLECTIVE_FIELDS)]) == tuple(
        f"collective_{f.name}"
        for f in sorted(guard_pb2.CollectiveWave.DESCRIPTOR.fields, key=lambda f: f.number)
        if f.type != f.TYPE_MESSAGE and f.name != "wave"
    )
    # every numeric stat column of the proto has a section of the same name
    for f in guard_pb2.CollectiveStat.DESCRIPTOR.fields:
        if f.type != f.TYPE_STRING:
            assert f"collective_{f.name}" in wave_ring.SECTIONS
    assert wave_ring.FIXED_DTYPE.itemsize == wave_ring.FIXED_BYTES


def test_round_trip_fields_collectives_and_arrays(path):
    writer = RingWriter.create(path, slots=8, slot_bytes=4096, rank=(1, 2, 3))
    reader = RingReader.open(path, pid=os.getpid())
    assert reader.rank == (1, 2, 3)
    tokens = np.arange(300, dtype=np.int32) * 7
    writer.write(fields(1), collective=(11, 22, 3, 44, 55), arrays={
        "req_index": [4, 5], "sampled_token_ids": tokens, "joined_ids": b"req-a\nreq-b\n",
        "collective_calls": [9], "collective_bytes": [2**40]})  # fmt: skip
    writer.write(fields(2))
    drained = reader.drain(arrays=True)
    check(drained, [1, 2])
    first = drained.fields[0]
    assert [int(first[name]) for name in COLLECTIVE_FIELDS] == [11, 22, 3, 44, 55]
    one, two = drained.arrays
    assert one["req_index"].tolist() == [4, 5]
    assert one["sampled_token_ids"].tolist() == tokens.tolist()
    assert bytes(one["joined_ids"]) == b"req-a\nreq-b\n"
    assert one["collective_bytes"].tolist() == [2**40]
    assert two == {}
    assert bool(first["sampled"]) and not bool(first["dummy"])
    closes(reader, 2)


def test_wrap_around_with_a_reader_that_keeps_up(path):
    writer = RingWriter.create(path, slots=4, slot_bytes=512)
    reader = RingReader.open(path)
    seen = []
    for n in range(1, 51):
        writer.write(fields(n))
        if n % 3 == 0:
            seen += reader.drain().fields["wave"].tolist()
    seen += reader.drain().fields["wave"].tolist()
    assert seen == list(range(1, 51))
    assert reader.lost == 0
    closes(reader, 50)


def test_a_full_ring_drops_the_oldest_and_counts_them(path):
    writer = RingWriter.create(path, slots=8, slot_bytes=512)
    reader = RingReader.open(path)
    for n in range(1, 6):
        writer.write(fields(n))
    check(reader.drain(), range(1, 6))
    for n in range(6, 36):  # 30 more into 8 slots, the reader away
        writer.write(fields(n))
    check(reader.drain(), range(28, 36))
    assert reader.overwritten == 35 - 8 - 5
    assert reader.torn == 0
    closes(reader, 35)
    # a drain with a limit takes the oldest first and leaves the rest for the next
    for n in range(36, 42):
        writer.write(fields(n))
    check(reader.drain(limit=4), range(36, 40))
    check(reader.drain(), range(40, 42))
    closes(reader, 41)


def test_a_reader_that_attaches_late_counts_what_it_never_saw(path):
    writer = RingWriter.create(path, slots=16, slot_bytes=512)
    for n in range(1, 101):
        writer.write(fields(n))
    reader = RingReader.open(path)
    check(reader.drain(), range(85, 101))
    assert reader.overwritten == 84
    closes(reader, 100)
    # given where its business begins, it counts nothing before that
    later = RingReader.open(path, start=95)
    check(later.drain(), range(96, 101))
    assert later.lost == 0


def _writable(path: str) -> np.ndarray:
    with open(path, "r+b") as handle:
        mm = mmap.mmap(handle.fileno(), 0)
    return np.frombuffer(mm, dtype="<u8")


def test_a_torn_slot_is_counted_and_never_decoded(path):
    writer = RingWriter.create(path, slots=8, slot_bytes=512)
    reader = RingReader.open(path)
    for n in range(1, 6):
        writer.write(fields(n))
    words = _writable(path)
    slot_words = 512 // 8
    # record 3's slot left odd (a write that never finished), record 4's with a sequence from
    # before its commit: neither is decoded, both are counted
    words[HEADER_BYTES // 8 + 2 * slot_words] = 2 * 3 - 1
    words[HEADER_BYTES // 8 + 3 * slot_words] = 2 * 4 - 2
    drained = reader.drain()
    check(drained, [1, 2, 5])
    assert reader.torn == 2
    closes(reader, 5)


def test_a_reader_never_reads_past_the_commit_index(path):
    writer = RingWriter.create(path, slots=8, slot_bytes=512)
    reader = RingReader.open(path)
    writer.write(fields(1))
    words = _writable(path)
    # record 2 looks whole in its slot, but the committed word still says 1
    words[HEADER_BYTES // 8 + 512 // 8] = 4
    check(reader.drain(), [1])
    assert reader.drain().fields.size == 0
    closes(reader, 1)


def test_a_value_the_layout_cannot_hold_is_dropped_by_the_writer_and_counted(path):
    writer = RingWriter.create(path, slots=4, slot_bytes=512)
    reader = RingReader.open(path)
    writer.write(fields(1))
    bad = list(fields(2))
    bad[5] = -1  # num_reqs is a uint32
    writer.write(bad)
    writer.write(fields(3))  # takes number 2
    drained = reader.drain()
    assert drained.fields["wave"].tolist() == [1, 3]
    assert reader.writer_dropped == 1
    assert reader.finish() == 0  # the spoiled slot is not a torn record
    closes(reader, 3)


def test_arrays_that_do_not_fit_a_slot_are_left_out_and_counted(path):
    writer = RingWriter.create(path, slots=4, slot_bytes=512)
    reader = RingReader.open(path)
    writer.write(fields(1), arrays={"sampled_token_ids": np.arange(1000)})
    drained = reader.drain(arrays=True)
    check(drained, [1])
    assert drained.arrays == [{}]
    assert reader.arrays_dropped == 1


def test_an_unknown_layout_version_is_refused_by_name(path):
    RingWriter.create(path, slots=4, slot_bytes=512, version=7)
    with pytest.raises(RingLayoutError, match=r"layout version 7; this sidecar reads 1"):
        RingReader.open(path)
    assert wave_ring.header_of(path)["version"] == 7
    Path(path).write_bytes(b"\0" * HEADER_BYTES)
    with pytest.raises(RingLayoutError, match="is not a ring's"):
        RingReader.open(path)
    Path(path).write_bytes(b"\0" * 100)
    with pytest.raises(RingLayoutError, match="shorter than its header"):
        RingReader.open(path)


def test_a_ring_of_another_process_is_not_taken_for_this_one(path):
    RingWriter.create(path, slots=4, slot_bytes=512)
    with pytest.raises(OSError, match="written by pid"):
        RingReader.open(path, pid=os.getpid() + 1)


def test_bad_shapes_are_refused(path):
    with pytest.raises(ValueError, match="power of two"):
        RingWriter.create(path, slots=6)
    with pytest.raises(ValueError, match="multiple of 8"):
        RingWriter.create(path, slots=4, slot_bytes=1001)


_CHILD = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    sys.path.insert(0, {repo!r})
    from telemetry.wire.wave_ring import RingWriter

    def fields(n):
        return (n, 10**18 + n, 3 * n, 2 * n, n, n % 7, 1, n % 7 - 1 if n % 7 else 0, 5, 6,
                n % 7, False, True, 0)

    class Stall:
        # numpy converts this inside the write, after the slot's sequence went odd
        def __array__(self, dtype=None, copy=None):
            sys.stdout.write("writing\\n")
            sys.stdout.flush()
            time.sleep(60)

    writer = RingWriter.create({path!r}, slots=16, slot_bytes=8192)
    mode = sys.argv[1]
    if mode == "stall":
        for n in range(1, 21):
            writer.write(fields(n))
        writer.write(fields(21), arrays={{"sampled_token_ids": Stall()}})
    else:
        sys.stdout.write("writing\\n")
        sys.stdout.flush()
        n = 0
        while True:
            n += 1
            writer.write(fields(n), arrays={{"sampled_token_ids": np.full(1500, n)}})
    """
)


def _child(path: str, mode: str) -> subprocess.Popen:
    script = _CHILD.format(repo=str(REPO), path=path)
    child = subprocess.Popen(
        [sys.executable, "-c", script, mode], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline() == "writing\n"
    return child


def test_a_worker_killed_mid_write_leaves_a_torn_record_that_is_counted(path):
    child = _child(path, "stall")
    reader = RingReader.open(path, pid=child.pid)
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    drained = reader.drain()
    # 16 slots: records 1-4 were overwritten, and record 5's slot by the write that never ended
    check(drained, range(6, 21))
    assert reader.overwritten == 5
    assert reader.finish() == 1
    assert reader.finish() == 0  # counted once
    assert reader.torn == 1
    closes(reader, 21)


def test_a_worker_killed_at_random_while_it_writes_never_yields_a_mixed_record(path):
    for delay in (0.05, 0.13, 0.21):
        child = _child(path, "loop")
        reader = RingReader.open(path, pid=child.pid)
        taken = []
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline:  # a reader draining while the worker writes
            drained = reader.drain(arrays=True)
            taken.append(drained)
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        taken.append(reader.drain(arrays=True))
        tail = reader.finish()  # 1 when the kill came between a slot's two sequence stores
        for drained in taken:
            waves = drained.fields["wave"].tolist()
            assert drained.fields["execute_ns"].tolist() == [3 * n for n in waves]
            for n, arrays in zip(waves, drained.arrays, strict=True):
                assert set(arrays["sampled_token_ids"].tolist()) == {n}
        numbers = [n for d in taken for n in d.fields["wave"].tolist()]
        assert numbers == sorted(set(numbers))
        assert reader.committed > 0
        closes(reader, reader.committed + tail)
