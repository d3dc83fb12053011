"""`torch_npu.npu` stand-in: devices, stream, timing events, graphs, memory."""

from __future__ import annotations

from typing import Any

state: dict[str, Any] = {"devices": 1, "allocated": 0, "captures": []}


class Stream:
    def __init__(self) -> None:
        self.clock_ms = 0.0  # where queued work will have brought the device
        self.completed_ms = 0.0  # where the device is now


_stream = Stream()


def reset(devices: int = 1) -> None:
    global _stream
    state.update(devices=devices, allocated=0, captures=[])
    _stream = Stream()


def is_available() -> bool:
    return state["devices"] > 0


def device_count() -> int:
    return state["devices"]


def current_stream() -> Stream:
    return _stream


def queue(ms: float) -> None:
    """Queue `ms` of device work on the current stream."""
    _stream.clock_ms += ms


def complete(until_ms: float | None = None) -> None:
    """Let the device run (up to `until_ms`, default everything queued)."""
    _stream.completed_ms = _stream.clock_ms if until_ms is None else until_ms


def memory_allocated() -> int:
    return state["allocated"]


class Event:
    def __init__(self, enable_timing: bool = False, **_: Any) -> None:
        self.enable_timing = enable_timing
        self.at: float | None = None

    def record(self, stream: Stream | None = None) -> None:
        self.at = (stream or _stream).clock_ms

    def query(self) -> bool:
        return self.at is not None and _stream.completed_ms >= self.at

    def elapsed_time(self, end: Event) -> float:
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("events were not created with enable_timing=True")
        if not (self.query() and end.query()):
            raise RuntimeError("elapsed_time on an event the device has not reached")
        return float(end.at - self.at)  # type: ignore[operator]

    def synchronize(self) -> None:
        raise AssertionError("a probe waited for the NPU (Event.synchronize)")


class NPUGraph:
    def __init__(self) -> None:
        self.captured = False

    def capture_begin(self, *args: Any, **kwargs: Any) -> None:
        state["captures"].append(("begin", self))

    def capture_end(self) -> None:
        self.captured = True
        state["captures"].append(("end", self))

    def replay(self) -> None:
        if not self.captured:
            raise RuntimeError("replay before capture")


class graph:  # noqa: N801 - the torch_npu name
    """`with torch_npu.npu.graph(g):` as torch_npu spells it: capture_begin ... capture_end."""

    def __init__(self, npu_graph: NPUGraph, pool: Any = None, stream: Any = None) -> None:
        self.npu_graph = npu_graph

    def __enter__(self) -> NPUGraph:
        self.npu_graph.capture_begin()
        return self.npu_graph

    def __exit__(self, *exc: Any) -> None:
        self.npu_graph.capture_end()
