"""After KV-cache initialisation: find each layer's cache the way the attention layers see it
(the forward context), check its layout and report KV bytes and blocks."""

from __future__ import annotations

from typing import Any

from ascend_runtime.probes import report
from ascend_runtime.probes.kv_layout import (
    ALIGNMENT_BYTES,
    KVReport,
    LayerExpectation,
    check_kv_layout,
    expectation_from_spec,
)


def _layer_specs(kv_cache_config: Any) -> dict[str, Any]:
    specs: dict[str, Any] = {}
    for group in getattr(kv_cache_config, "kv_cache_groups", ()):
        spec = group.kv_cache_spec
        per_layer = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
        if isinstance(per_layer, dict):
            specs.update(per_layer)
        else:
            specs.update({name: spec for name in group.layer_names})
    return specs


def _bound_cache(layer: Any) -> Any:
    cache = getattr(layer, "kv_cache", None)
    if isinstance(cache, list) and len(cache) == 1:  # one entry per virtual engine (older form)
        cache = cache[0]
    return cache


def probe_kv_cache(runner: Any, kv_cache_config: Any, platform: str) -> KVReport | None:
    """Check the caches the runner bound; report violations as incidents and the totals."""
    vllm_config = getattr(runner, "vllm_config", None)
    forward_context = vllm_config.compilation_config.static_forward_context
    separate = platform == "ascend"
    aligned = separate and getattr(vllm_config, "kv_transfer_config", None) is not None
    dims_of = getattr(runner, "_get_attention_kv_cache_dims", None) if separate else None
    expected: dict[str, LayerExpectation] = {}
    for name, spec in _layer_specs(kv_cache_config).items():
        if not (hasattr(spec, "num_kv_heads") and hasattr(spec, "head_size")):
            continue  # Mamba state and other non-attention caches: not a K/V layout
        dims = tuple(dims_of(name, spec)) if callable(dims_of) else None
        expected[name] = expectation_from_spec(spec, dims)  # type: ignore[arg-type]
    if not expected:
        return None
    caches = {name: _bound_cache(forward_context.get(name)) for name in expected}
    num_blocks = int(kv_cache_config.num_blocks)
    result = check_kv_layout(
        caches, expected, num_blocks=num_blocks, separate_kv=separate, aligned=aligned
    )
    publish(result, num_blocks, aligned)
    return result


def publish(result: KVReport, num_blocks: int, aligned: bool) -> None:
    report.probe("kv_cache_bytes", result.total_bytes)
    report.probe("kv_cache_blocks", num_blocks)
    report.probe("kv_cache_layers", result.layers)
    by_kind: dict[str, list] = {}
    for violation in result.violations:
        by_kind.setdefault(violation.kind, []).append(violation)
    for kind, violations in by_kind.items():
        first = violations[0]
        report.incident(
            "kv_layout",
            "error",
            f"{kind}: {first.layer}: {first.detail}"
            + (f" (and {len(violations) - 1} more layer(s))" if len(violations) > 1 else ""),
            evidence={
                "violation": kind,
                "layers": [v.layer for v in violations][:32],
                "first": dict(first.evidence),
                "count": len(violations),
                "alignment_required": ALIGNMENT_BYTES if aligned else 0,
            },
        )
