"""Wave roots link to the request traces of their own replica's requests.

Two DP replicas number their waves alike; a wave root of dp1 must link dp1's requests, not
dp0's (the roots belong to no one rank, so the replica comes from the trace id's high half,
which the replica's ranks keep). The step objects are tests/support/request_sim.py's (no vLLM
in unit tests), run through the worker's real processor and streamer into a real store.
"""

from __future__ import annotations

from guard.config.runtime_guard import GuardConfig
from guard.processor import GuardProcessor
from telemetry.pipeline.writer import Item
from telemetry.spans.builders import Span
from telemetry.spans.requests import link_wave_spans
from telemetry.store import Store, connect
from telemetry.wire.proto import guard_pb2
from telemetry.wire.trace_ids import request_trace_id, wave_span_id, wave_trace_id
from tests.support.request_sim import Sim, SimRequest, _QuietStreamer, drive, items_of

RUN, ENGINE = "run-links", "links"


def _replica(dp: int) -> tuple[list[Item], list[SimRequest]]:
    rank = guard_pb2.RankInfo(run_id=RUN, engine=ENGINE, dp_rank=dp, dp_size=2, tp_rank=0,
                              tp_size=1, pp_size=1, node="n", pid=500 + dp)  # fmt: skip
    processor = GuardProcessor(
        GuardConfig(sidecar="localhost:1", liveness_record=False), lambda r: rank, _QuietStreamer
    )
    reqs = [SimRequest(f"cmpl-dp{dp}-{i}", prompt=20, max_tokens=4 + i, arrive_wave=1 + i)
            for i in range(3)]  # fmt: skip
    return items_of(drive(processor, Sim(reqs, budget=64)), ENGINE), reqs


def _root(dp: int, wave: int) -> Span:
    return Span(wave_trace_id(RUN, wave, dp), wave_span_id(RUN, wave, dp), None, "wave", 0, 1,
                RUN, ENGINE, wave)  # fmt: skip


def test_each_replicas_wave_roots_link_its_own_requests(tmp_path) -> None:
    store = Store(str(tmp_path / "store.db"))
    truth = {}
    for dp in (0, 1):
        items, reqs = _replica(dp)
        store.write(items)
        truth[dp] = reqs
    conn = connect(store.path, readonly=True)
    roots = [_root(dp, wave) for dp in (0, 1) for wave in (2, 3, 4)]
    link_wave_spans(conn, roots)
    for root in roots:
        dp = 0 if root.trace_id == wave_trace_id(RUN, root.wave, 0) else 1
        ran = {
            request_trace_id(RUN, ENGINE, dp, r.req_id) for r in truth[dp] if root.wave in r.waves
        }
        assert ran and {link["trace_id"] for link in root.links} == ran, (dp, root.wave)
    conn.close()
    store.close()
