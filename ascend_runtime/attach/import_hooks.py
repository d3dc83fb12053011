"""Run a callback when a module is imported (or now, if it already is).

The guard binds to runner classes in the process that imports them, at the moment it imports
them: processes that never load a model runner (API server, engine core at TP>1) pay nothing,
and the import order inside vLLM does not matter.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable
from types import ModuleType

Callback = Callable[[ModuleType], None]


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.pending: dict[str, list[Callback]] = {}
        self._lock = threading.Lock()
        self._resolving = threading.local()

    def find_spec(self, fullname, path, target=None):  # type: ignore[override]
        if fullname not in self.pending or getattr(self._resolving, "name", None) == fullname:
            return None
        self._resolving.name = fullname
        try:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        finally:
            self._resolving.name = None
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original_exec(module)
            self.fire(fullname, module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec

    def fire(self, name: str, module: ModuleType) -> None:
        with self._lock:
            callbacks = self.pending.pop(name, [])
        for callback in callbacks:
            callback(module)


_finder = _PostImportFinder()


def when_imported(module_name: str, callback: Callback) -> None:
    """Call `callback(module)` once `module_name` is imported; at once if it already is."""
    module = sys.modules.get(module_name)
    if module is not None:
        callback(module)
        return
    with _finder._lock:
        _finder.pending.setdefault(module_name, []).append(callback)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
