"""Graph capture: per captured graph, how many captures, how long, how much device memory;
and in FULL mode, whether each attention workspace is released right after its capture.

A `CaptureSession` spans one capture phase (a runner's `capture_model` or a graph manager's
`capture`). While it is open it wraps the device graph class's `capture_begin`/`capture_end`
(`torch.npu.NPUGraph` on Ascend, `torch.cuda.CUDAGraph` on CUDA), which every capture path goes
through, and it watches the attention workspaces of vllm-ascend's graph parameters: a workspace
stored during a capture must be gone (weak-referenced by `weak_ref_workspaces`) by the time the
next capture begins, or the phase ends. One that survives holds device memory for the life of
the process; it is reported as a leak with its size.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from ascend_runtime.probes import report


class _WorkspaceRecorder(dict):
    """A graph-params `workspaces` dict that remembers tensors stored during a capture."""

    session: CaptureSession | None = None

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        session = self.session
        if session is not None and session.capturing and value is not None:
            session.note_workspace(key, value)


class CaptureSession:
    def __init__(
        self,
        graph_cls: type | None,
        *,
        memory_allocated: Callable[[], int] = lambda: 0,
        describe: Callable[[], str] | None = None,
        workspace_params: Callable[[], Iterable[Any]] = lambda: (),
        source: str = "",
    ) -> None:
        self.graph_cls = graph_cls
        self._memory = memory_allocated
        self._describe = describe
        self._workspace_params = workspace_params
        self.source = source
        self.capturing = False
        self.stats: dict[str, list[float]] = {}  # label -> [count, seconds, bytes]
        self.leaks: list[dict[str, Any]] = []
        self._watched: list[tuple[Any, weakref.ref, int, str]] = []
        self._patched: dict[str, Any] = {}
        self._params: list[tuple[Any, dict]] = []
        self._begin: tuple[str, float, int] | None = None
        self._index = 0

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> CaptureSession:
        cls = self.graph_cls
        if cls is not None:
            for name, make in (
                ("capture_begin", self._wrap_begin),
                ("capture_end", self._wrap_end),
            ):
                original = cls.__dict__.get(name) or getattr(cls, name, None)
                if original is not None:
                    self._patched[name] = cls.__dict__.get(name)
                    setattr(cls, name, make(original))
        for params in self._workspace_params():
            if params is None or not isinstance(getattr(params, "workspaces", None), dict):
                continue
            recorder = _WorkspaceRecorder(params.workspaces)
            recorder.session = self
            self._params.append((params, params.workspaces))
            params.workspaces = recorder
        return self

    def __exit__(self, *exc: Any) -> None:
        cls = self.graph_cls
        for name, original in self._patched.items():
            if original is None:
                delattr(cls, name)
            else:
                setattr(cls, name, original)
        for params, _ in self._params:
            recorder = params.workspaces
            if isinstance(recorder, _WorkspaceRecorder):
                recorder.session = None
                params.workspaces = dict(recorder)
        self._params.clear()
        self.check_workspaces()
        self.publish()

    # -- hooks -------------------------------------------------------------------------------
    def _wrap_begin(self, original: Callable) -> Callable:
        def capture_begin(graph: Any, *args: Any, **kwargs: Any) -> Any:
            self._on_begin()
            return original(graph, *args, **kwargs)

        return capture_begin

    def _wrap_end(self, original: Callable) -> Callable:
        def capture_end(graph: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return original(graph, *args, **kwargs)
            finally:
                self._on_end()

        return capture_end

    def _on_begin(self) -> None:
        self.check_workspaces()  # the previous graph's workspace must be gone by now
        self._index += 1
        label = self._label()
        self.capturing = True
        self._begin = (label, time.perf_counter(), self._memory())

    def _on_end(self) -> None:
        self.capturing = False
        begun, self._begin = self._begin, None
        if begun is None:
            return
        label, t0, m0 = begun
        entry = self.stats.setdefault(label, [0, 0.0, 0])
        entry[0] += 1
        entry[1] += time.perf_counter() - t0
        entry[2] += max(0, self._memory() - m0)

    def _label(self) -> str:
        if self._describe is not None:
            try:
                label = self._describe()
                if label:
                    return label
            except Exception:  # noqa: BLE001
                pass
        return f"graph_{self._index}"

    def note_workspace(self, key: Any, value: Any) -> None:
        try:
            ref = weakref.ref(value)
        except TypeError:
            return
        nbytes = int(value.numel()) * int(value.element_size()) if hasattr(value, "numel") else 0
        self._watched.append((key, ref, nbytes, self._begin[0] if self._begin else ""))

    def check_workspaces(self) -> list[dict[str, Any]]:
        """Report workspaces still alive after their capture finished; forget released ones."""
        if self.capturing:
            return []
        found = []
        for key, ref, nbytes, label in self._watched:
            if ref() is not None:
                leak = {"num_tokens": key, "bytes": nbytes, "graph": label}
                found.append(leak)
                report.incident(
                    "graph_workspace_leak",
                    "error",
                    f"attention workspace of the {key}-token graph ({nbytes} bytes) survived its "
                    "capture; it is never freed",
                    evidence={**leak, "source": self.source},
                )
        self._watched.clear()
        self.leaks.extend(found)
        return found

    def publish(self) -> None:
        for label, (count, seconds, nbytes) in self.stats.items():
            report.probe("graph_captures", count, graph=label)
            report.probe("graph_capture_seconds", seconds, graph=label)
            report.probe("graph_capture_bytes", nbytes, graph=label)
        if self.leaks:
            report.probe("graph_workspace_leaked_bytes", sum(leak["bytes"] for leak in self.leaks))


def graph_class(platform: str) -> type | None:
    if platform == "ascend":
        import torch_npu

        return getattr(torch_npu.npu, "NPUGraph", None)
    if platform == "cuda":
        import torch

        return torch.cuda.CUDAGraph
    return None


def memory_reader(platform: str) -> Callable[[], int]:
    if platform == "ascend":
        import torch_npu

        return lambda: int(torch_npu.npu.memory_allocated())
    if platform == "cuda":
        import torch

        return lambda: int(torch.cuda.memory_allocated())
    return lambda: 0


def forward_context_label() -> str:
    """The batch descriptor vLLM's forward context holds while a graph is captured."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return ""
    descriptor = getattr(get_forward_context(), "batch_descriptor", None)
    if descriptor is None:
        return ""
    num_tokens = getattr(descriptor, "num_tokens", None)
    uniform = getattr(descriptor, "uniform", None)
    return f"tokens={num_tokens}" + (" uniform" if uniform else "")


def ascend_workspace_params() -> list[Any]:
    """vllm-ascend's FULL-mode graph parameters (None entries outside FULL mode)."""
    import sys

    acl_graph = sys.modules.get("vllm_ascend.compilation.acl_graph")
    if acl_graph is None:
        return []
    getters = ("get_graph_params", "get_draft_graph_params", "get_draft_graph_prefill_params")
    return [getattr(acl_graph, g)() for g in getters if hasattr(acl_graph, g)]
