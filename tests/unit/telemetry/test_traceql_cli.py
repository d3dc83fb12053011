"""`ascend-guard query 'TRACEQL'` over a store written by the real writer sink.

The expected traces come from how the fixture slowed the waves (tp1's all_reduce in waves 3
and 7), not from the search code.
"""

from __future__ import annotations

import json
import sys
import time

import pytest

from telemetry.cli import main as cli
from telemetry.wire.trace_ids import format_trace_id, wave_trace_id
from tests.support.trace_store import (
    MS,
    batch_item,
    collective_wave,
    rank_info,
    wave_record,
    write_store,
)

SLOW = {3, 7}
BASE = time.time_ns() - 600 * 10**9


@pytest.fixture(scope="module")
def store_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("traceql-cli") / "store.db"
    items = []
    for tp in (0, 1):
        numbers = range(1, 9)
        reduce_ns = {n: 60 * MS if tp == 1 and n in SLOW else MS for n in numbers}
        start = {n: BASE + n * 100 * MS for n in numbers}
        waves = [wave_record(n, start[n], reduce_ns[n] + 4 * MS) for n in numbers]
        colls = [collective_wave(n, start[n] + MS, reduce_ns[n]) for n in numbers]
        items.append(batch_item(rank_info(tp), waves, colls))
    write_store(path, items)
    return str(path)


def run(capsys, *args: str) -> tuple[int, str]:
    code = cli.main(["query", *args])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_a_traceql_search_lists_exactly_the_slowed_waves(store_path, capsys):
    code, out = run(
        capsys, '{ .tp = 1 && .op = "all_reduce" && duration > 50ms }', "--store", store_path,
        "--since", "1h",
    )  # fmt: skip
    assert code == 0, out
    listed = {w for w in range(1, 9) if format_trace_id(wave_trace_id("run-t", w, 0)) in out}
    assert listed == SLOW, out
    assert "2 trace(s); show one with: ascend-guard trace" in out


def test_no_match_says_what_to_do(store_path, capsys):
    code, out = run(capsys, "{ duration > 1h }", "--store", store_path, "--since", "1h")
    assert code == 0 and "no trace matches" in out


def test_a_search_stopped_at_the_cap_says_so_and_how_to_narrow_it(store_path, capsys, monkeypatch):
    code, out = run(capsys, "{ }", "--store", store_path, "--since", "1h")
    assert code == 0 and "8 trace(s)" in out and "stopped after checking" not in out, out
    # three traces may be checked: the search answers the newest three and says it stopped
    monkeypatch.setattr(sys.modules["telemetry.traceql.search"], "MAX_TRACES_INSPECTED", 3)
    code, out = run(capsys, "{ }", "--store", store_path, "--since", "1h")
    assert code == 0 and "3 trace(s)" in out, out
    assert "the search stopped after checking 3 traces: there may be more matches" in out, out
    assert ".engine" in out and "--since/--until" in out, out
    code, out = run(capsys, "{ }", "--store", store_path, "--since", "1h", "--json")
    assert code == 0 and "stopped after checking" not in out  # --json: the lines only
    # nothing found before the cap (every trace is a candidate, none matches): both lines
    code, out = run(capsys, "{ traceDuration > 1h }", "--store", store_path, "--since", "1h")
    assert "no trace matches" in out and "stopped after checking 3 traces" in out, out


def test_the_api_source_reads_the_cap_off_inspected_traces():
    from telemetry.cli.source import ApiSource
    from telemetry.traceql.search import MAX_TRACES_INSPECTED

    source = ApiSource("http://unused", None, None)
    for inspected, capped in ((12, False), (MAX_TRACES_INSPECTED, True)):
        body = {"traces": [{"traceID": "ab" * 16}], "metrics": {"inspectedTraces": inspected}}
        source.get = lambda *_a, b=body, **_k: json.dumps(b).encode()
        assert len(source.search("{ }", 0, 1, 20, 3)) == 1 and source.capped is capped


def test_a_parse_error_names_where_and_flags_do_not_mix(store_path, capsys):
    code, out = run(capsys, "{ .tp = = 1 }", "--store", store_path)
    assert code == 2 and "TRACEQL:" in out and "column" in out, out
    code, out = run(capsys, "{ .tp = 1 }", "--rank", "tp=1", "--store", store_path)
    assert code == 2 and "give a TraceQL query or --rank, not both" in out, out
