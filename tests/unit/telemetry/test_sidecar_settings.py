"""The sidecar's flags are generated from its settings table: every flag reaches its field, every
default is the owner's constant, and a bad value names its flag."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from telemetry.cli.commands import sidecar as command
from telemetry.crossrank.hangs import HangSettings
from telemetry.crossrank.ranksync import DEFAULT_STRAGGLER_S
from telemetry.crossrank.roster import DEFAULT_LINGER_S
from telemetry.sidecar.settings import SECURITY_FLAGS, SidecarSettings
from telemetry.spans.query import QueryError
from telemetry.store import DEFAULT_MAX_BYTES, DEFAULT_RETENTION_S
from telemetry.wire import paths


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    command.add_parser(parser.add_subparsers(dest="cmd"))
    return parser.parse_args(["sidecar", *argv])


def test_the_defaults_are_the_owners_constants():
    settings = command.settings_from_args(parse())
    assert settings.hang_stale_s == HangSettings.stale_s
    assert settings.hang_wait_s == HangSettings.wait_s
    assert settings.hang_frozen_s == HangSettings.frozen_s
    assert settings.straggler_threshold_s == DEFAULT_STRAGGLER_S
    assert settings.engine_linger_s == DEFAULT_LINGER_S
    assert settings.retention_s == DEFAULT_RETENTION_S
    assert settings.max_store_bytes == DEFAULT_MAX_BYTES
    assert settings.socket_mode == paths.DEFAULT_SOCKET_MODE
    # the fields the command line leaves alone keep the dataclass's defaults
    for field in dataclasses.fields(SidecarSettings):
        if not field.metadata.get("flag") and field.name != "security":
            assert getattr(settings, field.name) == field.default, field.name


def test_every_flag_reaches_its_field():
    args = parse(
        "--hang-after", "5s", "--hang-wait", "7s", "--max-store-bytes", "1GiB",
        "--retention", "90m", "--queue-bytes", "8MiB", "--straggler-threshold", "20ms",
        "--socket-group", "video", "--metrics-port", "1234", "--token-file", "/t",
        "--metrics-open",
    )  # fmt: skip
    settings = command.settings_from_args(args)
    assert (settings.hang_stale_s, settings.hang_wait_s) == (5.0, 7.0)
    assert settings.max_store_bytes == 2**30 and settings.queue_bytes == 8 * 2**20
    assert settings.retention_s == 5400.0 and settings.straggler_threshold_s == 0.02
    assert settings.socket_mode == paths.GROUP_SOCKET_MODE  # follows --socket-group
    assert settings.metrics_port == 1234
    assert settings.security.token_file == "/t" and settings.security.metrics_open
    flags = {f.metadata["flag"] for f in dataclasses.fields(SidecarSettings) if f.metadata["flag"]}
    assert {flag for _, flag, *_ in SECURITY_FLAGS} | flags <= _option_strings()


def _option_strings() -> set[str]:
    parser = argparse.ArgumentParser()
    command.add_parser(parser.add_subparsers())
    (sub,) = parser._subparsers._group_actions[0].choices.values()
    return {s for action in sub._actions for s in action.option_strings}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--hang-after", "0s"), "--hang-after: must be above 0, got 0s"),
        (("--otlp-keep-one-in", "0"), "--otlp-keep-one-in: must be above 0, got 0"),
        (("--max-store-bytes", "12XB"), "--max-store-bytes: '12XB' is not a size"),
        (("--retention", "soon"), "--retention: 'soon' is not a duration"),
    ],
)
def test_a_bad_value_names_its_flag(argv, message):
    with pytest.raises(QueryError, match=message):
        command.settings_from_args(parse(*argv))
