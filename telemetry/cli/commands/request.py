"""`ascend-guard request ID`: one vLLM request's trace, from the store (telemetry/store/requests.py).

ID is vLLM's request id, or the id the API returned (`cmpl-...`, `chatcmpl-...`): the engine
suffixes that per prompt (`-0`) and per n>1 child (`1_...`), so an id finds every request it is
a prefix or part of. Prints each request's trace as a tree (the request span, its prefill and
decode waves with tokens, its incidents), `--waves` as a table of waves, or `--json`.
"""

from __future__ import annotations

import argparse
import json

from telemetry.cli.common import add_store_argument
from telemetry.cli.render import span_tree
from telemetry.cli.table import format_duration_ns, render_table
from telemetry.spans.requests import REQUEST_SPAN, RequestTrace, request_traces
from telemetry.store import connect
from telemetry.wire import schema
from telemetry.wire.trace_ids import format_span_id, format_trace_id


def add_parser(sub: argparse._SubParsersAction) -> None:
    request = sub.add_parser(
        "request", help="print one vLLM request's trace: the waves it ran in, tokens, incidents"
    )
    request.add_argument("request_id", metavar="ID", help="vLLM or API request id (or a prefix)")
    request.add_argument("--waves", action="store_true", help="a table of its waves, not a tree")
    request.add_argument("--json", action="store_true", help="one JSON object per request")
    request.add_argument("--engine", default=None, help="engine label")
    request.add_argument("--run", dest="run_id", default=None, help="run id")
    add_store_argument(request)


def run(args: argparse.Namespace) -> int:
    conn = connect(args.store, readonly=True)
    try:
        traces = request_traces(conn, args.request_id, run_id=args.run_id, engine=args.engine)
    finally:
        conn.close()
    if not traces:
        print(
            f"no request {args.request_id!r} in {args.store} (expired, not written yet, or sent "
            "by a rank with runtime_guard.request_traces off)"
        )
        return 1
    for n, trace in enumerate(traces):
        if args.json:
            print(json.dumps(as_json(trace), sort_keys=True))
            continue
        if n:
            print()
        print(_headline(trace))
        print(_waves_table(trace) if args.waves else _tree(trace))
    return 0


def _headline(trace: RequestTrace) -> str:
    root = trace.spans[0]
    attrs = root.attributes
    state = "finished" if attrs.get(schema.attr("request.finished")) else "no finish seen yet"
    return (
        f"request {trace.request_id}  trace {format_trace_id(trace.trace_id)}  run {root.run_id}  "
        f"engine {root.engine}  dp{root.dp}  waves {attrs.get(schema.attr('request.waves'), 0)}  "
        f"scheduled {trace.scheduled_tokens()}  sampled {trace.sampled_tokens()}  "
        f"preemptions {attrs.get(schema.attr('request.preemptions'), 0)}  "
        f"{format_duration_ns(root.duration_ns)}  {state}"
    )


def _tree(trace: RequestTrace) -> str:
    origin = trace.spans[0].start_ns
    rows = []
    for depth, span in span_tree(trace.spans):
        attrs = span.attributes
        detail = []
        if span.name in ("prefill", "decode"):
            detail.append(f"wave={span.wave}")
            if span.pp:
                detail.append(f"pp={span.pp}")
            detail.append(f"scheduled={attrs.get(schema.attr('request.scheduled_tokens'))}")
            sampled = attrs.get(schema.attr("request.sampled_tokens"))
            detail.append(f"sampled={'?' if sampled is None else sampled}")
            if attrs.get(schema.attr("request.preempted")):
                detail.append("after-preemption")
            if span.links:
                detail.append(f"wave-trace={format_trace_id(span.links[0]['trace_id'])}")
        elif span.name == REQUEST_SPAN and span.links:  # the traceparent it came with
            link = span.links[0]
            detail.append(
                f"traceparent={format_trace_id(link['trace_id'])}/{format_span_id(link['span_id'])}"
            )
        elif span.name.startswith("incident:"):
            event = span.events[0]["attributes"] if span.events else {}
            detail.append(f"wave={span.wave} {event.get('incident.summary', '')}")
        rows.append(
            (
                "  " * depth + ("└─ " if depth else "") + span.name,
                f"+{format_duration_ns(span.start_ns - origin)}",
                format_duration_ns(span.duration_ns),
                " ".join(detail),
            )
        )
    return render_table(("span", "start", "duration", "detail"), rows, right=(1, 2))


def _waves_table(trace: RequestTrace) -> str:
    origin = trace.spans[0].start_ns
    rows = [
        (
            w.wave,
            w.pp,
            w.kind + (" (recompute)" if w.recompute else ""),
            w.scheduled,
            "?" if w.sampled < 0 else w.sampled,
            "yes" if w.preempted else "",
            f"+{format_duration_ns(w.start_ns - origin)}" if w.start_ns else "?",
        )
        for w in trace.waves
    ]
    return render_table(
        ("wave", "pp", "kind", "scheduled", "sampled", "preempted before", "start"),
        rows,
        right=(0, 1, 3, 4, 6),
    )


def as_json(trace: RequestTrace) -> dict:
    """The trace as one JSON object: the request, its waves, and its spans."""
    root = trace.spans[0]
    return {
        "request_id": trace.request_id,
        "trace_id": format_trace_id(trace.trace_id),
        "run_id": root.run_id,
        "engine": root.engine,
        "dp": root.dp,
        "start_ns": root.start_ns,
        "end_ns": root.end_ns,
        "scheduled_tokens": trace.scheduled_tokens(),
        "sampled_tokens": trace.sampled_tokens(),
        "finished": bool(root.attributes.get(schema.attr("request.finished"))),
        "waves": [
            {
                "wave": w.wave,
                "pp": w.pp,
                "kind": w.kind,
                "recompute": w.recompute,
                "scheduled_tokens": w.scheduled,
                "sampled_tokens": None if w.sampled < 0 else w.sampled,
                "preempted": w.preempted,
                "start_ns": w.start_ns,
                "end_ns": w.end_ns,
            }
            for w in trace.waves
        ],
        "spans": [
            {
                "span_id": format_span_id(s.span_id),
                "parent_id": format_span_id(s.parent_id) if s.parent_id is not None else None,
                "name": s.name,
                "start_ns": s.start_ns,
                "end_ns": s.end_ns,
                "wave": s.wave,
                "attributes": s.attributes,
                "links": [
                    {
                        "trace_id": format_trace_id(link["trace_id"]),
                        "span_id": format_span_id(link["span_id"]),
                    }
                    for link in s.links
                ],
                "events": s.events,
            }
            for s in trace.spans
        ],
        "incidents": [
            s.events[0]["attributes"] for s in trace.spans if s.name.startswith("incident:")
        ],
    }
