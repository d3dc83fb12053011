"""Which argument of a collective call holds its payload, and its size, read without torch
(`.nbytes` and `.dtype` only). Engine thread.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


def tensor_size(value: Any) -> tuple[int, Any]:
    """(bytes, dtype) of a tensor, a list of tensors or a dict of them; (0, None) otherwise."""
    nbytes = getattr(value, "nbytes", None)
    if nbytes is not None:
        return int(nbytes), getattr(value, "dtype", None)
    if isinstance(value, Mapping):
        value = value.values()
    elif not isinstance(value, (list, tuple)):
        return 0, None
    total, dtype = 0, None
    for item in value:
        size = getattr(item, "nbytes", None)
        if size is not None:
            total += int(size)
            if dtype is None:
                dtype = getattr(item, "dtype", None)
    return total, dtype


# -- payload readers: (args, kwargs, result) -> the tensor, list or dict carried (or None) ----
Payload = Callable[[tuple, dict, Any], Any]


def first_arg(args: tuple, kwargs: dict, result: Any) -> Any:
    if args:
        return args[0]
    for value in kwargs.values():
        return value
    return None


def arg_or_result(args: tuple, kwargs: dict, result: Any) -> Any:
    """The tensor (dict) passed in, or on receiving ranks the one that came back."""
    data = first_arg(args, kwargs, result)
    return result if data is None else data


def result_only(args: tuple, kwargs: dict, result: Any) -> Any:
    return result


def no_payload(args: tuple, kwargs: dict, result: Any) -> Any:
    return None
