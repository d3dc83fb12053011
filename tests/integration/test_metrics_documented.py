"""Every family a running sidecar declares on /metrics is in docs/metrics.md (the table
tools/gen_docs.py writes from the code's own registries): the live list, read from a real
sidecar process with every listener on and a token, is the independent source, so a family
registered outside the generator's list (as `ascend_guard_auth_refused_total` once was) fails."""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.ports import free_port
from tests.support.sidecar import SidecarProcess

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def test_every_family_a_live_sidecar_declares_is_documented(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    token.chmod(0o600)
    sidecar = SidecarProcess.start(
        tmp_path,
        extra_args=("--health-port", str(free_port()), "--health-host", "127.0.0.1",
                    "--query-port", str(free_port()), "--query-host", "127.0.0.1",
                    "--token-file", str(token), "--metrics-open"),
    )  # fmt: skip
    try:
        text = sidecar.metrics_text()
    finally:
        sidecar.stop()
    declared = dict(re.findall(r"^# TYPE (ascend_guard_\S+) (\S+)\s*$", text, flags=re.M))
    assert "ascend_guard_auth_refused" in declared or "ascend_guard_auth_refused_total" in declared
    documented = set(re.findall(r"^\| `(ascend_guard_[a-z0-9_]+)` \|", DOC.read_text(), re.M))
    missing = []
    for family, kind in sorted(declared.items()):
        shown = f"{family.removesuffix('_total')}_total" if kind == "counter" else family
        if shown not in documented:
            missing.append(f"{shown} ({kind})")
    assert not missing, f"declared on /metrics, not in docs/metrics.md: {missing}"
