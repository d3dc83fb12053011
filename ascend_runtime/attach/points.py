"""Every place the guard attaches, per component and runtime, in one table.

The binder (`ascend_runtime.attach.binder`), `ascend-guard doctor` and the source scan of a
vllm-ascend checkout (`ascend_runtime.doctor.source_scan`) all read `ATTACH_POINTS`; nothing else names
a module, class or method of vLLM or vllm-ascend.

A runtime is `<platform>-<runner generation>`: platform `ascend` (vllm-ascend on torch_npu),
`cuda` or `cpu` (upstream vLLM); generation `mrv2` (Model Runner V2) or `v1`. An attach point
applies to the runtimes it lists. `inherited=True` marks a class that only inherits the method
from a base class listed elsewhere in the table: it is bound when the base is, and the binder
never wraps it a second time.

The table also knows which releases hold which runner: a point's `span` names the releases of
its package that hold its class (`VLLM_V1_RUNNER`: upstream's V1 runner and sampler, removed in
vLLM 0.34). In a release outside the span the point is "not in this version" (with the reason),
neither bound nor missing: there is nothing to update when upstream removed a runner.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

PLATFORMS = ("ascend", "cuda", "cpu")
GENERATIONS = ("mrv2", "v1")
RUNTIMES = tuple(f"{p}-{g}" for p in PLATFORMS for g in GENERATIONS)

# a table: one row per line, columns aligned (fmt: skip)
COMPONENTS = (
    "worker", "model_runner", "sampler", "kv_cache", "graph", "speculator", "communicator",
    "scheduler", "collective",
)  # fmt: skip

# What the guard does at an attach point; the binder maps each action to a wrapper.
ACTIONS = {
    "step": "open a wave around the runner step (execute_model)",
    "sample": "close the wave around sampling (sample_tokens)",
    "dummy_step": "count the idle DP rank's dummy step as a dummy wave",
    "device_time": "device time of the phase from NPU/CUDA events, resolved without a sync",
    "kv_init": "check the KV-cache layout after initialisation; KV bytes and blocks",
    "graph_capture": "per-graph capture count, time and memory; FULL-mode workspaces released",
    "rotary_capacity": "MLA cos/sin tables hold max requests x decode query length",
    "speculator_propose": "dispatched speculator; drafts proposed (accepted from the sampler)",
    "communicator_init": "device communicator in use; HCCL settings as an info metric",
    "logits": "logits before sampling: the logits detectors",
    "batch_logits": "logits before sampling, with the batch that names their rows (MRV2): the "
    "logits detectors",
    "verify_logits": "spec-decode verification logits: the logits detectors",
    "batch_verify_logits": "spec-decode verification logits, with the batch that names each "
    "request's rows (MRV2): the logits detectors",
    "schedule": "engine core: stamp hot-reloaded config onto the scheduler output, and new "
    "requests' W3C traceparent (when vLLM's tracing is on)",
    "collective": "op, group, backend, bytes, per-group sequence number; per-wave aggregates",
    "compiled_graph": "torch.compile'd graphs: collectives found in the FX graph, counted per "
    "compiled-graph call (graph_counted), no Python per collective",
    "graph_collectives": "captured device graphs: collectives noted at capture, counted at each "
    "replay (replayed), replay device time from events",
}

# GroupCoordinator methods that carry a collective: the out-of-place all-reduce / all-gather /
# reduce-scatter are what both the direct and the custom-op paths reach; the rest are wrapped
# where they are defined. How each one's payload is read is in ascend_runtime/attach/collectives.py.
# a table: one row per line, columns aligned (fmt: skip)
COLLECTIVE_METHODS = (
    "_all_reduce_out_place", "_all_gather_out_place", "_reduce_scatter_out_place", "all_gatherv",
    "reduce_scatterv", "gather", "broadcast", "broadcast_object", "broadcast_object_list",
    "broadcast_tensor_dict", "send_object", "recv_object", "send_tensor_dict", "recv_tensor_dict",
    "send", "recv", "barrier", "dispatch", "combine",
)  # fmt: skip

# Device graph classes' own capture/replay hooks: every capture path (vLLM's CUDAGraphWrapper,
# MRV2's graph managers, vllm-ascend's ACLGraphWrapper; piecewise and FULL) goes through them.
GRAPH_METHODS = ("capture_begin", "capture_end", "replay")

ASCEND = ("ascend-mrv2", "ascend-v1")
ASCEND_MRV2 = ("ascend-mrv2",)
ASCEND_V1 = ("ascend-v1",)
MRV2 = ("ascend-mrv2", "cuda-mrv2", "cpu-mrv2")  # Ascend MRV2 inherits upstream methods
UPSTREAM_MRV2 = ("cuda-mrv2", "cpu-mrv2")
UPSTREAM_V1 = ("cuda-v1", "cpu-v1")
UPSTREAM = ("cuda-mrv2", "cuda-v1", "cpu-mrv2", "cpu-v1")
CUDA = ("cuda-mrv2", "cuda-v1")
CPU = ("cpu-mrv2", "cpu-v1")

# A point the installed (or scanned) release cannot hold: reported apart from "missing"
NOT_IN_VERSION = "not in this version"


@dataclasses.dataclass(frozen=True)
class Span:
    """The releases of a package that hold a set of classes: from `since` (empty: every release
    the table covers) up to, not including, `removed_in` (empty: still there)."""

    what: str
    since: str = ""
    removed_in: str = ""

    def holds(self, version: str) -> bool:
        release = release_of(version)
        if self.since and release < release_of(self.since):
            return False
        return not (self.removed_in and release >= release_of(self.removed_in))

    def why_not(self, version: str) -> str:
        if self.since and release_of(version) < release_of(self.since):
            return f"{self.what} added in {self.since}"
        return f"{self.what} removed in {self.removed_in}"


# Upstream vLLM's runners by release. 0.33 holds both generations; 0.34 removed the V1 runner
# (gpu_model_runner.py, cpu_model_runner.py) and the V1 samplers, and added a Triton-free MRV2
# CPU runner that vLLM picks on non-x86 CPUs.
VLLM_V1_RUNNER = Span("V1 runner", removed_in="0.34")
VLLM_MRV2 = Span("Model Runner V2")
VLLM_STANDALONE_CPU_RUNNER = Span("standalone MRV2 CPU runner", since="0.34")
RUNNER_SPANS = {("vllm", "v1"): VLLM_V1_RUNNER, ("vllm", "mrv2"): VLLM_MRV2}


def release_of(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: "0.34.0rc1.dev3+gabc" -> (0, 34, 0)."""
    match = re.match(r"v?(\d+(?:\.\d+)*)", version)
    return tuple(int(n) for n in match.group(1).split(".")) if match else ()


