"""What a worker of each DP engine sees: vLLM's real config and engine-core start-up, no model.

For each scenario (command-line arguments as `vllm serve` takes them, and the engine-core ranks
the launcher would start), this parses them with vLLM's own argument parser and builds the real
`VllmConfig` with `EngineArgs.create_engine_config`
and runs vLLM's real `EngineCoreProc.run_engine_core` for each rank, with the engine-core class
replaced by a stub that records `ascend_runtime.attach.ranks.dp_identity` of the parallel config it was
handed and stops there (the config an engine core builds its executor and workers from).

Run as `python -m tests.support.engine_core_dp SCENARIOS_JSON`: a JSON list of
`{"argv": ["--model", DIR, ...], "dp_ranks": [[dp_rank, local_dp_rank], ...]}`; prints one JSON
line: per scenario, per rank, `[rank, size, lockstep]` or `{"error": "..."}`. It runs in its own
process because the engine-core entry point sets signal handlers, the process title and a log
prefix on stdout.
"""

from __future__ import annotations

import contextlib
import copy
import json
import sys
from typing import Any


class _Captured(BaseException):
    """Raised by the stub engine core: passes vLLM's `except Exception` and `SystemExit`."""


def run(scenarios: list[dict[str, Any]]) -> list[Any]:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.engine import core

    from ascend_runtime.attach.ranks import dp_identity

    seen: list[Any] = []

    class StubEngineCore:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            seen.append(list(dp_identity(kwargs["vllm_config"].parallel_config)))
            raise _Captured

    run_engine_core = core.EngineCoreProc.run_engine_core
    core.EngineCoreProc = StubEngineCore  # the names run_engine_core builds its engine from
    core.DPEngineCoreProc = StubEngineCore
    results = []
    for scenario in scenarios:
        try:
            parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
            args = EngineArgs.from_cli_args(parser.parse_args(scenario["argv"]))
            config = args.create_engine_config()
        except Exception as exc:  # noqa: BLE001 - reported to the test
            results.append({"error": f"{type(exc).__name__}: {exc}"})
            continue
        ranks = []
        for dp_rank, local_dp_rank in scenario["dp_ranks"]:
            seen.clear()
            with contextlib.suppress(_Captured):
                run_engine_core(
                    vllm_config=copy.deepcopy(config),  # each engine core gets its own copy
                    local_client=True,
                    handshake_address="",
                    executor_class=None,
                    log_stats=False,
                    dp_rank=dp_rank,
                    local_dp_rank=local_dp_rank,
                )
            ranks.append(seen[0] if seen else {"error": "no engine core was built"})
        results.append(ranks)
    return results


if __name__ == "__main__":
    out = run(json.loads(sys.argv[1]))
    sys.__stdout__.write("RESULT " + json.dumps(out) + "\n")
    sys.__stdout__.flush()
