"""structlog set-up shared by the sidecar, the CLI and the worker-side guard."""

from __future__ import annotations

import logging
import sys

import structlog


def configure(*, json_output: bool = False, level: str = "info") -> None:
    """Structured logs on stderr: key=value for people, JSON lines for log shippers."""
    renderer = (
        structlog.processors.JSONRenderer()
        if json_output
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
