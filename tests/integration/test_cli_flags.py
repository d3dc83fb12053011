"""The CLI's port and sidecar flags, run the way an operator runs them: a real sidecar process
(started the documented way, tests/integration/test_operator_paths.py), the CLI as a subprocess.

- a port flag's 0 turns that listener off, for all three listeners, and no port is derived
  from 0 (`--metrics-port 0` once put the query API on port 2);
- with the health endpoint off (docs/usage.md's non-root example), `hangs --live`,
  `doctor --live` and `ready` say so instead of asking port 9465;
- one spelling, `--sidecar URL`, names the sidecar in every command; the old spellings
  (`--api`, `--live URL`, doctor's `--source`) still work and print one deprecation line;
- `doctor --help` shows `--live`; `doctor` says on stderr what it is doing while it imports vLLM;
- Ctrl-C in `query --follow` exits 130 without a traceback, also while it waits for the API;
- `incidents` and `query` tables carry an engine column.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from telemetry.wire import paths
from telemetry.wire.proto import guard_pb2
from tests.integration.test_operator_paths import (
    REPO,
    DocumentedSidecar,
    _env,
    cli,
    rank_streamer,
)
from tests.support.feed import make_streamer, wave_tuple
from tests.support.metrics import value
from tests.support.ports import free_port

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def documented(tmp_path):
    started = []

    def start(*args: str) -> DocumentedSidecar:
        sidecar = DocumentedSidecar(tmp_path, *args)
        started.append(sidecar)
        return sidecar

    yield start
    for sidecar in started:
        sidecar.stop()


def _discovery(sidecar: DocumentedSidecar) -> dict:
    return json.loads(
        (REPO / sidecar.env[paths.RUNTIME_DIR_ENV] / paths.DISCOVERY_NAME).read_text()
    )


def _deprecations(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "is deprecated; use" in line]


# -- ports ------------------------------------------------------------------------------------
def test_metrics_port_zero_is_off_and_no_port_is_derived_from_it(tmp_path):
    """`--metrics-port 0` turns /metrics off, as `--health-port 0` and `--query-port 0` turn
    theirs off; the query API then takes its own default port, never 0 + 2."""
    health = free_port()
    env = _env(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "telemetry.cli", "sidecar", "--metrics-port", "0",
         "--health-host", "127.0.0.1", "--health-port", str(health), "--query-host", "127.0.0.1"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    discovery = tmp_path / "run" / paths.DISCOVERY_NAME
    try:
        deadline = time.monotonic() + 30
        while not discovery.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if proc.poll() is not None:  # the default query port is taken on this host
            out = proc.stdout.read()  # type: ignore[union-attr]
            assert f"cannot serve the query API on 127.0.0.1:{paths.DEFAULT_QUERY_PORT}" in out, out
            return
        facts = json.loads(discovery.read_text())
        assert facts["metrics_url"] == ""  # off: nothing for the CLI to read
        assert facts["query_url"] == f"http://127.0.0.1:{paths.DEFAULT_QUERY_PORT}"
        assert facts["health_url"] == f"http://127.0.0.1:{health}"
    finally:
        proc.terminate()
        proc.wait(20)
    assert paths.query_port(0) == paths.DEFAULT_QUERY_PORT
    assert paths.query_port(9500) == 9502 and paths.query_port(9500, 0) == 0


def test_every_port_flag_refuses_what_is_not_a_port(tmp_path):
    for flag in ("--metrics-port", "--health-port", "--query-port"):
        proc = cli(_env(tmp_path), "sidecar", flag, "70000")
        assert proc.returncode == 2, proc.stderr
        assert f"{flag}: 70000 is not a port; use 1-65535, or 0 to turn it off" in proc.stderr


# -- the health endpoint off ------------------------------------------------------------------
def test_live_commands_say_the_health_endpoint_is_off(documented):
    """docs/usage.md's non-root example runs `--health-port 0`: the on-call commands that need
    the health endpoint say it is off and what to do, rather than asking port 9465."""
    sidecar = documented("--health-port", "0")
    assert _discovery(sidecar)["health_url"] == ""
    for argv in (("hangs", "--live"), ("doctor", "--live")):
        proc = cli(sidecar.env, *argv)
        assert proc.returncode == 2, (argv, proc.stdout, proc.stderr)
        assert "runs with its health endpoint off (--health-port 0)" in proc.stderr, proc.stderr
        assert "restart the sidecar with --health-port PORT" in proc.stderr
        assert str(paths.DEFAULT_HEALTH_PORT) not in proc.stderr.split("default")[0]
        assert "Connection refused" not in proc.stderr
    ready = cli(sidecar.env, "ready", "--engine", "llama")
    assert ready.returncode == 0 and "health endpoint off" in ready.stdout, ready.stdout
    # another sidecar named explicitly is still asked
    other = cli(sidecar.env, "hangs", "--live", "--sidecar", f"http://127.0.0.1:{free_port()}")
    assert other.returncode == 2 and "cannot read" in other.stderr, other.stderr


# -- one way to name the sidecar --------------------------------------------------------------
def test_sidecar_names_the_sidecar_in_every_command_and_old_spellings_warn(documented):
    sidecar = documented()
    health = f"http://127.0.0.1:{sidecar.health_port}"
    query = f"http://127.0.0.1:{sidecar.query_port}"
    streamer = rank_streamer(sidecar.address, "llama", 0)
    streamer.start()
    try:
        sidecar.wait(lambda t: value(t, "ascend_guard_attach_points", status="bound") == 14)
        env = {**sidecar.env, paths.RUNTIME_DIR_ENV: str(REPO / "no-such-dir")}  # no sidecar.json
        new = {
            "hangs": cli(env, "hangs", "--live", "--sidecar", health),
            "hangs (implied --live)": cli(env, "hangs", "--sidecar", health),
            "doctor": cli(env, "doctor", "--live", "--sidecar", health),
            "ready": cli(env, "ready", "--engine", "llama", "--sidecar", health),
            "query": cli(env, "query", "--since", "1h", "--source", "api", "--sidecar", query),
        }
        for name, proc in new.items():
            assert proc.returncode in (0, 1), (name, proc.stdout, proc.stderr)
            assert not _deprecations(proc.stderr), (name, proc.stderr)
        assert "no hang verdict stands" in new["hangs"].stdout
        assert "no hang verdict stands" in new["hangs (implied --live)"].stdout
        assert "llama" in new["doctor"].stdout and new["doctor"].returncode == 0
        assert new["ready"].stdout.startswith("ready:"), new["ready"].stdout
        assert f"reading the sidecar's query API at {query}" in new["query"].stderr

        old = {
            "hangs --live URL": (cli(env, "hangs", "--live", health), "--live --sidecar URL"),
            "doctor --live URL": (cli(env, "doctor", "--live", health), "--live --sidecar URL"),
            "query --api URL": (
                cli(env, "query", "--since", "1h", "--source", "api", "--api", query),
                "--sidecar URL",
            ),
        }
        for name, (proc, use) in old.items():
            assert proc.returncode == new[name.split()[0]].returncode, (name, proc.stderr)
            assert proc.stdout == new[name.split()[0]].stdout or name.startswith("query")
            lines = _deprecations(proc.stderr)
            assert len(lines) == 1 and lines[0].endswith(f"use {use}"), (name, proc.stderr)
        # --sidecar given the health endpoint where the query API is wanted: says which is which
        wrong = cli(env, "query", "--since", "1h", "--source", "api", "--sidecar", health)
        assert wrong.returncode == 2 and "not its health endpoint" in wrong.stderr, wrong.stderr
    finally:
        streamer.stop()


def test_doctor_help_shows_live_and_source_has_one_meaning(tmp_path):
    help_text = cli(dict(os.environ, COLUMNS="200"), "doctor", "--help").stdout
    flat = " ".join(help_text.split())
    assert "--live" in flat and "--sidecar URL" in flat and "--source-tree PATH" in flat, flat
    live_help = " ".join(cli(dict(os.environ), "doctor", "--live", "--help").stdout.split())
    assert "--sidecar URL" in live_help and "--expect-local" in live_help
    tree = tmp_path / "empty-tree"
    tree.mkdir()
    new = cli(dict(os.environ), "doctor", "--source-tree", str(tree), "--json")
    old = cli(dict(os.environ), "doctor", "--source", str(tree), "--json")
    assert new.returncode == old.returncode and new.stdout == old.stdout, (new.stderr, old.stderr)
    assert not _deprecations(new.stderr)
    (line,) = _deprecations(old.stderr)
    assert line == "ascend-guard doctor: --source PATH is deprecated; use --source-tree PATH"


def test_doctor_says_what_it_does_while_it_imports_vllm():
    """`doctor` imports torch and vLLM (seconds): its first stderr line comes before it ends."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "telemetry.cli", "doctor"], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        first = proc.stderr.readline()  # type: ignore[union-attr]
        running = proc.poll() is None
        out, _ = proc.communicate(timeout=170)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert first.startswith("ascend-guard doctor: importing torch and vLLM"), first
    assert running, "the progress line came only once doctor had finished"
    assert "attach points" in out


