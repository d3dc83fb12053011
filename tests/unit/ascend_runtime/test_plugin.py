"""The vLLM plugin entry point, run in a fresh interpreter as vLLM runs it in each process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from guard.config.runtime_guard import RESOLVED_ENV, RUN_ID_ENV, GuardConfig
from tests.support.side_by_side import side_by_side

pytestmark = pytest.mark.timeout(180)

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from ascend_runtime.plugin import register
    from guard.decorators import active_processor, is_guarded

    register()
    import vllm.v1.worker.gpu_model_runner as v1
    import vllm.v1.worker.cpu_model_runner as cpu

    print(json.dumps({
        "execute_guarded": is_guarded(v1.GPUModelRunner.__dict__["execute_model"]),
        "sample_guarded": is_guarded(v1.GPUModelRunner.__dict__["sample_tokens"]),
        "cpu_inherits_guarded": is_guarded(cpu.CPUModelRunner.execute_model),
        "processor": active_processor() is not None,
        "run_id": os.environ.get("ASCEND_GUARD_RUN_ID"),
    }))
    """
)


def _run(env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASCEND_GUARD_")}
    env.update(env_extra)
    env["VLLM_TARGET_DEVICE"] = "cpu"
    return subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=150
    )


def _seen(run) -> dict:
    out = run.result()
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The fresh interpreters of the tests below, by the environment each gets: each is some
    10 s of importing vLLM on one core, so they run side by side."""
    config_file = tmp_path_factory.mktemp("plugin") / "guard.json"
    config_file.write_text(json.dumps({"runtime_guard": {"sidecar": "127.0.0.1:50051"}}))
    handed_down = GuardConfig(sidecar="unix:///tmp/nowhere.sock", engine="unit")
    envs = {
        "no config": {},
        "handed down": {RESOLVED_ENV: handed_down.to_json(), RUN_ID_ENV: "run-from-parent"},
        "config file": {"ASCEND_GUARD_CONFIG": str(config_file)},
    }
    yield from side_by_side(_run, {name: (env,) for name, env in envs.items()})


def test_without_config_the_plugin_wraps_nothing(runs) -> None:
    seen = _seen(runs["no config"])
    assert seen == {
        "execute_guarded": False,
        "sample_guarded": False,
        "cpu_inherits_guarded": False,
        "processor": False,
        "run_id": None,
    }


def test_with_a_handed_down_config_the_runner_is_bound_on_import(runs) -> None:
    seen = _seen(runs["handed down"])
    assert seen["execute_guarded"] and seen["sample_guarded"] and seen["cpu_inherits_guarded"]
    assert seen["processor"]
    assert seen["run_id"] == "run-from-parent"


def test_config_file_env_turns_the_guard_on(runs) -> None:
    seen = _seen(runs["config file"])
    assert seen["execute_guarded"] and seen["processor"]
    assert seen["run_id"]  # generated once, for the processes this one spawns


def test_engine_config_with_a_guard_turns_it_on_in_this_process_too() -> None:
    """With the engine in-process (no multiprocessing), the config arrives after the plugins
    loaded; the engine-config hook must still bind the runner in this process."""
    script = textwrap.dedent(
        """
        import json, os
        from ascend_runtime.plugin import on_engine_config
        from guard.decorators import active_processor

        assert active_processor() is None
        config = on_engine_config({"runtime_guard": {"sidecar": "127.0.0.1:50051", "engine": "x"}})
        print(json.dumps({
            "engine": config.engine,
            "active": active_processor() is not None,
            "published": json.loads(os.environ["ASCEND_GUARD_RESOLVED_CONFIG"])["engine"],
            "run_id": bool(os.environ.get("ASCEND_GUARD_RUN_ID")),
        }))
        on_engine_config({})
        print(json.dumps({"published_after_off": "ASCEND_GUARD_RESOLVED_CONFIG" in os.environ}))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASCEND_GUARD_")}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    first, second = (json.loads(line) for line in out.stdout.strip().splitlines()[-2:])
    assert first == {"engine": "x", "active": True, "published": "x", "run_id": True}
    assert second == {"published_after_off": False}
