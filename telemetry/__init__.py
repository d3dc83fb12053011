"""The wire contract and the node sidecar: what a wave record becomes after it leaves a worker.

One wave's path through the folders of this package:

    guard/ (in each worker) ──gRPC──▶ ingest/ ──▶ crossrank/   hang and straggler state, /live
                                         │          (before the queue: liveness never waits)
                                         ▼
                                     pipeline/ ──▶ metrics/ ──▶ Prometheus ──▶ dashboards/
                                         ├──────▶ store/ ──▶ spans/ ──▶ traceql/ ──▶ tempo_api/
                                         └──────▶ export/ (OTLP) ──▶ the cluster's trace backend
    wire/      the contract both ends import: the proto, the names derived from it, ids, paths
    sidecar/   builds and starts the parts above from one settings table
    cli/       `ascend-guard`: the on-call commands, reading the store or the sidecar's API

Imports point down this list (cli > sidecar > tempo_api > traceql > export > spans, ingest >
crossrank > metrics > store > pipeline > wire); `make lint` checks it (import-linter, pyproject).
Nothing here imports torch, vLLM or the worker side: the sidecar installs and runs without them.
"""
