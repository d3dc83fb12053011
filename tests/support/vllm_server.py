"""A real `vllm serve` (OpenAI API server) on CPU for end-to-end tests, demo and benchmarks."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tests.support.ports import free_port
from tests.support.ready import wait_http_ok


def cpu_env(tp: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for vLLM's CPU backend on these 2-core machines (see shared/ENVIRONMENT.md)."""
    env = dict(os.environ)
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    env["VLLM_CPU_OMP_THREADS_BIND"] = (
        "0|1" if tp == 2 else env.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    )
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.pop("ASCEND_GUARD_RESOLVED_CONFIG", None)
    env.pop("ASCEND_GUARD_RUN_ID", None)
    env.pop("ASCEND_GUARD_INLINE_CONFIG", None)
    if extra:
        env.update(extra)
    return env


TRITON_INTERP = Path(__file__).resolve().parent / "triton_interp"


def mrv2_env(overlay: Path | None = None) -> dict[str, str]:
    """Environment for a `vllm serve` whose workers run Model Runner V2 on this CPU build: MRV2
    switched on, and Triton's interpreter behind the triton-cpu stand-in (tests/support/
    triton_interp says why and what it replaces). `overlay` (tools/mrv2_overlay.py) goes first
    on PYTHONPATH: another vLLM release's Python over the installed compiled CPU ops."""
    parts = (str(overlay or ""), str(TRITON_INTERP), os.environ.get("PYTHONPATH", ""))
    path = os.pathsep.join(p for p in parts if p)
    return {"VLLM_USE_V2_MODEL_RUNNER": "1", "TRITON_INTERPRET": "1", "PYTHONPATH": path}


