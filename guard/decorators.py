"""The two decorators a model runner carries: one on `execute_model`, one on `sample_tokens`.

They can be applied in source (an Ascend `NPUModelRunner` carries them right below
`@torch.inference_mode()`) or at class level by `ascend_runtime`. With the guard off, the
decorated method is the bare call plus one module-global read: same arguments, same result, no
allocation, no device work. With the guard on, they hand the call to this process's
`GuardProcessor`, which times it and records the wave without touching the result.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from guard.processor import GuardProcessor

F = TypeVar("F", bound=Callable[..., Any])

WRAPPED_ATTR = "__ascend_guard_wrapped__"

_processor: GuardProcessor | None = None


def install(processor: GuardProcessor | None) -> None:
    """Turn the guard on for this process (or off, with None)."""
    global _processor
    _processor = processor


def active_processor() -> GuardProcessor | None:
    return _processor


def runtime_guard_step(fn: F) -> F:
    """Decorate a runner's `execute_model(self, scheduler_output, ...)`."""
    if getattr(fn, WRAPPED_ATTR, None) is not None:
        return fn

    @functools.wraps(fn)
    def guarded_execute_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        processor = _processor
        if processor is None:
            return fn(self, *args, **kwargs)
        return processor.run_step(fn, self, args, kwargs)

    setattr(guarded_execute_model, WRAPPED_ATTR, fn)
    return guarded_execute_model  # type: ignore[return-value]


def runtime_guard_sample_tokens(fn: F) -> F:
    """Decorate a runner's `sample_tokens(self, grammar_output)`."""
    if getattr(fn, WRAPPED_ATTR, None) is not None:
        return fn

    @functools.wraps(fn)
    def guarded_sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        processor = _processor
        if processor is None:
            return fn(self, *args, **kwargs)
        return processor.run_sample(fn, self, args, kwargs)

    setattr(guarded_sample_tokens, WRAPPED_ATTR, fn)
    return guarded_sample_tokens  # type: ignore[return-value]


def is_guarded(method: Any) -> bool:
    return getattr(method, WRAPPED_ATTR, None) is not None


def unwrap(method: Any) -> Any:
    """The bare function under a guard decorator (or the method itself)."""
    return getattr(method, WRAPPED_ATTR, None) or method
