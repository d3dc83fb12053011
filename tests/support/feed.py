"""Streams synthetic wave records into a sidecar through the real worker-side client."""

from __future__ import annotations

import time

from guard.stream import identity
from guard.stream.streamer import HeartbeatState, Streamer, WaveTuple
from telemetry.wire.proto import guard_pb2


def make_streamer(
    address: str,
    *,
    engine: str = "test",
    rank: tuple[int, int, int] = (0, 0, 0),
    sizes=(1, 2, 1),
    run_id: str = "run-test",
    pid: int = 4242,
    buffer_size: int = 8192,
    node: str = "test-node",
) -> Streamer:
    dp, tp, pp = rank
    info = guard_pb2.RankInfo(
        run_id=run_id, engine=engine, dp_rank=dp, tp_rank=tp, pp_rank=pp, dp_size=sizes[0], tp_size=sizes[1],
        pp_size=sizes[2], node=node, pid=pid, runner="tests.FakeRunner",
    )  # fmt: skip
    return Streamer(
        address, info, buffer_size=buffer_size, batch_max=256, flush_interval_s=0.02, heartbeat_interval_s=0.2,
        max_backoff_s=0.2,
        # build_info with every heartbeat, as a real worker
        fillers=[FixedHeartbeat(HeartbeatState(0, "idle", 0), probes=identity.readings)],
    )  # fmt: skip


class FillWith:
    """A batch filler made of a function `(batch, with_heartbeat)`."""

    def __init__(self, fill) -> None:
        self.fill_batch = fill


class FixedHeartbeat:
    """A batch filler that reports the same heartbeat state every time.

    `fill` adds more fields to every batch; `probes` gives readings for each heartbeat batch.
    """

    def __init__(self, state: HeartbeatState, fill=None, probes=None) -> None:
        self.state = state
        self._fill = fill
        self._probes = probes

    def fill_batch(self, batch, with_heartbeat: bool) -> None:
        if with_heartbeat:
            self.state.fill(batch)
            for name, value, labels in self._probes() if self._probes is not None else ():
                batch.probes.add(name=name, labels=labels, value=value)
        if self._fill is not None:
            self._fill(batch, with_heartbeat)


def wave_tuple(
    wave: int, *, sampled: int = 4, execute_ns: int = 2_000_000, sample_ns: int = 500_000
) -> WaveTuple:
    start = time.time_ns()
    return WaveTuple(
        wave=wave, start_unix_nano=start, execute_ns=execute_ns, sample_ns=sample_ns, sample_offset_ns=execute_ns + 1000,
        num_reqs=sampled, prefill_reqs=0, decode_reqs=sampled, prefill_tokens=0, decode_tokens=sampled,
        sampled_tokens=sampled, dummy=False, sampled=True,
    )  # fmt: skip


def send_waves(
    address: str,
    *,
    engine: str = "test",
    ranks=((0, 0, 0), (0, 1, 0)),
    waves: int = 50,
    sampled_per_wave: int = 4,
    drop: int = 0,
    run_id: str = "run-test",
    timeout: float = 10.0,
) -> None:
    """Send `waves` waves from each rank and return once the streamers have handed them all over.

    `drop` records per rank are reported as dropped (the client's drop counter is set directly).
    """
    streamers = []
    sizes = tuple(max(2 if axis == 1 else 1, 1 + max(r[axis] for r in ranks)) for axis in range(3))
    for index, rank in enumerate(ranks):
        streamer = make_streamer(
            address, engine=engine, rank=rank, sizes=sizes, run_id=run_id, pid=4000 + index
        )
        streamer.dropped = drop
        for n in range(1, waves + 1):
            streamer.offer(wave_tuple(n, sampled=sampled_per_wave))
        streamer.start()
        streamers.append(streamer)
    deadline = time.monotonic() + timeout
    while any(s.sent_waves < waves for s in streamers):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"sent {[s.sent_waves for s in streamers]} of {waves} waves per rank"
            )
        time.sleep(0.02)
    time.sleep(0.3)  # a heartbeat and the last batch reach the sidecar
    for streamer in streamers:
        streamer.stop()


def attach_reporter(streamer: Streamer, run_id: str, *, wave: int = 7, **config):
    """An IncidentReporter wired to `streamer` the way GuardProcessor wires them."""
    from guard.config.runtime_guard import IncidentsConfig
    from guard.stream.reporter import IncidentReporter

    reporter = IncidentReporter(
        IncidentsConfig(**config), run_id=run_id, current_wave=lambda: wave,
        sink=streamer.offer_incident,
    )  # fmt: skip
    streamer.fillers.append(reporter)  # each batch carries the hit counts
    return reporter


# every probe a dashboard panel shows: (name, value, labels)
DASHBOARD_PROBES = (
    ("logits_max_abs", 12.5, {}), ("logits_entropy_nats", 3.2, {}), ("config_generation", 1, {}),
    ("spec_acceptance_rate", 0.6, {"method": "ngram"}), ("spec_draft_tokens", 30, {"method": "ngram"}),
    ("spec_accepted_tokens", 18, {"method": "ngram"}),
    ("kv_cache_bytes", 1 << 30, {}), ("kv_cache_blocks", 8192, {}), ("kv_cache_layers", 2, {}),
    ("rotary_table_rows", 4096, {}), ("device_phase_ms", 4.5, {"phase": "execute_model"}),
    ("graph_captures", 1, {"graph": "bs8"}), ("graph_capture_seconds", 0.2, {"graph": "bs8"}),
    ("graph_capture_bytes", 1 << 20, {"graph": "bs8"}), ("graph_workspace_leaked_bytes", 0, {}),
    ("spec_drafts_proposed", 33, {"method": "ngram"}), ("spec_drafts_accepted", 18, {"method": "ngram"}),
    ("speculator_info", 1, {"method": "ngram", "speculator": "NgramProposer"}),
    ("device_communicator_info", 1, {"communicator": "CpuCommunicator", "backend": "gloo", "group": "tp"}),
    ("hccl_settings_info", 1, {"communicator": "NPUCommunicator", "hccl_algo": "", "hccl_exec_timeout": "1836",
                               "hccl_connect_timeout": "120"}),
)  # fmt: skip


def send_incidents_and_probes(
    address: str, *, engine: str = "test", run_id: str = "run-test", timeout: float = 10.0
) -> None:
    """One rank reports a few incidents (through a real IncidentReporter) and every probe the
    dashboard shows, then stops once they are handed over."""
    streamer = make_streamer(address, engine=engine, run_id=run_id, pid=4999)
    reporter = attach_reporter(streamer, run_id, wave=1)
    for n in range(3):
        reporter.report("logits_finite", "error", "nan row", request_id=f"req-{n}")
    reporter.report("token_repeat", "warning", "loop", request_id="req-9")
    for name, val, labels in DASHBOARD_PROBES:
        streamer.offer_probe(name, float(val), labels)
    streamer.start()
    deadline = time.monotonic() + timeout
    while streamer.incidents_sent < 4 or streamer._probes:
        if time.monotonic() > deadline:
            raise TimeoutError(f"sent {streamer.incidents_sent} of 4 incidents")
        time.sleep(0.02)
    time.sleep(0.3)
    streamer.stop()
