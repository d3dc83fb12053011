"""Collectives inside torch.compile'd graphs, counted per call of the compiled graph.

A compiled model's per-layer collectives run inside the compiled code: on CPU Dynamo inlines
`GroupCoordinator._all_reduce_out_place` -> `CpuCommunicator.all_reduce` down to the kernel
(`torch.ops._C.shm_allreduce`), which the graph then calls with no Python; on CUDA, ROCm, XPU
and Ascend they are vLLM's custom ops (`torch.ops.vllm.all_reduce`), whose Python
implementation reaches the `GroupCoordinator` wrappers, one dispatcher crossing per call.

Rather than put a Python kernel around each collective (a dispatcher crossing from compiled
code costs ~2 us on the CPUs measured, more than the whole eager per-call budget), the guard
reads the graph once: at its first call, `scan` walks the Dynamo FX graph for the collective
kernels below and notes op, group and bytes per collective, bytes as a function of the graph's
symbolic sizes (the batch size) taken from the fake tensors' shapes. Each call of the compiled
graph then goes through one wrapper (`CollectiveTracker.run_graph`) that counts all of them
into the wave, marked graph-counted, advances the groups' sequence numbers by the graph's
count, and names the graph and its list as the current collective while inside it. Inside
the call the per-collective wrappers step aside (the tracker's depth), so nothing is counted
twice, and those a custom op reaches from Python are shadowed by the unwrapped methods on
their coordinators (`bypass_of`), so they cost no frame at all; the graph itself is the
same with the guard on and off (no guard op, no recompile).

Lost against per-call counting: each collective's own host time (host_ns 0 for these; the
slow-call list and the wave's wait time come from eager calls only) and, in a hang, which of
the graph's collectives a rank waits in (the verdict names the graph and its list).

Two hooks (action "compiled_graph" in `ascend_runtime/attach/points.py`), one per compilation
mode: `vllm.compilation.caching.VllmSerializableFunction.__call__` for `VLLM_COMPILE` (every
compiled graph vLLM's own backend returns, freshly compiled or loaded as an AOT artifact, is
one, and it keeps the Dynamo graph as `graph_module`), and
`vllm.config.compilation.CompilationConfig.init_backend` for the modes that hand torch.compile
a stock backend (`DYNAMO_TRACE_ONCE`, vLLM's CPU default, and `STOCK_TORCH_COMPILE`): that
backend is wrapped so that its compiled callable is counted the same way; under AOT compile
(vLLM's default there with the compile cache on) the wrapper is a torch `SerializableCallable`
that saves the stock artifact with the graph's collective list and counts again once loaded.
An artifact saved by an unguarded process and loaded by a guarded one holds no list: its
collectives stay unseen (separate caches, or VLLM_DISABLE_COMPILE_CACHE=1, avoid that).
"""

from __future__ import annotations

import contextlib
import itertools
import types
from collections.abc import Callable
from typing import Any

import structlog

from guard.collectives import graphs as collective_graphs
from guard.collectives import install as collective_install

log = structlog.get_logger("ascend_guard.compiled_collectives")

GRAPH_ATTR = "_ascend_guard_compiled_graph"
_NONE = collective_graphs.CompiledGraph("none", [], [])  # a graph holding no collective
_labels = itertools.count()

# kernel (namespace::name) -> (op as the eager wrappers name it, tensor argument, how the group
# is named: "name" (vLLM's unique group name), "handle" (the CPU shared-memory handle), "c10d"
# (the torch.distributed group name)), with that argument's position
KERNELS: dict[str, tuple[str, int, str, int]] = {
    "vllm::all_reduce": ("all_reduce", 0, "name", 1),
    "vllm::all_gather": ("all_gather", 0, "name", 3),
    "vllm::reduce_scatter": ("reduce_scatter", 0, "name", 3),
    "_C::shm_allreduce": ("all_reduce", 1, "handle", 0),
    "_C::shm_all_gather": ("all_gather", 1, "handle", 0),
    "_c10d_functional::all_reduce": ("all_reduce", 0, "c10d", 2),
    "_c10d_functional::all_reduce_": ("all_reduce", 0, "c10d", 2),
    "_c10d_functional::all_gather_into_tensor": ("all_gather", 0, "c10d", 2),
    "_c10d_functional::reduce_scatter_tensor": ("reduce_scatter", 0, "c10d", 3),
}


