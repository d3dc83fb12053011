"""The guard inside each vLLM worker process: device-agnostic, bound to the runtime by
ascend_runtime/.

    runner ──▶ decorators.py ──▶ processor.py ──▶ wave/ observers: detectors/, collectives/, ...
                                     │
                                     └──▶ stream/ ──gRPC──▶ the node sidecar (telemetry/)
    config/        the `runtime_guard` sections, their checks and hot reload
    incidents.py   the façade probes and bindings report through

decorators.py and incidents.py are the public surface; of telemetry, the guard imports only
the wire contract (telemetry.wire).
"""
