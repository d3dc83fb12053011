"""What a detector's finding says in its incident: the summary a person reads and the evidence a
tool reads, for token_repeat, spec_acceptance and logits_stats. Pure functions, run where the finding is
reported (the streamer thread in a worker).
"""

from __future__ import annotations

from typing import Any


def repeat_finding(kind: str, size: int, extent: int, block: Any) -> tuple[str, dict[str, Any]]:
    """A loop (period `size` over the last `extent` tokens) or an n-gram (`size` tokens repeated
    `extent` times in the window), with the repeated block."""
    if kind == "loop":
        summary = f"loop of period {size} over the last {extent} tokens"
        return summary, {"kind": kind, "period": size, "span": extent, "block": block[:32]}
    summary = f"{size}-gram repeated {extent} times in the window"
    return summary, {"kind": kind, "n": size, "count": extent, "ngram": block}


def spec_finding(
    method: str, config: Any, key: str, window: Any, kind: str, baseline: float
) -> tuple[str, dict[str, Any]]:
    """A window of draft acceptance out of line: outside the configured band (`kind` "band"), or
    jumped above its baseline; `key` names the request ("" for the wave window)."""
    scope = f"request {key}" if key else "wave window"
    rate = window.rate
    if kind == "band":
        band = f"[{config.min_rate:g}, {config.max_rate:g}]"
        summary = f"{method} acceptance {rate:.2f} in the {scope} is outside {band}"
    else:
        summary = (
            f"{method} acceptance {rate:.2f} in the {scope} jumped "
            f"{rate - baseline:+.2f} above the baseline {baseline:.2f} "
            "(repetitive output raises acceptance)"
        )
    evidence = {
        "method": method,
        "kind": kind,
        "rate": round(rate, 4),
        "drafted": window.drafted,
        "accepted": window.accepted,
        "band": [config.min_rate, config.max_rate],
        "baseline": round(baseline, 4),
        "scope": "request" if key else "wave",
    }
    return summary, evidence


def stats_finding(max_abs: float, entropy: float, limit: float) -> tuple[str, dict[str, Any]]:
    """A stats wave whose largest |logit| reached the configured limit."""
    summary = f"max |logit| {max_abs:.4g} reached the limit {limit:g}"
    return summary, {"max_abs": max_abs, "entropy_nats": entropy, "limit": limit}