# -- Ctrl-C -----------------------------------------------------------------------------------
def test_ctrl_c_in_query_follow_exits_130_without_a_traceback_while_it_waits_for_the_api():
    """A query API that accepts the connection and never answers (a starved sidecar): Ctrl-C
    during the check of /api/echo stops the command quietly."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # never accepted: the client's request waits for an answer
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "telemetry.cli", "query", "--follow", "--source", "api",
         "--sidecar", url],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        time.sleep(3.0)  # started, parsed, waiting in the echo
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
    finally:
        silent.close()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


# -- engine columns ---------------------------------------------------------------------------
def test_incidents_and_query_tables_name_the_engine(documented):
    """A DaemonSet sidecar serves several engines whose ranks share coordinates: without an
    engine column, their rows read alike."""
    sidecar = documented()
    streamers = []
    for engine, pid in (("llama", 6101), ("qwen-7b", 6102)):
        s = make_streamer(sidecar.address, engine=engine, run_id=f"run-{engine}", pid=pid)
        streamers.append(s)
        s.start()
        for wave in range(1, 4):
            s.offer(wave_tuple(wave, execute_ns=6_000_000))
        s.offer_incident(
            guard_pb2.Incident(
                schema_version=1,
                id=f"inc-{engine}",
                type="logits_finite",
                severity="critical",
                wave=2,
                time_unix_nano=time.time_ns(),
                summary=f"NaN logits on {engine}",
            )  # fmt: skip
        )
    try:
        sidecar.wait(
            lambda t: all(
                value(t, "ascend_guard_incidents_total", engine=e) == 1
                for e in ("llama", "qwen-7b")
            )
        )
        time.sleep(1.0)  # spans reach the store in the exporter's next batch
        incidents = cli(sidecar.env, "incidents", "--since", "1h")
        assert incidents.returncode == 0, incidents.stderr
        header, *rows = incidents.stdout.splitlines()
        assert header.split()[:5] == ["time", "(UTC)", "type", "severity", "engine"], header
        engines = {row.split()[3] for row in rows if "logits_finite" in row}
        assert engines == {"llama", "qwen-7b"}, incidents.stdout
        for argv in (
            ("query", "--since", "1h", "--name", "execute_model", "--min-duration", "5ms"),
            ("query", '{ name = "execute_model" }', "--since", "1h"),
        ):
            proc = cli(sidecar.env, *argv)
            assert proc.returncode == 0, (argv, proc.stderr)
            header, _, *rows = proc.stdout.splitlines()
            assert "engine" in header.split(), header
            column = header.split().index("engine") - 1  # "start (UTC)" is two words
            got = {row.split()[column] for row in rows if row[:2].isdigit()}
            assert {"llama", "qwen-7b"} <= got, proc.stdout
    finally:
        for s in streamers:
            s.stop()
