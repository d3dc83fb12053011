"""The two decorators a model runner carries: one on `execute_model`, one on `sample_tokens`.

They can be applied in source (an Ascend `NPUModelRunner` carries them right below
`@torch.inference_mode()`) or at class level by `ascend_runtime`. With the guard off, the
decorated method is the bare call plus one module-global read: same arguments, same result, no
allocation, no device work. With the guard on, they hand the call to this process's
`GuardProcessor`, which times it and records the wave without touching the result.

This module is a leaf: it imports nothing of the guard (the processor is handed in through
`install`), so the façade `guard/incidents.py` and any binding can import it freely.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # for type checkers only: no import at run time
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


def runtime_guard_dummy_step(fn: F) -> F:
    """Decorate a worker's `execute_dummy_batch(self)`: the step an idle DP rank runs so its
    collectives match the busy ranks'. It counts as a wave with no requests (a dummy wave)."""
    if getattr(fn, WRAPPED_ATTR, None) is not None:
        return fn

    @functools.wraps(fn)
    def guarded_execute_dummy_batch(self: Any, *args: Any, **kwargs: Any) -> Any:
        processor = _processor
        if processor is None:
            return fn(self, *args, **kwargs)
        runner = getattr(self, "model_runner", None) or self
        return processor.run_step(
            lambda _runner, dummy_run: fn(self, *args, **kwargs), runner, (), {"dummy_run": True}
        )

    setattr(guarded_execute_dummy_batch, WRAPPED_ATTR, fn)
    return guarded_execute_dummy_batch  # type: ignore[return-value]


def is_guarded(method: Any) -> bool:
    return getattr(method, WRAPPED_ATTR, None) is not None


def unwrap(method: Any) -> Any:
    """The bare function under a guard decorator (or the method itself)."""
    return getattr(method, WRAPPED_ATTR, None) or method


def step_aside(cls: type, name: str, wrapper: Any) -> bool:
    """Put the bare function back in place of `wrapper`, on the class of `cls`'s MRO that holds
    it as `name`. For a wrapper that finds at its first call that it has nothing to do in this
    process, ever (no device clock, no config file to watch): on the engine thread every later
    step would still pay its frame. False when `wrapper` is not there (stepped aside already,
    or rebound)."""
    for owner in cls.__mro__:
        if owner.__dict__.get(name) is wrapper:
            setattr(owner, name, getattr(wrapper, WRAPPED_ATTR))
            return True
    return False


def runtime_guard_logits(fn: F) -> F:
    """Decorate a sampler's `forward(self, logits, sampling_metadata, ...)`: logits detectors."""
    if getattr(fn, WRAPPED_ATTR, None) is not None:
        return fn

    @functools.wraps(fn)
    def guarded_sampler_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        processor = _processor
        if processor is not None and processor.wants_logits:
            logits = args[0] if args else kwargs.get("logits")
            processor.on_logits(logits, None)
        return fn(self, *args, **kwargs)

    setattr(guarded_sampler_forward, WRAPPED_ATTR, fn)
    return guarded_sampler_forward  # type: ignore[return-value]


def runtime_guard_batch_logits(fn: F) -> F:
    """Decorate a sampler's `__call__(self, logits, input_batch)` (Model Runner V2): logits
    detectors, with the request id of each row from the batch's `req_ids`. An MRV2 runner
    keeps no batch of its own: it builds an `InputBatch` per step and hands it to the sampler."""
    if getattr(fn, WRAPPED_ATTR, None) is not None:
        return fn

    @functools.wraps(fn)
    def guarded_sampler_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        processor = _processor
        if processor is not None and processor.wants_logits:
            logits = args[0] if args else kwargs.get("logits")
            batch = args[1] if len(args) > 1 else kwargs.get("input_batch")
            processor.on_logits(logits, None, getattr(batch, "req_ids", None))
        return fn(self, *args, **kwargs)

    setattr(guarded_sampler_call, WRAPPED_ATTR, fn)
    return guarded_sampler_call  # type: ignore[return-value]


def batch_rows_per_request(batch: Any, logits: Any) -> list[int] | None:
    """The logits rows of each request of an MRV2 batch (its drafts + 1), from the batch's
    `cu_num_logits_np`; None when they do not add up to the logits' rows (adaptive
    verification compacts the logits and leaves that layout as it was)."""
    bounds = getattr(batch, "cu_num_logits_np", None)
    if bounds is None:
        return None
    bounds = bounds.tolist()
    rows = [end - start for start, end in zip(bounds[:-1], bounds[1:], strict=True)]
    return rows if sum(rows) == int(logits.shape[0]) else None


def runtime_guard_batch_verify_logits(fn: F) -> F:
    """Decorate MRV2's rejection sampler `__call__(self, logits, input_batch, draft_logits, ...)`:
    logits detectors over the target logits, `num_draft_tokens[i] + 1` rows for request i,
    with each request's id from the batch. MRV2 calls it instead of its sampler on a wave with
    drafts. A sampler called from inside is not checked a second time."""
    if getattr(fn, WRAPPED_ATTR, None) is not None:
        return fn

    @functools.wraps(fn)
    def guarded_verify_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        processor = _processor
        if processor is None or not processor.wants_logits:
            return fn(self, *args, **kwargs)
        logits = args[0] if args else kwargs.get("logits")
        batch = args[1] if len(args) > 1 else kwargs.get("input_batch")
        rows = batch_rows_per_request(batch, logits) if logits is not None else None
        # without the rows per request, a batch's ids would name the wrong rows
        req_ids = getattr(batch, "req_ids", None) if rows is not None else None
        processor.on_logits(logits, rows, req_ids)
        processor.logits_checked = True
        try:
            return fn(self, *args, **kwargs)
        finally:
            processor.logits_checked = False

    setattr(guarded_verify_call, WRAPPED_ATTR, fn)
    return guarded_verify_call  # type: ignore[return-value]


def runtime_guard_verify_logits(fn: F) -> F:
    """Decorate a rejection sampler's `forward(self, metadata, draft_probs, logits, ...)`.

    The target logits hold `num_draft_tokens[i] + 1` rows for request i. A sampler called from
    inside (for the bonus token) is not checked a second time.
    """
    if getattr(fn, WRAPPED_ATTR, None) is not None:
        return fn

    @functools.wraps(fn)
    def guarded_verify_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        processor = _processor
        if processor is None or not processor.wants_logits:
            return fn(self, *args, **kwargs)
        metadata = args[0] if args else kwargs.get("metadata")
        logits = args[2] if len(args) > 2 else kwargs.get("logits")
        rows = [n + 1 for n in getattr(metadata, "num_draft_tokens", ())] or None
        processor.on_logits(logits, rows)
        processor.logits_checked = True
        try:
            return fn(self, *args, **kwargs)
        finally:
            processor.logits_checked = False

    setattr(guarded_verify_forward, WRAPPED_ATTR, fn)
    return guarded_verify_forward  # type: ignore[return-value]
