"""`runtime_guard` config: defaults, validation errors that name key and value, where it comes from."""

from __future__ import annotations

import dataclasses
import json

import pytest

from guard.config.runtime_guard import (
    CONFIG_FILE_ENV,
    RESOLVED_ENV,
    GuardConfig,
    GuardConfigError,
    config_from_env,
    parse_config,
    resolve_config,
)
from telemetry.wire.addresses import default_sidecar_address


def test_defaults_fill_every_field():
    config = parse_config({})
    assert config == GuardConfig()
    assert config.enabled is True
    assert config.sidecar == default_sidecar_address()
    assert config.sidecar.startswith("unix://")
    assert config.buffer_size == 8192
    assert config.batch_max == 512
    assert config.flush_interval_ms == 50
    assert config.heartbeat_interval_s == 1.0
    assert config.reconnect_max_backoff_s == 2.0
    assert config.error_log_per_minute == 5
    assert config.engine == "" and config.run_id == ""


def test_given_values_are_kept_and_ints_become_floats_for_float_keys():
    config = parse_config(
        {
            "sidecar": "127.0.0.1:50051",
            "engine": "llama-3.1:8b",
            "run_id": "run_01",
            "buffer_size": 100,
            "batch_max": 100,
            "heartbeat_interval_s": 2,
        }
    )
    assert config.sidecar == "127.0.0.1:50051"
    assert config.engine == "llama-3.1:8b"
    assert config.run_id == "run_01"
    assert (config.buffer_size, config.batch_max) == (100, 100)
    assert config.heartbeat_interval_s == 2.0
    assert isinstance(config.heartbeat_interval_s, float)


@pytest.mark.parametrize(
    ("raw", "key", "value_text"),
    [
        # unknown key
        ({"bufer_size": 10}, "bufer_size", "10"),
        # wrong types
        ({"enabled": "yes"}, "enabled", "'yes'"),
        ({"enabled": 1}, "enabled", "1"),
        ({"buffer_size": "1024"}, "buffer_size", "'1024'"),
        ({"buffer_size": 1024.0}, "buffer_size", "1024.0"),
        ({"batch_max": True}, "batch_max", "True"),
        ({"heartbeat_interval_s": "1s"}, "heartbeat_interval_s", "'1s'"),
        ({"heartbeat_interval_s": False}, "heartbeat_interval_s", "False"),
        ({"sidecar": 50051}, "sidecar", "50051"),
        ({"engine": ["a"]}, "engine", "['a']"),
        # out of range
        ({"buffer_size": 15}, "buffer_size", "15"),
        ({"buffer_size": 10_000_001}, "buffer_size", "10000001"),
        ({"batch_max": 0}, "batch_max", "0"),
        ({"flush_interval_ms": 0}, "flush_interval_ms", "0"),
        ({"flush_interval_ms": 10_001}, "flush_interval_ms", "10001"),
        ({"heartbeat_interval_s": 0.01}, "heartbeat_interval_s", "0.01"),
        ({"reconnect_max_backoff_s": 601}, "reconnect_max_backoff_s", "601"),
        ({"error_log_per_minute": -1}, "error_log_per_minute", "-1"),
        # bad sidecar address
        ({"sidecar": "http://host:50051"}, "sidecar", "'http://host:50051'"),
        ({"sidecar": "localhost"}, "sidecar", "'localhost'"),
        ({"sidecar": "unix://"}, "sidecar", "'unix://'"),
        ({"sidecar": "host:port"}, "sidecar", "'host:port'"),
        ({"sidecar": ""}, "sidecar", "''"),
        # bad labels
        ({"engine": "my model"}, "engine", "'my model'"),
        ({"engine": "a/b"}, "engine", "'a/b'"),
        ({"engine": "x" * 65}, "engine", "'" + "x" * 65 + "'"),
        ({"run_id": "run id!"}, "run_id", "'run id!'"),
        # batch_max above buffer_size (explicit and against the default buffer)
        ({"buffer_size": 100, "batch_max": 101}, "batch_max", "101"),
        ({"batch_max": 9000}, "batch_max", "9000"),
    ],
)
def test_bad_values_name_key_and_value(raw, key, value_text):
    with pytest.raises(GuardConfigError) as info:
        parse_config(raw)
    message = str(info.value)
    assert f"runtime_guard.{key}" in message
    assert value_text in message


