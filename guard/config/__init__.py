"""The `runtime_guard` configuration: runtime_guard.py (the sections and where they come from),
one module per feature's section (detectors, collectives, fault_injection), schema.py (the typed
section machinery: errors name the dotted key, the value and the allowed range), reload.py (hot
reload, applied at the same wave on every rank).
"""
