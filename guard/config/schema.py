"""The machinery behind the `runtime_guard` config: typed sections validated recursively.

A section is a frozen dataclass. Field types say what a value must be (bool, int, float, str,
tuple of str or int, or another section); numeric bounds and enumerations sit in the field's
metadata (`value_range`, `choices`), and a section may add cross-field rules in `check(path)`.
Every error names the full dotted key and the value.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class GuardConfigError(ValueError):
    """A `runtime_guard` config that does not validate. The message names key and value."""


def value_range(low: float, high: float) -> dict[str, Any]:
    return {"range": (low, high)}


def choices(*values: str) -> dict[str, Any]:
    return {"choices": values}


ACTIONS = ("report", "dump")


def _check_type(key: str, value: Any, expected: Any) -> Any:
    if expected is bool:
        if not isinstance(value, bool):
            raise GuardConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if expected is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise GuardConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if expected is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise GuardConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if expected == tuple[str, ...]:
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise GuardConfigError(f"{key}: expected a list of strings, got {value!r}")
        return tuple(value)
    if expected == tuple[int, ...]:
        if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise GuardConfigError(f"{key}: expected a list of integers, got {value!r}")
        return tuple(value)
    if not isinstance(value, str):
        raise GuardConfigError(f"{key}: expected a string, got {value!r}")
    return value


def parse_section(cls: type[T], raw: Any, path: str) -> T:
    """Validate one config object against the frozen dataclass `cls`, recursively.

    `path` is the dotted key of `raw` (e.g. "runtime_guard.detectors"), so every error names
    the full key. Bounds and enumerations come from each field's metadata.
    """
    if not isinstance(raw, Mapping):
        raise GuardConfigError(f"{path}: expected a JSON object, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for key, value in raw.items():
        field = fields.get(key)
        dotted = f"{path}.{key}"
        if field is None:
            known = ", ".join(sorted(fields))
            raise GuardConfigError(f"{dotted}: unknown key (value {value!r}); known keys: {known}")
        expected = hints[key]
        if dataclasses.is_dataclass(expected):
            values[key] = parse_section(expected, value, dotted)
            continue
        value = _check_type(dotted, value, expected)
        bounds = field.metadata.get("range")
        if bounds is not None and not bounds[0] <= value <= bounds[1]:
            raise GuardConfigError(f"{dotted}: {value!r} is outside [{bounds[0]:g}, {bounds[1]:g}]")
        choices = field.metadata.get("choices")
        if choices is not None and value not in choices:
            raise GuardConfigError(f"{dotted}: {value!r} is not one of {', '.join(choices)}")
        values[key] = value
    section = cls(**values)
    check = getattr(section, "check", None)
    if callable(check):
        check(path)  # cross-field rules; raises GuardConfigError naming the key
    return section