def test_batch_max_error_also_names_buffer_size():
    with pytest.raises(GuardConfigError, match=r"batch_max: 101 exceeds buffer_size 100"):
        parse_config({"buffer_size": 100, "batch_max": 101})


def test_range_bounds_themselves_are_accepted():
    config = parse_config({"buffer_size": 16, "batch_max": 16, "heartbeat_interval_s": 0.05})
    assert (config.buffer_size, config.batch_max, config.heartbeat_interval_s) == (16, 16, 0.05)


@pytest.mark.parametrize(
    "address",
    ["unix:///tmp/guard.sock", "unix:relative.sock", "localhost:50051", "10.0.0.1:9000",
     "[::1]:50051"],
)  # fmt: skip
def test_good_sidecar_addresses(address):
    assert parse_config({"sidecar": address}).sidecar == address


def test_port_out_of_range_is_a_bad_sidecar_address():
    with pytest.raises(GuardConfigError, match=r"runtime_guard\.sidecar: 'localhost:99999'"):
        parse_config({"sidecar": "localhost:99999"})


def test_unix_single_slash_absolute_path_is_accepted():
    assert parse_config({"sidecar": "unix:/tmp/guard.sock"}).sidecar == "unix:/tmp/guard.sock"


def test_unix_authority_form_is_a_bad_sidecar_address():
    with pytest.raises(GuardConfigError, match=r"runtime_guard\.sidecar: 'unix://tmp/guard.sock'"):
        parse_config({"sidecar": "unix://tmp/guard.sock"})


def test_not_an_object_is_refused():
    with pytest.raises(GuardConfigError, match=r"runtime_guard: expected a JSON object, got \[1\]"):
        parse_config([1])  # type: ignore[arg-type]


# -- where the config comes from ------------------------------------------------------------


