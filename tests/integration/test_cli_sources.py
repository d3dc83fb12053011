"""`ascend-guard query` and `trace` read through a real sidecar's query API or straight from its
store file, and print the same rows either way; `query --follow` tails what a real sidecar
stores while real workers stream to it over gRPC.

Real processes and transports throughout: the sidecar is `python -m telemetry.cli sidecar`, the
records come from the real worker-side streamer over its gRPC socket, the API is real HTTP, and
the followers are CLI subprocesses stopped with SIGINT, as Ctrl-C stops them.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from telemetry.cli import main as cli
from telemetry.cli.source import ApiSource, StoreSource
from telemetry.spans.query import load_trace
from telemetry.store import connect
from telemetry.store.incidents import IncidentFilter, list_incidents
from telemetry.wire import paths
from telemetry.wire.trace_ids import format_trace_id, wave_trace_id
from tests.support.certs import TestCA
from tests.support.collective_feed import _filler as collective_filler
from tests.support.feed import FillWith, attach_reporter, make_streamer, wave_tuple
from tests.support.ports import free_port
from tests.support.sidecar import SidecarProcess

REPO = Path(__file__).resolve().parents[2]
SLOW_WAVE, SLOW_TP = 7, 1
pytestmark = pytest.mark.timeout(120)


def _feed(address: str) -> None:
    """tp0 and tp1 of run-cli send 30 waves (wave 7 slow on tp1, with two incidents), and
    run-coll's two ranks 12 waves with their collectives (a straggler in wave 5)."""
    streamers = []
    for tp in (0, 1):
        streamer = make_streamer(
            address, engine="eng", rank=(0, tp, 0), run_id="run-cli", pid=7000 + tp
        )
        for n in range(1, 31):
            slow = n == SLOW_WAVE and tp == SLOW_TP
            streamer.offer(wave_tuple(n, execute_ns=80_000_000 if slow else 2_000_000))
        if tp == SLOW_TP:  # and it reports incidents in that wave, as its detectors would
            reporter = attach_reporter(streamer, "run-cli", wave=SLOW_WAVE)
            reporter.report("logits_finite", "error", "nan row", request_id="req-1")
            reporter.report("token_repeat", "warning", "loop", request_id="req-2")
        # run-coll's ranks send their collectives with their waves, as a worker does
        colls = make_streamer(
            address, engine="coll", rank=(0, tp, 0), run_id="run-coll", pid=7200 + tp
        )
        colls.fillers.append(FillWith(collective_filler(tp, 12, 5, 1, 0.05)))
        for n in range(1, 13):
            colls.offer(wave_tuple(n))
        streamers += [streamer, colls]
    for streamer in streamers:
        streamer.start()
    deadline = time.monotonic() + 15
    while any(s.sent_waves < 12 for s in streamers) or streamers[0].sent_waves < 30:
        assert time.monotonic() < deadline, "waves not sent"
        time.sleep(0.02)
    time.sleep(0.3)
    for streamer in streamers:
        streamer.stop()


def _wait_stored(store_path: Path) -> None:
    deadline = time.monotonic() + 20
    slow = format_trace_id(wave_trace_id("run-cli", SLOW_WAVE, 0))
    while True:
        try:
            conn = connect(store_path, readonly=True)
            last = format_trace_id(wave_trace_id("run-cli", 30, 0))
            ready = (
                len(load_trace(conn, slow)) >= 7
                and len(load_trace(conn, last)) >= 7
                and len(list_incidents(conn, IncidentFilter(since_ns=0, limit=100))) >= 2
            )
            conn.close()
        except FileNotFoundError:
            ready = False
        if ready:
            return
        assert time.monotonic() < deadline, "the records did not reach the store"
        time.sleep(0.1)


class Fed:
    def __init__(self, sidecar: SidecarProcess, port: int) -> None:
        self.sidecar, self.url = sidecar, f"http://127.0.0.1:{port}"
        self.store = str(sidecar.store_path)


@pytest.fixture(scope="module")
def fed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli-sources")
    port = free_port()
    sidecar = SidecarProcess.start(tmp, extra_args=("--query-port", str(port)))
    try:
        _feed(sidecar.address)
        _wait_stored(sidecar.store_path)
        yield Fed(sidecar, port)
    finally:
        sidecar.stop()


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


