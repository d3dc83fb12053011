"""The HTTP listener and its routes, in the shapes Grafana's Tempo datasource decodes.

Grafana decodes search and tag responses strictly (an unknown field fails the query), so every
body below writes only fields of Tempo's own messages, zero values left out as protobuf JSON
does, 64-bit integers as strings. Refusals (400 bad parameter, 401, 404, 405, 501) are plain
text naming what is wrong, as Tempo's are, and each is counted in
`ascend_guard_query_api_refused_total{endpoint, reason}`.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, Counter

from telemetry import store
from telemetry.spans import requests as request_spans
from telemetry.spans.query import load_trace
from telemetry.tempo_api import otlp, params, span_list_api, store_search, traceql_adapter
from telemetry.tempo_api.params import BadParameter
from telemetry.tempo_api.store_search import Hit
from telemetry.wire import build_info
from telemetry.wire.transport import (
    ServerSecurity,
    http_refusal,
    secure_http_server,
    send_unauthorized,
)

log = structlog.get_logger("ascend_guard.tempo_api")

DEFAULT_LIMIT = 20  # Tempo's and Grafana's defaults
DEFAULT_SPSS = 3
DEFAULT_METRICS_WINDOW_NS = 3600 * 10**9
METRICS_POINTS = 100  # query_range without `step`: about this many points
NO_ROOT = "<root span not yet received>"  # Tempo's text for a trace whose root is missing
TAG_SCOPES = ("resource", "span", "intrinsic", "event", "link", "instrumentation")
_SEARCH_PARAMS = {"q", "tags", "minDuration", "maxDuration", "limit", "start", "end", "spss"}
PROTOBUF = "application/protobuf"


class Reply:
    def __init__(self, code: int, body: bytes, content_type: str, reason: str = "") -> None:
        self.code, self.body, self.content_type, self.reason = code, body, content_type, reason


def _json(body: Any, code: int = 200) -> Reply:
    return Reply(code, json.dumps(body, separators=(",", ":")).encode(), "application/json")


def _text(code: int, message: str, reason: str) -> Reply:
    return Reply(code, (message + "\n").encode(), "text/plain; charset=utf-8", reason)


class Request:
    def __init__(self, path: str, query: dict[str, list[str]], headers: Any) -> None:
        self.path, self.query, self.headers = path, query, headers

    def get(self, name: str) -> str | None:
        values = self.query.get(name)
        return values[-1] if values else None


# -- trace by id ----------------------------------------------------------------------------
def _trace(conn: sqlite3.Connection, req: Request, raw_id: str, v2: bool) -> Reply:
    trace_id = params.trace_id(urllib.parse.unquote(raw_id))
    params.search_window(req.get("start"), req.get("end"))  # validated; the id decides
    spans = load_trace(conn, trace_id)
    request_spans.link_wave_spans(conn, spans)  # a wave links to its requests' traces
    spans = spans or request_spans.load_request_trace(conn, trace_id)
    if not spans:
        return _text(
            404,
            f"trace {trace_id} not found: no span of it is in this sidecar's store "
            "(retention, another node's sidecar, or an id of another system)",
            "not_found",
        )
    data = otlp.traces_data(spans)
    if PROTOBUF in (req.headers.get("Accept") or ""):
        body = otlp.trace_by_id_v2(data) if v2 else data.SerializeToString()
        return Reply(200, body, PROTOBUF)
    encoded = otlp.otlp_json(data)
    return _json({"trace": encoded} if v2 else {"batches": encoded.get("resourceSpans", [])})


# -- search ---------------------------------------------------------------------------------
def _span_json(span, attrs: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "spanID": span.span_hex,
        "name": span.name,
        "startTimeUnixNano": str(span.start_ns),
    }
    if span.duration_ns:
        out["durationNanos"] = str(span.duration_ns)
    if attrs:
        out["attributes"] = otlp.key_values_json(attrs)
    return out


def hit_json(hit: Hit) -> dict[str, Any]:
    """A `TraceSearchMetadata` (zero values left out)."""
    out: dict[str, Any] = {
        "traceID": hit.trace_id,
        "rootServiceName": (hit.root_service or NO_ROOT) if hit.root_name else NO_ROOT,
        "rootTraceName": hit.root_name or NO_ROOT,
        "startTimeUnixNano": str(hit.start_ns),
    }
    if hit.duration_ns // 10**6:
        out["durationMs"] = min(hit.duration_ns // 10**6, params.UINT32_MAX)
    sets = []
    for spans, matched, attributes in hit.spansets:
        spanset: dict[str, Any] = {}
        if spans:
            spanset["spans"] = [_span_json(s, a) for s, a in spans]
        if matched:
            spanset["matched"] = matched
        if attributes:
            spanset["attributes"] = otlp.key_values_json(attributes)
        sets.append(spanset)
    if sets:
        out["spanSet"] = sets[0]  # deprecated in Tempo, still read by older Grafana
        out["spanSets"] = sets
    return out


def _search(conn: sqlite3.Connection, req: Request) -> Reply:
    q, tags = req.get("q"), req.get("tags")
    start_ns, end_ns = params.search_window(req.get("start"), req.get("end"))
    limit = params.positive_int("limit", req.get("limit") or str(DEFAULT_LIMIT))
    spss = params.positive_int("spss", req.get("spss") or str(DEFAULT_SPSS))
    extra = sorted(set(req.query) - _SEARCH_PARAMS)
    if q is not None and tags is not None:
        raise BadParameter("q", "give either q (TraceQL) or tags (logfmt), not both")
    legacy_tags: list[tuple[str, str]] = []
    if extra:
        # Tempo (and older Grafana): with no q, tags or time range, other parameters are tags
        if q is not None or tags is not None or start_ns is not None or end_ns is not None:
            raise BadParameter(
                extra[0], f"unknown parameter; known: {', '.join(sorted(_SEARCH_PARAMS))}"
            )
        legacy_tags = [(name, req.get(name) or "") for name in extra]
    min_ns = (
        params.go_duration_ns("minDuration", req.get("minDuration"))
        if req.get("minDuration")
        else None
    )
    max_ns = (
        params.go_duration_ns("maxDuration", req.get("maxDuration"))
        if req.get("maxDuration")
        else None
    )
    if min_ns is not None and max_ns is not None and max_ns < min_ns:
        raise BadParameter(
            "maxDuration", f"{req.get('maxDuration')} is below minDuration {req.get('minDuration')}"
        )
    if q is not None and q.strip():
        if min_ns is not None or max_ns is not None:
            raise BadParameter(
                "minDuration", "with q, write durations in TraceQL: {duration > 10ms}"
            )
        if not traceql_adapter.available():
            return _text(
                501,
                "TraceQL (q) is not available in this build of the sidecar; "
                "use tags=, minDuration= and maxDuration=",
                "not_implemented",
            )
        hits, stats = traceql_adapter.search(
            conn, q, start_ns or 0, end_ns if end_ns is not None else time.time_ns(), limit, spss
        )
        # as Tempo: the traces inspected (at most traceql.MAX_TRACES_INSPECTED, as the legacy
        # search: a search that reaches it answers with what it found so far)
        metrics = {"inspectedTraces": stats.inspected_traces} if stats.inspected_traces else {}
        return _json({"traces": [hit_json(h) for h in hits], "metrics": metrics})
    if tags:
        legacy_tags += params.logfmt("tags", tags)
    result = store_search.legacy_search(
        conn,
        legacy_tags,
        min_ns=min_ns,
        max_ns=max_ns,
        start_ns=start_ns,
        end_ns=end_ns,
        limit=limit,
        spss=spss,
    )
    metrics: dict[str, Any] = {}
    if result.inspected_traces:
        metrics["inspectedTraces"] = result.inspected_traces
    if result.inspected_bytes:
        metrics["inspectedBytes"] = str(result.inspected_bytes)
    return _json({"traces": [hit_json(h) for h in result.hits], "metrics": metrics})


# -- tags -----------------------------------------------------------------------------------
def _tag_limit(req: Request) -> int | None:
    return params.positive_int("limit", req.get("limit")) if req.get("limit") else None


def _tags(req: Request, v2: bool) -> Reply:
    scope = req.get("scope")
    if scope is not None and scope not in (*TAG_SCOPES, "none", "all", ""):
        raise BadParameter("scope", f"{scope!r}; one of {', '.join(TAG_SCOPES)}")
    params.search_window(req.get("start"), req.get("end"))
    limit = _tag_limit(req)
    known = store_search.tag_scopes()
    if not v2:
        names = sorted({*known["resource"], *known["span"]})
        return _json({"tagNames": names[:limit]})
    wanted = TAG_SCOPES if scope in (None, "", "none", "all") else (scope,)
    scopes = []
    for name in wanted:
        entry: dict[str, Any] = {"name": name}
        if known.get(name):
            entry["tags"] = known[name][:limit]
        scopes.append(entry)
    return _json({"scopes": scopes})


def tag_identifier(raw: str) -> str:
    """The tag of `/search/tag/<tag>/values`, URL-decoded until it stops changing (older
    Grafana encoded it twice)."""
    tag = raw
    for _ in range(4):
        decoded = urllib.parse.unquote(tag)
        if decoded == tag:
            break
        tag = decoded
    if not tag or tag in (".", "..") or any(c.isspace() or c in '"{}()=!<>~|&,' for c in tag):
        raise BadParameter("tag", f"{raw!r} is not a tag name such as resource.host.name or .tp")
    return tag


def _tag_values(conn: sqlite3.Connection, req: Request, raw_tag: str, v2: bool) -> Reply:
    tag = tag_identifier(raw_tag)
    start_ns, end_ns = params.search_window(req.get("start"), req.get("end"))
    limit = _tag_limit(req)
    if req.get("maxStaleValues"):
        params.positive_int("maxStaleValues", req.get("maxStaleValues") or "")
    if not v2 and "." not in tag.lstrip(".") and tag not in ("name", "status", "kind"):
        tag = f".{tag}"  # v1 names are bare attribute keys
    values = store_search.tag_values(
        conn, tag if v2 or tag.startswith(".") else f".{tag}", start_ns, end_ns
    )[:limit]
    if v2:
        return _json({"tagValues": [{"type": t, "value": str(v)} for t, v in values]})
    return _json({"tagValues": [str(v) for _, v in values]})


# -- metrics --------------------------------------------------------------------------------
def _sample_json(at_ns: int, value: float) -> dict[str, Any]:
    out: dict[str, Any] = {"timestampMs": str(at_ns // 10**6)}
    if value != value:  # NaN, as protobuf JSON writes it
        out["value"] = "NaN"
    elif value:
        out["value"] = value
    return out


def _query_range(conn: sqlite3.Connection, req: Request) -> Reply:
    q = req.get("q") if req.get("q") is not None else req.get("query")
    if not q:
        raise BadParameter("q", "missing: a TraceQL metrics query, e.g. {} | rate()")
    end_ns = params.metrics_time_ns("end", req.get("end")) if req.get("end") else time.time_ns()
    if req.get("start"):
        start_ns = params.metrics_time_ns("start", req.get("start") or "")
    elif req.get("since"):
        start_ns = end_ns - params.go_duration_ns("since", req.get("since") or "")
    else:
        start_ns = end_ns - DEFAULT_METRICS_WINDOW_NS
    if end_ns <= start_ns:
        raise BadParameter("end", "is not after start")
    step = (
        params.step_ns(req.get("step") or "")
        if req.get("step")
        else max(10**9, -(-(end_ns - start_ns) // METRICS_POINTS // 10**9) * 10**9)
    )
    if req.get("exemplars") and not (req.get("exemplars") or "").isdigit():
        raise BadParameter("exemplars", f"{req.get('exemplars')!r} is not a whole number")
    if not traceql_adapter.available():
        return _text(
            501, "TraceQL metrics are not available in this build of the sidecar", "not_implemented"
        )
    series = traceql_adapter.metrics_range(conn, q, start_ns, end_ns, step)
    out = []
    for labels, samples in series:
        item: dict[str, Any] = {}
        if labels:
            item["labels"] = otlp.key_values_json(labels)
        if samples:
            item["samples"] = [_sample_json(t, v) for t, v in samples]
        out.append(item)
    return _json({"series": out, "metrics": {}})


# -- the CLI's span list (not a Tempo endpoint) ---------------------------------------------
def _span_list(conn: sqlite3.Connection, req: Request) -> Reply:
    extra = span_list_api.unknown_parameter(req.query)
    if extra:
        raise BadParameter(extra, "unknown parameter; known: q, start, end, sort, limit")
    if not traceql_adapter.available():
        return _text(
            501, "TraceQL is not available in this build of the sidecar", "not_implemented"
        )
    return _json(span_list_api.answer(conn, req.get))


# -- routing --------------------------------------------------------------------------------
def _buildinfo() -> Reply:
    return _json(
        {
            "version": build_info.version(),
            "revision": "",
            "branch": "",
            "buildUser": "",
            "buildDate": "",
            "goVersion": "",
        }
    )


def route(store_path: str, req: Request) -> tuple[str, Reply]:
    """(endpoint label, reply) of one GET."""
    path = req.path
    if path == "/api/echo":
        return "echo", Reply(200, b"echo\n", "text/plain; charset=utf-8")
    if path == "/api/status/buildinfo":
        return "buildinfo", _buildinfo()
    simple: dict[str, tuple[str, Callable]] = {
        "/api/search": ("search", lambda c: _search(c, req)),
        "/api/v2/search/tags": ("tags", lambda c: _tags(req, True)),
        "/api/search/tags": ("tags", lambda c: _tags(req, False)),
        "/api/metrics/query_range": ("query_range", lambda c: _query_range(c, req)),
        span_list_api.ROUTE: ("spans", lambda c: _span_list(c, req)),
    }
    if path in simple:
        endpoint, handler = simple[path]
    elif path.startswith("/api/v2/traces/"):
        endpoint, raw = "trace", path[len("/api/v2/traces/") :]
        handler = lambda c: _trace(c, req, raw, True)  # noqa: E731
    elif path.startswith("/api/traces/"):
        endpoint, raw = "trace", path[len("/api/traces/") :]
        handler = lambda c: _trace(c, req, raw, False)  # noqa: E731
    elif path.startswith(("/api/v2/search/tag/", "/api/search/tag/")) and path.endswith("/values"):
        v2 = path.startswith("/api/v2/")
        raw = path[len("/api/v2/search/tag/" if v2 else "/api/search/tag/") : -len("/values")]
        endpoint = "tag_values"
        handler = lambda c: _tag_values(c, req, raw, v2)  # noqa: E731
    else:
        return "other", _text(
            404,
            f"unknown path {path!r}; this is a Tempo-compatible query "
            "API: /api/search, /api/v2/traces/<id>, /api/v2/search/tags, ...",
            "unknown_path",
        )
    try:
        conn = store.connect(store_path, readonly=True)
    except (FileNotFoundError, sqlite3.Error) as exc:
        return endpoint, _text(503, f"trace store unavailable: {exc}", "store_unavailable")
    try:
        return endpoint, handler(conn)
    except BadParameter as exc:
        return endpoint, _text(400, str(exc), "bad_parameter")
    finally:
        conn.close()


def _handler(
    store_path: str, token: str | None, refused: Counter, on_auth_refused: Callable[[], None]
):
    class TempoApiHandler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            url = urllib.parse.urlsplit(self.path)
            if http_refusal(self.headers, token):
                on_auth_refused()
                refused.labels("any", "unauthorized").inc()
                send_unauthorized(self)
                return
            req = Request(
                url.path.rstrip("/") or "/",
                urllib.parse.parse_qs(url.query, keep_blank_values=True),
                self.headers,
            )
            try:
                endpoint, reply = route(store_path, req)
            except Exception:  # a bug must not take the listener down; say so and count it
                log.exception("query_api_error", path=url.path)
                endpoint, reply = (
                    "any",
                    _text(500, "internal error; see the sidecar's log", "error"),
                )
            if reply.reason:
                refused.labels(endpoint, reply.reason).inc()
            self._send(reply)

        def _refuse_method(self) -> None:
            refused.labels("any", "method_not_allowed").inc()
            reply = _text(405, f"{self.command} is not allowed: this API is read-only (GET)", "")
            self._send(reply, allow=True)

        do_POST = do_PUT = do_DELETE = do_PATCH = _refuse_method  # noqa: N815

        def _send(self, reply: Reply, allow: bool = False) -> None:
            self.send_response(reply.code)
            self.send_header("Content-Type", reply.content_type)
            self.send_header("Content-Length", str(len(reply.body)))
            if allow:
                self.send_header("Allow", "GET")
            self.end_headers()
            self.wfile.write(reply.body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            return

    return TempoApiHandler


def refused_counter(registry: CollectorRegistry) -> Counter:
    return Counter(
        "ascend_guard_query_api_refused",
        "Requests the Tempo-compatible query API refused, by endpoint and reason "
        "(bad_parameter, not_found, unauthorized, unknown_path, not_implemented, ...)",
        ("endpoint", "reason"),
        registry=registry,
    )


class TempoApiServer:
    """The query API on its own port, reading the store file read-only per request."""

    def __init__(
        self,
        store_path: str,
        host: str,
        port: int,
        registry: CollectorRegistry,
        *,
        security: ServerSecurity | None = None,
        token: str | None = None,
        on_auth_refused: Callable[[], None] = lambda: None,
    ) -> None:
        self.refused = refused_counter(registry)
        self._server = ThreadingHTTPServer(
            (host, port), _handler(store_path, token, self.refused, on_auth_refused)
        )
        self._server.daemon_threads = True
        if security is not None:
            secure_http_server(self._server, security)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="query-http", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
