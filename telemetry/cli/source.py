"""Where the on-call commands read traces: the sidecar's query API when one answers, else the
store file.

Both sources answer in one currency, so a command prints the same rows whichever answered:
- a trace search gives Tempo's `TraceSearchMetadata` objects, exactly as `/api/search` writes
  them (the store source builds them with the API's own encoder);
- a span list (the filter flags, `query --spans`) and a trace by id give telemetry/spans/builders.py
  `Span`s (the API source decodes `/ascend-guard/api/spans` and the OTLP protobuf of
  `/api/traces/<id>`).

`auto` (the default) asks the API that `--sidecar`, `$ASCEND_GUARD_QUERY_URL` or the local
sidecar's `sidecar.json` names, unless `--store` names a file; when that API does not answer, it
says so on stderr and reads the store file directly.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from telemetry.cli.common import DeprecatedAlias, add_sidecar_argument
from telemetry.cli.http_client import Unreachable, add_token_argument, refusal_hint, token_of
from telemetry.spans.builders import STATUS_ERROR, STATUS_UNSET, Span
from telemetry.spans.query import QueryError
from telemetry.wire import paths, schema
from telemetry.wire.transport import TOKEN_HEADER

SOURCES = ("auto", "api", "store")
PROTOBUF = "application/protobuf"


class SourceError(Exception):
    """The chosen source cannot answer; the message says why and what to do."""


def add_source_arguments(parser: argparse.ArgumentParser) -> None:
    """--store, --sidecar (old spelling: --api), --source, --token-file and --ca-file."""
    parser.add_argument(
        "--store",
        default=None,
        help="read this store file directly, not the API (when no API answers: "
        + paths.CLI_STORE_HELP.removeprefix("trace store (default: "),
    )
    add_sidecar_argument(parser, "query")
    parser.add_argument(
        "--api", dest="sidecar", action=DeprecatedAlias, metavar="URL", use="--sidecar URL"
    )
    parser.add_argument(
        "--source",
        choices=SOURCES,
        default="auto",
        help="auto: the API when one answers and no --store is given, else the store file",
    )
    add_token_argument(parser)
    parser.add_argument(
        "--ca-file",
        default=os.environ.get(paths.CA_FILE_ENV) or None,
        metavar="FILE",
        help=f"PEM CA bundle that signed an https API's certificate (default: ${paths.CA_FILE_ENV})",
    )


# -- the store file --------------------------------------------------------------------------
class StoreSource:
    kind = "store"
    capped = False  # the last search stopped at the traces it may check (there may be more)

    def __init__(self, path: str) -> None:
        from telemetry.store import connect

        self.path = path
        self.conn = connect(path, readonly=True)  # FileNotFoundError names the path

    def describe(self) -> str:
        return f"the store file {self.path}"

    def trace_hint(self) -> str:
        return f" --store {self.path}"

    def search(self, q: str, start_s: int, end_s: int, limit: int, spss: int) -> list[dict]:
        from telemetry.tempo_api import params, server, traceql_adapter

        start_ns, end_ns = params.search_window(str(start_s), str(end_s))
        try:
            hits, stats = traceql_adapter.search(
                self.conn, q, start_ns or 0, end_ns or 0, limit, spss
            )
        except params.BadParameter as exc:
            raise QueryError(str(exc)) from None
        self.capped = stats.capped
        return [server.hit_json(h) for h in hits]

    def spans(self, q: str, start_s: int, end_s: int, sort: str, limit: int) -> list[Span]:
        from telemetry.tempo_api import params, span_list_api

        start_ns, end_ns = params.search_window(str(start_s), str(end_s))
        try:
            return span_list_api.top_spans(self.conn, q, start_ns or 0, end_ns or 0, sort, limit)
        except params.BadParameter as exc:
            raise QueryError(str(exc)) from None

    def trace(self, trace_id: str) -> list[Span]:
        from telemetry.spans.query import load_trace

        return load_trace(self.conn, trace_id)


# -- the sidecar's query API -----------------------------------------------------------------
class ApiSource:
    kind = "api"
    capped = False  # the last search stopped at the traces it may check (there may be more)

    def __init__(self, url: str, token: str | None, ca_file: str | None, timeout: float = 30.0):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.context = ssl.create_default_context(cafile=ca_file) if ca_file else None

    def describe(self) -> str:
        return f"the sidecar's query API at {self.url}"

    def trace_hint(self) -> str:
        return ""

    def get(self, path: str, query: dict[str, Any], accept: str = "application/json") -> bytes:
        """The body of a 200 answer; QueryError for a 400 (the API names the parameter),
        SourceError for anything else."""
        url = f"{self.url}{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
        headers = {"Accept": accept}
        if self.token:
            headers[TOKEN_HEADER] = f"Bearer {self.token}"
        request = urllib.request.Request(url, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout, context=self.context) as r:
                return r.read()
        except urllib.error.HTTPError as exc:
            text = exc.read().decode(errors="replace").strip()
            if exc.code == 400:
                raise QueryError(text) from None
            if exc.code == 404:
                raise NotFound(text) from None
            raise SourceError(
                f"{self.url} answered {exc.code}: {text[:300]}{refusal_hint(exc.code)}"
            ) from None
        except (urllib.error.URLError, OSError) as exc:
            raise SourceError(f"cannot read {self.url}: {getattr(exc, 'reason', exc)}") from None

    def check(self) -> None:
        """Raises SourceError when the API does not answer its echo."""
        try:
            answer = self.get("/api/echo", {}, "text/plain")
        except NotFound:
            answer = b""
        if answer.strip() != b"echo":
            raise SourceError(
                f"{self.url}/api/echo did not answer 'echo': not a query API (--sidecar names "
                f"the sidecar's query API here, port {paths.DEFAULT_QUERY_PORT} by default, not "
                "its health endpoint)"
            )

    def search(self, q: str, start_s: int, end_s: int, limit: int, spss: int) -> list[dict]:
        body = self.get(
            "/api/search", {"q": q, "start": start_s, "end": end_s, "limit": limit, "spss": spss}
        )
        from telemetry.traceql.search import MAX_TRACES_INSPECTED

        answer = json.loads(body)
        # the API says how many traces it checked (Tempo's inspectedTraces); at the cap, it
        # answered what it had found so far
        inspected = answer.get("metrics", {}).get("inspectedTraces", 0)
        self.capped = int(inspected) >= MAX_TRACES_INSPECTED
        return list(answer.get("traces", []))

    def spans(self, q: str, start_s: int, end_s: int, sort: str, limit: int) -> list[Span]:
        from telemetry.tempo_api.span_list_api import ROUTE, span_from_json

        query = {"q": q, "start": start_s, "end": end_s, "sort": sort, "limit": limit}
        try:
            body = self.get(ROUTE, query)
        except NotFound as exc:
            raise SourceError(
                f"{self.url} has no span list ({exc}); the sidecar is older than this CLI"
            ) from None
        return [span_from_json(s) for s in json.loads(body).get("spans", [])]

    def trace(self, trace_id: str) -> list[Span]:
        from opentelemetry.proto.trace.v1 import trace_pb2

        try:
            body = self.get(f"/api/traces/{trace_id}", {}, PROTOBUF)
        except NotFound:
            return []
        data = trace_pb2.TracesData()
        data.ParseFromString(body)
        return spans_of_otlp(data)


class NotFound(Exception):
    """The API answered 404."""


# -- OTLP protobuf back to spans -------------------------------------------------------------
def _value(any_value) -> Any:
    which = any_value.WhichOneof("value")
    if which == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, which) if which else None


def _attrs(key_values) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in key_values}


def spans_of_otlp(data) -> list[Span]:
    """The telemetry/spans/builders.py `Span`s an OTLP `TracesData` holds (what tempo_api/otlp.py wrote),
    in start order."""
    from opentelemetry.proto.trace.v1 import trace_pb2

    out = []
    for rs in data.resource_spans:
        for ss in rs.scope_spans:
            for s in ss.spans:
                attrs = _attrs(s.attributes)
                out.append(
                    Span(
                        trace_id=int.from_bytes(s.trace_id, "big"),
                        span_id=int.from_bytes(s.span_id, "big"),
                        parent_id=int.from_bytes(s.parent_span_id, "big")
                        if s.parent_span_id
                        else None,
                        name=s.name,
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        run_id=attrs.get(schema.ATTR_RUN, ""),
                        engine=attrs.get(schema.ATTR_ENGINE, ""),
                        wave=attrs.get(schema.ATTR_WAVE, 0),
                        dp=attrs.get(schema.ATTR_DP),
                        tp=attrs.get(schema.ATTR_TP),
                        pp=attrs.get(schema.ATTR_PP),
                        attributes=attrs,
                        events=[
                            {
                                "name": e.name,
                                "time_ns": e.time_unix_nano,
                                "attributes": _attrs(e.attributes),
                            }
                            for e in s.events
                        ],
                        links=[
                            {
                                "trace_id": int.from_bytes(link.trace_id, "big"),
                                "span_id": int.from_bytes(link.span_id, "big"),
                                "attributes": _attrs(link.attributes),
                                **({"flags": link.flags} if link.flags else {}),
                            }
                            for link in s.links
                        ],
                        status=STATUS_ERROR
                        if s.status.code == trace_pb2.Status.STATUS_CODE_ERROR
                        else STATUS_UNSET,
                    )
                )
    out.sort(key=lambda s: (s.start_ns, s.name))
    return out


# -- choosing ------------------------------------------------------------------------------
def api_url(args: argparse.Namespace) -> str | None:
    """The query API the CLI would ask: --sidecar, else $ASCEND_GUARD_QUERY_URL, else the local
    sidecar's (sidecar.json)."""
    return args.sidecar or paths.cli_query_url()


