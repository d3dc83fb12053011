"""`ascend_guard_auth_refused_total`: what the sidecar's listeners refused for a missing or wrong
bearer token (`--token-file`), per listener: `grpc` (the workers' streams), `metrics`, `http`
(the health endpoint), `query` (the query API). A rise is a client with a stale or missing token:
a worker whose records are then lost, or a Prometheus that scrapes nothing."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

AUTH_REFUSED = "ascend_guard_auth_refused"
LISTENERS = ("grpc", "metrics", "http", "query")


def auth_refused_counter(registry: CollectorRegistry) -> Counter:
    return Counter(
        AUTH_REFUSED,
        "Calls and requests refused for a missing or wrong bearer token, per listener "
        f"({', '.join(LISTENERS)})",
        ["listener"],
        registry=registry,
    )
