"""Incidents between the real worker-side reporter/streamer and a real sidecar process.

None may be lost: not across a sidecar that is away from the start (the spool), not across one
killed while incidents flow (re-send of the unconfirmed window), and none is stored twice.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import pytest

from guard.stream.spool import IncidentSpool
from tests.integration.test_sidecar_grpc import batch, raw_call, store_rows, wait_for
from tests.support.feed import attach_reporter, make_streamer, wave_tuple
from tests.support.metrics import value
from tests.support.store import trace_spans

pytestmark = pytest.mark.timeout(90)


def reporter_for(streamer, run_id: str = "run-test", **config):
    return attach_reporter(streamer, run_id, **config)


def stored_ids(sidecar) -> set[str]:
    try:
        return {row[0] for row in store_rows(sidecar.store_path, "SELECT id FROM incidents")}
    except Exception:  # noqa: BLE001 - table not created yet
        return set()


def test_incident_is_counted_stored_listed_and_attached_to_its_wave(sidecars, tmp_path):
    sidecar = sidecars()
    streamer = make_streamer(sidecar.address, run_id="run-inc")
    streamer.offer(wave_tuple(7))
    reporter = reporter_for(streamer, run_id="run-inc")
    streamer.start()
    try:
        incident = reporter.report(
            "logits_finite", "error", "row 0 has 3 NaN logits", request_id="cmpl-abc-0",
            evidence={"nan": 3, "inf": 0}, wave=7,
        )  # fmt: skip
        wait_for(lambda: incident.id in stored_ids(sidecar), what="incident stored")
    finally:
        streamer.stop()
    text = sidecar.wait_for(
        lambda t: value(t, "ascend_guard_incidents_total", type="logits_finite") == 1
    )
    assert value(text, "ascend_guard_incidents_total", severity="error", tp="0") == 1
    assert value(text, "ascend_guard_detector_hits_total", type="logits_finite") == 1
    # the CLI lists it, filtered by type and by request prefix
    out = subprocess.run(
        [sys.executable, "-m", "telemetry.cli", "incidents", "--store", str(sidecar.store_path),
         "--type", "logits_finite", "--request", "cmpl-abc", "--json"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    records = [json.loads(line) for line in out.splitlines()]
    assert len(records) == 1
    record = records[0]
    assert record["id"] == incident.id and record["wave"] == 7
    assert record["evidence"] == {"inf": 0, "nan": 3}
    assert record["request_id"] == "cmpl-abc-0" and record["tp"] == 0
    none = subprocess.run(
        [sys.executable, "-m", "telemetry.cli", "incidents", "--store", str(sidecar.store_path),
         "--type", "token_repeat"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "no incidents match" in none
    # the incident span hangs under the rank span of wave 7, in the wave's trace (both built
    # from the stored rows)
    sidecar.stop()  # writes what is queued
    spans = trace_spans(sidecar.store_path, record["trace_id"])
    (span,) = [s for s in spans if s.name == "incident:logits_finite"]
    (rank_span,) = [s for s in spans if s.name == "rank" and s.wave == 7 and s.tp == 0]
    assert (span.trace_id, span.parent_id) == (rank_span.trace_id, rank_span.span_id)
    assert span.events[0]["attributes"]["incident.request_id"] == "cmpl-abc-0"


def test_incidents_wait_in_the_spool_while_no_sidecar_and_arrive_once(sidecars, sock_dir, tmp_path):
    address = f"unix://{sock_dir / 'guard.sock'}"  # where `sidecars()` will listen
    streamer = make_streamer(address, run_id="run-spool")
    streamer._spool = IncidentSpool(str(tmp_path / "spool"), "run-spool", 4242, 1 << 20)
    reporter = reporter_for(streamer, run_id="run-spool")
    streamer.start()
    try:
        sent = [
            reporter.report("token_repeat", "warning", f"loop {n}", request_id=f"r{n}")
            for n in range(40)
        ]
        wait_for(lambda: streamer.incidents_spooled == 40, what="incidents spooled")
        assert streamer._spool.path.exists()
        assert streamer.pending_incidents == 0  # on disk, not in memory
        # the sidecar comes up on the address the worker was configured with
        sidecar = sidecars()
        wait_for(lambda: stored_ids(sidecar) == {i.id for i in sent}, what="all spooled incidents")
        assert not streamer._spool.path.exists()
    finally:
        streamer.stop()
    text = sidecar.wait_for(
        lambda t: value(t, "ascend_guard_incidents_total", type="token_repeat") == 40
    )
    assert value(text, "ascend_guard_detector_hits_total", type="token_repeat") == 40


def test_sidecar_killed_while_incidents_flow_loses_none_and_stores_none_twice(sidecars, tmp_path):
    sidecar = sidecars()
    streamer = make_streamer(sidecar.address, run_id="run-kill")
    streamer._spool = IncidentSpool(str(tmp_path / "spool"), "run-kill", 4242, 1 << 20)
    reporter = reporter_for(streamer, run_id="run-kill")
    streamer.start()
    sent: list[str] = []
    stop = threading.Event()

    def produce():
        n = 0
        while not stop.is_set():
            sent.append(reporter.report("logits_finite", "error", "nan", request_id=f"q{n}").id)
            n += 1
            time.sleep(0.005)

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        wait_for(lambda: len(stored_ids(sidecar)) > 20, what="some incidents stored")
        sidecar.stop(signal.SIGKILL)
        time.sleep(1.0)  # incidents keep coming while the sidecar is gone
        sidecar = sidecars(store_path=sidecar.store_path)
        time.sleep(0.5)
        stop.set()
        producer.join()
        wait_for(lambda: stored_ids(sidecar) >= set(sent), timeout=20, what="every incident stored")
    finally:
        stop.set()
        streamer.stop()
    (count,) = store_rows(sidecar.store_path, "SELECT COUNT(*) FROM incidents")[0]
    assert count == len(sent)  # stored once each, although some were sent twice


def test_invalid_incident_is_dropped_alone_naming_the_field(sidecars):
    """A bad incident is dropped and counted on its own; the rest of its batch is kept."""
    sidecar = sidecars()
    bad = batch(1)
    bad.incidents.add(schema_version=1, id="x", type="logits_finite", severity="fatal")
    assert raw_call(sidecar.address, [bad.SerializeToString()]).waves == 1
    future = batch(2)
    future.incidents.add(schema_version=9, id="y", type="t", severity="info")
    assert raw_call(sidecar.address, [future.SerializeToString()]).waves == 1
    text = sidecar.wait_for(
        lambda t: value(t, "ascend_guard_ingest_rejected_total", reason="invalid_incident") == 2
    )
    assert value(text, "ascend_guard_ingest_rejected_total", reason="invalid") == 0
    assert value(text, "ascend_guard_incidents_total") == 0
    log = sidecar.log()
    assert "incidents[0].severity: 'fatal'" in log
    assert "incidents[0].schema_version: 9 is not supported" in log


def test_probe_values_become_gauges_and_unknown_probes_are_counted(sidecars):
    sidecar = sidecars()
    good = batch(1)
    good.probes.add(name="spec_acceptance_rate", labels={"method": "ngram"}, value=0.625)
    good.probes.add(name="no_such_probe", value=1.0)
    good.probes.add(name="logits_max_abs", labels={"extra": "x"}, value=3.0)
    ack = raw_call(sidecar.address, [good.SerializeToString()])
    assert ack.batches == 1
    text = sidecar.metrics_text()
    assert value(text, "ascend_guard_spec_acceptance_rate", method="ngram", tp="0") == 0.625
    assert value(text, "ascend_guard_ingest_rejected_total", reason="unknown_probe") == 2
