"""One wave as the processor sees it: what it scheduled and sampled (schedule.py, read from
vLLM's step objects by attribute), the observer protocol every per-wave participant implements
(observers.py), which requests ran in it (request_membership.py), and the guard's own error
budget (errors.py).
"""
