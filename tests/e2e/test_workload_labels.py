"""A real `vllm serve` on CPU names its pod (Downward-API env) and its served model to the
sidecar: `ascend_guard_rank_workload_info` carries the `model_name` that vLLM's own /metrics
carries (the independent source: vLLM's label, read from vLLM's endpoint), and no device (CPU).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from telemetry.wire import workload
from tests.e2e.test_serve import guard_config
from tests.support.metrics import samples
from tests.support.sidecar import SidecarProcess
from tests.support.vllm_server import VllmServer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SERVED = "tiny-chat"
POD = {
    workload.POD_NAME_ENV: "vllm-tiny-5d8f-xk2lp",
    workload.POD_NAMESPACE_ENV: "serving",
    workload.NODE_NAME_ENV: "node-a",
}


def test_the_info_series_names_vllms_model_name_and_the_pod(tiny_model, tmp_path: Path):
    sidecar = SidecarProcess.start(tmp_path)
    guard = guard_config(Path(sidecar.address[len("unix://") :]))
    try:
        server = VllmServer.start(
            tiny_model, tmp_path, guard=guard, extra_args=("--served-model-name", SERVED), env=POD
        )
        try:
            server.complete("The quick brown fox", max_tokens=4, model=SERVED)  # first wave
            text = sidecar.wait_for(
                lambda t: bool(samples(t, "ascend_guard_rank_workload_info")), timeout=60
            )
            ((labels, _),) = samples(text, "ascend_guard_rank_workload_info")
            vllm_names = {
                lab["model_name"]
                for family in ("vllm:num_requests_waiting", "vllm:num_requests_running")
                for lab, _ in samples(server.metrics_text(), family)
            }
        finally:
            server.stop()
    finally:
        sidecar.stop()
    assert vllm_names == {SERVED}, vllm_names  # what vLLM labels its own series with
    assert labels["model_name"] == SERVED
    assert (labels["namespace"], labels["pod"], labels["node"]) == (
        "serving",
        "vllm-tiny-5d8f-xk2lp",
        "node-a",
    )
    assert labels["device"] == ""  # CPU: no accelerator to name
