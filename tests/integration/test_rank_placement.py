"""The NPU a rank opened and the model it serves, from the worker to every place an on-call
engineer reads them: `ascend_guard_rank_workload_info`, the hang verdict on /hangs, the
`hangs --live` table, and the stored verdict incident.

Real sidecar and real streamer client in stand-in rank processes (tests/support/rank_process.py);
the device comes from the guard's own placement code (guard/stream/placement.py) with the real
`ASCEND_RT_VISIBLE_DEVICES` / `ASCEND_VISIBLE_DEVICES` of the rank's environment and a stand-in
for torch_npu's `current_device()` (torch_npu cannot run here).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from telemetry.wire import workload
from tests.integration.test_hang_verdicts import REPO, get, wait_until
from tests.support.metrics import samples
from tests.support.ports import free_port
from tests.support.sidecar import SidecarProcess

pytestmark = pytest.mark.timeout(120)

MODEL = "Qwen/Qwen2.5-7B-Instruct"
# the container holds the node's NPUs 2, 5, 6 and 7 (the device plugin's list); the runtime is
# limited to the last two of them, so runtime device 1 is the node's NPU 7
ENV = {
    "ASCEND_VISIBLE_DEVICES": "2,5,6,7",
    "ASCEND_RT_VISIBLE_DEVICES": "2,3",
    workload.POD_NAME_ENV: "vllm-qwen-7c9d-abcde",
    workload.POD_NAMESPACE_ENV: "serving",
    workload.NODE_NAME_ENV: "node-a",
}
NODE_NPU = {0: "6", 1: "7"}


@pytest.fixture
def sidecar_with(tmp_path):
    started = []

    def start(*args: str) -> tuple[SidecarProcess, int]:
        port = free_port()
        sidecar = SidecarProcess.start(
            tmp_path, extra_args=("--health-port", str(port), "--health-host", "127.0.0.1", *args)
        )
        started.append(sidecar)
        return sidecar, port

    yield start
    for sidecar in started:
        sidecar.stop()


def _rank(address: str, tp: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.rank_process", address, "--engine", "qwen",
         "--tp", str(tp), "--npu", str(tp), "--model-name", MODEL, *extra],
        cwd=REPO, env={**os.environ, **ENV}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip


def test_device_and_model_reach_the_info_series_the_verdict_and_the_cli(sidecar_with):
    sidecar, port = sidecar_with("--hang-after", "1.5s", "--hang-wait", "60s")
    procs = {0: _rank(sidecar.address, 0, "--in-collective"), 1: _rank(sidecar.address, 1)}
    try:
        text = sidecar.wait_for(
            lambda t: len(samples(t, "ascend_guard_rank_workload_info")) == 2, timeout=20
        )
        info = {
            labels["tp"]: labels for labels, _ in samples(text, "ascend_guard_rank_workload_info")
        }
        for tp, npu in NODE_NPU.items():
            assert info[str(tp)]["device"] == npu, info
            assert info[str(tp)]["model_name"] == MODEL
            assert info[str(tp)]["pod"] == "vllm-qwen-7c9d-abcde"
        victim = procs[1].pid
        os.kill(victim, signal.SIGSTOP)
        _, body = wait_until(lambda: (r := get(port, "/live/qwen"))[0] == 503 and r, 10, "verdict")
        verdict = body["verdicts"][0]
        assert verdict["model_name"] == MODEL
        (stopped,) = verdict["stopped"]
        assert (stopped["tp"], stopped["pid"], stopped["device"]) == (1, victim, "7")
        assert (stopped["namespace"], stopped["pod"]) == ("serving", "vllm-qwen-7c9d-abcde")
        assert [w["device"] for w in verdict["waiting"]] == ["6"]
        assert get(port, "/hangs")[1]["standing"][0]["stopped"][0]["device"] == "7"
        live = subprocess.run(
            [sys.executable, "-m", "telemetry.cli", "hangs", "--live", "--sidecar",
             f"http://127.0.0.1:{port}"],
            cwd=REPO, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert live.returncode == 3, live.stdout + live.stderr
        assert f"tp1/pid{victim}/dev7" in live.stdout, live.stdout
        assert f"model {MODEL}" in live.stdout and "pod serving/vllm-qwen-7c9d-abcde" in live.stdout
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.terminate()
                proc.wait(10)
    stored = subprocess.run(
        [sys.executable, "-m", "telemetry.cli", "hangs", "--json", "--store",
         str(sidecar.store_path)],
        cwd=REPO, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    verdicts = [
        json.loads(line)
        for line in stored.stdout.splitlines()
        if json.loads(line)["type"] == "hang_verdict"
    ]
    assert verdicts and verdicts[0]["evidence"]["stopped"][0]["device"] == "7", stored.stdout
    assert verdicts[0]["evidence"]["model_name"] == MODEL


def test_a_rank_outside_kubernetes_names_its_device_on_the_verdict_only(sidecar_with):
    """No pod named (systemd, or a pod without the Downward API env): no info series, so an
    alert's join cannot blank the target's namespace and pod; the verdict still names the
    device and the model."""
    sidecar, port = sidecar_with("--hang-after", "1.5s", "--hang-wait", "60s")
    bare = {k: v for k, v in os.environ.items() if not k.startswith("ASCEND_GUARD_POD")}
    procs = {
        tp: subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.support.rank_process",
                sidecar.address,
                "--engine",
                "bare",
                "--tp",
                str(tp),
                "--npu",
                str(tp),
                "--model-name",
                MODEL,
                *(["--in-collective"] if tp == 0 else []),
            ],
            cwd=REPO,
            env={**bare, "ASCEND_RT_VISIBLE_DEVICES": "4,5"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for tp in (0, 1)
    }
    try:
        wait_until(lambda: len(get(port, "/live/bare")[1].get("ranks", [])) == 2, 20, "two ranks")
        assert not samples(sidecar.metrics_text(), "ascend_guard_rank_workload_info")
        os.kill(procs[1].pid, signal.SIGSTOP)
        _, body = wait_until(lambda: (r := get(port, "/live/bare"))[0] == 503 and r, 10, "verdict")
        (stopped,) = body["verdicts"][0]["stopped"]
        assert stopped["device"] == "5" and "pod" not in stopped
        assert body["verdicts"][0]["model_name"] == MODEL
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.terminate()
                proc.wait(10)
