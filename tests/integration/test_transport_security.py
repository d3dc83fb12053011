"""Transport security of a real sidecar process: the refusal to listen off loopback with
neither TLS nor a token, bearer tokens on gRPC (UNAUTHENTICATED) and HTTP (401), TLS and mTLS
with a CA this test makes itself (tests/support/certs.py), and the real worker-side streamer
reaching a sidecar through each."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from guard.stream.streamer import Streamer
from telemetry.wire import paths
from telemetry.wire.proto import guard_pb2
from telemetry.wire.transport import ClientSecurity
from tests.support.certs import TestCA
from tests.support.feed import make_streamer, wave_tuple
from tests.support.metrics import value
from tests.support.ports import free_port

REPO = Path(__file__).resolve().parents[2]
METHOD = "/ascend_guard.v1.GuardIngest/Stream"
TOKEN = "s3cret-token-for-tests"
pytestmark = pytest.mark.timeout(90)


class Sidecar:
    """A sidecar on 127.0.0.1 TCP with the given security flags, ready once it logs so."""

    def __init__(self, tmp: Path, *flags: str, listen_host: str = "127.0.0.1") -> None:
        self.port, self.metrics_port, self.health_port = free_port(), free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = tmp / f"sidecar-{self.port}.log"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "telemetry.cli",
                "sidecar",
                "--listen",
                f"{listen_host}:{self.port}",
                "--metrics-host",
                "127.0.0.1",
                "--metrics-port",
                str(self.metrics_port),
                "--health-host",
                "127.0.0.1",
                "--health-port",
                str(self.health_port),
                "--store",
                str(tmp / f"store-{self.port}.db"),
                *flags,
            ],
            cwd=REPO,
            stdout=self.log_path.open("w"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 20
        while "sidecar_ready" not in self.log():
            assert self.proc.poll() is None, self.log()
            assert time.monotonic() < deadline, self.log()
            time.sleep(0.05)

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
def started(tmp_path):
    running = []

    def start(*flags: str, **kw) -> Sidecar:
        running.append(Sidecar(tmp_path, *flags, **kw))
        return running[-1]

    yield start
    for sidecar in running:
        sidecar.stop()


@pytest.fixture(scope="module")
def ca(tmp_path_factory):
    authority = TestCA(tmp_path_factory.mktemp("ca"))
    authority.server = authority.issue("server", server=True)
    authority.client = authority.issue("client", server=False)
    other = TestCA(tmp_path_factory.mktemp("other-ca"), name="someone else's CA")
    authority.stranger = other.issue("stranger", server=False)
    return authority


def token_file(tmp_path: Path, token: str = TOKEN) -> str:
    path = tmp_path / "token"
    path.write_text(token + "\n")
    path.chmod(0o600)
    return str(path)


def one_batch() -> bytes:
    rank = guard_pb2.RankInfo(
        run_id="run-sec", engine="sec", tp_size=1, dp_size=1, pp_size=1, node="n", pid=5
    )
    batch = guard_pb2.Batch(rank=rank)
    batch.waves.add(**wave_tuple(1)._asdict())
    return batch.SerializeToString()


def call(channel: grpc.Channel, metadata=None) -> guard_pb2.Ack:
    stub = channel.stream_unary(
        METHOD, request_serializer=lambda b: b, response_deserializer=guard_pb2.Ack.FromString
    )
    return stub(iter([one_batch()]), metadata=metadata, timeout=10)


def http(url: str, token: str | None = None, context: ssl.SSLContext | None = None):
    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=5, context=context) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def client_context(ca: TestCA, cert=None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca.cert))
    if cert is not None:
        context.load_cert_chain(str(cert.cert), str(cert.key))
    return context


def stream_waves(streamer: Streamer, waves: int = 5) -> Streamer:
    for n in range(1, waves + 1):
        streamer.offer(wave_tuple(n))
    streamer.start()
    return streamer


def test_a_non_loopback_listener_without_tls_or_token_refuses_to_start(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "telemetry.cli",
            "sidecar",
            "--listen",
            f"0.0.0.0:{free_port()}",
            "--metrics-host",
            "127.0.0.1",
            "--metrics-port",
            str(free_port()),
            "--health-port",
            "0",
            "--store",
            str(tmp_path / "s.db"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 1
    assert "0.0.0.0, which is not a loopback address, with neither TLS nor a token" in out.stderr


def test_a_non_loopback_listener_with_a_token_starts(started, tmp_path):
    sidecar = started("--token-file", token_file(tmp_path), listen_host="0.0.0.0")
    with grpc.insecure_channel(sidecar.address) as channel:
        assert call(channel, metadata=(("authorization", f"Bearer {TOKEN}"),)).waves == 1


def test_grpc_without_or_with_a_wrong_token_is_unauthenticated(started, tmp_path):
    sidecar = started("--token-file", token_file(tmp_path))
    with grpc.insecure_channel(sidecar.address) as channel:
        for metadata in (None, (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)):
            with pytest.raises(grpc.RpcError) as info:
                call(channel, metadata=metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
            assert "bearer token" in info.value.details()
        assert call(channel, metadata=(("authorization", f"Bearer {TOKEN}"),)).waves == 1
    status, text = http(f"http://127.0.0.1:{sidecar.metrics_port}/metrics", TOKEN)
    assert status == 200
    assert value(text, "ascend_guard_auth_refused_total", listener="grpc") == 3
    assert value(text, "ascend_guard_waves_total", engine="sec") == 1


def test_the_worker_streamer_sends_its_token(started, tmp_path):
    sidecar = started("--token-file", token_file(tmp_path))
    streamer = make_streamer(sidecar.address, engine="tok")
    streamer._security = ClientSecurity.from_files(token_file=token_file(tmp_path))
    stream_waves(streamer)
    deadline = time.monotonic() + 15
    url = f"http://127.0.0.1:{sidecar.metrics_port}/metrics"
    while value(http(url, TOKEN)[1], "ascend_guard_waves_total", engine="tok") < 5:
        assert time.monotonic() < deadline, sidecar.log()
        time.sleep(0.1)
    streamer.stop()


def test_http_without_or_with_a_wrong_token_is_401(started, tmp_path):
    sidecar = started("--token-file", token_file(tmp_path))
    live = f"http://127.0.0.1:{sidecar.health_port}"
    metrics = f"http://127.0.0.1:{sidecar.metrics_port}/metrics"
    for url in (f"{live}/live", f"{live}/hangs", metrics):
        assert http(url)[0] == 401, url
        assert http(url, "wrong")[0] == 401, url
        assert http(url, TOKEN)[0] == 200, url
    assert json.loads(http(f"{live}/live", TOKEN)[1]) == {"engines": []}
    text = http(metrics, TOKEN)[1]
    assert value(text, "ascend_guard_auth_refused_total", listener="http") == 4
    assert value(text, "ascend_guard_auth_refused_total", listener="metrics") == 2


def test_metrics_open_leaves_only_metrics_open(started, tmp_path):
    sidecar = started("--token-file", token_file(tmp_path), "--metrics-open")
    assert http(f"http://127.0.0.1:{sidecar.metrics_port}/metrics")[0] == 200
    assert http(f"http://127.0.0.1:{sidecar.health_port}/live")[0] == 401


def test_tls_serves_grpc_and_http_with_the_test_ca(started, ca):
    sidecar = started("--tls-cert", str(ca.server.cert), "--tls-key", str(ca.server.key))
    with grpc.insecure_channel(sidecar.address) as plain:
        with pytest.raises(grpc.RpcError) as info:
            call(plain)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    security = ClientSecurity.from_files(ca_file=str(ca.cert), server_name="localhost")
    with security.channel(sidecar.address) as channel:
        assert call(channel).waves == 1
    streamer = make_streamer(sidecar.address, engine="tls")
    streamer._security = security
    stream_waves(streamer)
    context = client_context(ca)
    url = f"https://localhost:{sidecar.metrics_port}/metrics"
    deadline = time.monotonic() + 15
    while value(http(url, context=context)[1], "ascend_guard_waves_total", engine="tls") < 5:
        assert time.monotonic() < deadline, sidecar.log()
        time.sleep(0.1)
    streamer.stop()
    assert http(f"https://localhost:{sidecar.health_port}/live", context=context)[0] == 200
    with pytest.raises(urllib.error.URLError):  # plain HTTP to a TLS port, or no CA
        http(f"https://localhost:{sidecar.health_port}/live", context=ssl.create_default_context())


def test_mtls_requires_a_client_certificate_from_the_ca(started, ca):
    sidecar = started(
        "--tls-cert",
        str(ca.server.cert),
        "--tls-key",
        str(ca.server.key),
        "--tls-client-ca",
        str(ca.cert),
    )
    files = {"ca_file": str(ca.cert), "server_name": "localhost"}
    for who in (None, ca.stranger):
        security = ClientSecurity.from_files(
            **files, **({"cert_file": str(who.cert), "key_file": str(who.key)} if who else {})
        )
        with security.channel(sidecar.address) as channel:
            with pytest.raises(grpc.RpcError) as info:
                call(channel)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, who
    mine = ClientSecurity.from_files(
        **files, cert_file=str(ca.client.cert), key_file=str(ca.client.key)
    )
    with mine.channel(sidecar.address) as channel:
        assert call(channel).waves == 1
    live = f"https://localhost:{sidecar.health_port}/live"
    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
        http(live, context=client_context(ca))
    assert http(live, context=client_context(ca, ca.client))[0] == 200


def test_bad_security_flags_are_named(tmp_path, ca):
    base = [
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
        "--store",
        str(tmp_path / "s.db"),
    ]
    for flags, message in (
        (["--tls-cert", str(ca.server.cert)], "--tls-cert and --tls-key go together"),
        (["--tls-client-ca", str(ca.cert)], "--tls-client-ca needs --tls-cert"),
        (["--token-file", str(tmp_path / "missing")], "cannot read it"),
    ):
        out = subprocess.run(base + flags, cwd=REPO, capture_output=True, text=True, timeout=30)
        assert out.returncode == 1 and message in out.stderr, (flags, out.stderr)


def test_the_worker_config_names_an_unusable_transport_file(tmp_path):
    from guard.config.runtime_guard import GuardConfigError, parse_config

    with pytest.raises(GuardConfigError, match="runtime_guard.transport: token_file .*missing"):
        parse_config({"transport": {"token_file": str(tmp_path / "missing")}})
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(GuardConfigError, match="the file is empty"):
        parse_config({"transport": {"token_file": str(empty)}})
    assert parse_config({"transport": {"token_file": token_file(tmp_path)}}).transport.token_file


def test_the_cli_sends_the_token_to_a_protected_sidecar(started, tmp_path):
    """`hangs --live`, `doctor --live` and `ready` against a sidecar that wants a token: without
    it each says it was refused and what to do; with `--token-file` (or its env) each reads."""
    sidecar = started("--token-file", token_file(tmp_path))
    live = f"http://127.0.0.1:{sidecar.health_port}"

    def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        environ = {k: v for k, v in os.environ.items() if k != paths.TOKEN_FILE_ENV}
        return subprocess.run(
            [sys.executable, "-m", "telemetry.cli", *args],
            env={**environ, **(env or {})}, capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    refused = cli("hangs", "--live", "--sidecar", live)
    assert refused.returncode == 2 and "answered 401" in refused.stderr, refused
    assert "--token-file" in refused.stderr
    with_token = cli("hangs", "--live", "--sidecar", live, "--token-file", token_file(tmp_path))
    assert with_token.returncode == 0, with_token
    assert "no hang verdict stands" in with_token.stdout

    doctor = cli("doctor", "--live", "--sidecar", live)
    assert doctor.returncode == 2 and "answered 401" in doctor.stderr, doctor
    doctor = cli(
        "doctor", "--live", "--sidecar", live, env={paths.TOKEN_FILE_ENV: token_file(tmp_path)}
    )
    assert "answered 401" not in doctor.stdout + doctor.stderr, doctor
    assert "no rank connected" in doctor.stdout, doctor

    ready = cli("ready", "--engine", "e", "--sidecar", live)
    assert ready.returncode == 0 and "refused the probe with 401" in ready.stdout, ready
    ready = cli("ready", "--engine", "e", "--sidecar", live, "--token-file", token_file(tmp_path))
    assert ready.returncode == 0 and ready.stdout.startswith("ready: "), ready
    bad = cli("ready", "--engine", "e", "--sidecar", live, "--token-file", str(tmp_path / "none"))
    assert "--token-file" in bad.stdout and "cannot read it" in bad.stdout, bad
