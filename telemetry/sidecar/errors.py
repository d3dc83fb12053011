"""Why a sidecar does not start: the one error its start-up raises, with what is in the way."""

from __future__ import annotations


class SidecarStartError(RuntimeError):
    """The sidecar cannot start; the message says what is in the way."""
