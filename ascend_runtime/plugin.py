"""The `vllm.general_plugins` entry point: runs in every vLLM process (API server, engine
core, each worker).

In the process that builds the engine config (the API server, or the script that creates an
`LLM`), it validates the `runtime_guard` config — a bad one stops start-up with a message naming
the key and value — and hands the resolved config and a shared run id down to the processes it
spawns through the environment. In a process that received a config, it binds the guard to the
model runner classes as they are imported. With no config anywhere, it wraps nothing.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import uuid
from typing import Any

import structlog

from guard.config.reload import INLINE_ENV
from guard.config.runtime_guard import (
    CONFIG_KEY,
    RESOLVED_ENV,
    RUN_ID_ENV,
    GuardConfig,
    GuardConfigError,
    config_from_env,
    resolve_config,
)

log = structlog.get_logger("ascend_guard.plugin")

_state: dict[str, bool] = {"config_hook": False, "bound": False}


def register() -> None:
    """Entry point; must never break vLLM except to refuse an invalid guard config."""
    try:
        _hook_engine_config()
        config = config_from_env() or resolve_config(None)
    except GuardConfigError:
        raise
    except Exception:  # noqa: BLE001 - a guard bug must not stop vLLM from starting
        log.exception("guard_plugin_failed")
        return
    if config is not None:
        activate(config)


def _hook_engine_config() -> None:
    """Validate the guard config where vLLM builds its config, and pass it to child processes."""
    if _state["config_hook"] or "vllm.engine.arg_utils" not in sys.modules:
        return
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config

    def create_engine_config(self, *args, **kwargs):
        vllm_config = original(self, *args, **kwargs)
        on_engine_config(getattr(vllm_config, "additional_config", None), vllm_config)
        return vllm_config

    create_engine_config.__wrapped__ = original  # type: ignore[attr-defined]
    EngineArgs.create_engine_config = create_engine_config
    _state["config_hook"] = True


def on_engine_config(additional_config: Any, vllm_config: Any = None) -> GuardConfig | None:
    """Validate the guard config of a new engine config; publish it and turn the guard on here.

    Turning it on in this process too matters when vLLM runs the engine in-process
    (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): plugins were loaded before the config existed, and
    no child process will load them again. Elsewhere it only arms the import hooks.
    """
    inline = (
        (additional_config or {}).get(CONFIG_KEY) if isinstance(additional_config, dict) else None
    )
    if isinstance(inline, dict):  # the hot-reload watcher keeps these on top of file edits
        os.environ[INLINE_ENV] = json.dumps(inline)
    try:
        config = resolve_config(additional_config)
    except GuardConfigError as exc:
        log.error("guard_config_invalid", error=str(exc))
        raise
    publish(config, vllm_config)
    if config is not None:
        activate(config)
    return config


def publish(config: GuardConfig | None, vllm_config: Any = None) -> None:
    """Hand the resolved config (with its run id) to processes spawned from this one."""
    if config is None:
        os.environ.pop(RESOLVED_ENV, None)
        return
    shared_run_id(config, vllm_config)
    os.environ[RESOLVED_ENV] = config.to_json()


def shared_run_id(config: GuardConfig, vllm_config: Any = None) -> str:
    """The run id every process of this engine uses: configured, inherited, derived from the
    rendezvous all nodes of a multi-node engine share (ascend_runtime/attach/ranks.py), or made here
    once (one node: every process is spawned from this one and inherits it)."""
    run_id = config.run_id or os.environ.get(RUN_ID_ENV)
    if not run_id and vllm_config is not None:
        from ascend_runtime.attach.ranks import engine_label, rendezvous_run_id, shared_rendezvous

        rendezvous = shared_rendezvous(getattr(vllm_config, "parallel_config", None))
        if rendezvous:
            run_id = rendezvous_run_id(engine_label(config, vllm_config), rendezvous)
            log.info("run_id_from_rendezvous", run_id=run_id, rendezvous=rendezvous)
    run_id = run_id or uuid.uuid4().hex[:16]
    os.environ[RUN_ID_ENV] = run_id
    return run_id


def activate(config: GuardConfig) -> None:
    """Turn the guard on in this process: a processor, and bindings as runner modules load."""
    if _state["bound"]:
        return
    from ascend_runtime.attach.binder import bind_all, bind_sampling
    from ascend_runtime.attach.ranks import describe_rank
    from guard.decorators import install
    from guard.processor import GuardProcessor
    from telemetry.wire import logs

    logs.configure()
    run_id = shared_run_id(config)
    processor = GuardProcessor(
        config, lambda runner: describe_rank(runner, config, run_id), run_id=run_id
    )
    install(processor)
    atexit.register(processor.close)
    bind_all()
    bind_sampling()
    from ascend_runtime.attach.collectives import install_collective_guard

    install_collective_guard(config, processor)
    from ascend_runtime.attach.binder import attach_point_readings
    from guard.stream import identity

    identity.add_source(attach_point_readings)
    _state["bound"] = True