def runner_generations(package: str, version: str | None) -> tuple[str, ...]:
    """The runner generations a release of `package` holds (every generation the table knows
    when the version is unknown or the package has no spans)."""
    return tuple(
        g
        for g in GENERATIONS
        if version is None
        or (span := RUNNER_SPANS.get((package, g))) is None
        or span.holds(version)
    )


@dataclasses.dataclass(frozen=True)
class AttachPoint:
    component: str
    module: str
    qualname: str
    method: str
    action: str
    runtimes: tuple[str, ...]
    inherited: bool = False
    note: str = ""
    span: Span | None = None  # the package releases that hold the class; None: every one

    @property
    def target(self) -> str:
        return f"{self.module}.{self.qualname}.{self.method}"

    @property
    def package(self) -> str:
        return self.module.split(".", 1)[0]

    def applies_to(self, runtime: str) -> bool:
        return runtime == "all" or runtime in self.runtimes

    def absent_from(self, versions: Mapping[str, str | None]) -> str | None:
        """Why a release cannot hold this point ("V1 runner removed in 0.34"), given the
        versions by package (`vllm`, `vllm_ascend`); None when it can, or when unknown."""
        version = versions.get(self.package)
        if self.span is None or not version or not release_of(version):
            return None
        return None if self.span.holds(version) else self.span.why_not(version)


def _points(
    component: str,
    module: str,
    qualname: str,
    methods: dict[str, str],
    runtimes: tuple[str, ...],
    *,
    inherited: bool = False,
    note: str = "",
    span: Span | None = None,
) -> list[AttachPoint]:
    return [
        AttachPoint(component, module, qualname, method, action, runtimes, inherited, note, span)
        for method, action in methods.items()
    ]


_VA = "vllm_ascend"
_STEP_SAMPLE = {"execute_model": "step", "sample_tokens": "sample"}
_WORKER = {
    "execute_model": "device_time",
    "sample_tokens": "device_time",
    "execute_dummy_batch": "dummy_step",
}

