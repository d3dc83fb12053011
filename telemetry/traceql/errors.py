"""The error every TraceQL refusal is (parse, validation, planning, evaluation)."""

from __future__ import annotations


class TraceQLError(ValueError):
    """A query that cannot run here (a metrics query given to search, a bad time range...)."""
