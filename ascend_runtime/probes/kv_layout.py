"""KV-cache layout checks after initialisation, as pure functions over the cache tensors.

vllm-ascend allocates a separate K and a separate V cache per attention layer (MLA: K holds
`kv_lora_rank`, V `qk_rope_head_dim`); with KV transfer configured (prefill/decode
disaggregation) each starts on a 2 MiB boundary so Mooncake/HCCL can register it. Upstream vLLM
keeps one tensor per layer with K and V stacked. Either way every cache must be contiguous and
exactly as large as the KV-cache spec says: `num_blocks x block_size x kv_heads x head_size x
dtype size` (per half), or `num_blocks x page_size_bytes` for a stacked cache.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

ALIGNMENT_BYTES = 2 * 1024 * 1024

NOT_SEPARATE = "kv_not_separate"
NOT_CONTIGUOUS = "kv_not_contiguous"
MISALIGNED = "kv_misaligned"
SIZE_MISMATCH = "kv_size_mismatch"
OVERLAP = "kv_overlap"
MISSING = "kv_missing"


@dataclasses.dataclass(frozen=True)
class LayerExpectation:
    """What one layer's cache must be, from its KV-cache spec."""

    block_size: int
    num_kv_heads: int
    k_dim: int  # head size of K (MLA: kv_lora_rank)
    v_dim: int  # head size of V (MLA: qk_rope_head_dim)
    dtype_size: int
    page_bytes: int | None = None  # a stacked cache's bytes per block (spec.page_size_bytes)

    def stacked_bytes(self, num_blocks: int) -> int:
        if self.page_bytes is not None:
            return num_blocks * self.page_bytes
        return self.k_bytes(num_blocks) + self.v_bytes(num_blocks)

    def k_bytes(self, num_blocks: int) -> int:
        return num_blocks * self.block_size * self.num_kv_heads * self.k_dim * self.dtype_size

    def v_bytes(self, num_blocks: int) -> int:
        return num_blocks * self.block_size * self.num_kv_heads * self.v_dim * self.dtype_size


@dataclasses.dataclass(frozen=True)
class Violation:
    kind: str
    layer: str
    detail: str
    evidence: Mapping[str, Any]


@dataclasses.dataclass
class KVReport:
    layers: int = 0
    total_bytes: int = 0
    violations: list[Violation] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations


def _nbytes(tensor: Any) -> int:
    return int(tensor.numel()) * int(tensor.element_size())


def _span(tensor: Any) -> tuple[int, int]:
    start = int(tensor.data_ptr())
    return start, start + _nbytes(tensor)


def check_kv_layout(
    caches: Mapping[str, Any],
    expected: Mapping[str, LayerExpectation],
    *,
    num_blocks: int,
    separate_kv: bool,
    aligned: bool,
    alignment: int = ALIGNMENT_BYTES,
) -> KVReport:
    """Check every expected layer's cache; `caches[layer]` is a tensor or a (K, V) pair.

    `separate_kv`: K and V must be two tensors (vllm-ascend). `aligned`: each must start on
    `alignment` bytes (KV transfer configured). Layers sharing one cache (cross-layer KV sharing)
    are counted once in `total_bytes`.
    """
    report = KVReport()
    seen: set[int] = set()
    for layer, want in expected.items():
        cache = caches.get(layer)
        if cache is None:
            report.violations.append(Violation(MISSING, layer, "no KV cache bound", {}))
            continue
        report.layers += 1
        parts = list(cache) if isinstance(cache, (tuple, list)) else [cache]
        for part in parts:
            if int(part.data_ptr()) not in seen:
                seen.add(int(part.data_ptr()))
                report.total_bytes += _nbytes(part)
        if separate_kv:
            _check_separate(report, layer, parts, want, num_blocks, aligned, alignment)
        else:
            _check_stacked(report, layer, parts, want, num_blocks)
    return report


