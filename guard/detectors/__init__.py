"""The sampling detectors of one rank, one wave observer (host.py) over a suite (suite.py):
logits checks (logits.py, logits_kernel.py), token streams (tokens.py, repeat_kernel.py,
slots.py, token_log.py), speculative acceptance (spec.py), and evidence dumps (evidence.py).
"""
