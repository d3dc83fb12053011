"""`ascend-guard ready`: a readiness probe for a vLLM pod that never kills it.

Not ready (exit 1) when vLLM's own `/health` fails, or while the local sidecar holds a hang
verdict on the engine: the pod leaves the Service and keeps its state for the on-call engineer.
Ready (exit 0) otherwise — also when the sidecar is down or has not heard from the engine yet,
because telemetry must never take serving capacity away. Use it as a readinessProbe, never as a
livenessProbe (a 2 s hang verdict must not become a restart of a model that loads for minutes).
"""

from __future__ import annotations

import argparse
import os
import urllib.parse

from telemetry.cli.common import add_sidecar_argument, health_base
from telemetry.cli.http_client import (
    Unreachable,
    add_token_argument,
    get_json,
    refusal_hint,
    token_of,
)

ENGINE_ENV = (
    "ASCEND_GUARD_ENGINE"  # = guard.config.runtime_guard.ENGINE_ENV (telemetry imports no guard)
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    ready = sub.add_parser("ready", help="readiness probe: vLLM healthy and no hang verdict")
    ready.add_argument(
        "--engine",
        default=os.environ.get(ENGINE_ENV) or None,
        help=f"engine label of the guarded server (env ${ENGINE_ENV})",
    )
    ready.add_argument(
        "--vllm",
        default=None,
        metavar="URL",
        help="also require 200 from this URL, e.g. http://127.0.0.1:8000/health",
    )
    add_sidecar_argument(ready, "health")
    ready.add_argument("--timeout", type=float, default=2.0, help="seconds per request")
    add_token_argument(ready)


def run(args: argparse.Namespace) -> int:
    if not args.engine:
        print(f"ascend-guard ready: give --engine or set ${ENGINE_ENV}")
        return 2
    if args.vllm:
        try:
            status, _ = get_json_or_status(args.vllm, args.timeout)
        except Unreachable as exc:
            print(f"not ready: vLLM does not answer ({exc})")
            return 1
        if status != 200:
            print(f"not ready: {args.vllm} answered {status}")
            return 1
    base = health_base(args)
    if base is None:
        print(
            "ready (the local sidecar runs with its health endpoint off, --health-port 0, so "
            "readiness follows vLLM alone)"
        )
        return 0
    url = f"{base}/ready/{urllib.parse.quote(args.engine, safe='')}"
    try:
        status, body = get_json(url, args.timeout, token_of(args))
    except Unreachable as exc:
        print(f"ready (sidecar not reachable, so readiness follows vLLM alone: {exc})")
        return 0
    if status in (401, 403):
        print(
            f"ready (the sidecar refused the probe with {status}, so readiness follows vLLM "
            f"alone){refusal_hint(status)}"
        )
        return 0
    if status == 503:
        stopped = [
            f"{r.get('tp')}/{r.get('pid')}"
            for v in body.get("verdicts", [])
            for r in v.get("stopped", [])
        ]
        print(
            f"not ready: hang verdict on engine {args.engine} (stopped tp/pid: "
            f"{', '.join(stopped) or '?'}); see `ascend-guard hangs --live`"
        )
        return 1
    print(f"ready: {body.get('reason') or 'no hang verdict'} (engine {args.engine})")
    return 0


def get_json_or_status(url: str, timeout: float) -> tuple[int, dict]:
    """vLLM's /health answers an empty body: only the status matters."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, {}
    except urllib.error.HTTPError as exc:
        return exc.code, {}
    except (urllib.error.URLError, OSError) as exc:
        raise Unreachable(str(getattr(exc, "reason", exc))) from exc