class VllmServer:
    def __init__(self, proc: subprocess.Popen, port: int, model: str, log_path: Path) -> None:
        self.proc = proc
        self.port = port
        self.model = model
        self.log_path = log_path
        self.base = f"http://127.0.0.1:{port}"

    @classmethod
    def start(
        cls,
        model: str | Path,
        log_dir: Path,
        *,
        timeout: float = 300.0,
        **launch_args: Any,
    ) -> VllmServer:
        """Launch a server (the arguments of `launch`) and wait until it is healthy."""
        return cls.start_together([cls.launch(model, log_dir, **launch_args)], timeout)[0]

    @classmethod
    def start_together(cls, launched: list[VllmServer], timeout: float = 300.0) -> list[VllmServer]:
        """Wait for servers launched at once; they import vLLM side by side (a start is mostly
        imports in three processes one after another: two servers take about 50 s here, one
        35 s). If one fails, all are stopped."""
        try:
            for server in launched:
                server.wait_healthy(timeout)
        except BaseException:
            for server in launched:
                server.stop()
            raise
        return launched

    @classmethod
    def launch(
        cls,
        model: str | Path,
        log_dir: Path,
        *,
        tp: int = 1,
        guard: dict[str, Any] | None = None,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        port: int | None = None,
        eager: bool = True,
    ) -> VllmServer:
        """Start the `vllm serve` process and return at once; `wait_healthy` waits for it."""
        port = port or free_port()
        model = str(model)
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--dtype", "float32", "--gpu-memory-utilization", "0.1",
            "--max-model-len", "1024", "--max-num-seqs", "32", "--port", str(port), "--host", "127.0.0.1",
            "--tensor-parallel-size", str(tp), "--seed", "0", *extra_args,
        ]  # fmt: skip
        if eager:  # torch.compile off: faster start; `eager=False` is vLLM's default (compiled)
            cmd.append("--enforce-eager")
        if guard is not None:
            cmd += ["--additional-config", json.dumps({"runtime_guard": guard})]
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"vllm-tp{tp}-{port}.log"
        log = open(log_path, "w")  # noqa: SIM115 - lives as long as the server
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=cpu_env(tp, env), start_new_session=True
        )
        return cls(proc, port, model, log_path)

    def wait_healthy(self, timeout: float) -> None:
        status = wait_http_ok(self.proc, f"{self.base}/health", timeout, interval=0.5)
        if status == "ready":
            return
        if status == "exited":
            raise RuntimeError(
                f"vllm exited with {self.proc.returncode}; log tail:\n{self.log_tail()}"
            )
        raise RuntimeError(f"vllm not healthy after {timeout}s; log tail:\n{self.log_tail()}")

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def _completion(
        self, prompt: Any, max_tokens: int, params: dict[str, Any], headers: dict | None = None
    ) -> Any:
        """POST /v1/completions (greedy, EOS ignored, token ids returned unless `params` say
        otherwise), with `headers` added (e.g. a W3C traceparent); the open response."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True, **params}  # fmt: skip
        req = urllib.request.Request(
            f"{self.base}/v1/completions", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **(headers or {})},
        )  # fmt: skip
        return urllib.request.urlopen(req, timeout=120)

    def complete(
        self, prompt: str, max_tokens: int = 16, *, headers: dict | None = None, **params: Any
    ) -> dict[str, Any]:
        with self._completion(prompt, max_tokens, params, headers) as resp:
            return json.loads(resp.read())

    def complete_streamed(
        self,
        prompt: Any,
        max_tokens: int,
        on_first_token: Callable[[], None],
        arrivals: list[float] | None = None,
        **params: Any,
    ) -> dict[str, Any]:
        """`complete` over a stream: `on_first_token` runs once the engine is decoding it, and
        `arrivals`, if given, gets the wall-clock time each chunk of tokens came.

        Returns the shape `complete` does (id, choices[0].token_ids), so `token_ids` reads both.
        """
        response_id, tokens = "", []
        with self._completion(prompt, max_tokens, {"stream": True, **params}) as resp:
            for line in resp:
                text = line.decode().strip()
                if not text.startswith("data: ") or text == "data: [DONE]":
                    continue
                chunk = json.loads(text[len("data: ") :])
                response_id = chunk["id"]
                delta = chunk["choices"][0].get("token_ids") or []
                if delta and not tokens:
                    on_first_token()
                if delta and arrivals is not None:
                    arrivals.append(time.time())
                tokens += delta
        return {"id": response_id, "choices": [{"token_ids": tokens}]}

    def complete_many(
        self, prompts: list[str], max_tokens: int = 16, **params: Any
    ) -> list[dict[str, Any]]:
        """Send all prompts concurrently; results in prompt order."""
        with ThreadPoolExecutor(max_workers=max(1, len(prompts))) as pool:
            return list(pool.map(lambda p: self.complete(p, max_tokens, **params), prompts))

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"{self.base}/metrics", timeout=10) as resp:
            return resp.read().decode()

    def health_status(self) -> int:
        try:
            with urllib.request.urlopen(f"{self.base}/health", timeout=5) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@functools.cache
def cpu_tp_backend() -> tuple[str, str]:
    """How this host's vLLM CPU build runs a TP all-reduce: (the guard's backend label, the
    all-reduce kernel in a compiled graph's code).

    vllm-cpu loads its AVX-512 kernels where the CPU has AVX-512, and only those hold the
    shared-memory collectives; elsewhere (an AVX2-only host) TP groups fall back to
    torch.distributed on gloo. Asked of the installed vLLM itself, in a fresh interpreter.
    """
    probe = "import torch, vllm._custom_ops; print(hasattr(torch.ops._C, 'init_shm_manager'))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    if out and out[-1] == "True":
        return "shm", "torch.ops._C.shm_allreduce("
    return "gloo", "torch.ops._c10d_functional.all_reduce("


def completion_tokens(responses: list[dict[str, Any]]) -> int:
    return sum(r["usage"]["completion_tokens"] for r in responses)


def token_ids(response: dict[str, Any]) -> list[int]:
    return list(response["choices"][0]["token_ids"])
