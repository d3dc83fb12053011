"""Who this worker is: rank coordinates and labels, read from vLLM once distributed is up."""

from __future__ import annotations

import os
import re
import socket
from typing import Any

from guard.config import GuardConfig
from telemetry.proto import guard_pb2


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


def describe_rank(runner: Any, config: GuardConfig, run_id: str) -> guard_pb2.RankInfo:
    """Rank coordinates of the process that runs `runner` (call after distributed init)."""
    from vllm.distributed import parallel_state as ps

    vllm_config = getattr(runner, "vllm_config", None)
    parallel = getattr(vllm_config, "parallel_config", None)
    tp_group = ps.get_tp_group()
    pp_group = ps.get_pp_group()
    return guard_pb2.RankInfo(
        run_id=run_id,
        engine=engine_label(config, vllm_config),
        dp_rank=int(getattr(parallel, "data_parallel_rank", 0) or 0),
        tp_rank=tp_group.rank_in_group,
        pp_rank=pp_group.rank_in_group,
        dp_size=int(getattr(parallel, "data_parallel_size", 1) or 1),
        tp_size=tp_group.world_size,
        pp_size=pp_group.world_size,
        node=socket.gethostname(),
        pid=os.getpid(),
        runner=f"{type(runner).__module__}.{type(runner).__qualname__}",
    )
