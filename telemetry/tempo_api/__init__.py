"""A Tempo-compatible, read-only trace query API on the sidecar, for Grafana's Tempo datasource.

    /api/echo, /api/status/buildinfo          health check, version
    /api/v2/traces/<id>, /api/traces/<id>     a wave trace: OTLP protobuf or OTLP/JSON (Accept)
    /api/search                               q (TraceQL) or tags/minDuration/maxDuration
    /api/v2/search/tags, .../tag/<t>/values   autocomplete
    /api/metrics/query_range                  TraceQL metrics

Modules: `params` (parameters, errors naming them), `otlp` (a trace as resource spans per rank),
`store_search` (the legacy search and tag values over the store), `traceql_adapter` (the one
door to the TraceQL evaluator), `server` (listener, routes, response shapes).
"""

from telemetry.tempo_api.server import TempoApiServer

__all__ = ["TempoApiServer"]
