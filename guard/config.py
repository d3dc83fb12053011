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

from telemetry.addresses import address_problem, default_sidecar_address

CONFIG_KEY = "runtime_guard"
CONFIG_FILE_ENV = "ASCEND_GUARD_CONFIG"
# Set by the first process that validated the config (the API server) for the processes it
# spawns (engine core, workers): the resolved config as JSON, and the run id they all share.
RESOLVED_ENV = "ASCEND_GUARD_RESOLVED_CONFIG"
RUN_ID_ENV = "ASCEND_GUARD_RUN_ID"

_LABEL_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


class GuardConfigError(ValueError):
    """A `runtime_guard` config that does not validate. The message names key and value."""


@dataclasses.dataclass(frozen=True)
class GuardConfig:
    """Validated guard settings. Field docs double as the reference in README."""

    enabled: bool = True
    # gRPC address of the node sidecar: unix:///path/guard.sock or HOST:PORT
    sidecar: str = dataclasses.field(default_factory=default_sidecar_address)
    # engine label on every metric and span; defaults to the served model's directory name
    engine: str = ""
    # shared by all processes of one server; generated when empty
    run_id: str = ""
    # records held in each worker while the sidecar is slow or away; beyond it, drops are counted
    buffer_size: int = 8192
    # most records in one gRPC message
    batch_max: int = 512
    # how often the streamer thread wakes up to send
    flush_interval_ms: int = 50
    heartbeat_interval_s: float = 1.0
    reconnect_max_backoff_s: float = 2.0
    # at most this many guard-internal errors are logged per minute and rank (all are counted)
    error_log_per_minute: int = 5

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


_FIELDS = {f.name: f for f in dataclasses.fields(GuardConfig)}


def _check_type(key: str, value: Any, expected: type) -> Any:
    if expected is bool:
        if not isinstance(value, bool):
            raise GuardConfigError(f"runtime_guard.{key}: expected true or false, got {value!r}")
        return value
    if expected is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise GuardConfigError(f"runtime_guard.{key}: expected an integer, got {value!r}")
        return value
    if expected is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise GuardConfigError(f"runtime_guard.{key}: expected a number, got {value!r}")
        return float(value)
    if not isinstance(value, str):
        raise GuardConfigError(f"runtime_guard.{key}: expected a string, got {value!r}")
    return value


_BOUNDS: dict[str, tuple[float, float]] = {
    "buffer_size": (16, 10_000_000),
    "batch_max": (1, 100_000),
    "flush_interval_ms": (1, 10_000),
    "heartbeat_interval_s": (0.05, 60.0),
    "reconnect_max_backoff_s": (0.05, 600.0),
    "error_log_per_minute": (0, 10_000),
}


def parse_config(raw: Mapping[str, Any]) -> GuardConfig:
    """Validate a `runtime_guard` object and fill in defaults."""
    if not isinstance(raw, Mapping):
        raise GuardConfigError(f"runtime_guard: expected a JSON object, got {raw!r}")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        field = _FIELDS.get(key)
        if field is None:
            known = ", ".join(sorted(_FIELDS))
            raise GuardConfigError(
                f"runtime_guard.{key}: unknown key (value {value!r}); known keys: {known}"
            )
        expected = {"bool": bool, "int": int, "float": float, "str": str}[str(field.type)]
        value = _check_type(key, value, expected)
        if key in _BOUNDS:
            low, high = _BOUNDS[key]
            if not low <= value <= high:
                raise GuardConfigError(
                    f"runtime_guard.{key}: {value!r} is outside [{low:g}, {high:g}]"
                )
        values[key] = value
    sidecar = values.get("sidecar")
    problem = address_problem(sidecar) if sidecar is not None else None
    if problem:
        raise GuardConfigError(f"runtime_guard.sidecar: {sidecar!r} is not an address; {problem}")
    for key in ("engine", "run_id"):
        if values.get(key) and not _LABEL_RE.match(values[key]):
            raise GuardConfigError(
                f"runtime_guard.{key}: {values[key]!r} must be 1-64 characters of letters, digits, _ . : -"
            )
    if values.get("batch_max", GuardConfig.batch_max) > values.get(
        "buffer_size", GuardConfig.buffer_size
    ):
        raise GuardConfigError(
            f"runtime_guard.batch_max: {values.get('batch_max', GuardConfig.batch_max)!r} exceeds "
            f"buffer_size {values.get('buffer_size', GuardConfig.buffer_size)!r}"
        )
    return GuardConfig(**values)


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