def _write(tmp_path, data, name="guard.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_no_config_anywhere_is_off():
    assert resolve_config(None, environ={}) is None
    assert resolve_config({}, environ={}) is None
    assert resolve_config({"other_plugin": {"x": 1}}, environ={}) is None
    assert resolve_config(None, environ={CONFIG_FILE_ENV: ""}) is None


def test_inline_config():
    config = resolve_config(
        {"runtime_guard": {"engine": "inline", "buffer_size": 64, "batch_max": 32}}, environ={}
    )
    assert config is not None
    assert (config.engine, config.buffer_size, config.batch_max) == ("inline", 64, 32)


def test_empty_inline_object_turns_the_guard_on_with_defaults():
    assert resolve_config({"runtime_guard": {}}, environ={}) == GuardConfig()


def test_env_file_with_wrapper(tmp_path):
    path = _write(tmp_path, {"runtime_guard": {"engine": "from-file", "batch_max": 7}})
    config = resolve_config(None, environ={CONFIG_FILE_ENV: str(path)})
    assert config is not None
    assert (config.engine, config.batch_max) == ("from-file", 7)


def test_env_file_without_wrapper(tmp_path):
    path = _write(tmp_path, {"engine": "bare", "flush_interval_ms": 10})
    config = resolve_config(None, environ={CONFIG_FILE_ENV: str(path)})
    assert config is not None
    assert (config.engine, config.flush_interval_ms) == ("bare", 10)


def test_env_file_is_read_from_os_environ_by_default(tmp_path, monkeypatch):
    path = _write(tmp_path, {"engine": "via-os-environ"})
    monkeypatch.setenv(CONFIG_FILE_ENV, str(path))
    config = resolve_config(None)
    assert config is not None and config.engine == "via-os-environ"


def test_env_file_missing_names_the_path(tmp_path):
    path = tmp_path / "nope" / "guard.json"
    with pytest.raises(GuardConfigError) as info:
        resolve_config(None, environ={CONFIG_FILE_ENV: str(path)})
    assert str(path) in str(info.value)
    assert CONFIG_FILE_ENV in str(info.value)
    assert "cannot read" in str(info.value)


def test_env_file_invalid_json_names_the_path(tmp_path):
    path = _write(tmp_path, '{"engine": "x",')
    with pytest.raises(GuardConfigError) as info:
        resolve_config(None, environ={CONFIG_FILE_ENV: str(path)})
    assert str(path) in str(info.value)
    assert "not valid JSON" in str(info.value)


@pytest.mark.parametrize("data", [[1, 2], {"runtime_guard": 5}, "3"])
def test_env_file_not_an_object_names_the_path(tmp_path, data):
    path = _write(tmp_path, json.dumps(data))
    with pytest.raises(GuardConfigError) as info:
        resolve_config(None, environ={CONFIG_FILE_ENV: str(path)})
    assert str(path) in str(info.value)


def test_env_file_bad_value_names_key_and_value(tmp_path):
    path = _write(tmp_path, {"runtime_guard": {"buffer_size": -3}})
    with pytest.raises(GuardConfigError, match=r"runtime_guard\.buffer_size: -3"):
        resolve_config(None, environ={CONFIG_FILE_ENV: str(path)})


def test_inline_wins_over_file_key_by_key(tmp_path):
    path = _write(
        tmp_path, {"runtime_guard": {"engine": "file", "buffer_size": 64, "batch_max": 8}}
    )
    config = resolve_config(
        {"runtime_guard": {"engine": "inline", "batch_max": 16}},
        environ={CONFIG_FILE_ENV: str(path)},
    )
    assert config is not None
    assert config.engine == "inline"  # inline wins
    assert config.batch_max == 16  # inline wins
    assert config.buffer_size == 64  # only in the file: kept


def test_inline_can_turn_off_a_file_config(tmp_path):
    path = _write(tmp_path, {"runtime_guard": {"engine": "file"}})
    environ = {CONFIG_FILE_ENV: str(path)}
    assert resolve_config({"runtime_guard": {"enabled": False}}, environ=environ) is None
    assert resolve_config(None, environ=environ) is not None


def test_enabled_false_is_off():
    assert resolve_config({"runtime_guard": {"enabled": False}}, environ={}) is None


def test_enabled_false_in_file_is_off(tmp_path):
    path = _write(tmp_path, {"enabled": False, "engine": "e"})
    assert resolve_config(None, environ={CONFIG_FILE_ENV: str(path)}) is None


def test_enabled_false_still_validates():
    with pytest.raises(GuardConfigError, match=r"runtime_guard\.buffer_size: .*'big'"):
        resolve_config({"runtime_guard": {"enabled": False, "buffer_size": "big"}}, environ={})


def test_inline_not_an_object():
    with pytest.raises(GuardConfigError, match=r"runtime_guard: expected a JSON object, got 'on'"):
        resolve_config({"runtime_guard": "on"}, environ={})


# -- the config handed down to child processes ----------------------------------------------


def test_config_from_env_round_trips_to_json():
    config = GuardConfig(
        sidecar="10.1.2.3:7000",
        engine="eng",
        run_id="abc123",
        buffer_size=1000,
        batch_max=10,
        flush_interval_ms=5,
        heartbeat_interval_s=0.5,
        reconnect_max_backoff_s=3.0,
        error_log_per_minute=0,
    )
    assert config_from_env({RESOLVED_ENV: config.to_json()}) == config
    defaults = GuardConfig()
    assert config_from_env({RESOLVED_ENV: defaults.to_json()}) == defaults
    # to_json carries every field
    assert set(json.loads(config.to_json())) == {f.name for f in dataclasses.fields(GuardConfig)}


def test_config_from_env_absent_is_none(monkeypatch):
    assert config_from_env({}) is None
    assert config_from_env({RESOLVED_ENV: ""}) is None
    monkeypatch.delenv(RESOLVED_ENV, raising=False)
    assert config_from_env() is None


def test_config_from_env_reads_os_environ(monkeypatch):
    monkeypatch.setenv(RESOLVED_ENV, GuardConfig(engine="child").to_json())
    config = config_from_env()
    assert config is not None and config.engine == "child"


@pytest.mark.parametrize(
    ("text", "fragment"),
    [("{not json", RESOLVED_ENV), ('{"buffer_size": 1}', "runtime_guard.buffer_size: 1")],
)
def test_config_from_env_bad_text(text, fragment):
    with pytest.raises(GuardConfigError) as info:
        config_from_env({RESOLVED_ENV: text})
    assert RESOLVED_ENV in str(info.value)
    assert fragment in str(info.value)
