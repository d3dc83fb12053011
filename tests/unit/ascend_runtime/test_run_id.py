"""The run id is the same on every node of one multi-node engine (traces join by it, the
cross-node rules join on it) and stays a fresh one per launch on one node.

The parallel configs are vLLM's own `ParallelConfig`, built as `vllm serve` on each node would
build it from that node's launch arguments.
"""

from __future__ import annotations

import os
import re
from types import SimpleNamespace

import pytest

from ascend_runtime import plugin
from ascend_runtime.attach.ranks import rendezvous_run_id, shared_rendezvous
from guard.config.runtime_guard import RUN_ID_ENV, GuardConfig

ParallelConfig = pytest.importorskip("vllm.config").ParallelConfig


def tp_across_nodes(node_rank: int, port: int = 29501) -> ParallelConfig:
    """`--tensor-parallel-size 16 --nnodes 2 --node-rank R --master-addr 10.1.0.5`"""
    return ParallelConfig(
        tensor_parallel_size=16, nnodes=2, node_rank=node_rank, master_addr="10.1.0.5",
        master_port=port, distributed_executor_backend="mp",
    )  # fmt: skip


def dp_across_nodes(start_rank: int) -> ParallelConfig:
    """`--data-parallel-size 4 --data-parallel-size-local 2 --data-parallel-start-rank S
    --data-parallel-address 10.1.0.5 --data-parallel-rpc-port 13345`"""
    return ParallelConfig(
        data_parallel_size=4, data_parallel_size_local=2, data_parallel_rank=start_rank,
        data_parallel_master_ip="10.1.0.5", data_parallel_rpc_port=13345,
    )  # fmt: skip


def vllm_config(parallel: ParallelConfig, model: str = "/models/DeepSeek-V3") -> SimpleNamespace:
    return SimpleNamespace(parallel_config=parallel, model_config=SimpleNamespace(model=model))


@pytest.fixture
def no_inherited_run_id(monkeypatch):
    monkeypatch.delenv(RUN_ID_ENV, raising=False)


def node_run_id(parallel: ParallelConfig, config: GuardConfig | None = None, **kw) -> str:
    """What `vllm serve` on one node derives (a fresh environment: a node inherits nothing)."""
    os.environ.pop(RUN_ID_ENV, None)
    return plugin.shared_run_id(config or GuardConfig(), vllm_config(parallel, **kw))


def test_rendezvous_of_one_node_is_none():
    assert shared_rendezvous(ParallelConfig(tensor_parallel_size=2)) is None
    # `--data-parallel-size 2` on one node: EngineArgs makes every DP rank local
    assert (
        shared_rendezvous(ParallelConfig(data_parallel_size=2, data_parallel_size_local=2)) is None
    )
    assert shared_rendezvous(None) is None


def test_every_node_of_a_tp_group_derives_the_same_run_id(no_inherited_run_id):
    ids = {node_run_id(tp_across_nodes(rank)) for rank in (0, 1)}
    assert len(ids) == 1
    (run_id,) = ids
    assert re.fullmatch(r"mn-[0-9a-f]{16}", run_id)
    assert run_id == rendezvous_run_id("DeepSeek-V3", "nodes=10.1.0.5:29501")
    # another engine (other rendezvous, or other model label) gets another id
    assert node_run_id(tp_across_nodes(0, port=29600)) != run_id
    assert node_run_id(tp_across_nodes(0), model="/models/Qwen3-235B") != run_id


def test_dp_engines_started_apart_derive_the_same_run_id(no_inherited_run_id):
    assert shared_rendezvous(dp_across_nodes(0)) == "dp=10.1.0.5:13345"
    assert node_run_id(dp_across_nodes(0)) == node_run_id(dp_across_nodes(2))


def test_configured_or_inherited_run_id_wins(no_inherited_run_id, monkeypatch):
    configured = GuardConfig(run_id="launch-42")
    assert node_run_id(tp_across_nodes(1), configured) == "launch-42"
    monkeypatch.setenv(RUN_ID_ENV, "from-the-launcher")
    assert plugin.shared_run_id(GuardConfig(), vllm_config(tp_across_nodes(1))) == (
        "from-the-launcher"
    )


def test_one_node_keeps_a_fresh_run_id_per_launch(no_inherited_run_id):
    first = node_run_id(ParallelConfig(tensor_parallel_size=2))
    second = node_run_id(ParallelConfig(tensor_parallel_size=2))
    assert re.fullmatch(r"[0-9a-f]{16}", first) and first != second
    assert os.environ[RUN_ID_ENV] == second  # handed down to the processes it spawns
