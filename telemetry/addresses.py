"""Default places the sidecar and the workers agree on without configuration."""

from __future__ import annotations

import os
import tempfile


def default_sidecar_address() -> str:
    """The unix socket the sidecar listens on, and the guard sends to, unless told otherwise."""
    return f"unix://{os.path.join(tempfile.gettempdir(), 'ascend-guard.sock')}"
