"""End to end: the attach points `ascend-guard doctor` reports bound are bound in a real
`vllm serve` worker on CPU, and the KV-cache probe's numbers equal vLLM's own.

One server (TP=1, the V1 CPU runner this host runs, n-gram speculative decoding) and one
sidecar over real gRPC. The KV figures are checked against vLLM's `vllm:cache_config_info`
(blocks, block size) and the model's config.json (layers, KV heads, head size, dtype); the
speculator counts against vLLM's `vllm:spec_decode_*` counters; not against the probes' own
arithmetic.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.metrics import samples, value
from tests.support.sidecar import SidecarProcess
from tests.support.vllm_server import VllmServer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
ENGINE = "e2e-bind"
RANK = {"engine": ENGINE, "dp": "0", "tp": "0", "pp": "0"}
FLOAT32_BYTES = 4  # the server runs --dtype float32 (tests/support/vllm_server.py)
SPEC_TOKENS = 3
SPECULATIVE = {
    "method": "ngram",
    "num_speculative_tokens": SPEC_TOKENS,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 2,
}
# repetitive prompts, so the n-gram proposer finds matches and some drafts are accepted
SPEC_PROMPTS = ["one two three one two three one two three one two", "a b c a b c a b c a b"]


@pytest.fixture(scope="module")
def deployment(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("bind")
    sock = root / "guard.sock"
    sidecar = SidecarProcess.start(root, address=f"unix://{sock}")
    try:
        guard = {"sidecar": f"unix://{sock}", "engine": ENGINE, "flush_interval_ms": 20}
        server = VllmServer.start(
            tiny_model,
            root,
            guard=guard,
            extra_args=("--speculative-config", json.dumps(SPECULATIVE)),
        )
    except BaseException:
        sidecar.stop()
        raise
    yield sidecar, server, tiny_model
    server.stop()
    sidecar.stop()


def _doctor() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASCEND_GUARD_")}
    env.update(PYTHONPATH=str(REPO), VLLM_TARGET_DEVICE="cpu")
    out = subprocess.run(
        [sys.executable, "-m", "telemetry.cli", "doctor", "--json"],
        env=env, capture_output=True, text=True, timeout=240, cwd=REPO,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return json.loads(out.stdout)


def test_doctor_bound_points_are_live_in_the_worker(deployment) -> None:
    sidecar, server, _ = deployment
    doctor = _doctor()
    bound = {(p["class"], p["method"], p["action"]) for p in doctor["attach_points"]}
    assert ("CPUModelRunner", "execute_model", "step") in bound
    assert ("CPUModelRunner", "initialize_kv_cache", "kv_init") in bound

    server.complete_many(["The quick brown fox", "Numbers should agree"], max_tokens=12)
    text = sidecar.wait_for(lambda t: value(t, "ascend_guard_sampled_tokens_total", **RANK) >= 24)
    # step and sample bound: waves with sampled tokens; KV init bound: the KV probe reported
    assert value(text, "ascend_guard_waves_total", **RANK) > 0
    assert samples(text, "ascend_guard_kv_cache_blocks", **RANK)
    assert value(text, "ascend_guard_guard_errors_total") == 0
    assert value(text, "ascend_guard_ingest_rejected_total", reason="unknown_probe") == 0
    # the V1 CPU runner keeps one stacked K/V tensor per layer: no layout incident
    assert value(text, "ascend_guard_incidents_total", type="kv_layout") == 0
    # CPU has no device clock and no graphs: those probes stay silent rather than guess
    assert not samples(text, "ascend_guard_device_phase_ms")
    assert not samples(text, "ascend_guard_graph_captures")


def test_kv_probe_equals_vllm_and_the_model_config(deployment) -> None:
    sidecar, server, model = deployment
    text = sidecar.wait_for(lambda t: bool(samples(t, "ascend_guard_kv_cache_bytes", **RANK)))
    ((info, _),) = samples(server.metrics_text(), "vllm:cache_config_info")
    blocks = int(info["num_gpu_blocks"])
    block_size = int(info["block_size"])
    config = json.loads((Path(model) / "config.json").read_text())
    layers = config["num_hidden_layers"]
    page = 2 * block_size * config["num_key_value_heads"] * config["head_dim"] * FLOAT32_BYTES

    assert value(text, "ascend_guard_kv_cache_blocks", **RANK) == blocks > 0
    assert value(text, "ascend_guard_kv_cache_layers", **RANK) == layers
    assert value(text, "ascend_guard_kv_cache_bytes", **RANK) == blocks * page * layers


def test_speculator_counts_equal_vllm(deployment) -> None:
    """Accepted drafts equal vLLM's own count exactly. Proposed drafts are at least the drafts
    vLLM scheduled for verification: those proposed in a request's last step are never
    scheduled (at most num_speculative_tokens per request)."""
    sidecar, server, _ = deployment
    before = server.metrics_text()
    drafts_before = value(before, "vllm:spec_decode_num_draft_tokens_total")
    accepted_before = value(before, "vllm:spec_decode_num_accepted_tokens_total")
    guard_before = sidecar.metrics_text()
    proposed_0 = value(
        guard_before, "ascend_guard_spec_drafts_proposed_total", method="ngram", **RANK
    )
    accepted_0 = value(
        guard_before, "ascend_guard_spec_drafts_accepted_total", method="ngram", **RANK
    )

    server.complete_many(SPEC_PROMPTS, max_tokens=40)
    after = server.metrics_text()
    drafts = value(after, "vllm:spec_decode_num_draft_tokens_total") - drafts_before
    accepted = value(after, "vllm:spec_decode_num_accepted_tokens_total") - accepted_before
    assert accepted > 0, "the n-gram prompts should get drafts accepted"

    def settled(text: str) -> bool:
        got = value(text, "ascend_guard_spec_drafts_accepted_total", method="ngram", **RANK)
        return got - accepted_0 >= accepted

    text = sidecar.wait_for(settled)
    assert (
        value(text, "ascend_guard_spec_drafts_accepted_total", method="ngram", **RANK) - accepted_0
        == accepted
    )
    proposed = (
        value(text, "ascend_guard_spec_drafts_proposed_total", method="ngram", **RANK) - proposed_0
    )
    assert drafts <= proposed <= drafts + SPEC_TOKENS * len(SPEC_PROMPTS)
    ((labels, one),) = samples(text, "ascend_guard_speculator_info", **RANK)
    assert one == 1 and labels["method"] == "ngram" and labels["speculator"] == "NgramProposer"
