"""The guard with `wave_ring` on: the engine thread writes each wave into the rank's ring, which
a real reader maps; nothing goes to the streamer's buffer. Off, or when the ring cannot be made,
the waves go to the streamer as before."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from guard.config.runtime_guard import GuardConfig
from guard.decorators import install
from telemetry.wire.schema import WAVE_FIELDS
from telemetry.wire.wave_ring import RingReader, ring_path
from tests.unit.guard.test_decorators import RANK, Guard, Runner


def run_waves(guard: Guard, count: int) -> None:
    runner = Runner(execute_result=None, sample_result="out")
    for _ in range(count):
        runner.execute_model(object())
        runner.sample_tokens(None)


def test_waves_go_to_the_ring_and_match_what_the_streamer_would_get(tmp_path: Path):
    base = GuardConfig(sidecar="localhost:1", buffer_size=64, batch_max=8)
    try:
        plain = Guard(config=base)
        run_waves(plain, 5)
        plain.processor.close()
        config = dataclasses.replace(
            base, wave_ring=True, wave_ring_slots=16, liveness_dir=str(tmp_path)
        )
        ringed = Guard(config=config)
        path = ring_path(str(tmp_path), RANK.run_id, 0, 0, 0)
        run_waves(ringed, 5)
        reader = RingReader.open(path, pid=os.getpid())
        drained = reader.drain()
        assert ringed.records == []  # nothing for the streamer thread to turn into protobuf
        assert drained.fields["wave"].tolist() == [1, 2, 3, 4, 5]
        # the same fields as the gRPC path's tuples, but the clocks
        same = [n for n in WAVE_FIELDS if n not in ("start_unix_nano", "execute_ns", "sample_ns",
                                                    "sample_offset_ns")]  # fmt: skip
        for record, row in zip(plain.records, drained.fields, strict=True):
            assert [getattr(record, n) for n in same] == [row[n].item() for n in same]
            assert row["execute_ns"] > 0 and row["start_unix_nano"] > 0
        ringed.processor.close()
        assert not os.path.exists(path)  # removed at close; the reader's mapping stays
        assert reader.drain().fields.size == 0 and reader.lost == 0
    finally:
        install(None)


def test_a_ring_that_cannot_be_made_leaves_the_waves_on_grpc(tmp_path: Path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    config = GuardConfig(
        sidecar="localhost:1", buffer_size=64, batch_max=8, wave_ring=True,
        liveness_dir=str(blocker / "sub"),
    )  # fmt: skip
    try:
        guard = Guard(config=config)
        run_waves(guard, 3)
        assert guard.processor.ring is None
        assert [r.wave for r in guard.records] == [1, 2, 3]
        guard.processor.close()
    finally:
        install(None)


def test_with_waves_in_the_ring_batches_still_follow_the_waves():
    """The fillers (collectives, membership, detectors) add per-wave data to each batch; with
    no wave records in the streamer's buffer a batch is still made in each flush interval in
    which the wave count moved, not only at each heartbeat."""
    import threading

    from guard.stream.streamer import Streamer, _InFlight

    waves = [0]
    streamer = Streamer(
        "localhost:1", RANK, buffer_size=16, batch_max=8, flush_interval_s=0.01,
        heartbeat_interval_s=60.0, max_backoff_s=1.0, progress=lambda: waves[0],
    )  # fmt: skip
    batches = streamer._batches(_InFlight())
    assert next(batches).HasField("heartbeat")  # the first, always
    got = []
    pull = threading.Thread(target=lambda: got.append(next(batches)), daemon=True)
    pull.start()
    pull.join(0.3)
    assert not got  # nothing moved: no batch before the next heartbeat
    waves[0] = 3
    pull.join(5.0)
    assert len(got) == 1 and not got[0].HasField("heartbeat")
    assert not got[0].wave_columns.wave  # the waves themselves went into the ring
    streamer._stop.set()
