"""The README is a door, docs/ hold the reference, and the generated tables match the code."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

from tests.compat_record import TESTED
from tools import gen_docs

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"


def test_generated_tables_match_the_code():
    assert gen_docs.main(["--check"]) == 0, "run `make docs`"


def test_config_table_has_every_key():
    from guard.config.runtime_guard import GuardConfig

    rows = {row[0].strip("`") for row in gen_docs.config_rows()}
    assert {"sidecar", "incidents.spool_dir", "detectors.dump.directory"} <= rows
    assert len(rows) > 40
    text = (ROOT / "docs" / "configuration.md").read_text()
    assert "`unix:///run/ascend-guard/guard.sock`" in text
    assert GuardConfig().buffer_size == 8192 and "| `buffer_size` | int | `8192` |" in text


def test_metrics_table_has_every_family():
    text = (ROOT / "docs" / "metrics.md").read_text()
    for family in ("ascend_guard_waves_total", "ascend_guard_build_info",
                   "ascend_guard_attach_points", "ascend_guard_engine_wedged"):  # fmt: skip
        assert f"`{family}`" in text, family


def test_the_suite_records_the_versions_it_runs_on():
    """The compatibility table is the suite's own record: the machine's versions must be in it."""
    here = [row for row in TESTED if row.installed]
    assert here, "tests/compat_record.py has no row for the machine the suite runs on"
    matches = [
        row for row in here
        if all(metadata.version(dist) == version for dist, version in row.installed)
    ]  # fmt: skip
    assert matches, "this environment's versions are not in tests/compat_record.py: " + ", ".join(
        f"{d}=={metadata.version(d)}" for d, _ in here[0].installed
    )


def test_readme_is_a_door():
    text = README.read_text()
    assert len(text.splitlines()) < 130, "move reference material to docs/"
    for command in ("make demo", "make test"):
        assert command in text
    for heading in ("## What decides coverage on Ascend", "## Try it", "## Deploy in three steps",
                    "## On call", "## Compatibility"):  # fmt: skip
        assert heading in text, heading
    assert "deploy/overlays/daemonset" in text and "docs/runbooks/" in text


def test_every_path_the_docs_name_exists():
    names = set()
    for doc in [README, ROOT / "deploy" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        names |= set(re.findall(r"(?<![\w/.~-])((?:docs|deploy|dashboards|bench|tools|tests|telemetry|guard|ascend_runtime)/[\w./-]*\w)", doc.read_text()))  # fmt: skip
    missing = sorted(
        n for n in names if not (ROOT / n).exists() and not (ROOT / "deploy" / n).exists()
    )
    assert not missing, f"named but missing: {missing}"


def test_license_and_security_policy():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    security = (ROOT / "SECURITY.md").read_text()
    assert "Reporting a vulnerability" in security and "0600" in security