def open_source(args: argparse.Namespace, command: str) -> StoreSource | ApiSource:
    """The source `--source` asks for; says on stderr which one answers (and why the API did
    not, when `auto` falls back to the store file)."""
    choice = getattr(args, "source", "auto")
    url = api_url(args)
    if choice == "store" or (choice == "auto" and (args.store is not None or not url)):
        source: StoreSource | ApiSource = StoreSource(args.store or paths.cli_store())
    else:
        if not url:
            raise SourceError(
                f"no query API known: give --sidecar URL, set ${paths.QUERY_URL_ENV}, or start the "
                "sidecar with --query-port"
            )
        try:
            api = ApiSource(url, token_of(args), getattr(args, "ca_file", None))
            api.check()
            source = api
        except (SourceError, Unreachable, QueryError, NotFound, ssl.SSLError, OSError) as exc:
            if choice == "api":
                raise SourceError(f"the sidecar's query API does not answer: {exc}") from None
            store = paths.cli_store()
            print(
                f"ascend-guard {command}: the sidecar's query API does not answer ({exc}); "
                f"reading the store file {store} directly",
                file=sys.stderr,
            )
            return StoreSource(store)
    print(f"ascend-guard {command}: reading {source.describe()}", file=sys.stderr)
    return source


def ask(args: argparse.Namespace, command: str, source, call):
    """(source, call(source)); when `auto`'s API fails after it answered the echo (a sidecar
    older than this CLI, or one that just stopped), says so and asks the store file instead."""
    try:
        return source, call(source)
    except SourceError as exc:
        if source.kind != "api" or getattr(args, "source", "auto") != "auto":
            raise
        store = paths.cli_store()
        print(
            f"ascend-guard {command}: {exc}; reading the store file {store} directly",
            file=sys.stderr,
        )
        fallback = StoreSource(store)
        return fallback, call(fallback)
