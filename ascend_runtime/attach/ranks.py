"""Who this worker is: rank coordinates and labels, read from vLLM once distributed is up."""

from __future__ import annotations

import hashlib
import os
import re
import socket
from typing import Any, NamedTuple

from guard.config.runtime_guard import GuardConfig
from telemetry.wire import workload
from telemetry.wire.proto import guard_pb2


def engine_label(config: GuardConfig, vllm_config: Any) -> str:
    """The configured engine label, else the served model's name (its last path part)."""
    if config.engine:
        return config.engine
    model_config = getattr(vllm_config, "model_config", None)
    name = (
        getattr(model_config, "served_model_name", None)
        or getattr(model_config, "model", None)
        or "default"
    )
    if isinstance(name, (list, tuple)):
        name = name[0] if name else "default"
    name = os.path.basename(str(name).rstrip("/")) or "default"
    return re.sub(r"[^A-Za-z0-9_.:-]", "_", name)[:64]


def shared_rendezvous(parallel_config: Any) -> str | None:
    """Where the nodes of a multi-node engine meet, as every node's launch arguments give it;
    None when one `vllm serve` runs the whole engine.

    - TP/PP across nodes (`--nnodes N --node-rank R --master-addr A --master-port P`, one
      `vllm serve` per node, the others `--headless`): every node is given A:P.
    - DP engines started apart (`--data-parallel-size-local` below `--data-parallel-size`,
      `--data-parallel-rank`, hybrid or external load balancing; vLLM allows it for MoE models
      only, whose DP engines step in lockstep): every engine is given the DP coordinator's
      `--data-parallel-address` and `--data-parallel-rpc-port`.
    """
    if parallel_config is None:
        return None
    parts = []
    if int(getattr(parallel_config, "nnodes", 1) or 1) > 1:
        addr = getattr(parallel_config, "master_addr", "")
        parts.append(f"nodes={addr}:{getattr(parallel_config, 'master_port', '')}")
    size = int(getattr(parallel_config, "data_parallel_size", 1) or 1)
    local = getattr(parallel_config, "data_parallel_size_local", size)
    if size > 1 and isinstance(local, int) and local < size:
        addr = getattr(parallel_config, "data_parallel_master_ip", "")
        port = getattr(parallel_config, "data_parallel_rpc_port", "")
        parts.append(f"dp={addr}:{port}")
    return ";".join(parts) or None


def rendezvous_run_id(engine: str, rendezvous: str) -> str:
    """The run id every node of one multi-node engine derives alike (docs/cross-node.md)."""
    return "mn-" + hashlib.sha1(f"{engine}|{rendezvous}".encode()).hexdigest()[:16]


class DpIdentity(NamedTuple):
    """Which DP engine a worker belongs to, of how many, and whether the engines step together."""

    rank: int
    size: int
    lockstep: bool


def dp_identity(parallel_config: Any, dp_group: Any = None) -> DpIdentity:
    """The DP rank and size of this worker's engine, from vLLM's own DP state.

    vLLM runs DP in one of two ways, in-process (`--data-parallel-size N`: one engine core
    process per DP rank) and external (`--data-parallel-rank R`, one `vllm serve` per rank or
    `--data-parallel-size-local` engines per node); both hand each engine core its rank, and
    the engine core (`EngineCoreProc.run_engine_core`) then sets:

    - MoE models: `data_parallel_rank` = the rank; the engines form one DP process group
      (`get_dp_group()`) and step in lockstep, idle ones running dummy batches.
    - dense models: `data_parallel_index` = the rank, and the DP fields are reset to those of
      a lone engine (`reconfigure_for_independent_dp_rank`: size 1, rank 0), since the
      engines are independent replicas. `data_parallel_rank` then reads 0 on every engine.

    So the rank is `data_parallel_index` (always the rank, "not overridden for dense models");
    the engines step in lockstep when the engine kept a DP size above 1 (its DP group, once
    distributed is up, says the same); the size is then the DP group's, else the deployment's
    size as the config was validated (`elastic_ep_max_dp_size`, which vLLM sets to
    `data_parallel_size` then unless elastic EP is on, and which the reset leaves alone).
    """
    index = getattr(parallel_config, "data_parallel_index", None)
    if not isinstance(index, int):
        index = getattr(parallel_config, "data_parallel_rank", 0)
    rank = int(index or 0)
    configured = int(getattr(parallel_config, "data_parallel_size", 1) or 1)
    group_size = int(getattr(dp_group, "world_size", 1) or 1) if dp_group is not None else 1
    if group_size > 1:
        return DpIdentity(int(getattr(dp_group, "rank_in_group", rank)), group_size, True)
    validated = getattr(parallel_config, "elastic_ep_max_dp_size", None)
    size = max(configured, validated if isinstance(validated, int) else 1, rank + 1)
    return DpIdentity(rank, size, configured > 1)


def _dp_group(ps: Any) -> Any:
    """vLLM's DP process group, or None where it is not set up (single engine, older vLLM)."""
    try:
        return ps.get_dp_group()
    except (AssertionError, AttributeError):
        return None


def describe_rank(runner: Any, config: GuardConfig, run_id: str) -> guard_pb2.RankInfo:
    """Rank coordinates of the process that runs `runner` (call after distributed init)."""
    from vllm.distributed import parallel_state as ps

    vllm_config = getattr(runner, "vllm_config", None)
    parallel = getattr(vllm_config, "parallel_config", None)
    tp_group = ps.get_tp_group()
    pp_group = ps.get_pp_group()
    dp = dp_identity(parallel, _dp_group(ps))
    return guard_pb2.RankInfo(
        run_id=run_id,
        engine=engine_label(config, vllm_config),
        dp_rank=dp.rank,
        tp_rank=tp_group.rank_in_group,
        pp_rank=pp_group.rank_in_group,
        dp_size=dp.size,
        dp_lockstep=dp.lockstep,
        tp_size=tp_group.world_size,
        pp_size=pp_group.world_size,
        # the Kubernetes node where the Downward API names it (a pod's hostname is its own
        # name), else the host
        node=workload.from_env().node or socket.gethostname(),
        pid=os.getpid(),
        runner=f"{type(runner).__module__}.{type(runner).__qualname__}",
    )
