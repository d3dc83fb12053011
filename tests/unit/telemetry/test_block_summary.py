"""Per-block duration histograms (telemetry/store/block_summary.py) against numpy on the raw values."""

from __future__ import annotations

import numpy as np
import pytest

from telemetry.store import block_summary as bs


def _samples(rng, kind: str, n: int) -> np.ndarray:
    if kind == "uniform":
        return rng.integers(3_000_000, 8_000_000, n)
    if kind == "lognormal":
        return rng.lognormal(15, 1.5, n).astype(np.int64)
    if kind == "outliers":  # steady steps and a few 60 ms ones
        out = rng.integers(3_000_000, 4_000_000, n)
        out[rng.random(n) < 0.01] = 60_000_000
        return out
    if kind == "constant":
        return np.full(n, 1_234_567)
    return rng.integers(0, 3, n)  # tiny: zero and one nanosecond


@pytest.mark.parametrize("kind", ["uniform", "lognormal", "outliers", "constant", "tiny"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_merged_histograms_count_exactly_and_quantiles_are_within_one_bucket(kind, seed):
    rng = np.random.default_rng(seed)
    blocks = [_samples(rng, kind, int(rng.integers(1, 400))) for _ in range(60)]
    groups = rng.integers(0, 3, len(blocks))
    merged = bs.accumulate([bs.encode(b) for b in blocks], groups, 3)
    for g in range(3):
        values = np.concatenate([b for b, gb in zip(blocks, groups, strict=True) if gb == g])
        # the counts are those of the values' own buckets
        assert list(merged[g]) == list(np.bincount(bs.bucket_of(values), minlength=bs.BUCKETS))
        for q in (0.0, 0.5, 0.9, 0.99, 1.0):
            exact = float(np.quantile(values, q))
            got = bs.quantile(merged[g], q)
            assert abs(got - exact) <= bs.RELATIVE_WIDTH * max(exact, 1.0) + 1.0, (q, got, exact)


def test_an_empty_histogram_and_one_too_big_to_store():
    assert bs.encode(np.array([], np.int64)) == b""
    assert list(bs.decode(b"")) == [0] * bs.BUCKETS
    assert bs.encode(np.ones(bs.MAX_COUNT + 1, np.int64)) is None
    assert np.isnan(bs.quantile(np.zeros(bs.BUCKETS, np.int64), 0.5))
    assert bs.accumulate([b"", b""], np.array([0, 1]), 2).sum() == 0


def test_a_stored_histogram_is_small():
    """256 waves whose steps vary 3..8 ms: a few dozen bytes (bench/README.md has the store's
    bytes per rank-wave)."""
    rng = np.random.default_rng(7)
    blob = bs.encode(rng.integers(3_000_000, 8_000_000, 256))
    assert len(blob) <= 2 * (1 + 24)
    assert list(bs.decode(blob)) == list(bs.accumulate([blob], np.array([0]), 1)[0])
