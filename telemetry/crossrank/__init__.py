"""What the sidecar knows across ranks, updated on the ingest path before a batch is queued, so
a slow disk or a flood of records never delays a hang verdict.

    view.py        collective counters, wave skew and stragglers (ranksync.py) per replica stage
    hangs.py       hang verdicts from heartbeats, liveness records and /proc
    roster.py      which engines this sidecar serves, and when one has left
    peers.py       the ranks of a replica this sidecar does not see (other nodes)
    rank_gauges.py per-rank facts the cluster rules join across sidecars
    liveness.py    /live, /ready, /hangs over HTTP for probes and the CLI
"""
