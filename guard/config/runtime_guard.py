"""The `runtime_guard` configuration: schema, defaults, validation and where it comes from.

The guard is configured by the `runtime_guard` object of vLLM's `--additional-config`, or by a
JSON file named in the environment variable `ASCEND_GUARD_CONFIG` (an object with the same
`runtime_guard` key, or the bare object). When both are given, keys from `--additional-config`
win. Every error names the offending key and value, so a bad config stops start-up with a
message an operator can act on.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from typing import Any

from guard.config.collectives import CollectivesConfig
from guard.config.detectors import DetectorsConfig
from guard.config.fault_injection import FaultInjectionConfig
from guard.config.schema import (  # noqa: F401 - re-exported for config sections
    ACTIONS,
    GuardConfigError,
    choices,
    parse_section,
    value_range,
)
from telemetry.wire.addresses import address_problem, default_sidecar_address

CONFIG_KEY = "runtime_guard"
CONFIG_FILE_ENV = "ASCEND_GUARD_CONFIG"
# The engine label when the config sets none: one config file shared by many pods gives each its
# own label (deploy/ sets it from the pod name), which keeps engine labels unique per sidecar.
ENGINE_ENV = "ASCEND_GUARD_ENGINE"
# Set by the first process that validated the config (the API server) for the processes it
# spawns (engine core, workers): the resolved config as JSON, and the run id they all share.
RESOLVED_ENV = "ASCEND_GUARD_RESOLVED_CONFIG"
RUN_ID_ENV = "ASCEND_GUARD_RUN_ID"

_LABEL_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


@dataclasses.dataclass(frozen=True)
class IncidentsConfig:
    """How often one kind of incident is reported for one request (all hits are counted)."""

    # reports of one (type, request) on one rank before backing off
    per_request_cap: int = dataclasses.field(default=3, metadata=value_range(1, 100_000))
    # after the cap, report again at occurrence cap * factor**k (k = 1, 2, ...)
    backoff_factor: float = dataclasses.field(default=4.0, metadata=value_range(1.0, 1000.0))
    # where a worker keeps incidents while the sidecar is away; default: $ASCEND_GUARD_STATE_DIR/spool (/var/lib/ascend-guard/spool)
    spool_dir: str = ""
    spool_max_bytes: int = dataclasses.field(default=64 << 20, metadata=value_range(4096, 1 << 40))


@dataclasses.dataclass(frozen=True)
class TransportConfig:
    """How the worker reaches a sidecar that asks for TLS and/or a token (telemetry/wire/transport.py).
    Empty: a plain channel."""

    # file holding the bearer token the sidecar's --token-file holds
    token_file: str = ""
    # PEM CA bundle to verify the sidecar's certificate: TLS on
    tls_ca_file: str = ""
    # this worker's certificate and key, for a sidecar that requires client certificates (mTLS)
    tls_cert_file: str = ""
    tls_key_file: str = ""
    # the name the sidecar's certificate is checked for, when not the host of `sidecar`
    tls_server_name: str = ""

    def client_security(self):  # -> telemetry.wire.transport.ClientSecurity | None
        from telemetry.wire.transport import ClientSecurity

        return ClientSecurity.from_files(
            ca_file=self.tls_ca_file,
            cert_file=self.tls_cert_file,
            key_file=self.tls_key_file,
            server_name=self.tls_server_name,
            token_file=self.token_file,
        )


@dataclasses.dataclass(frozen=True)
class GuardConfig:
    """Validated guard settings. Field docs double as the reference in README."""

    # false turns the guard off while keeping the config
    enabled: bool = True
    # gRPC address of the node sidecar: unix:///path/guard.sock or HOST:PORT
    sidecar: str = dataclasses.field(default_factory=default_sidecar_address)
    # engine label on every metric and span; defaults to the served model's directory name
    engine: str = ""
    # shared by all processes of one engine; when empty: ASCEND_GUARD_RUN_ID, else derived from
    # the rendezvous of a multi-node engine (docs/cross-node.md), else generated
    run_id: str = ""
    # records held in each worker while the sidecar is slow or away; beyond it, drops are counted
    buffer_size: int = dataclasses.field(default=8192, metadata=value_range(16, 10_000_000))
    # most records in one gRPC message
    batch_max: int = dataclasses.field(default=512, metadata=value_range(1, 100_000))
    # how often the streamer thread wakes up to send
    flush_interval_ms: int = dataclasses.field(default=50, metadata=value_range(1, 10_000))
    # heartbeat period, sent even when no wave runs (hang verdicts need it)
    heartbeat_interval_s: float = dataclasses.field(default=1.0, metadata=value_range(0.05, 60.0))
    # the engine thread's phase and collective in a shared-memory file the sidecar on this node
    # reads, so a wait that holds the GIL is not taken for a frozen rank (telemetry/wire/liveness_record.py)
    liveness_record: bool = True
    # where those files live (the sidecar's --liveness-dir); default /dev/shm/ascend-guard
    liveness_dir: str = ""
    # the engine thread writes each wave's record into a shared-memory ring in liveness_dir,
    # which the sidecar on this node drains (telemetry/wire/wave_ring.py), instead of handing
    # it to the streamer thread; gRPC carries the rest. The sidecar must share liveness_dir.
    wave_ring: bool = False
    # waves the ring holds (a power of two); a sidecar that falls further behind loses the
    # oldest, counted
    wave_ring_slots: int = dataclasses.field(default=1024, metadata=value_range(16, 1 << 20))
    # bytes of one slot: the wave's fields and its arrays (token ids, membership, collectives)
    wave_ring_slot_bytes: int = dataclasses.field(default=4096, metadata=value_range(512, 1 << 20))
    # tp0 of each replica and PP stage sends which requests ran in each wave (request traces)
    request_traces: bool = True
    # cap of the reconnect backoff while the sidecar is away
    reconnect_max_backoff_s: float = dataclasses.field(
        default=2.0, metadata=value_range(0.05, 600.0)
    )
    # at most this many guard-internal errors are logged per minute and rank (all are counted)
    error_log_per_minute: int = dataclasses.field(default=5, metadata=value_range(0, 10_000))
    incidents: IncidentsConfig = dataclasses.field(default_factory=IncidentsConfig)
    transport: TransportConfig = dataclasses.field(default_factory=TransportConfig)
    detectors: DetectorsConfig = dataclasses.field(default_factory=DetectorsConfig)
    collectives: CollectivesConfig = dataclasses.field(default_factory=CollectivesConfig)
    fault_injection: FaultInjectionConfig = dataclasses.field(default_factory=FaultInjectionConfig)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


def parse_config(raw: Mapping[str, Any]) -> GuardConfig:
    """Validate a `runtime_guard` object and fill in defaults."""
    config = parse_section(GuardConfig, raw, CONFIG_KEY)
    if "sidecar" in raw:
        problem = address_problem(config.sidecar)
        if problem:
            raise GuardConfigError(
                f"runtime_guard.sidecar: {config.sidecar!r} is not an address; {problem}"
            )
    for key in ("engine", "run_id"):
        value = getattr(config, key)
        if value and not _LABEL_RE.match(value):
            raise GuardConfigError(
                f"runtime_guard.{key}: {value!r} must be 1-64 characters of letters, digits, _ . : -"
            )
    try:
        config.transport.client_security()
    except ValueError as exc:  # TransportConfigError: a file missing, empty or mismatched
        raise GuardConfigError(f"runtime_guard.transport: {exc}") from exc
    if config.wave_ring_slots & (config.wave_ring_slots - 1):
        raise GuardConfigError(
            f"runtime_guard.wave_ring_slots: {config.wave_ring_slots!r} is not a power of two"
        )
    if config.wave_ring_slot_bytes % 8:
        raise GuardConfigError(
            f"runtime_guard.wave_ring_slot_bytes: {config.wave_ring_slot_bytes!r} is not a "
            "multiple of 8"
        )
    if config.batch_max > config.buffer_size:
        raise GuardConfigError(
            f"runtime_guard.batch_max: {config.batch_max!r} exceeds buffer_size {config.buffer_size!r}"
        )
    return config


def config_from_json(text: str) -> GuardConfig:
    return parse_config(json.loads(text))


def _load_file(path: str) -> Mapping[str, Any]:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except OSError as exc:
        raise GuardConfigError(
            f"{CONFIG_FILE_ENV}={path}: cannot read the file ({exc.strerror})"
        ) from exc
    except json.JSONDecodeError as exc:
        raise GuardConfigError(f"{CONFIG_FILE_ENV}={path}: not valid JSON ({exc})") from exc
    if isinstance(data, Mapping) and CONFIG_KEY in data:
        data = data[CONFIG_KEY]
    if not isinstance(data, Mapping):
        raise GuardConfigError(
            f"{CONFIG_FILE_ENV}={path}: expected a JSON object with a '{CONFIG_KEY}' key"
        )
    return data


def resolve_config(
    additional_config: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
) -> GuardConfig | None:
    """The guard config from vLLM's additional_config and the environment, or None when off."""
    environ = os.environ if environ is None else environ
    merged: dict[str, Any] = {}
    found = False
    path = environ.get(CONFIG_FILE_ENV)
    if path:
        merged.update(_load_file(path))
        found = True
    if additional_config and CONFIG_KEY in additional_config:
        inline = additional_config[CONFIG_KEY]
        if not isinstance(inline, Mapping):
            raise GuardConfigError(f"runtime_guard: expected a JSON object, got {inline!r}")
        merged.update(inline)
        found = True
    if not found:
        return None
    if environ.get(ENGINE_ENV) and not merged.get("engine"):
        merged["engine"] = environ[ENGINE_ENV]
    config = parse_config(merged)
    return config if config.enabled else None


def config_from_env(environ: Mapping[str, str] | None = None) -> GuardConfig | None:
    """The config that the parent process resolved and handed down, if any."""
    environ = os.environ if environ is None else environ
    text = environ.get(RESOLVED_ENV)
    if not text:
        return None
    try:
        return parse_config(json.loads(text))
    except (json.JSONDecodeError, GuardConfigError) as exc:
        raise GuardConfigError(f"{RESOLVED_ENV}: {exc}") from exc
