"""Where the guard attaches: points.py (the one table, read by the binder, the doctor and the
source scan), binder.py and import_hooks.py (apply it as modules load), actions.py (a wrapper
per kind of point), collectives.py, graph_collectives.py and compiled_collectives.py (the
collective wrappers' places), detect.py (platform and runner generation), ranks.py (who this
worker is).
"""
