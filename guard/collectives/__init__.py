"""Collectives inside a worker, one wave observer (observer.py).

GroupCoordinator methods ──▶ install.wrap_collective ──▶ tracker.py (sequence numbers,
    per-wave aggregates, the call in flight; graphs.py for captured and compiled graphs)
                               ├──▶ columns.py (wire columns, streamer thread)
                               └──▶ watchdog.py (hang_suspected), fault_injection.py (drill)
"""
