"""Request membership's drop counts, and what became of requests' W3C traceparent headers, as
Prometheus families read from the store's request writer at scrape time.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from telemetry.store.requests import RequestWriter


class RequestMetrics(Collector):
    """Membership the workers shed (their buffer full, names forgotten), and traceparents
    linked or refused, on /metrics."""

    def __init__(self, writer: RequestWriter | None = None) -> None:
        self.writer = writer

    def collect(self):
        family = CounterMetricFamily(
            "ascend_guard_request_membership_dropped",
            "Request membership the workers shed: rows (a wave's requests; the worker's buffer "
            "was full) and names (requests forgotten unfinished past the worker's cap). Their "
            "waves' request traces lack those entries.",
            labels=("engine", "dp", "tp", "pp", "kind"),
        )
        drops = self.writer.drops() if self.writer is not None else {}
        for labels, (rows, names) in sorted(drops.items()):
            family.add_metric([*labels, "rows"], float(rows))
            family.add_metric([*labels, "names"], float(names))
        yield family
        traceparents = CounterMetricFamily(
            "ascend_guard_request_traceparents",
            "Requests that came with a W3C traceparent header (vLLM keeps trace headers when "
            "its tracing is on): linked (their request trace links to that trace and span), or "
            "malformed (refused by the W3C format, stored without a link).",
            labels=("engine", "outcome"),
        )
        counts = self.writer.traceparents() if self.writer is not None else {}
        for (engine, outcome), count in sorted(counts.items()):
            traceparents.add_metric([engine, outcome], float(count))
        yield traceparents

    def forget(self, engine: str) -> int:
        """An engine left: its series go with the others (`roster.forget_series`)."""
        return self.writer.forget_drops(engine) if self.writer is not None else 0