# op -> the GroupCoordinator method that vLLM's custom op of that op (a kernel whose group is
# named by "name") calls from its Python implementation
CUSTOM_OP_METHODS = {
    "all_reduce": "_all_reduce_out_place",
    "all_gather": "_all_gather_out_place",
    "reduce_scatter": "_reduce_scatter_out_place",
}


def bypass_of(
    collectives_found: list[tuple[Any, str, str]],
) -> tuple[tuple[dict, str, Callable[..., Any]], ...]:
    """`CompiledGraph.bypass` for a graph's collectives, each (coordinator, op, how its group
    is named): for those that are vLLM's custom ops (named by "name"), the guard-wrapped
    method each one's implementation calls, unwrapped and bound to its coordinator, with
    where it shadows the wrapper (the instance `__dict__`, which an attribute lookup reads
    before the class's function). A method the guard has not wrapped needs none."""
    found: dict[tuple[int, str], tuple[dict, str, Callable[..., Any]]] = {}
    for group, op, naming in collectives_found:
        name = CUSTOM_OP_METHODS.get(op) if naming == "name" else None
        if name is None:
            continue
        original = getattr(getattr(type(group), name, None), collective_install.WRAPPED_ATTR, None)
        namespace = getattr(group, "__dict__", None)
        if original is None or not isinstance(namespace, dict) or name in namespace:
            continue
        found[(id(group), name)] = (namespace, name, types.MethodType(original, group))
    return tuple(found.values())


def kernel_name(target: Any) -> str | None:
    """The "namespace::name" of an FX node's op target (overload or packet), else None."""
    name = getattr(target, "_qualified_op_name", None)  # OpOverloadPacket
    if name is None:
        schema = getattr(target, "_schema", None)  # OpOverload
        name = getattr(schema, "name", None)
    return name if isinstance(name, str) else None


def _groups() -> list[Any]:
    from vllm.distributed import parallel_state

    live = []
    for ref in list(parallel_state._groups.values()):
        group = ref()
        if group is not None:
            live.append(group)
    return live


def _resolve(how: str, value: Any) -> Any:
    """The live GroupCoordinator a kernel's group argument names, or None."""
    from vllm.distributed import parallel_state

    if how == "name":
        ref = parallel_state._groups.get(value)
        return ref() if ref is not None else None
    for group in _groups():
        communicator = getattr(group, "device_communicator", None)
        if how == "handle":
            dist_module = getattr(communicator, "dist_module", None)
            if getattr(dist_module, "handle", None) == value:
                return group
        else:
            for pg in (getattr(group, "device_group", None), getattr(group, "cpu_group", None)):
                if pg is not None and getattr(pg, "group_name", None) == value:
                    return group
    return None


def _arg(node: Any, index: int) -> Any:
    if index < len(node.args):
        return node.args[index]
    target = node.target
    schema = getattr(target, "_schema", None) or getattr(
        getattr(target, "default", None), "_schema", None
    )
    if schema is not None and index < len(schema.arguments):
        return node.kwargs.get(schema.arguments[index].name)
    return None


def _constant(value: Any) -> Any:
    """A group argument's value: a constant, or a graph input Dynamo lifted (an int attribute
    read as a symbolic int under dynamic=True), by its traced value."""
    if hasattr(value, "meta"):
        value = _fake(value)
        hint = getattr(getattr(value, "node", None), "hint", None)
        return hint if hint is not None else value
    return value


def _fake(value: Any) -> Any:
    meta = getattr(value, "meta", None) or {}
    return meta.get("example_value", meta.get("val"))


