"""The worker's end of the wire: a bounded buffer drained by the streamer thread over gRPC
(streamer.py), incidents capped and backed off (reporter.py) and spooled on disk while the
sidecar is away (spool.py), and the readings every heartbeat repeats (identity.py).
"""
