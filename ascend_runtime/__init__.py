"""Knows the concrete runtimes and binds the guard to them.

    plugin.py ──▶ attach/ (points.py: every attach point, one table; binder.py applies it as
                  modules load) ──▶ guard/ decorators and collective wrappers
    probes/   Ascend checks and readings taken at the attach points
    doctor/   where the guard attaches on this host, or in a source tree

vLLM, torch and torch_npu are imported lazily; nothing breaks where one is missing.
"""