SLOW = format_trace_id(wave_trace_id("run-cli", SLOW_WAVE, 0))
CASES = [
    ["query", "{ .tp = 1 && duration > 50ms }"],
    ["query", '{ .op = "all_reduce" } | by(.tp)', "--limit", "5"],
    ["query", '{ name = "rank" } >> { name = "execute_model" }', "--limit", "3", "--spss", "2"],
    ["query", '{ name =~ "incident:.*" }', "--json"],
    ["query", "{ .tp = 1 }", "--tree", "--limit", "2"],
    ["query", "--min-duration", "1ms", "--limit", "50"],
    ["query", "--rank", "tp=1", "--sort", "start", "--json"],
    ["query", "--name", "wave", "--engine", "eng", "--sort", "wave", "--limit", "5"],
    ["query", "--spans", '{ .op = "all_reduce" }', "--limit", "30"],
    ["query", "--spans", "{ }", "--tree", "--limit", "4"],
    ["trace", SLOW],
    ["trace", format_trace_id(wave_trace_id("run-coll", 5, 0))],
    ["trace", format_trace_id(wave_trace_id("run-cli", 30, 0))],
]


@pytest.mark.parametrize("argv", CASES, ids=[" ".join(c) for c in CASES])
def test_both_sources_print_the_same_rows(fed, capsys, argv):
    code_s, out_s, err_s = run(capsys, *argv, "--source", "store", "--store", fed.store)
    code_a, out_a, err_a = run(capsys, *argv, "--source", "api", "--sidecar", fed.url)
    assert code_s == code_a == 0, (err_s, err_a)
    assert f"reading the store file {fed.store}" in err_s
    assert f"reading the sidecar's query API at {fed.url}" in err_a
    assert out_s.replace(f" --store {fed.store}", "") == out_a
    rows = [line for line in out_s.splitlines() if line.strip()]
    assert rows, out_s  # something was found: the comparison proves something
    assert "no trace matches" not in out_s and "no spans match" not in out_s


def test_the_slow_rank_is_what_the_flags_and_traceql_find(fed, capsys):
    """The old flag form and its TraceQL find tp1 in wave 7 first, through the API."""
    code, out, _ = run(capsys, "query", "--min-duration", "50ms", "--sidecar", fed.url)
    assert code == 0
    rows = [line for line in out.splitlines() if line.endswith(SLOW) and line[:2].isdigit()]
    assert len(rows) == 2 and "2 span(s)" in out, out  # tp1's rank and execute_model spans
    assert all("dp0 tp1 pp0" in line for line in rows), out
    assert "as TraceQL: ascend-guard query --spans '{" in out
    code, out, _ = run(capsys, "query", "{ .tp = 1 && duration > 50ms }", "--sidecar", fed.url)
    assert code == 0 and SLOW in out and "1 trace(s)" in out, out


def test_each_source_decodes_every_trace_the_same(fed):
    """Field by field: spans from /api/traces/<id> (OTLP protobuf) equal the store's, and the
    API's search and span list equal the store source's."""
    api, store = ApiSource(fed.url, None, None), StoreSource(fed.store)
    now = int(time.time()) + 1
    hits = store.search("{ }", now - 3600, now, 200, 3)
    assert len(hits) > 40 and hits == api.search("{ }", now - 3600, now, 200, 3)
    for hit in hits:
        assert api.trace(hit["traceID"]) == store.trace(hit["traceID"]), hit["traceID"]
    for sort in ("duration", "start", "wave"):
        spans = store.spans("{ .tp = 1 }", now - 3600, now, sort, 500)
        assert len(spans) > 100 and spans == api.spans("{ .tp = 1 }", now - 3600, now, sort, 500)
    conn = connect(fed.store, readonly=True)
    slow = api.trace(SLOW)
    assert slow == load_trace(conn, SLOW)
    assert {s.name for s in slow} >= {"incident:logits_finite", "incident:token_repeat", "wave"}
    assert api.trace("0" * 31 + "1") == []


