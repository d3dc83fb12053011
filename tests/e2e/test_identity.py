"""Pure observability: generations are token-identical with the guard (all detectors on) and off."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.e2e.test_serve import PROMPTS, guard_config
from tests.support.metrics import value
from tests.support.sidecar import SidecarProcess
from tests.support.vllm_server import VllmServer, token_ids

pytestmark = [pytest.mark.e2e]

ALL_DETECTORS = {
    "logits_finite": {"enabled": True, "sync_gate": True},
    "token_repeat": {"enabled": True},
    "spec_acceptance": {"enabled": True},
    "logits_stats": {"enabled": True, "every_n_waves": 1},
    "token_range": {"enabled": True},
}


@pytest.mark.timeout(600)
def test_greedy_outputs_identical_with_guard_on_and_off(tiny_model, tmp_path: Path) -> None:
    """Pure observability: the same greedy and seeded sampled requests give token-identical
    outputs with the guard on — streaming to a live sidecar, every sampling detector enabled,
    logits checked synchronously and stats taken every wave — and off (no runtime_guard
    config, nothing wrapped)."""
    prompts = PROMPTS[:6]
    roots = {mode: tmp_path / mode for mode in ("off", "on")}
    for root in roots.values():
        root.mkdir()
    sidecar = SidecarProcess.start(roots["on"])
    guard = guard_config(Path(sidecar.address[len("unix://") :]))
    guard["detectors"] = ALL_DETECTORS
    # both servers start at once, and serve one after the other (idle, a server costs about
    # 0.03 of a core)
    launched: list[VllmServer] = []
    try:
        launched.append(VllmServer.launch(tiny_model, roots["off"], tp=1, guard=None))
        launched.append(VllmServer.launch(tiny_model, roots["on"], tp=1, guard=guard))
        servers = VllmServer.start_together(launched)
    except BaseException:  # the first server is stopped too if the second fails to launch
        for server in launched:
            server.stop()
        sidecar.stop()
        raise
    outputs = {}
    try:
        for mode, server in zip(("off", "on"), servers, strict=True):
            outputs[mode] = [token_ids(r) for r in server.complete_many(prompts, max_tokens=48)]
            outputs[mode + "-sampled"] = [
                token_ids(r)
                for r in server.complete_many(prompts[:3], max_tokens=32, temperature=0.9, seed=11)
            ]
        assert "guard_streaming" not in servers[0].log_path.read_text()
        text = sidecar.wait_for(
            lambda t: value(t, "ascend_guard_sampled_tokens_total") >= 6 * 48 + 3 * 32,
            timeout=10,
        )
        time.sleep(0.5)  # anything extra would show up now
        text = sidecar.metrics_text()
        assert value(text, "ascend_guard_sampled_tokens_total") == 6 * 48 + 3 * 32
        assert value(text, "ascend_guard_guard_errors_total") == 0
        # the detectors did run: statistics were taken from the logits
        assert value(text, "ascend_guard_logits_entropy_nats") > 0
    finally:
        for server in servers:
            server.stop()
        sidecar.stop()
    assert outputs["on"] == outputs["off"]
    assert outputs["on-sampled"] == outputs["off-sampled"]
    assert all(len(ids) == 48 for ids in outputs["on"])
