"""Collectives inside captured device graphs: noted at capture, counted at each replay.

A CUDA graph or ACL graph (piecewise or FULL) replays its collectives with no Python, so the
per-call wrappers see a collective only while the graph is captured. The wrappers here sit on
the device graph class's own `capture_begin` / `capture_end` / `replay` (`torch.cuda.CUDAGraph`,
`torch_npu.npu.NPUGraph`; rows of action "graph_collectives" in
`ascend_runtime/attach/points.py`), which every capture path goes through: vLLM's
`CUDAGraphWrapper`, the MRV2 graph managers, vllm-ascend's `ACLGraphWrapper`. Between
`capture_begin` and `capture_end` the tracker notes each collective on the graph being
captured; each `replay` of a graph that holds collectives is counted into the wave by the
tracker (`CollectiveTracker.replay`), with device events around it.

With the guard off (no tracker) each wrapper is the bare method plus one global read.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any

from guard.collectives import graphs as collective_graphs
from guard.collectives import install as collective_install

GRAPH_ATTR = "_ascend_guard_graph"
_index = itertools.count(1)
# graphs whose class refuses attributes (a C++ type without __dict__)
_side: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def graph_label() -> str:
    """Which graph this is: vLLM's runtime mode and batch descriptor while it is captured
    ("PIECEWISE tokens=8 #12"), else just its capture index."""
    mode, tokens = "", ""
    try:
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if is_forward_context_available():
            context = get_forward_context()
            runtime_mode = getattr(context, "cudagraph_runtime_mode", None)
            mode = str(getattr(runtime_mode, "name", "") or "")
            descriptor = getattr(context, "batch_descriptor", None)
            num_tokens = getattr(descriptor, "num_tokens", None)
            tokens = f"tokens={num_tokens}" if num_tokens is not None else ""
    except Exception:  # noqa: BLE001 - no vLLM here (the torch-only CUDA check)
        pass
    return " ".join(part for part in (mode, tokens, f"#{next(_index)}") if part)


def captured(graph: Any) -> collective_graphs.CapturedGraph | None:
    """The collectives noted while `graph` was captured (None: none seen, or guard off)."""
    found = getattr(graph, GRAPH_ATTR, None)
    if found is None and _side:
        found = _side.get(graph)
    return found


def _attach(graph: Any, record: collective_graphs.CapturedGraph) -> None:
    try:
        setattr(graph, GRAPH_ATTR, record)
    except (AttributeError, TypeError):
        _side[graph] = record


def graph_wrapper(method_name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """The wrapper of one device graph method (the binder's "graph_collectives" action)."""
    if method_name == "capture_begin":

        def capture_begin(self: Any, *args: Any, **kwargs: Any) -> Any:
            tracker = collective_install._tracker
            if tracker is not None:
                _attach(self, tracker.begin_capture(graph_label()))
            return method(self, *args, **kwargs)

        wrapper = capture_begin
    elif method_name == "capture_end":

        def capture_end(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            finally:
                tracker = collective_install._tracker
                if tracker is not None:
                    tracker.end_capture()

        wrapper = capture_end
    elif method_name == "replay":

        def replay(self: Any, *args: Any, **kwargs: Any) -> Any:
            tracker = collective_install._tracker
            record = captured(self) if tracker is not None else None
            if record is None or not record.calls:
                return method(self, *args, **kwargs)
            if args or kwargs:
                return tracker.replay(record, lambda g: method(g, *args, **kwargs), self)
            return tracker.replay(record, method, self)

        wrapper = replay
    else:
        raise ValueError(f"no graph wrapper for {method_name!r}")
    wrapper.__name__ = method_name
    wrapper.__qualname__ = getattr(method, "__qualname__", method_name)
    wrapper.__doc__ = getattr(method, "__doc__", None)
    wrapper.__wrapped__ = method  # type: ignore[attr-defined]
    setattr(wrapper, collective_install.GUARD_WRAPPED_ATTR, method)
    return wrapper
