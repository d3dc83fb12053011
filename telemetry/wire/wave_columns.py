"""Wave records as columns: a v1 batch's `waves` messages moved into `wave_columns`."""

from __future__ import annotations

from telemetry.wire.proto import guard_pb2
from telemetry.wire.schema import WAVE_FIELDS


def to_columns(batch: guard_pb2.Batch) -> None:
    """Move a v1 batch's `waves` messages into `wave_columns` (a v1 worker, or a raw client)."""
    if not batch.waves:
        return
    cols = batch.wave_columns
    for name in WAVE_FIELDS:
        getattr(cols, name).extend([getattr(w, name) for w in batch.waves])
    del batch.waves[:]
