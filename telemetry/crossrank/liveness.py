"""HTTP liveness per engine, for probes that must not trust vLLM's `/health` alone.

`GET /live/<engine>`: 200 with `{"live": true, ...}` while no hang verdict stands on any
replica (DP engine) of the engine; 503 with the verdict(s) (stopped ranks, the op, group and
sequence number their peers wait in) while one does; 404 for an engine no rank has reported.
The body lists every rank of every replica, each replica's state (`replicas`) and the wedged
ones (`wedged`: run id and dp). `GET /live/<engine>/<dp>`: the same for one replica, for a
probe of one DP engine (one `vllm serve` per DP rank). `GET /live` lists engines;
`GET /hangs` returns the standing verdicts and recent verdicts/recoveries; `GET /skew` the
latest aligned waves (skew, straggler, per-rank wait).

`GET /ready/<engine>` is for a pod's readiness probe: 503 only while a hang verdict stands (the
pod leaves the Service, nobody kills it), 200 otherwise — also for an engine that has not
reported yet, so a model that loads for minutes is never held back by the guard. Extra routes
(`/coverage` for `ascend-guard doctor --live`) are handed in by the sidecar.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import urllib.parse
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import structlog

from telemetry.crossrank.view import CrossRankView
from telemetry.wire.transport import (
    ServerSecurity,
    http_refusal,
    secure_http_server,
    send_unauthorized,
)

log = structlog.get_logger("ascend_guard.liveness")


Route = Callable[[str], tuple[int, dict[str, Any]]]


def _ready(detector: Any, engine: str) -> tuple[int, dict[str, Any]]:
    status = detector.engine_status(engine)
    if status is None:
        return 200, {"engine": engine, "ready": True, "reason": "no rank has reported yet"}
    live, body = status
    return (200 if live else 503), {**body, "ready": live}


def _handler(
    view: CrossRankView,
    routes: Mapping[str, Route],
    token: str | None,
    on_refused: Callable[[], None],
) -> type[BaseHTTPRequestHandler]:
    detector = view.hangs

    class LivenessHandler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if http_refusal(self.headers, token):
                on_refused()
                send_unauthorized(self)
                return
            path = urllib.parse.urlparse(self.path).path.rstrip("/")
            if path == "/live":
                self._send(200, {"engines": detector.engines()})
            elif path.startswith("/live/"):
                engine, _, dp_part = urllib.parse.unquote(path[len("/live/") :]).partition("/")
                if dp_part and not dp_part.isdigit():
                    self._send(400, {"error": f"dp {dp_part!r} is not a DP rank (0, 1, ...)"})
                    return
                dp = int(dp_part) if dp_part else None
                status = detector.engine_status(engine, dp)
                if status is None:
                    what = "this engine" if dp is None else f"replica dp{dp} of this engine"
                    self._send(
                        404,
                        {
                            "engine": engine,
                            "error": f"no rank of {what} has reported to this sidecar",
                            "engines": detector.engines(),
                        },
                    )
                else:
                    live, body = status
                    self._send(200 if live else 503, body)
            elif path.startswith("/ready/"):
                self._send(*_ready(detector, urllib.parse.unquote(path[len("/ready/") :])))
            elif path in routes:
                self._send(*routes[path](""))
            elif path == "/hangs":
                self._send(200, detector.snapshot())
            elif path == "/skew":
                recent = [dataclasses.asdict(s) for s in list(view.sync.recent)[-200:]]
                self._send(200, {"waves": recent})
            else:
                self._send(
                    404, {"error": f"unknown path {path!r}; try /live/<engine>[/<dp>] or /hangs"}
                )

        def _send(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body, default=str).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet probes
            return

    return LivenessHandler


class LivenessServer:
    def __init__(
        self,
        view: CrossRankView,
        host: str,
        port: int,
        routes: Mapping[str, Route] | None = None,
        *,
        security: ServerSecurity | None = None,
        token: str | None = None,
        on_refused: Callable[[], None] = lambda: None,
    ) -> None:
        self._server = ThreadingHTTPServer(
            (host, port), _handler(view, routes or {}, token, on_refused)
        )
        self._server.daemon_threads = True
        if security is not None:
            secure_http_server(self._server, security)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="liveness-http", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
