"""Where ascend-guard keeps its files and listens: the one home of these defaults.

Sidecar, workers and CLI read the same defaults, so a sidecar started one way is found by the
CLI and the workers started the same way, with no flags:

- runtime directory `/run/ascend-guard/` (env `ASCEND_GUARD_RUNTIME_DIR`): the gRPC socket
  `guard.sock` and `sidecar.json`, which the running sidecar writes to say where its store and
  HTTP endpoints are;
- state directory `/var/lib/ascend-guard/` (env `ASCEND_GUARD_STATE_DIR`): the trace store
  `store.db`, the workers' incident `spool/` and evidence `dumps/`, the hang evidence
  `bundles/` (telemetry/crossrank/bundle.py);
- `ASCEND_GUARD_SIDECAR` overrides the gRPC address and `ASCEND_GUARD_STORE` the store file.

A developer or test run that is not root points the two directory variables at a folder of its
own (the test suite and `make demo` do).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from typing import Any

RUNTIME_DIR_ENV = "ASCEND_GUARD_RUNTIME_DIR"
STATE_DIR_ENV = "ASCEND_GUARD_STATE_DIR"
SIDECAR_ENV = "ASCEND_GUARD_SIDECAR"
STORE_ENV = "ASCEND_GUARD_STORE"
HEALTH_PORT_ENV = "ASCEND_GUARD_HEALTH_PORT"
# where a pod's probe reaches a sidecar that is not on its loopback (DaemonSet: the node's IP)
HEALTH_URL_ENV = "ASCEND_GUARD_HEALTH_URL"
# where the CLI reaches a sidecar's query API that is not the local one (a port-forward, another
# node); the Grafana datasource provisioning reads the same variable
QUERY_URL_ENV = "ASCEND_GUARD_QUERY_URL"
# the CA bundle the CLI checks an https sidecar's certificate with
CA_FILE_ENV = "ASCEND_GUARD_CA_FILE"
# the bearer token the CLI sends to a sidecar started with --token-file (same file)
TOKEN_FILE_ENV = "ASCEND_GUARD_TOKEN_FILE"

DEFAULT_RUNTIME_DIR = "/run/ascend-guard"
# the workers' liveness records (telemetry/wire/liveness_record.py): shared memory, so a frozen or
# GIL-holding worker's last phase stays readable by the sidecar on the same node
DEFAULT_LIVENESS_DIR = "/dev/shm/ascend-guard"
DEFAULT_STATE_DIR = "/var/lib/ascend-guard"
SOCKET_NAME = "guard.sock"
DISCOVERY_NAME = "sidecar.json"
STORE_NAME = "store.db"
SPOOL_NAME = "spool"
DUMPS_NAME = "dumps"
BUNDLES_NAME = "bundles"

DEFAULT_METRICS_PORT = 9464
DEFAULT_HEALTH_PORT = 9465
# the Tempo-compatible trace query API (telemetry/tempo_api.py) listens on the metrics port + 2
# unless told otherwise (9466 by default), so one offset finds it next to a moved /metrics
QUERY_PORT_OFFSET = 2
DEFAULT_QUERY_PORT = DEFAULT_METRICS_PORT + QUERY_PORT_OFFSET
# every port flag (--metrics-port, --health-port, --query-port): 0 turns that listener off
PORT_OFF = 0
# owner only; with --socket-group the group may connect too
DEFAULT_SOCKET_MODE = 0o600
GROUP_SOCKET_MODE = 0o660


def _env(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def runtime_dir(environ: Mapping[str, str] | None = None) -> str:
    return _env(environ).get(RUNTIME_DIR_ENV) or DEFAULT_RUNTIME_DIR


def state_dir(environ: Mapping[str, str] | None = None) -> str:
    return _env(environ).get(STATE_DIR_ENV) or DEFAULT_STATE_DIR


def sidecar_address(environ: Mapping[str, str] | None = None) -> str:
    """The gRPC address the sidecar listens on and workers send to, unless told otherwise."""
    env = _env(environ)
    return env.get(SIDECAR_ENV) or f"unix://{os.path.join(runtime_dir(env), SOCKET_NAME)}"


def default_store(environ: Mapping[str, str] | None = None) -> str:
    """The store a sidecar opens unless given `--store`."""
    env = _env(environ)
    return env.get(STORE_ENV) or os.path.join(state_dir(env), STORE_NAME)


def spool_dir(environ: Mapping[str, str] | None = None) -> str:
    return os.path.join(state_dir(environ), SPOOL_NAME)


def dump_dir(environ: Mapping[str, str] | None = None) -> str:
    return os.path.join(state_dir(environ), DUMPS_NAME)


def bundle_dir(environ: Mapping[str, str] | None = None) -> str:
    """Where the sidecar writes hang evidence bundles unless given `--bundle-dir`."""
    return os.path.join(state_dir(environ), BUNDLES_NAME)


def cli_bundle_dir(environ: Mapping[str, str] | None = None) -> str:
    """The bundles `ascend-guard hangs --bundle` reads: the running local sidecar's (from
    `sidecar.json`), else the default under the state directory."""
    return str(read_discovery(environ).get("bundle_dir") or "") or bundle_dir(environ)


def health_port(environ: Mapping[str, str] | None = None) -> int:
    """The liveness/API port (`--health-port`); 0 turns it off."""
    raw = _env(environ).get(HEALTH_PORT_ENV)
    if not raw:
        return DEFAULT_HEALTH_PORT
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{HEALTH_PORT_ENV}={raw!r} is not a port number") from None


def query_port(metrics_port: int, asked: int | None = None) -> int:
    """The query API's port: `asked` (`--query-port`; 0 turns it off), else the metrics port
    + 2, or its own default while /metrics is off (a port is never derived from 0)."""
    if asked is not None:
        return asked
    if metrics_port == PORT_OFF:
        return DEFAULT_QUERY_PORT
    return metrics_port + QUERY_PORT_OFFSET


def discovery_path(environ: Mapping[str, str] | None = None) -> str:
    return os.path.join(runtime_dir(environ), DISCOVERY_NAME)


def write_discovery(facts: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> str:
    """Publish what a started sidecar uses (store, ports) for the CLI; returns the file."""
    path = discovery_path(environ)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(dict(facts), handle, sort_keys=True)
    os.chmod(tmp, 0o644)  # nothing secret: paths and ports
    os.replace(tmp, path)
    return path


def read_discovery(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What the local sidecar published, or {} when none runs (or the file is unreadable)."""
    try:
        with open(discovery_path(environ), encoding="utf-8") as handle:
            facts = json.load(handle)
    except (OSError, ValueError):
        return {}
    return facts if isinstance(facts, dict) else {}


