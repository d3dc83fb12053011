"""structlog set-up shared by the sidecar, the CLI and the worker-side guard."""

from __future__ import annotations

import logging
import sys

import structlog

# logging.getLevelNamesMapping() would do, but it is Python 3.11+; pyproject allows 3.10
LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


def configure(*, json_output: bool = False, level: str = "info") -> None:
    """Structured logs on stderr: key=value for people, JSON lines for log shippers."""
    try:
        threshold = LEVELS[level.lower()]
    except KeyError:
        raise ValueError(f"log level {level!r} is not one of {', '.join(LEVELS)}") from None
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
        wrapper_class=structlog.make_filtering_bound_logger(threshold),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
