"""Recompute tokens travel from the worker's wave tuple to `kind="recompute"` on the sidecar."""

from __future__ import annotations

from prometheus_client import generate_latest

from guard.stream.streamer import WaveTuple
from telemetry.metrics.waves import SidecarMetrics
from tests.support.feed import make_streamer, wave_tuple
from tests.support.metrics import value


def test_recompute_tokens_reach_their_own_kind_and_leave_prefill_alone():
    streamer = make_streamer("unix:///nonexistent.sock")
    resumed = wave_tuple(2)._replace(prefill_tokens=6, recompute_tokens=24, decode_tokens=3)
    batch = streamer._make_batch([wave_tuple(1), resumed], with_heartbeat=False)
    assert list(batch.wave_columns.recompute_tokens) == [0, 24]  # wire v2 columns

    metrics = SidecarMetrics()
    metrics.observe_batch(("e", "0", "0", "0"), batch, ("run", 1))

    text = generate_latest(metrics.registry).decode()
    labels = {"engine": "e", "dp": "0", "tp": "0", "pp": "0"}
    kinds = {
        kind: value(text, "ascend_guard_scheduled_tokens_total", kind=kind, **labels)
        for kind in ("prefill", "recompute", "decode")
    }
    assert kinds == {"prefill": 6, "recompute": 24, "decode": 4 + 3}
    assert WaveTuple._field_defaults == {"recompute_tokens": 0}  # older callers still build it
