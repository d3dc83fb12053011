"""KV-cache layout checks on real CPU tensors laid out the way vllm-ascend lays them out:
an int8 buffer per K and per V (over-allocated by 2 MiB and sliced to the next boundary when KV
transfer is configured), viewed as the cache dtype and shaped (num_blocks, block_size, heads,
head_size). Expectations come from vLLM's own `FullAttentionSpec`."""

from __future__ import annotations

import pytest
import torch

from ascend_runtime.probes import report
from ascend_runtime.probes.kv_layout import (
    ALIGNMENT_BYTES,
    MISALIGNED,
    MISSING,
    NOT_CONTIGUOUS,
    NOT_SEPARATE,
    OVERLAP,
    SIZE_MISMATCH,
    check_kv_layout,
    expectation_from_spec,
)
from ascend_runtime.probes.kv_probe import publish

kv_interface = pytest.importorskip("vllm.v1.kv_cache_interface")

NUM_BLOCKS = 3
BLOCK_SIZE = 16


def spec(heads=2, head_size=64, head_size_v=None, dtype=torch.bfloat16):
    return kv_interface.FullAttentionSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=heads,
        head_size=head_size,
        head_size_v=head_size_v,
        dtype=dtype,
    )


def int8_buffer(nbytes: int, *, aligned: bool, offset: int = 0) -> torch.Tensor:
    """vllm-ascend's `_allocate_int8_cache_tensor`: with KV transfer, over-allocate by the
    alignment and return the slice that starts on the next boundary (`offset` shifts it)."""
    if not aligned:
        return torch.zeros(nbytes, dtype=torch.int8)
    raw = torch.zeros(nbytes + 2 * ALIGNMENT_BYTES, dtype=torch.int8)
    start = (-raw.data_ptr()) % ALIGNMENT_BYTES + offset
    return raw[start : start + nbytes]


def layer_kv(s, *, aligned=True, v_offset=0, num_blocks=NUM_BLOCKS):
    """(K, V) for one layer as vllm-ascend's `_reshape_kv_cache`: each int8 half viewed as the
    cache dtype with shape (num_blocks, block_size, heads, head_size[_v])."""
    dsize = torch.empty((), dtype=s.dtype).element_size()
    k_shape = (num_blocks, s.block_size, s.num_kv_heads, s.head_size)
    v_shape = (num_blocks, s.block_size, s.num_kv_heads, s.head_size_v)
    k = int8_buffer(int(torch.Size(k_shape).numel()) * dsize, aligned=aligned)
    v = int8_buffer(int(torch.Size(v_shape).numel()) * dsize, aligned=aligned, offset=v_offset)
    return k.view(s.dtype).view(k_shape), v.view(s.dtype).view(v_shape)


def check(caches, specs, *, separate=True, aligned=True, num_blocks=NUM_BLOCKS):
    expected = {name: expectation_from_spec(s) for name, s in specs.items()}
    return check_kv_layout(
        caches, expected, num_blocks=num_blocks, separate_kv=separate, aligned=aligned
    )


@pytest.mark.parametrize("head_size", [64, 80, 96, 72, 120])
@pytest.mark.parametrize("aligned", [True, False])
def test_ascend_layout_passes(head_size, aligned):
    specs = {f"model.layers.{i}.self_attn.attn": spec(head_size=head_size) for i in range(3)}
    caches = {name: layer_kv(s, aligned=aligned) for name, s in specs.items()}
    result = check(caches, specs, aligned=aligned)
    assert result.violations == []
    assert result.layers == 3
    per_layer = 2 * NUM_BLOCKS * BLOCK_SIZE * 2 * head_size * 2  # K+V, 2 heads, bf16
    assert (
        result.total_bytes
        == 3 * per_layer
        == 3 * NUM_BLOCKS * specs[next(iter(specs))].page_size_bytes
    )


def test_different_k_and_v_head_sizes_pass():
    s = spec(head_size=128, head_size_v=96)
    assert check({"l": layer_kv(s)}, {"l": s}).violations == []


def kinds(result):
    return sorted({v.kind for v in result.violations})


def test_misaligned_v_cache_is_caught_with_its_offset():
    s = spec(head_size=80)
    result = check({"l": layer_kv(s, v_offset=4096)}, {"l": s})
    assert kinds(result) == [MISALIGNED]
    (violation,) = result.violations
    assert violation.evidence["cache"] == "V" and violation.evidence["offset"] == 4096
    # without KV transfer the same layout is fine
    assert check({"l": layer_kv(s, v_offset=4096)}, {"l": s}, aligned=False).ok


def test_stacked_kv_where_separate_caches_are_required_is_caught():
    s = spec()
    stacked = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, 2, 64, dtype=torch.bfloat16)
    result = check({"l": stacked}, {"l": s}, aligned=False)
    assert kinds(result) == [NOT_SEPARATE]
    # the same tensor is the right layout for upstream vLLM (one stacked cache per layer)
    assert check({"l": stacked}, {"l": s}, separate=False).ok


def test_non_contiguous_cache_is_caught():
    s = spec(heads=4, head_size=96)
    k, v = layer_kv(s, aligned=False)
    v_strided = v.transpose(1, 2)  # same bytes, heads and block positions swapped in place
    result = check({"l": (k, v_strided)}, {"l": s}, aligned=False)
    assert kinds(result) == [NOT_CONTIGUOUS]


def test_size_not_matching_the_spec_is_caught():
    s = spec(head_size=72)
    short = layer_kv(s, num_blocks=NUM_BLOCKS - 1)
    result = check({"l": short}, {"l": s})
    assert kinds(result) == [SIZE_MISMATCH]
    assert {v.evidence["cache"] for v in result.violations} == {"K", "V"}
    assert result.violations[0].evidence["expected_bytes"] == NUM_BLOCKS * BLOCK_SIZE * 2 * 72 * 2


def test_k_and_v_sharing_memory_is_caught():
    s = spec()
    k, _ = layer_kv(s, aligned=False)
    result = check({"l": (k, k.view_as(k))}, {"l": s}, aligned=False)
    assert kinds(result) == [OVERLAP]


def test_a_layer_without_a_cache_is_caught():
    s = spec()
    result = check({"a": layer_kv(s)}, {"a": s, "b": s})
    assert kinds(result) == [MISSING]
    assert result.violations[0].layer == "b"


def test_violations_become_one_incident_per_kind_and_metrics():
    s = spec(head_size=80)
    specs = {f"layer{i}": s for i in range(3)}
    caches = {name: layer_kv(s, v_offset=512) for name in specs}
    result = check(caches, specs)
    with report.capture() as seen:
        publish(result, NUM_BLOCKS, aligned=True)
    assert seen.incident_types() == ["kv_layout"]
    (incident,) = seen.incidents
    assert incident["evidence"]["violation"] == MISALIGNED
    assert incident["evidence"]["layers"] == ["layer0", "layer1", "layer2"]
    assert incident["evidence"]["alignment_required"] == ALIGNMENT_BYTES
    assert "and 2 more layer(s)" in incident["summary"]
    assert seen.probe_values("kv_cache_blocks") == [(float(NUM_BLOCKS), {})]
    assert seen.probe_values("kv_cache_bytes") == [(float(3 * NUM_BLOCKS * s.page_size_bytes), {})]
    assert seen.probe_values("kv_cache_layers") == [(3.0, {})]