def _check_separate(
    report: KVReport,
    layer: str,
    parts: list[Any],
    want: LayerExpectation,
    num_blocks: int,
    aligned: bool,
    alignment: int,
) -> None:
    if len(parts) != 2:
        report.violations.append(
            Violation(
                NOT_SEPARATE,
                layer,
                f"expected separate K and V caches, found {len(parts)} tensor(s)",
                {"tensors": len(parts), "shapes": [list(p.shape) for p in parts]},
            )
        )
        return
    k, v = parts
    for name, tensor, want_bytes in (
        ("K", k, want.k_bytes(num_blocks)),
        ("V", v, want.v_bytes(num_blocks)),
    ):
        _check_tensor(report, layer, name, tensor, want_bytes, aligned, alignment)
    (k0, k1), (v0, v1) = _span(k), _span(v)
    if k0 < v1 and v0 < k1:
        report.violations.append(
            Violation(
                OVERLAP,
                layer,
                "K and V caches share memory",
                {"k": [k0, k1], "v": [v0, v1]},
            )
        )


def _check_stacked(
    report: KVReport, layer: str, parts: list[Any], want: LayerExpectation, num_blocks: int
) -> None:
    want_bytes = want.stacked_bytes(num_blocks)
    if len(parts) == 2:  # a runtime that splits K and V anyway: check each half
        for name, tensor, half in (
            ("K", parts[0], want.k_bytes(num_blocks)),
            ("V", parts[1], want.v_bytes(num_blocks)),
        ):
            _check_tensor(report, layer, name, tensor, half, False, ALIGNMENT_BYTES)
        return
    for tensor in parts:
        _check_tensor(report, layer, "KV", tensor, want_bytes, False, ALIGNMENT_BYTES)


def _check_tensor(
    report: KVReport,
    layer: str,
    name: str,
    tensor: Any,
    want_bytes: int,
    aligned: bool,
    alignment: int,
) -> None:
    if not tensor.is_contiguous():
        report.violations.append(
            Violation(
                NOT_CONTIGUOUS,
                layer,
                f"{name} cache is not contiguous",
                {"cache": name, "shape": list(tensor.shape), "stride": list(tensor.stride())},
            )
        )
    have = _nbytes(tensor)
    if have != want_bytes:
        report.violations.append(
            Violation(
                SIZE_MISMATCH,
                layer,
                f"{name} cache holds {have} bytes, the spec says {want_bytes}",
                {
                    "cache": name,
                    "bytes": have,
                    "expected_bytes": want_bytes,
                    "shape": list(tensor.shape),
                    "dtype": str(tensor.dtype),
                },
            )
        )
    if aligned:
        offset = int(tensor.data_ptr()) % alignment
        if offset:
            report.violations.append(
                Violation(
                    MISALIGNED,
                    layer,
                    f"{name} cache starts {offset} bytes past a {alignment // 1024} KiB boundary",
                    {
                        "cache": name,
                        "data_ptr": int(tensor.data_ptr()),
                        "offset": offset,
                        "alignment": alignment,
                    },
                )
            )


def expectation_from_spec(spec: Any, dims: tuple[int, int] | None = None) -> LayerExpectation:
    """From a vLLM `AttentionSpec` (block_size, num_kv_heads, head_size[, head_size_v], dtype);
    `dims` overrides (k_dim, v_dim), as vllm-ascend's `_get_attention_kv_cache_dims` gives."""
    import torch

    head_size = int(spec.head_size)
    head_size_v = int(getattr(spec, "head_size_v", None) or head_size)
    k_dim, v_dim = dims if dims is not None else (head_size, head_size_v)
    dtype_size = torch.empty((), dtype=spec.dtype).element_size()
    page = getattr(spec, "page_size_bytes", None)
    return LayerExpectation(
        int(spec.block_size),
        int(spec.num_kv_heads),
        k_dim,
        v_dim,
        dtype_size,
        int(page) if isinstance(page, int) else None,
    )