def _symbol_locations(gm: Any) -> dict[Any, tuple[int, int]]:
    """Each bare symbolic size -> (placeholder index, dim; -1 for a SymInt placeholder)."""
    import torch

    found: dict[Any, tuple[int, int]] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):  # SymInt inputs first: read as the int itself
        value = _fake(node)
        if isinstance(value, torch.SymInt) and value.node.expr.is_Symbol:
            found.setdefault(value.node.expr, (i, -1))
    for i, node in enumerate(placeholders):
        value = _fake(node)
        if isinstance(value, torch.Tensor):
            for dim, size in enumerate(value.shape):
                if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                    found.setdefault(size.node.expr, (i, dim))
    return found


def _bytes(tensor: Any, symbols: dict[Any, int]) -> tuple[int, tuple, Any]:
    """(constant, terms, exact) of the tensor's byte size over the symbolic sizes."""
    import sympy
    import torch

    itemsize = tensor.element_size()
    numel = tensor.numel()
    if not isinstance(numel, torch.SymInt):
        return int(numel) * itemsize, (), None
    expr = sympy.expand(numel.node.expr * itemsize)
    free = list(expr.free_symbols)
    if any(s not in symbols for s in free):
        raise ValueError(f"size {expr} depends on a symbol no graph input carries")
    poly = sympy.Poly(expr, *free) if free else None
    if poly is not None and poly.total_degree() <= 1:
        terms = tuple((symbols[s], int(poly.coeff_monomial(s))) for s in free)
        return int(poly.coeff_monomial(1)), terms, None
    order = [symbols[s] for s in free]
    fn = sympy.lambdify(free, expr, modules="math")
    return 0, (), lambda sizes: int(fn(*(sizes[k] for k in order)))


def scan(
    gm: Any, label: str, offset: int = 0, portable: list | None = None
) -> collective_graphs.CompiledGraph:
    """The collectives the Dynamo FX graph `gm` holds, in program order (the call's
    arguments are the graph's inputs after `offset` leading ones)."""
    locations = _symbol_locations(gm)
    symbols = {sym: k for k, sym in enumerate(locations)}
    entries = []
    reached = []  # (coordinator, op, naming) of each collective, for `bypass_of`
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        how = KERNELS.get(kernel_name(node.target) or "")
        if how is None:
            continue
        op, tensor_at, naming, group_at = how
        naming_value = _constant(_arg(node, group_at))
        group = _resolve(naming, naming_value)
        if group is None:
            raise ValueError(f"{node.target}: no live group for {naming_value!r}")
        tensor = _fake(_arg(node, tensor_at))
        if tensor is None:
            raise ValueError(f"{node.target}: the graph keeps no fake tensor for its input")
        constant, terms, exact = _bytes(tensor, symbols)
        dtype = str(tensor.dtype).removeprefix("torch.")
        entries.append((op, group, dtype, constant, terms, exact))
        reached.append((group, op, naming))
        if portable is not None:  # what a saved artifact keeps: groups by how they are named
            portable.append((op, naming, naming_value, dtype, constant, terms, exact is not None))
    where = [(i + offset, dim) for i, dim in locations.values()]
    graph = collective_graphs.CompiledGraph(label, entries, where)
    graph.bypass = bypass_of(reached)
    return graph


def graph_of(
    owner: Any, gm: Any, prefix: str = "graph", offset: int = 0
) -> collective_graphs.CompiledGraph:
    """The scanned collectives of a compiled callable (cached on it), scanning on first use;
    a graph that cannot be read is counted in guard errors and treated as holding none."""
    found = getattr(owner, GRAPH_ATTR, None)
    if found is not None:
        return found
    try:
        label = f"compiled {prefix} #{next(_labels)}"
        found = scan(gm, label, offset) if gm is not None else _NONE
        if found.entries:
            log.info(
                "compiled_graph_collectives", graph=found.label, collectives=len(found.entries)
            )
    except Exception as exc:  # noqa: BLE001 - an unreadable graph: its collectives stay unseen
        tracker = collective_install._tracker
        if tracker is not None:
            tracker.errors += 1
        log.warning("compiled_graph_unreadable", error=f"{type(exc).__name__}: {exc}")
        found = _NONE
    with contextlib.suppress(AttributeError, TypeError):  # then read again at the next call
        setattr(owner, GRAPH_ATTR, found)
    return found


