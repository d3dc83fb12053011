"""Every `ascend_guard_*` Prometheus family the sidecar exports, from batches or read at scrape
time: waves.py (the writer's per-batch aggregates), collectives.py (collectives, skew,
stragglers, verdicts), store.py and requests.py (the store's own health and drops).
"""
