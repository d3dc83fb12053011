"""Reading Prometheus exposition text in tests."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

# Families about the sidecar itself, not a rank, so they carry no dp label (name prefixes):
# ingest and token refusals, the record path's queue, drops by stage, OTLP decisions, rank
# gauges left out, the store's health, the hang checker's lateness.
SIDECAR_WIDE = (
    "ascend_guard_ingest_rejected",
    "ascend_guard_auth_refused",
    "ascend_guard_pipeline_",
    "ascend_guard_otlp_records",
    "ascend_guard_rank_gauges_omitted",
    "ascend_guard_store_",
    "ascend_guard_hang_check_late",
    "ascend_guard_hang_bundle",
)


def samples(text: str, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
    """All samples called `name` whose labels include `labels`."""
    out = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                out.append((sample.labels, sample.value))
    return out


def value(text: str, name: str, **labels: str) -> float:
    """Sum of the matching samples (0 when there are none)."""
    return sum(v for _, v in samples(text, name, **labels))
