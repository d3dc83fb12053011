"""HCCL settings as an info metric, and the rule that the guard's hang deadline stays well
below HCCL's own timeout (or HCCL aborts the job before the guard can say which rank hung)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from ascend_runtime.probes import report

HCCL_SETTINGS = ("HCCL_ALGO", "HCCL_EXEC_TIMEOUT", "HCCL_CONNECT_TIMEOUT")
# HCCL's documented defaults (seconds) when the variables are unset.
HCCL_DEFAULTS = {"HCCL_EXEC_TIMEOUT": "1836", "HCCL_CONNECT_TIMEOUT": "120"}
# The hang deadline must be at most this fraction of HCCL_EXEC_TIMEOUT.
DEADLINE_FRACTION = 0.1


def hccl_settings(env: Mapping[str, str] | None = None) -> dict[str, str]:
    env = os.environ if env is None else env
    return {
        name.lower(): env.get(name) or HCCL_DEFAULTS.get(name, "default") for name in HCCL_SETTINGS
    }


def report_settings(communicator: str, env: Mapping[str, str] | None = None) -> dict[str, str]:
    settings = hccl_settings(env)
    report.probe("hccl_settings_info", 1, communicator=communicator, **settings)
    return settings


def check_hang_deadline(deadline_s: float, env: Mapping[str, str] | None = None) -> str | None:
    """A problem in words, or None when deadline_s <= DEADLINE_FRACTION x HCCL_EXEC_TIMEOUT."""
    raw = hccl_settings(env)["hccl_exec_timeout"]
    try:
        exec_timeout = float(raw)
    except ValueError:
        return f"HCCL_EXEC_TIMEOUT={raw!r} is not a number of seconds"
    if exec_timeout <= 0:
        return None  # 0 disables HCCL's timeout: any deadline is below it
    limit = exec_timeout * DEADLINE_FRACTION
    if deadline_s > limit:
        return (
            f"hang deadline {deadline_s:g} s is above {DEADLINE_FRACTION:g} x HCCL_EXEC_TIMEOUT "
            f"({exec_timeout:g} s): HCCL would abort before the guard reports the hang"
        )
    return None
