"""Request traces through the real record path: worker processor and streamer, gRPC, a real
sidecar process, its store, its query API and the CLI in a process of its own.

The engine's step objects come from tests/support/request_sim.py (no vLLM here; the e2e
accounting test checks request traces on a real `vllm serve`). Two ranks of one TP group
stream; only tp0 sends membership.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from opentelemetry.proto.trace.v1 import trace_pb2

from telemetry.spans import requests as request_spans
from telemetry.store import connect
from telemetry.store import requests as request_store
from telemetry.wire.trace_ids import format_trace_id, request_trace_id, wave_trace_id
from tests.support.metrics import value
from tests.support.ports import free_port
from tests.support.request_sim import RANK, Sim, SimRequest, drive, guarded
from tests.support.sidecar import SidecarProcess

REPO = Path(__file__).resolve().parents[2]


def _requests() -> list[SimRequest]:
    return [
        SimRequest(f"cmpl-it{i}-0", prompt=12 + 41 * i, max_tokens=6 + 2 * i, arrive_wave=1 + 3 * i)
        for i in range(6)
    ]


@pytest.fixture(scope="module")
def fed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reqtrace")
    port = free_port()
    sidecar = SidecarProcess.start(tmp, extra_args=("--query-port", str(port)))
    truth = None
    try:
        for tp in (0, 1):  # both ranks of the TP group run the same steps
            reqs = _requests()
            processor = guarded(tp=tp, sidecar=sidecar.address)
            drive(processor, Sim(reqs, budget=64, preempt={12: "cmpl-it2-0"}))
            processor.close()  # flushes the streamer
            assert processor.errors.total == 0
            truth = truth or reqs
        waves = max(max(r.waves) for r in truth)
        sidecar.wait_for(
            lambda text: value(text, "ascend_guard_store_committed_records_total") >= 2 * waves
        )
        yield sidecar, port, truth
    finally:
        sidecar.stop()


def _get(port: int, path: str, headers: dict | None = None, **query) -> tuple[int, bytes]:
    url = f"http://127.0.0.1:{port}{path}" + ("?" + urllib.parse.urlencode(query) if query else "")
    with urllib.request.urlopen(
        urllib.request.Request(url, headers=headers or {}), timeout=10
    ) as r:
        return r.status, r.read()


def test_each_request_trace_holds_its_waves_and_tokens(fed) -> None:
    sidecar, _, truth = fed
    conn = connect(sidecar.store_path, readonly=True)
    for req in truth:
        (trace,) = request_spans.request_traces(conn, req.req_id)
        assert {w.wave: (w.scheduled, w.sampled) for w in trace.waves} == req.waves
        assert trace.sampled_tokens() == req.max_tokens
        assert sum(w.preempted for w in trace.waves) == req.preemptions
    # only tp0 sent membership: one rank's requests
    ranks = {row.rank for r in truth for row in request_store.find_requests(conn, r.req_id)}
    assert len(ranks) == 1


def test_query_api_serves_request_traces_and_traceql_finds_them(fed) -> None:
    _, port, truth = fed
    req = truth[2]
    trace_hex = format_trace_id(request_trace_id(RANK["run_id"], RANK["engine"], 0, req.req_id))
    status, body = _get(port, f"/api/v2/traces/{trace_hex}")
    assert status == 200
    spans = [s for rs in json.loads(body)["trace"]["resourceSpans"] for ss in rs["scopeSpans"]
             for s in ss["spans"]]  # fmt: skip
    assert sorted(int(next(a["value"]["intValue"] for a in s["attributes"]
                           if a["key"] == "ascend_guard.wave"))
                  for s in spans if s["name"] in ("prefill", "decode")) == sorted(req.waves)  # fmt: skip
    status, raw = _get(port, f"/api/traces/{trace_hex}", {"Accept": "application/protobuf"})
    data = trace_pb2.TracesData.FromString(raw)
    links = {s.links[0].trace_id.hex() for rs in data.resource_spans for ss in rs.scope_spans
             for s in ss.spans if s.name in ("prefill", "decode")}  # fmt: skip
    assert links == {format_trace_id(wave_trace_id(RANK["run_id"], w, 0)) for w in req.waves}
    # and a wave links back
    wave = min(req.waves)
    status, raw = _get(port, f"/api/traces/{format_trace_id(wave_trace_id(RANK['run_id'], wave, 0))}",
                       {"Accept": "application/protobuf"})  # fmt: skip
    data = trace_pb2.TracesData.FromString(raw)
    (root,) = [s for rs in data.resource_spans for ss in rs.scope_spans for s in ss.spans
               if s.name == "wave"]  # fmt: skip
    assert trace_hex in {link.trace_id.hex() for link in root.links}
    q = f'{{ name = "request" && span.ascend_guard.request = "{req.req_id}" }}'
    status, body = _get(port, "/api/search", q=q, start="0", end=str(int(time.time()) + 60))
    traces = json.loads(body)["traces"]
    assert [t["traceID"] for t in traces] == [trace_hex]
    assert traces[0]["rootTraceName"] == "request"


def test_cli_prints_the_request_from_the_store(fed) -> None:
    sidecar, _, truth = fed
    req = truth[4]
    done = subprocess.run(
        [sys.executable, "-m", "telemetry.cli", "request", req.req_id.removesuffix("-0"),
         "--json", "--store", str(sidecar.store_path)],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    (line,) = done.stdout.splitlines()
    body = json.loads(line)
    assert body["request_id"] == req.req_id and body["sampled_tokens"] == req.max_tokens
    assert len(body["waves"]) == len(req.waves)


def test_membership_drops_are_on_metrics(fed) -> None:
    sidecar, _, _ = fed
    text = sidecar.metrics_text()
    labels = {"engine": RANK["engine"], "dp": "0", "tp": "0", "pp": "0"}
    assert "ascend_guard_request_membership_dropped_total{" in text
    assert value(text, "ascend_guard_request_membership_dropped_total", kind="rows", **labels) == 0
    assert value(text, "ascend_guard_request_membership_dropped_total", kind="names", **labels) == 0
