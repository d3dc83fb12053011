"""Transport security of the sidecar's listeners: TLS (optionally mutual), a bearer token, and
the rule that a TCP listener off the loopback interface has at least one of them.

- gRPC ingest: `grpc.ssl_server_credentials` (with `require_client_auth` when a client CA is
  given) and `TokenInterceptor`, which answers UNAUTHENTICATED to a call whose
  `authorization` metadata is not `Bearer <token>`.
- HTTP (`/metrics`, `/live`, `/hangs`, `/skew`): the same certificate through an
  `ssl.SSLContext`, and the same token (401 without it). `/metrics` may be left open to
  Prometheus by an explicit `--metrics-open`.
- The worker side (`ClientSecurity`) reads the token from the file named in its config and
  builds the channel: TLS when a CA is configured, the token as call metadata.

Tokens are compared in constant time (`hmac.compare_digest`). A token file is read once at
start; whitespace around the token is ignored.
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import ssl
from collections.abc import Callable
from typing import Any

import grpc
import structlog

log = structlog.get_logger("ascend_guard.transport")

TOKEN_HEADER = "authorization"


class TransportConfigError(ValueError):
    """A security setting cannot be used; the message says which and why."""


def read_secret(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError as exc:
        raise TransportConfigError(f"{what} {path}: cannot read it ({exc.strerror})") from exc
    if not data.strip():
        raise TransportConfigError(f"{what} {path}: the file is empty")
    return data


def read_token(path: str, what: str = "token file") -> str:
    token = read_secret(path, what).decode("utf-8", errors="strict").strip()
    if any(c.isspace() for c in token) or not token.isprintable():
        raise TransportConfigError(f"{what} {path}: the token must be one printable word")
    return token


@dataclasses.dataclass(frozen=True)
class ServerSecurity:
    """What the sidecar's listeners require. Empty strings: off."""

    tls_cert: str = ""  # PEM certificate chain
    tls_key: str = ""  # PEM private key
    tls_client_ca: str = ""  # PEM CA bundle: clients must present a certificate it signed
    token_file: str = ""
    metrics_open: bool = False  # /metrics without the token (for Prometheus)

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    def problem(self) -> str | None:
        if bool(self.tls_cert) != bool(self.tls_key):
            return "--tls-cert and --tls-key go together"
        if self.tls_client_ca and not self.tls_cert:
            return "--tls-client-ca needs --tls-cert and --tls-key (mTLS is TLS first)"
        return None

    def token(self) -> str | None:
        return read_token(self.token_file) if self.token_file else None


def is_loopback_host(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


def tcp_host(address: str) -> str | None:
    """The host of a HOST:PORT gRPC address; None for unix sockets."""
    if address.startswith("unix:"):
        return None
    return address.rsplit(":", 1)[0]


def exposure_problem(what: str, host: str, security: ServerSecurity, *, open_ok: bool = False):
    """Why a listener on `host` may not start as configured, or None."""
    if open_ok or is_loopback_host(host) or security.tls or security.token_file:
        return None
    return (
        f"{what} would listen on {host}, which is not a loopback address, with neither TLS "
        "nor a token; give --tls-cert/--tls-key and/or --token-file, or listen on 127.0.0.1"
    )


def grpc_server_credentials(security: ServerSecurity) -> grpc.ServerCredentials:
    key = read_secret(security.tls_key, "--tls-key")
    cert = read_secret(security.tls_cert, "--tls-cert")
    ca = read_secret(security.tls_client_ca, "--tls-client-ca") if security.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )


def http_ssl_context(security: ServerSecurity) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(security.tls_cert, security.tls_key)
        if security.tls_client_ca:
            context.load_verify_locations(security.tls_client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as exc:
        raise TransportConfigError(f"TLS certificate or key unusable: {exc}") from exc
    return context


def token_matches(header: str | None, token: str) -> bool:
    """`header` is the whole `Authorization` value: `Bearer <token>`."""
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer ") :].encode(), token.encode())


class TokenInterceptor(grpc.ServerInterceptor):
    """Lets a call through only with `authorization: Bearer <token>` in its metadata."""

    def __init__(self, token: str, on_refused: Callable[[], None] | None = None) -> None:
        self._token = token
        self._on_refused = on_refused

    def intercept_service(self, continuation, handler_call_details):
        metadata = dict(handler_call_details.invocation_metadata or ())
        if token_matches(metadata.get(TOKEN_HEADER), self._token):
            return continuation(handler_call_details)
        if self._on_refused is not None:
            self._on_refused()
        handler = continuation(handler_call_details)
        return _refusing(handler) if handler is not None else None


def _deny(request: Any, context: grpc.ServicerContext) -> Any:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that refuses the call."""
    kind = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return kind(
        _deny,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


@dataclasses.dataclass(frozen=True)
class ClientSecurity:
    """The worker's side: how to reach a sidecar that asks for TLS and/or a token."""

    tls_ca: bytes | None = None  # PEM: verify the sidecar's certificate against this
    tls_cert: bytes | None = None  # PEM: this worker's certificate (mTLS)
    tls_key: bytes | None = None
    server_name: str = ""  # the name to check the certificate for, if not the address's host
    token: str | None = None

    @classmethod
    def from_files(
        cls,
        *,
        ca_file: str = "",
        cert_file: str = "",
        key_file: str = "",
        server_name: str = "",
        token_file: str = "",
    ) -> ClientSecurity | None:
        """None when nothing is configured (a plain channel, as before)."""
        if not (ca_file or cert_file or token_file):
            return None
        if bool(cert_file) != bool(key_file):
            raise TransportConfigError("tls_cert_file and tls_key_file go together")
        if cert_file and not ca_file:
            raise TransportConfigError("tls_cert_file (mTLS) needs tls_ca_file")
        return cls(
            tls_ca=read_secret(ca_file, "tls_ca_file") if ca_file else None,
            tls_cert=read_secret(cert_file, "tls_cert_file") if cert_file else None,
            tls_key=read_secret(key_file, "tls_key_file") if key_file else None,
            server_name=server_name,
            token=read_token(token_file, "token_file") if token_file else None,
        )

    def channel(self, address: str) -> grpc.Channel:
        if self.tls_ca is None:
            return grpc.insecure_channel(address)
        credentials = grpc.ssl_channel_credentials(
            root_certificates=self.tls_ca,
            private_key=self.tls_key,
            certificate_chain=self.tls_cert,
        )
        options = [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
        return grpc.secure_channel(address, credentials, options=options)

    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        return ((TOKEN_HEADER, f"Bearer {self.token}"),) if self.token else None


def http_refusal(headers: Any, token: str | None) -> bool:
    """True when an HTTP request must be answered 401 (a token is set and it does not match)."""
    return token is not None and not token_matches(headers.get("Authorization"), token)


def secure_http_server(server: Any, security: ServerSecurity) -> None:
    """Wrap a listening `http.server` in TLS when configured. The handshake runs on the
    handler's thread (do_handshake_on_connect=False), so a slow client cannot hold up accept."""
    if not security.tls:
        return
    context = http_ssl_context(security)
    server.socket = context.wrap_socket(
        server.socket, server_side=True, do_handshake_on_connect=False
    )


def start_metrics_server(
    registry: Any,
    host: str,
    port: int,
    security: ServerSecurity,
    on_refused: Callable[[], None] = lambda: None,
):
    """`/metrics` over HTTP(S), behind the token unless `metrics_open`. Returns the server."""
    import threading
    from http.server import ThreadingHTTPServer

    from prometheus_client.exposition import MetricsHandler

    token = None if security.metrics_open else security.token()
    base = MetricsHandler.factory(registry)

    class GuardedMetricsHandler(base):  # type: ignore[misc, valid-type]
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if http_refusal(self.headers, token):
                on_refused()
                send_unauthorized(self)
                return
            super().do_GET()

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            return

    server = ThreadingHTTPServer((host, port), GuardedMetricsHandler)
    server.daemon_threads = True
    secure_http_server(server, security)
    thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return server


def send_unauthorized(handler: Any) -> None:
    body = b'{"error": "missing or wrong bearer token"}'
    handler.send_response(401)
    handler.send_header("WWW-Authenticate", 'Bearer realm="ascend-guard"')
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)
