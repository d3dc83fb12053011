"""The detectors' compiled kernels (numba), loaded once per process, lazily.

    repeat_kernel   token_repeat's screen over a batch of waves (`tokens.RepeatDetector`)
    logits_kernel   logits_finite's row check on host logits (`suite.DetectorSuite`)

numba compiles them on a machine's first load (about 2 s here) and reads them from its on-disk
cache after that (0.3 s with numba's own import). They are imported only when a detector
suite is made: in a worker that is at the first wave, after vLLM's worker set-up (vLLM's CPU
platform rebinds its Triton kernels by walking every module loaded then, and numba's llvmlite
bindings break that walk). A worker loads them on a thread of its own (`load_in_background`),
so no wave waits for a compile; until they are in, the detectors queue their waves
(token_repeat) or use torch (logits_finite).
"""

from __future__ import annotations

import threading
from types import ModuleType
from typing import NamedTuple

import structlog

log = structlog.get_logger("ascend_guard.detectors")


class Kernels(NamedTuple):
    repeat: ModuleType
    logits: ModuleType


_kernels: Kernels | None = None
_error: BaseException | None = None
_loading = False  # a background load is under way
_lock = threading.Lock()


def load() -> Kernels:
    """The kernels, compiled or read from numba's cache on the first call (which waits for a
    load under way on another thread)."""
    global _kernels, _error
    with _lock:
        if _kernels is None:
            if _error is not None:
                raise RuntimeError(f"the detectors' kernels did not load: {_error!r}")
            try:
                from guard.detectors import logits_kernel, repeat_kernel
            except Exception as exc:
                _error = exc
                raise
            _kernels = Kernels(repeat_kernel, logits_kernel)
    return _kernels


def loaded() -> Kernels | None:
    """The kernels if they are in; never waits."""
    return _kernels


def loading() -> bool:
    """A background load is under way."""
    return _loading


def load_in_background() -> None:
    """Start loading the kernels on a thread of their own."""
    global _loading
    with _lock:
        if _kernels is not None or _error is not None or _loading:
            return
        _loading = True
    threading.Thread(target=_load_quietly, name="guard-detector-kernels", daemon=True).start()


def _load_quietly() -> None:
    global _loading
    try:
        load()
    except Exception as exc:  # noqa: BLE001 - recorded; the next use raises it
        log.error("detector_kernels_failed", error=repr(exc))
    finally:
        _loading = False
