"""The worker-side incident reporter: caps and backoff per (type, request), counting, evidence."""

from __future__ import annotations

import json

import pytest

from guard.config.runtime_guard import GuardConfigError, IncidentsConfig, parse_config
from guard.stream.reporter import MAX_EVIDENCE_BYTES, IncidentReporter, encode_evidence
from guard.stream.spool import IncidentSpool


def make(cap=3, factor=4.0):
    sent = []
    reporter = IncidentReporter(
        IncidentsConfig(per_request_cap=cap, backoff_factor=factor),
        run_id="r",
        current_wave=lambda: 42,
        sink=sent.append,
    )
    return reporter, sent


def test_reports_up_to_the_cap_then_back_off_geometrically_and_keep_counting():
    reporter, sent = make(cap=3, factor=4.0)
    for _ in range(100):
        reporter.report("logits_finite", "error", "nan", request_id="a")
    assert [i.occurrence for i in sent] == [1, 2, 3, 12, 48]
    # each report says how many hits were held back since the previous one
    assert [i.suppressed for i in sent] == [0, 0, 0, 8, 35]
    assert reporter.hits == {"logits_finite": 100}


def test_caps_are_per_type_and_request():
    reporter, sent = make(cap=1, factor=2.0)
    for request in ("a", "b"):
        for type_ in ("token_repeat", "logits_finite"):
            reporter.report(type_, "warning", "x", request_id=request)
    assert len(sent) == 4
    assert reporter.would_report("token_repeat", "a") is True  # 2nd hit = 1 * 2
    reporter.report("token_repeat", "warning", "x", request_id="a")
    assert reporter.would_report("token_repeat", "a") is False  # next report at 4
    reporter.forget_requests(["a"])
    assert reporter.would_report("token_repeat", "a") is True


def test_forgetting_finished_requests_drops_every_type_of_theirs_and_only_theirs():
    reporter, sent = make(cap=1, factor=2.0)
    for request in ("a", "b", "c"):
        for type_ in ("token_repeat", "logits_finite"):
            reporter.report(type_, "warning", "x", request_id=request)
            reporter.report(type_, "warning", "x", request_id=request)  # next report at 4
    reporter.forget_requests(["a", "c", "never-seen"])
    for type_ in ("token_repeat", "logits_finite"):
        assert reporter.would_report(type_, "a") is True
        assert reporter.would_report(type_, "c") is True
        assert reporter.would_report(type_, "b") is False  # still capped
    reporter.report("token_repeat", "warning", "x", request_id="a")  # a new key, a fresh cap
    assert sent[-1].occurrence == 1 and sent[-1].request_id == "a"


def test_keys_forgotten_past_the_bound_leave_no_trace_for_a_later_forget(monkeypatch):
    monkeypatch.setattr("guard.stream.reporter.MAX_TRACKED_KEYS", 3)
    reporter, _ = make(cap=1, factor=2.0)
    for request in ("a", "b", "c", "d"):  # a's key is the oldest, dropped by d's
        reporter.report("token_repeat", "warning", "x", request_id=request)
        reporter.report("token_repeat", "warning", "x", request_id=request)
    assert reporter.would_report("token_repeat", "a") is True  # forgotten by the bound
    assert reporter.would_report("token_repeat", "b") is False
    reporter.forget_requests(["a", "b"])  # a has no key left: no error
    assert reporter.would_report("token_repeat", "b") is True
    for request in ("e", "f"):  # f's key drops c's, the oldest of c, d, e
        reporter.report("token_repeat", "warning", "x", request_id=request)
    assert reporter.would_report("token_repeat", "c") is True
    assert reporter.would_report("token_repeat", "d") is False


def test_incident_fields_ids_and_wave_default():
    reporter, sent = make()
    first = reporter.report(
        "token_range", "critical", "id 99999", request_id="q", evidence={"id": 99999}
    )
    second = reporter.report("token_range", "critical", "again", wave=5, incident_id="fixed-id")
    assert first.id == f"r:{first.id.split(':')[1]}:1" and first.wave == 42
    assert first.schema_version == 1 and list(first.actions) == ["report"]
    assert json.loads(first.evidence_json) == {"id": 99999}
    assert second.id == "fixed-id" and second.wave == 5
    with pytest.raises(ValueError, match="severity 'fatal'"):
        reporter.report("x", "fatal", "bad")


def test_oversized_evidence_is_cut_and_marked():
    text = encode_evidence({"blob": "x" * (2 * MAX_EVIDENCE_BYTES)})
    assert len(text) < MAX_EVIDENCE_BYTES
    assert json.loads(text)["truncated"] is True


def test_spool_round_trip_respects_max_bytes(tmp_path):
    reporter, sent = make(cap=1000)
    for n in range(10):
        reporter.report("t", "info", f"n{n}", request_id=str(n))
    spool = IncidentSpool(str(tmp_path), "run", 1, max_bytes=400)
    written = spool.append(sent)
    assert 0 < written < 10  # the rest stays with the caller
    back = spool.take()
    assert [i.id for i in back] == [i.id for i in sent[:written]]
    assert not spool.path.exists() and spool.take() == []


def test_incidents_section_is_validated_with_dotted_keys():
    assert parse_config({"incidents": {"per_request_cap": 5}}).incidents.per_request_cap == 5
    with pytest.raises(
        GuardConfigError, match=r"runtime_guard\.incidents\.per_request_cap: 0 is outside"
    ):
        parse_config({"incidents": {"per_request_cap": 0}})
    with pytest.raises(GuardConfigError, match=r"runtime_guard\.incidents\.caps: unknown key"):
        parse_config({"incidents": {"caps": 1}})
    with pytest.raises(GuardConfigError, match=r"runtime_guard\.incidents: expected a JSON object"):
        parse_config({"incidents": 3})