def test_auto_reads_the_local_sidecars_api_and_falls_back_to_the_store(fed, capsys, monkeypatch):
    monkeypatch.setenv(paths.RUNTIME_DIR_ENV, str(fed.sidecar.store_path.parent))  # sidecar.json
    monkeypatch.delenv(paths.STORE_ENV, raising=False)
    code, via_api, err = run(capsys, "query", "{ .tp = 1 && duration > 50ms }")
    assert code == 0 and f"reading the sidecar's query API at {fed.url}" in err, err
    dead = f"http://127.0.0.1:{free_port()}"
    code, via_store, err = run(capsys, "query", "{ .tp = 1 && duration > 50ms }", "--sidecar", dead)
    assert code == 0, err
    assert f"the sidecar's query API does not answer (cannot read {dead}" in err
    assert f"reading the store file {fed.store} directly" in err
    assert via_store.replace(f" --store {fed.store}", "") == via_api
    code, _, err = run(capsys, "trace", SLOW, "--source", "api", "--sidecar", dead)
    assert code == 2 and "query API does not answer" in err and dead in err
    code, out, err = run(capsys, "query", "{ duration > 1h }")
    assert code == 0 and "no trace matches in" in out and "widen --since" in out
    assert fed.url in out


def test_a_protected_https_api_needs_its_ca_and_token(tmp_path, capsys, monkeypatch):
    """A sidecar with TLS and a token: sidecar.json says https; without the token `auto` says
    what was refused and reads the store file; with --ca-file and --token-file it reads the API."""
    ca = TestCA(tmp_path / "ca")
    server = ca.issue("server", server=True)
    token = tmp_path / "token"
    token.write_text("cli-sources-token\n")
    port, store = free_port(), tmp_path / "store.db"
    log = tmp_path / "sidecar.log"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "telemetry.cli",
            "sidecar",
            "--listen",
            f"127.0.0.1:{free_port()}",
            "--metrics-host",
            "127.0.0.1",
            "--metrics-port",
            str(free_port()),
            "--health-port",
            "0",
            "--query-port",
            str(port),
            "--query-host",
            "127.0.0.1",
            "--store",
            str(store),
            "--tls-cert",
            str(server.cert),
            "--tls-key",
            str(server.key),
            "--token-file",
            str(token),
        ],
        cwd=REPO,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env={**os.environ, paths.RUNTIME_DIR_ENV: str(tmp_path)},
    )
    try:
        deadline = time.monotonic() + 20
        while "sidecar_ready" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        monkeypatch.setenv(paths.RUNTIME_DIR_ENV, str(tmp_path))
        monkeypatch.delenv(paths.STORE_ENV, raising=False)
        url = f"https://127.0.0.1:{port}"
        assert paths.cli_query_url() == url
        code, _, err = run(capsys, "query", "{ }", "--ca-file", str(ca.cert))
        assert code == 0 and "answered 401" in err and "--token-file" in err, err
        assert f"reading the store file {store} directly" in err
        code, out, err = run(
            capsys,
            "query",
            "{ }",
            "--ca-file",
            str(ca.cert),
            "--token-file",
            str(token),
            "--source",
            "api",
        )
        assert code == 0 and f"reading the sidecar's query API at {url}" in err, err
        assert "no trace matches" in out
        code, _, err = run(capsys, "query", "{ }", "--source", "api", "--token-file", str(token))
        assert code == 2 and "CERTIFICATE_VERIFY_FAILED" in err, err
    finally:
        proc.terminate()
        proc.wait(15)


# -- --follow ---------------------------------------------------------------------------------
def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Follower:
    """`ascend-guard query ... --follow` as a subprocess, its stdout lines read as they come."""

    def __init__(self, *argv: str) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "telemetry.cli",
                "query",
                *argv,
                "--follow",
                "--interval",
                "0.2s",
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            # Ctrl-C's default in the child, whatever this process inherited: a test run
            # started in the background of a script (`cmd &`, nohup) ignores SIGINT, its
            # children inherit that, and Python then installs no KeyboardInterrupt handler
            # (a fresh-clone run started so waited 20 s here for a follower that never stopped)
            preexec_fn=_default_sigint,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def wait_lines(self, keep, count: int, timeout: float = 30.0) -> list[str]:
        deadline = time.monotonic() + timeout
        while len([line for line in self.seen if keep(line)]) < count:
            left = deadline - time.monotonic()
            assert left > 0, f"saw {self.seen}; stderr so far: {self._stderr_now()}"
            try:
                self.seen.append(self.lines.get(timeout=min(left, 0.5)))
            except queue.Empty:
                assert self.proc.poll() is None, self.proc.stderr.read()  # type: ignore[union-attr]
        return [line for line in self.seen if keep(line)]

    def _stderr_now(self) -> str:
        return "(running)" if self.proc.poll() is None else self.proc.stderr.read()  # type: ignore[union-attr]

    def interrupt(self) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGINT)
        _, err = self.proc.communicate(timeout=20)
        return self.proc.returncode, err