def remove_discovery(pid: int, environ: Mapping[str, str] | None = None) -> None:
    """Remove the file on stop, but only if this process wrote it."""
    if read_discovery(environ).get("pid") == pid:
        with contextlib.suppress(OSError):
            os.unlink(discovery_path(environ))


def cli_store(environ: Mapping[str, str] | None = None) -> str:
    """The store the on-call commands read: `$ASCEND_GUARD_STORE`, else the running local
    sidecar's (from `sidecar.json`), else the default under the state directory."""
    env = _env(environ)
    return env.get(STORE_ENV) or read_discovery(env).get("store") or default_store(env)


def health_off_locally(environ: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """Why the local sidecar has no health endpoint to ask, or None when it may have one:
    its `sidecar.json` says it runs with `--health-port 0`, or (no sidecar.json)
    `$ASCEND_GUARD_HEALTH_PORT` is 0. `$ASCEND_GUARD_HEALTH_URL` overrides both."""
    env = _env(environ)
    if env.get(HEALTH_URL_ENV):
        return None
    facts = read_discovery(env)
    if "health_url" in facts:
        return None if facts["health_url"] else facts
    if env.get(HEALTH_PORT_ENV, "").strip() == str(PORT_OFF):
        return {"env": f"{HEALTH_PORT_ENV}={PORT_OFF}"}
    return None


def health_off_message(
    facts: Mapping[str, Any], command: str, environ: Mapping[str, str] | None = None
) -> str:
    """What a command that needs the health endpoint says when the local sidecar has none."""
    if "env" in facts:
        who = f"${facts['env']} turns the local sidecar's health endpoint off"
    else:
        who = (
            f"the local sidecar (pid {facts.get('pid', '?')}, {discovery_path(environ)}) runs "
            f"with its health endpoint off (--health-port {PORT_OFF})"
        )
    return (
        f"{who}, so `ascend-guard {command}` has nothing to ask; next: restart the sidecar "
        f"with --health-port PORT (default {DEFAULT_HEALTH_PORT}), or name another sidecar's "
        f"health endpoint with --sidecar URL or ${HEALTH_URL_ENV}"
    )


def cli_health_url(environ: Mapping[str, str] | None = None) -> str:
    """The local sidecar's liveness/API endpoint: `$ASCEND_GUARD_HEALTH_URL`, else from
    `sidecar.json`, else the default port on 127.0.0.1."""
    if _env(environ).get(HEALTH_URL_ENV):
        return _env(environ)[HEALTH_URL_ENV]
    facts = read_discovery(environ)
    if facts.get("health_url"):
        return str(facts["health_url"])
    return f"http://127.0.0.1:{health_port(environ)}"


def cli_query_url(environ: Mapping[str, str] | None = None) -> str | None:
    """The query API the on-call commands ask: `$ASCEND_GUARD_QUERY_URL`, else the running local
    sidecar's (`query_url` in `sidecar.json`), else None (they read the store file)."""
    env = _env(environ)
    return env.get(QUERY_URL_ENV) or read_discovery(env).get("query_url") or None


CLI_STORE_HELP = (
    f"trace store (default: ${STORE_ENV}, else the local sidecar's from "
    f"${RUNTIME_DIR_ENV}/{DISCOVERY_NAME} [{DEFAULT_RUNTIME_DIR}], "
    f"else ${STATE_DIR_ENV}/{STORE_NAME} [{DEFAULT_STATE_DIR}])"
)