ATTACH_POINTS: tuple[AttachPoint, ...] = tuple(
    # -- worker: step and sample (device time per phase), the idle DP rank's dummy step ------
    _points("worker", f"{_VA}.worker.worker", "NPUWorker", _WORKER, ASCEND)
    + _points("worker", "vllm.v1.worker.gpu_worker", "Worker", _WORKER, UPSTREAM)
    + _points(
        "worker",
        "vllm.v1.worker.cpu_worker",
        "CPUWorker",
        _WORKER,
        CPU,
        inherited=True,
        note="inherits the GPU worker's methods",
    )
    # -- model runner: the wave ------------------------------------------------------------
    + _points(
        "model_runner",
        f"{_VA}.worker.v2.model_runner",
        "NPUModelRunner",
        {"execute_model": "step"},
        ASCEND_MRV2,
    )
    + _points(
        "model_runner",
        f"{_VA}.worker.v2.model_runner",
        "NPUModelRunner",
        {"sample_tokens": "sample"},
        ASCEND_MRV2,
        inherited=True,
        note="sample_tokens comes from upstream MRV2",
    )
    + _points(
        "model_runner",
        f"{_VA}.worker.model_runner_v1",
        "NPUModelRunner",
        _STEP_SAMPLE,
        ASCEND_V1,
    )
    + _points(
        "model_runner", "vllm.v1.worker.gpu.model_runner", "GPUModelRunner", _STEP_SAMPLE, MRV2
    )
    + _points(
        "model_runner",
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner",
        _STEP_SAMPLE,
        UPSTREAM_V1,
        span=VLLM_V1_RUNNER,
    )
    + _points(
        "model_runner",
        "vllm.v1.worker.cpu_model_runner",
        "CPUModelRunner",
        _STEP_SAMPLE,
        ("cpu-v1",),
        inherited=True,
        span=VLLM_V1_RUNNER,
    )
    + _points(
        "model_runner",
        "vllm.v1.worker.cpu.model_runner",
        "CPUModelRunner",
        _STEP_SAMPLE,
        ("cpu-mrv2",),
        inherited=True,
        note="MRV2 on x86 CPUs; its kernels need triton-cpu",
    )
    + _points(
        "model_runner",
        "vllm.v1.worker.cpu.standalone_model_runner",
        "StandaloneCPUModelRunner",
        _STEP_SAMPLE,
        ("cpu-mrv2",),
        span=VLLM_STANDALONE_CPU_RUNNER,
        note="MRV2 without Triton (vllm._cpu_ops); vLLM picks it on non-x86 CPUs",
    )
    # -- samplers: logits detectors (V1 samplers; vllm-ascend's AscendSampler inherits forward) -
    + _points(
        "sampler",
        "vllm.v1.sample.sampler",
        "Sampler",
        {"forward": "logits"},
        UPSTREAM_V1 + ASCEND_V1,
        span=VLLM_V1_RUNNER,
    )
    + _points(
        "sampler",
        f"{_VA}.sample.sampler",
        "AscendSampler",
        {"forward": "logits"},
        ASCEND_V1,
        inherited=True,
    )
    + _points(
        "sampler",
        "vllm.v1.sample.rejection_sampler",
        "RejectionSampler",
        {"forward": "verify_logits"},
        UPSTREAM_V1,
        span=VLLM_V1_RUNNER,
    )
    + _points(
        "sampler",
        f"{_VA}.sample.rejection_sampler",
        "AscendRejectionSampler",
        {"forward": "verify_logits"},
        ASCEND_V1,
    )
    # MRV2's sampler: called with the logits after the grammar bitmask, before sampling (it
    # copies them before changing any), and with the step's input batch, whose req_ids name
    # the rows; its watermark subclass inherits __call__
    + _points(
        "sampler",
        "vllm.v1.worker.gpu.sample.sampler",
        "Sampler",
        {"__call__": "batch_logits"},
        UPSTREAM_MRV2,
    )
    # MRV2's rejection sampler: called instead of the sampler on a wave with drafts, with the
    # target logits (each request's drafts + 1 rows) and the step's input batch
    + _points(
        "sampler",
        "vllm.v1.worker.gpu.spec_decode.rejection_sampler",
        "RejectionSampler",
        {"__call__": "batch_verify_logits"},
        UPSTREAM_MRV2,
    )
    # -- KV cache: layout checks after initialisation ----------------------------------------
    + _points(
        "kv_cache",
        f"{_VA}.worker.v2.model_runner",
        "NPUModelRunner",
        {"initialize_kv_cache": "kv_init"},
        ASCEND_MRV2,
    )
    + _points(
        "kv_cache",
        f"{_VA}.worker.model_runner_v1",
        "NPUModelRunner",
        {"initialize_kv_cache": "kv_init"},
        ASCEND_V1,
    )
    + _points(
        "kv_cache",
        "vllm.v1.worker.gpu.model_runner",
        "GPUModelRunner",
        {"initialize_kv_cache": "kv_init"},
        UPSTREAM_MRV2,
    )
    + _points(
        "kv_cache",
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner",
        {"initialize_kv_cache": "kv_init"},
        UPSTREAM_V1,
        span=VLLM_V1_RUNNER,
    )
    + _points(
        "kv_cache",
        "vllm.v1.worker.cpu_model_runner",
        "CPUModelRunner",
        {"initialize_kv_cache": "kv_init"},
        ("cpu-v1",),
        span=VLLM_V1_RUNNER,
    )
    + _points(
        "kv_cache",
        "vllm.v1.worker.cpu.standalone_model_runner",
        "StandaloneCPUModelRunner",
        {"initialize_kv_cache": "kv_init"},
        ("cpu-mrv2",),
        span=VLLM_STANDALONE_CPU_RUNNER,
    )
    + _points(
        "kv_cache",
        f"{_VA}.worker.v2.model_runner",
        "NPUModelRunner",
        {"__init__": "rotary_capacity"},
        ASCEND_MRV2,
        note="MLA cos/sin tables",
    )
    + _points(
        "kv_cache",
        f"{_VA}.worker.model_runner_v1",
        "NPUModelRunner",
        {"__init__": "rotary_capacity"},
        ASCEND_V1,
        note="MLA cos/sin tables",
    )
    # -- graph managers: ACL-graph / CUDA-graph capture --------------------------------------
    + _points(
        "graph",
        f"{_VA}.worker.v2.aclgraph_utils",
        "ModelAclGraphManager",
        {"capture": "graph_capture"},
        ASCEND_MRV2,
        note="FULL mode: workspaces watched",
    )
    + _points(
        "graph",
        f"{_VA}.worker.model_runner_v1",
        "NPUModelRunner",
        {"capture_model": "graph_capture"},
        ASCEND_V1,
        note="ACLGraphWrapper captures inside",
    )
    + _points(
        "graph",
        "vllm.v1.worker.gpu.cudagraph_utils",
        "ModelCudaGraphManager",
        {"capture": "graph_capture"},
        ("cuda-mrv2",),
    )
    + _points(
        "graph",
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner",
        {"capture_model": "graph_capture"},
        ("cuda-v1",),
        note="CUDAGraphWrapper captures inside",
        span=VLLM_V1_RUNNER,
    )
    # -- speculators: which one was dispatched, drafts proposed -----------------------------
    + _points(
        "speculator",
        f"{_VA}.worker.v2.spec_decode.autoregressive.speculator",
        "AscendAutoRegressiveSpeculator",
        {"propose": "speculator_propose"},
        ASCEND_MRV2,
        note="EAGLE and MTP",
    )
    + _points(
        "speculator",
        f"{_VA}.worker.v2.spec_decode.dflash.speculator",
        "AscendDFlashSpeculator",
        {"propose": "speculator_propose"},
        ASCEND_MRV2,
    )
    + _points(
        "speculator",
        f"{_VA}.worker.v2.spec_decode.dspark.speculator",
        "AscendDSparkSpeculator",
        {"propose": "speculator_propose"},
        ASCEND_MRV2,
    )
    + _points(
        "speculator",
        f"{_VA}.worker.model_runner_v1",
        "NPUModelRunner",
        {"propose_draft_token_ids": "speculator_propose"},
        ASCEND_V1,
        note="one place for every V1 proposer: EAGLE, MTP, DFlash, DSpark, n-gram, "
        "extract-hidden-states",
    )
    + _points(
        "speculator",
        "vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator",
        "TargetDependentARSpeculator",
        {"propose": "speculator_propose"},
        ("cuda-mrv2",),
        note="EAGLE and MTP",
    )
    + _points(
        "speculator",
        "vllm.v1.worker.gpu.spec_decode.eagle.speculator",
        "EagleSpeculator",
        {"propose": "speculator_propose"},
        ("cuda-mrv2",),
        inherited=True,
    )
    + _points(
        "speculator",
        "vllm.v1.worker.gpu.spec_decode.mtp.speculator",
        "MTPSpeculator",
        {"propose": "speculator_propose"},
        ("cuda-mrv2",),
        inherited=True,
    )
    + _points(
        "speculator",
        "vllm.v1.worker.gpu.spec_decode.dflash.speculator",
        "DFlashSpeculator",
        {"propose": "speculator_propose"},
        ("cuda-mrv2",),
    )
    + _points(
        "speculator",
        "vllm.v1.worker.gpu.spec_decode.dspark.speculator",
        "DSparkSpeculator",
        {"propose": "speculator_propose"},
        ("cuda-mrv2",),
        inherited=True,
    )
    + _points(
        "speculator",
        "vllm.v1.worker.gpu.spec_decode.ngram.speculator",
        "NgramGPUSpeculator",
        {"propose": "speculator_propose"},
        ("cuda-mrv2",),
    )
    + _points(
        "speculator",
        "vllm.v1.worker.gpu.spec_decode.extract_hidden_states",
        "ExtractHiddenStatesSpeculator",
        {"propose": "speculator_propose"},
        ("cuda-mrv2",),
    )
    + _points(
        "speculator",
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner",
        {"propose_draft_token_ids": "speculator_propose"},
        UPSTREAM_V1,
        note="one place for every V1 proposer",
        span=VLLM_V1_RUNNER,
    )
    # -- device communicator (per-collective hooks: attach/collectives.py's GroupCoordinator) -----
    + _points(
        "communicator",
        f"{_VA}.distributed.device_communicators.npu_communicator",
        "NPUCommunicator",
        {"__init__": "communicator_init"},
        ASCEND,
        note="HCCL",
    )
    + _points(
        "communicator",
        "vllm.distributed.device_communicators.cuda_communicator",
        "CudaCommunicator",
        {"__init__": "communicator_init"},
        CUDA,
        note="NCCL",
    )
    + _points(
        "communicator",
        "vllm.distributed.device_communicators.cpu_communicator",
        "CpuCommunicator",
        {"__init__": "communicator_init"},
        CPU,
        note="gloo / shared memory",
    )
    # -- scheduler (engine core process): hot-reloaded config and traceparents stamped on steps -
    + _points(
        "scheduler",
        "vllm.v1.core.sched.scheduler",
        "Scheduler",
        {"schedule": "schedule"},
        RUNTIMES,
    )
    # -- collectives: every platform's GroupCoordinator (HCCL, NCCL, gloo, shm) ----------------
    + _points(
        "collective",
        "vllm.distributed.parallel_state",
        "GroupCoordinator",
        dict.fromkeys(COLLECTIVE_METHODS, "collective"),
        RUNTIMES,
    )
    # -- collectives inside torch.compile'd graphs: every compiled graph vLLM's backend returns -
    + _points(
        "collective",
        "vllm.compilation.caching",
        "VllmSerializableFunction",
        {"__call__": "compiled_graph"},
        RUNTIMES,
        note="VLLM_COMPILE: counted per compiled-graph call from its FX graph",
    )
    + _points(
        "collective",
        "vllm.config.compilation",
        "CompilationConfig",
        {"init_backend": "compiled_graph"},
        RUNTIMES,
        note="DYNAMO_TRACE_ONCE / stock torch.compile (CPU default): the backend counts",
    )
    # -- collectives inside captured graphs: the device graph classes' capture and replay ------
    + _points(
        "graph",
        "torch.cuda.graphs",
        "CUDAGraph",
        dict.fromkeys(GRAPH_METHODS, "graph_collectives"),
        CUDA,
        note="CUDA graph, piecewise and FULL: collectives counted per replay",
    )
    + _points(
        "graph",
        "torch_npu.npu",
        "NPUGraph",
        dict.fromkeys(GRAPH_METHODS, "graph_collectives"),
        ASCEND,
        note="ACL graph, piecewise and FULL: collectives counted per replay",
    )
)


def points_for(runtime: str, component: str | None = None) -> list[AttachPoint]:
    """The attach points that apply to `runtime` (or every one, with "all")."""
    if runtime != "all" and runtime not in RUNTIMES:
        raise ValueError(f"unknown runtime {runtime!r}; expected one of {', '.join(RUNTIMES)}, all")
    return [
        p
        for p in ATTACH_POINTS
        if p.applies_to(runtime) and (component is None or p.component == component)
    ]
