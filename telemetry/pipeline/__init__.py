"""The sidecar's record path after ingest: a queue bounded in bytes and one writer thread that
hands each batch to the sinks (metrics/, store/, export/), with every drop counted by stage and
reason (writer.py draws it). ratelimit.py keeps what a client can make the sidecar log bounded.
"""
