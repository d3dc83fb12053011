"""`ascend-guard doctor`: coverage.py reports where the guard attaches on this host, source_scan.py
finds the attach points in a source tree without importing it.
"""
