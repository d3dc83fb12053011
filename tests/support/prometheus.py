"""Run a real Prometheus server for tests.

``PrometheusServer`` starts the ``prometheus`` binary (Debian package ``prometheus``) on a free
loopback port with a throw-away config that scrapes the given ``host:port`` targets every second,
keeps its TSDB in a temporary directory, and offers a small client for the HTTP API::

    with PrometheusServer.start(["127.0.0.1:9464"]) as prom:
        prom.wait_for("up", lambda result: bool(result), timeout=30)
        series = prom.query('ascend_guard_waves_total{engine="test"}')

Install the binary with ``make deps`` or ``apt-get install prometheus``
(``tools/ensure_prometheus.sh`` does it only when it is missing).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from tests.support.ports import free_port
from tests.support.ready import wait_http_ok

INSTALL_HINT = (
    "the Prometheus server binary was not found: run `make deps` "
    "(or `apt-get update && apt-get install -y --no-install-recommends prometheus`, "
    "or `sudo tools/ensure_prometheus.sh`)"
)

DEFAULT_JOB = "ascend-guard"


class PrometheusError(RuntimeError):
    """Prometheus answered a query with an error, or did not answer."""


def find_prometheus() -> str:
    """Path of the ``prometheus`` binary: $PROMETHEUS_BIN, then PATH, then /usr/bin."""
    candidates = [os.environ.get("PROMETHEUS_BIN"), shutil.which("prometheus")]
    candidates.append("/usr/bin/prometheus")
    for cand in candidates:
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    raise RuntimeError(INSTALL_HINT)


def _config_text(
    targets: Iterable[str],
    job: str,
    scrape_interval: str,
    rule_files: Iterable[str] = (),
    target_labels: dict[str, dict[str, str]] | None = None,
    honor_labels: bool = False,
) -> str:
    targets = list(targets)
    labels = target_labels or {}
    static = [{"targets": [t], "labels": labels[t]} for t in targets if t in labels]
    rest = [t for t in targets if t not in labels]
    if rest:
        static.append({"targets": rest})
    # JSON is valid YAML, so no YAML library is needed to write the config.
    config: dict[str, Any] = {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
        "scrape_configs": [
            {
                "job_name": job,
                "scrape_interval": scrape_interval,
                "scrape_timeout": scrape_interval,
                "metrics_path": "/metrics",
                "honor_labels": honor_labels,
                "static_configs": static,
            }
        ],
    }
    rule_files = [str(Path(f).resolve()) for f in rule_files]
    if rule_files:
        config["rule_files"] = rule_files
    return json.dumps(config, indent=2) + "\n"


class PrometheusServer:
    """A running Prometheus server; use :meth:`start` (or the class as a context manager)."""

    def __init__(self, proc: subprocess.Popen, port: int, workdir: Path, owns_workdir: bool):
        self.proc = proc
        self.port = port
        self.workdir = workdir
        self._owns_workdir = owns_workdir
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = workdir / "prometheus.log"

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def start(
        cls,
        targets: Iterable[str],
        *,
        workdir: str | os.PathLike | None = None,
        job: str = DEFAULT_JOB,
        scrape_interval: str = "1s",
        ready_timeout: float = 30.0,
        binary: str | None = None,
        rule_files: Iterable[str | os.PathLike] = (),
        target_labels: dict[str, dict[str, str]] | None = None,
        honor_labels: bool = False,
    ) -> PrometheusServer:
        """Start Prometheus scraping ``targets`` (``host:port`` strings) every ``scrape_interval``.

        Storage, config and log live in ``workdir`` (a new temporary directory, removed on
        :meth:`stop`, when not given). ``rule_files`` (recording/alerting rule files) are
        evaluated every ``scrape_interval`` too. ``target_labels`` gives a target labels of its
        own (as a PodMonitor's relabelings give `node` and `pod`); ``honor_labels`` keeps a
        scraped series' own labels where they clash with those (a PodMonitor's honorLabels).
        Returns once ``/-/ready`` answers 200.
        """
        targets = list(targets)
        if not targets:
            raise ValueError("at least one scrape target (host:port) is required")
        for target in targets:
            if "://" in target or "/" in target:
                raise ValueError(f"scrape target must be host:port, got {target!r}")
        binary = binary or find_prometheus()
        owns = workdir is None
        wd = Path(tempfile.mkdtemp(prefix="prometheus-test-")) if owns else Path(workdir)
        wd.mkdir(parents=True, exist_ok=True)
        (wd / "data").mkdir(exist_ok=True)
        config = wd / "prometheus.yml"
        config.write_text(
            _config_text(targets, job, scrape_interval, rule_files, target_labels, honor_labels)
        )

        last_error: Exception | None = None
        for _attempt in range(3):  # the free port can be taken between probe and bind
            port = free_port()
            log = open(wd / "prometheus.log", "ab")  # noqa: SIM115 - closed with the process
            proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={wd / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                    "--storage.tsdb.retention.time=1h",
                    "--web.enable-lifecycle",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=wd,
            )
            log.close()
            server = cls(proc, port, wd, owns)
            try:
                server._wait_ready(ready_timeout)
                return server
            except Exception as exc:  # noqa: BLE001 - retried, then re-raised
                last_error = exc
                server.stop(remove_workdir=False)
        if owns:
            shutil.rmtree(wd, ignore_errors=True)
        raise PrometheusError(f"Prometheus did not become ready: {last_error}")

    def _wait_ready(self, timeout: float) -> None:
        status = wait_http_ok(self.proc, f"{self.url}/-/ready", timeout)
        if status == "exited":
            raise PrometheusError(
                f"prometheus exited with code {self.proc.returncode}:\n{self.log_tail()}"
            )
        if status == "timeout":
            raise PrometheusError(f"/-/ready not answered within {timeout}s:\n{self.log_tail()}")

    def stop(self, remove_workdir: bool = True) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and remove its temporary directory."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if remove_workdir and self._owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> PrometheusServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])

    # ------------------------------------------------------------------ HTTP API
    def api(self, path: str, params: dict[str, str] | None = None) -> dict[str, Any]:
        """GET ``/api/v1/<path>``; returns the decoded JSON body, error bodies included."""
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                body = resp.read()
        except urllib.error.HTTPError as err:  # 400/422/503 carry a JSON error body
            body = err.read()
            try:
                return json.loads(body)
            except ValueError:
                raise PrometheusError(f"HTTP {err.code} from {url}: {body[:500]!r}") from err
        except (urllib.error.URLError, OSError) as err:
            raise PrometheusError(f"cannot reach {url}: {err}") from err
        return json.loads(body)

    def query_raw(self, expr: str, at: float | None = None) -> dict[str, Any]:
        """Instant query; the full API response (``status``, ``data``, ``error``, ...)."""
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        return self.api("query", params)

    def query(self, expr: str, at: float | None = None) -> list:
        """Instant query; the ``result`` list. Raises :class:`PrometheusError` on an error."""
        body = self.query_raw(expr, at)
        if body.get("status") != "success":
            raise PrometheusError(
                f"query {expr!r} failed: {body.get('errorType')}: {body.get('error')}"
            )
        result = body["data"]["result"]
        if body["data"].get("resultType") in ("scalar", "string"):
            return [result]
        return result

    def wait_for(
        self,
        expr: str,
        predicate: Callable[[list], bool] = bool,
        timeout: float = 30.0,
        interval: float = 0.5,
    ) -> list:
        """Poll ``query(expr)`` until ``predicate(result)`` is true; return that result."""
        deadline = time.monotonic() + timeout
        last: list | Exception | None = None
        while True:
            try:
                last = self.query(expr)
                if predicate(last):
                    return last
            except PrometheusError as exc:
                last = exc
            if self.proc.poll() is not None:
                raise PrometheusError(f"prometheus exited:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{expr!r} did not satisfy the predicate within {timeout}s; last: {last!r}; "
                    f"targets: {self.targets()}"
                )
            time.sleep(interval)

    def targets(self) -> list[dict[str, Any]]:
        """The active scrape targets as reported by ``/api/v1/targets``."""
        body = self.api("targets", {"state": "active"})
        return body.get("data", {}).get("activeTargets", [])

    def rules(self) -> list[dict[str, Any]]:
        """Every loaded rule (with ``health``, ``lastError``, ``state``) from ``/api/v1/rules``."""
        body = self.api("rules")
        return [r for g in body.get("data", {}).get("groups", []) for r in g.get("rules", [])]

    def targets_up(self) -> bool:
        """True when there is at least one active target and every one is ``up``."""
        targets = self.targets()
        return bool(targets) and all(t.get("health") == "up" for t in targets)


def start_prometheus(targets: Iterable[str], **kwargs: Any) -> PrometheusServer:
    """Shorthand for :meth:`PrometheusServer.start`."""
    return PrometheusServer.start(targets, **kwargs)