def counted(gm: Any, compiled: Callable[..., Any], prefix: str = "graph") -> Callable[..., Any]:
    """`compiled` (the callable a torch.compile backend made of `gm`) with its collectives
    counted per call. For backends other than vLLM's (tests, benchmarks)."""

    def call(*args: Any) -> Any:
        tracker = collective_install._tracker
        if tracker is None:
            return compiled(*args)
        graph = call.__dict__.get(GRAPH_ATTR) or graph_of(call, gm, prefix)
        if graph is _NONE:
            return compiled(*args)
        return tracker.run_graph(graph, compiled, args, {})

    return call


def compiled_graph_wrapper(method_name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """The wrapper of `VllmSerializableFunction.__call__` and of
    `CompilationConfig.init_backend` (the binder's "compiled_graph" action)."""
    if method_name == "init_backend":
        wrapper = _init_backend_wrapper(method)
        wrapper.__qualname__ = getattr(method, "__qualname__", method_name)
        wrapper.__doc__ = getattr(method, "__doc__", None)
        wrapper.__wrapped__ = method  # type: ignore[attr-defined]
        setattr(wrapper, collective_install.GUARD_WRAPPED_ATTR, method)
        return wrapper
    if method_name != "__call__":
        raise ValueError(f"no compiled-graph wrapper for {method_name!r}")

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        tracker = collective_install._tracker
        if tracker is None:
            return method(self, *args, **kwargs)
        graph = self.__dict__.get(GRAPH_ATTR)
        if graph is None:
            graph = graph_of(self, getattr(self, "graph_module", None), _prefix(self), 1)
        if graph is _NONE:
            return method(self, *args, **kwargs)
        return tracker.run_graph(graph, method, (self, *args), kwargs)

    __call__.__qualname__ = getattr(method, "__qualname__", method_name)
    __call__.__doc__ = getattr(method, "__doc__", None)
    __call__.__wrapped__ = method  # type: ignore[attr-defined]
    setattr(__call__, collective_install.GUARD_WRAPPED_ATTR, method)
    return __call__


def _prefix(fn: Any) -> str:
    prefix = getattr(fn, "prefix", "") or ""
    return prefix if isinstance(prefix, str) and prefix else "graph"


def counting_backend(backend: Any, inductor_config: dict | None = None) -> Callable[..., Any]:
    """A torch.compile backend (a name or a callable) whose compiled callables count their
    collectives per call. "inductor" is compiled as torch.compile would (`compile_fx` with
    the inductor options vLLM passes for it)."""
    if isinstance(backend, str):
        if backend == "inductor":
            patches = dict(inductor_config or {})

            def inner(gm: Any, example_inputs: Any) -> Any:
                from torch._inductor.compile_fx import compile_fx

                return compile_fx(gm, example_inputs, config_patches=patches)
        else:
            from torch._dynamo import lookup_backend

            inner = lookup_backend(backend)
    else:
        inner = backend

    def guard_counting_backend(gm: Any, example_inputs: Any) -> Any:
        compiled = inner(gm, example_inputs)
        serializable = _serializable_base()
        if serializable is not None and _aot_compiling():  # AOT compile saves what we return
            if not isinstance(compiled, serializable) and getattr(compiled, "serialize", None):
                from torch._dynamo.aot_compile import BundledAOTAutogradSerializableCallable

                compiled = BundledAOTAutogradSerializableCallable(compiled)  # as torch does
            if isinstance(compiled, serializable):
                return _counted_serializable()(gm, compiled)
        return counted(gm, compiled, "model")

    return guard_counting_backend


def _init_backend_wrapper(method: Callable[..., Any]) -> Callable[..., Any]:
    def init_backend(self: Any, *args: Any, **kwargs: Any) -> Any:
        backend = method(self, *args, **kwargs)
        if type(backend).__name__ == "VllmBackend":  # its graphs: VllmSerializableFunction
            return backend
        try:
            return counting_backend(backend, getattr(self, "inductor_compile_config", None))
        except Exception as exc:  # noqa: BLE001 - the stock backend then, collectives unseen
            log.warning("compiled_backend_unwrapped", error=f"{type(exc).__name__}: {exc}")
            return backend

    return init_backend


def _aot_compiling() -> bool:
    try:
        import torch._dynamo.config as dynamo_config

        return bool(getattr(dynamo_config, "enable_aot_compile", False))
    except Exception:  # noqa: BLE001
        return False


def _serializable_base() -> Any:
    try:
        from torch._dynamo.aot_compile_types import SerializableCallable
    except Exception:  # noqa: BLE001 - an older torch: no AOT compile
        return None
    return SerializableCallable


_classes: dict[str, Any] = {}


def _counted_serializable() -> Any:
    """The counting wrapper as a torch `SerializableCallable` (what AOT compile saves and
    loads, vLLM's default with the compile cache on): the stock backend's artifact plus the
    graph's collective list, groups kept by name / handle / c10d name and resolved again at
    load."""
    cls = _classes.get("counted")
    if cls is not None:
        return cls
    import importlib
    import pickle

    base = _serializable_base()

    class GuardCountedCallable(base):  # type: ignore[misc, valid-type]
        def __init__(self, gm: Any, inner: Any, portable: list | None = None) -> None:
            self.inner = inner
            self.portable: list = []
            if portable is not None:
                self.portable = portable
                self.graph = _rebuild(portable, self)
            else:
                try:
                    self.graph = scan(gm, f"compiled model #{next(_labels)}", 0, self.portable)
                except Exception as exc:  # noqa: BLE001
                    log.warning("compiled_graph_unreadable", error=f"{type(exc).__name__}: {exc}")
                    self.graph = _NONE

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            tracker = collective_install._tracker
            graph = self.graph
            if tracker is None or graph is _NONE or not graph.entries:
                return self.inner(*args, **kwargs)
            return tracker.run_graph(graph, self.inner, args, kwargs)

        @classmethod
        def serialize_compile_artifacts(cls, fn: Any) -> bytes:
            if any(entry[6] for entry in fn.portable):
                raise ValueError("a collective's size is not linear in the batch size")
            inner_cls = type(fn.inner)
            data = inner_cls.serialize_compile_artifacts(fn.inner)
            where = (inner_cls.__module__, inner_cls.__qualname__)
            return pickle.dumps((where, data, fn.portable, fn.graph.locations))

        @classmethod
        def deserialize_compile_artifacts(cls, data: bytes) -> Any:
            (module, qualname), inner_data, portable, locations = pickle.loads(data)
            inner_cls: Any = importlib.import_module(module)
            for part in qualname.split("."):
                inner_cls = getattr(inner_cls, part)
            fn = cls(None, inner_cls.deserialize_compile_artifacts(inner_data), portable)
            if fn.graph is not _NONE:
                fn.graph.locations = locations
            return fn

    GuardCountedCallable.__module__ = __name__
    GuardCountedCallable.__qualname__ = "GuardCountedCallable"
    _classes["counted"] = GuardCountedCallable
    globals()["GuardCountedCallable"] = GuardCountedCallable  # found by module + qualname
    return GuardCountedCallable


def _rebuild(portable: list, owner: Any) -> collective_graphs.CompiledGraph:
    entries = []
    reached = []
    for op, naming, value, dtype, constant, terms, _exact in portable:
        group = _resolve(naming, value)
        if group is None:
            log.warning("compiled_graph_unreadable", error=f"no live group for {value!r}")
            return _NONE
        entries.append((op, group, dtype, constant, tuple(terms), None))
        reached.append((group, op, naming))
    graph = collective_graphs.CompiledGraph(f"compiled model #{next(_labels)}", entries, [])
    graph.bypass = bypass_of(reached)
    return graph


def __getattr__(name: str) -> Any:  # pickle / AOT load look the class up by name
    if name == "GuardCountedCallable":
        return _counted_serializable()
    raise AttributeError(name)