def is_row(line: str) -> bool:
    return line[:2].isdigit() and " rank " in line


def test_follow_prints_new_traces_as_they_are_stored_until_ctrl_c(tmp_path):
    port = free_port()
    sidecar = SidecarProcess.start(tmp_path, extra_args=("--query-port", str(port)))
    url = f"http://127.0.0.1:{port}"
    as_json = Follower(
        '{ name = "rank" && .tp = 1 }', "--json", "--source", "api", "--sidecar", url
    )
    table = Follower("--rank", "tp=1", "--name", "rank", "--store", str(sidecar.store_path))
    streamers = [
        make_streamer(
            sidecar.address, engine="live", rank=(0, tp, 0), run_id="run-live", pid=7100 + tp
        )
        for tp in (0, 1)
    ]
    try:
        header = table.wait_lines(lambda line: line.startswith("start (UTC)"), 1)
        assert header[0].split()[:3] == ["start", "(UTC)", "wave"]
        for streamer in streamers:
            streamer.start()
        for first, last in ((1, 5), (6, 10)):  # two rounds: the second arrives while they tail
            for n in range(first, last + 1):
                for streamer in streamers:
                    streamer.offer(wave_tuple(n))
            got = as_json.wait_lines(lambda line: line.startswith("{"), last)
            rows = table.wait_lines(is_row, last)
        ids = [json.loads(line)["traceID"] for line in got]
        assert ids == [format_trace_id(wave_trace_id("run-live", n, 0)) for n in range(1, 11)]
        assert [int(row.split()[1]) for row in rows] == list(range(1, 11))
        assert all("dp0 tp1 pp0" in row for row in rows)
        time.sleep(1.0)  # more polls: nothing is printed twice
        code, err = as_json.interrupt()
        assert code == 130 and "Traceback" not in err, err  # Ctrl-C: quiet, the SIGINT status
        assert f"reading the sidecar's query API at {url}" in err
        assert len([line for line in as_json.seen if line.startswith("{")]) == 10
        code, err = table.interrupt()
        assert code == 130 and "reading the store file" in err, err
        left = [table.lines.get() for _ in range(table.lines.qsize())]
        assert not [line for line in left if is_row(line)], left
    finally:
        for streamer in streamers:
            streamer.stop()
        for follower in (as_json, table):
            if follower.proc.poll() is None:
                follower.proc.kill()
        sidecar.stop()


def test_auto_falls_back_when_the_api_fails_after_its_echo(fed, capsys, monkeypatch):
    """A sidecar older than this CLI answers /api/echo but has no span list (404), and a trace
    request that fails with a 500: `auto` says so and reads the store file; `api` exits 2.
    (An http.server stand-in plays that old sidecar: no released sidecar lacks the route.)"""
    import http.server

    class Old(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            code, body = (200, b"echo\n") if self.path == "/api/echo" else (404, b"unknown path")
            if self.path.startswith("/api/traces/"):
                code, body = 500, b"internal error"
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            return

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Old)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    old = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv(paths.STORE_ENV, fed.store)
    try:
        code, out, err = run(capsys, "query", "--min-duration", "50ms", "--sidecar", old)
        assert code == 0 and "the sidecar is older than this CLI" in err, err
        assert f"reading the store file {fed.store} directly" in err and SLOW in out
        code, out, err = run(capsys, "trace", SLOW, "--sidecar", old)
        assert code == 0 and "answered 500" in err and "rank dp0 tp1 pp0" in out, err
        code, _, err = run(
            capsys, "query", "--min-duration", "50ms", "--sidecar", old, "--source", "api"
        )
        assert code == 2 and "older than this CLI" in err
    finally:
        server.shutdown()
