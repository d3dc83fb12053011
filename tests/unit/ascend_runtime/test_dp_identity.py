"""DP identity of a worker, from vLLM's own DP state.

The config paths run vLLM's real code: `vllm serve` arguments parsed by vLLM's parser, the
`VllmConfig` built by `EngineArgs.create_engine_config`, and vLLM's engine-core entry point
(`EngineCoreProc.run_engine_core`) for each DP rank, which rewrites the parallel config the
engine's workers get (see tests/support/engine_core_dp.py). Only the engine core itself is a
stub: no model is loaded. The MoE model is a config file alone (external DP is MoE-only).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from ascend_runtime.attach.ranks import DpIdentity, dp_identity

ROOT = Path(__file__).resolve().parents[3]
COMMON = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "256"]
COMMON += ["--skip-tokenizer-init"]


def tiny_moe(path: Path) -> Path:
    from transformers import MixtralConfig

    MixtralConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=512,
        max_position_embeddings=512,
    ).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def engine_views(tiny_model, tmp_path_factory) -> list:
    """Per scenario, per engine-core rank: the DP identity its workers would report."""
    pytest.importorskip("vllm")
    moe = str(tiny_moe(tmp_path_factory.mktemp("moe")))
    dense = str(tiny_model)
    scenarios = [
        # in-process DP of a dense model: every engine core is an independent replica
        {"argv": ["--model", dense, "--data-parallel-size", "2"], "dp_ranks": [[0, 0], [1, 1]]},
        # external DP, one `vllm serve` per DP rank: this is rank 1's serve
        {
            "argv": ["--model", moe, "--data-parallel-size", "2", "--data-parallel-rank", "1"],
            "dp_ranks": [[1, 0]],
        },
        # hybrid: this node runs DP ranks 2 and 3 of 4
        {
            "argv": ["--model", moe, "--data-parallel-size", "4"]
            + ["--data-parallel-size-local", "2", "--data-parallel-start-rank", "2"]
            + ["--data-parallel-hybrid-lb"],
            "dp_ranks": [[2, 0], [3, 1]],
        },
        # in-process DP of a MoE model: one DP group in lockstep
        {"argv": ["--model", moe, "--data-parallel-size", "2"], "dp_ranks": [[0, 0], [1, 1]]},
        # vLLM refuses external DP for a dense model (so its ranks never reach a worker)
        {
            "argv": ["--model", dense, "--data-parallel-size", "2", "--data-parallel-rank", "1"],
            "dp_ranks": [[1, 0]],
        },
    ]
    for scenario in scenarios:
        scenario["argv"] += COMMON
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.engine_core_dp", json.dumps(scenarios)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


def test_in_process_dp_of_a_dense_model_gives_each_engine_its_rank(engine_views):
    """vLLM resets `data_parallel_rank` to 0 on each independent engine: the bug's cause."""
    assert engine_views[0] == [[0, 2, False], [1, 2, False]]


def test_external_dp_rank_from_data_parallel_rank(engine_views):
    assert engine_views[1] == [[1, 2, True]]


def test_hybrid_dp_ranks_from_start_rank_and_size_local(engine_views):
    assert engine_views[2] == [[2, 4, True], [3, 4, True]]


def test_in_process_dp_of_a_moe_model_steps_in_lockstep(engine_views):
    assert engine_views[3] == [[0, 2, True], [1, 2, True]]


def test_external_dp_of_a_dense_model_is_refused_by_vllm(engine_views):
    assert "Non-MoE models do not support external data parallel" in engine_views[4]["error"]


def test_the_dp_group_wins_once_distributed_is_up():
    pytest.importorskip("vllm")
    from vllm.config import ParallelConfig

    config = ParallelConfig(data_parallel_size=2, data_parallel_rank=1)
    group = SimpleNamespace(world_size=2, rank_in_group=1)
    assert dp_identity(config, group) == DpIdentity(1, 2, True)
    lone = SimpleNamespace(world_size=1, rank_in_group=0)
    assert dp_identity(ParallelConfig(), lone) == DpIdentity(0, 1, False)


def test_without_vllm_fields_a_worker_is_dp0_of_1():
    assert dp_identity(SimpleNamespace()) == DpIdentity(0, 1, False)
    assert dp_identity(None) == DpIdentity(0, 1, False)
