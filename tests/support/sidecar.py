"""A real `ascend-guard sidecar` process for tests: started, polled until ready, stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from telemetry.wire import paths
from tests.support.ports import free_port
from tests.support.ready import wait_http_ok


class SidecarProcess:
    def __init__(
        self,
        proc: subprocess.Popen,
        address: str,
        metrics_port: int,
        store_path: Path,
        log_path: Path,
    ):
        self.proc = proc
        self.address = address
        self.metrics_port = metrics_port
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        self.store_path = store_path
        self.log_path = log_path

    @classmethod
    def start(
        cls,
        tmp_path: Path,
        *,
        address: str | None = None,
        metrics_port: int | None = None,
        store_path: Path | None = None,
        extra_args: tuple[str, ...] = (),
        timeout: float = 20.0,
        env: dict[str, str] | None = None,
    ) -> SidecarProcess:
        tmp_path = Path(tmp_path)
        address = address or f"unix://{tmp_path / 'guard.sock'}"
        taken = {int(a) for a in extra_args if a.isdigit()}  # e.g. the caller's --health-port
        while not metrics_port or metrics_port in taken:
            metrics_port = free_port()
        store_path = store_path or tmp_path / "store.db"
        log_path = tmp_path / f"sidecar-{metrics_port}-{int(time.time() * 1000)}.log"
        cmd = [
            sys.executable, "-m", "telemetry.cli", "sidecar", "--listen", address,
            "--metrics-host", "127.0.0.1", "--metrics-port", str(metrics_port), "--store", str(store_path),
            *(() if "--health-port" in extra_args else ("--health-port", "0")),
            *(() if "--query-port" in extra_args else ("--query-port", "0")), *extra_args,
        ]  # fmt: skip
        # its sidecar.json goes next to its own files, never into a folder other sidecars share
        environ = {**os.environ, paths.RUNTIME_DIR_ENV: str(tmp_path), **(env or {})}
        log = open(log_path, "w")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=environ
        )
        sidecar = cls(proc, address, metrics_port, store_path, log_path)
        sidecar._wait_ready(timeout)
        return sidecar

    def _wait_ready(self, timeout: float) -> None:
        status = wait_http_ok(self.proc, self.metrics_url, timeout, also=self._socket_ready)
        if status == "ready":
            return
        if status == "exited":
            raise RuntimeError(f"sidecar exited with {self.proc.returncode}:\n{self.log()}")
        self.stop()
        raise RuntimeError(f"sidecar not ready after {timeout}s:\n{self.log()}")

    def _socket_ready(self) -> bool:
        if self.address.startswith("unix://"):
            return os.path.exists(self.address[len("unix://") :])
        return True

    def metrics_text(self, timeout: float = 30.0) -> str:
        # generous: on the 2-core test machines a sidecar beside pinned, spinning vLLM engines
        # has gone unscheduled for up to 7.2 s (its `hang_check_late` lines, DP=2 e2e)
        with urllib.request.urlopen(self.metrics_url, timeout=timeout) as resp:
            return resp.read().decode()

    def wait_for(self, predicate: Callable[[str], bool], timeout: float = 15.0) -> str:
        """Poll /metrics until `predicate(text)` holds (records are in flight); return the text."""
        deadline = time.monotonic() + timeout
        text = self.metrics_text()
        while not predicate(text):
            if time.monotonic() > deadline:
                lines = [
                    line
                    for line in text.splitlines()
                    if line.startswith("ascend_guard_") and "_bucket" not in line
                ]
                raise TimeoutError(
                    f"sidecar metrics did not settle in {timeout}s:\n" + "\n".join(lines)
                )
            time.sleep(0.1)
            text = self.metrics_text()
        return text

    def log(self) -> str:
        try:
            return self.log_path.read_text()
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
