"""The sidecar's front door: one gRPC client stream per worker rank.

    worker ──Batch──▶ service.py ──▶ validation.py ──▶ crossrank/ (at once) ──▶ pipeline/ queue

A batch that cannot be used is refused with a status that names the field; nothing already
accepted is lost, and every refusal is counted.
"""
