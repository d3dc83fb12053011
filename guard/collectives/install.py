"""The process's one collective tracker and the wrapper that feeds it: `wrap_collective` sits on
vLLM's `GroupCoordinator` methods (bound by `ascend_runtime.attach.collectives`) and does
nothing but call through while no tracker is installed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from guard.collectives.payload import Payload, first_arg
from guard.collectives.tracker import CollectiveTracker

WRAPPED_ATTR = "__ascend_guard_collective__"


# the marker every guard wrapper carries (guard.decorators.WRAPPED_ATTR; not imported here: that
# module imports the config, which imports this one), so is_guarded/unwrap and the binder see it
GUARD_WRAPPED_ATTR = "__ascend_guard_wrapped__"


# -- the wrapper ----------------------------------------------------------------------------
_tracker: CollectiveTracker | None = None


def install_tracker(tracker: CollectiveTracker | None) -> None:
    """Turn collective recording on for this process (or off, with None)."""
    global _tracker
    _tracker = tracker


def active_tracker() -> CollectiveTracker | None:
    return _tracker


def wrap_collective(
    op: str,
    fn: Callable[..., Any],
    payload: Payload = first_arg,
    is_compiling: Callable[[], bool] = lambda: False,
) -> Callable[..., Any]:
    """A `GroupCoordinator` method that reports itself to this process's tracker.

    With no tracker installed it is the bare call plus one global read. While torch.compile
    traces (is_compiling), it is the bare call too, so no guard code enters a graph.
    """
    if getattr(fn, WRAPPED_ATTR, None) is not None:
        return fn

    def guarded_collective(self: Any, *args: Any, **kwargs: Any) -> Any:
        tracker = _tracker
        if tracker is None or tracker._depth or is_compiling():  # _depth: inside a counted
            return fn(self, *args, **kwargs)  # call (a compiled graph, a nested collective)
        return tracker.run(op, fn, self, args, kwargs, payload)

    guarded_collective.__name__ = getattr(fn, "__name__", op)
    guarded_collective.__qualname__ = getattr(fn, "__qualname__", op)
    guarded_collective.__doc__ = getattr(fn, "__doc__", None)
    guarded_collective.__wrapped__ = fn  # type: ignore[attr-defined]
    setattr(guarded_collective, WRAPPED_ATTR, fn)
    setattr(guarded_collective, GUARD_WRAPPED_ATTR, fn)
    return guarded_collective
