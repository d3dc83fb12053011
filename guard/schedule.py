"""Reads what a wave scheduled and what it sampled from vLLM's step objects, by attribute only.

Nothing here imports vLLM: the objects are read duck-typed, so the same code serves the V1 and
MRV2 runners and survives small version skews (a missing attribute reads as "nothing").
"""

from __future__ import annotations

from typing import Any, NamedTuple


class ScheduleSummary(NamedTuple):
    num_reqs: int
    prefill_reqs: int
    decode_reqs: int
    prefill_tokens: int
    decode_tokens: int


EMPTY_SCHEDULE = ScheduleSummary(0, 0, 0, 0, 0)


class PromptLengths:
    """Prompt length per live request, so later waves can tell prefill chunks from decode."""

    __slots__ = ("_lengths",)

    def __init__(self) -> None:
        self._lengths: dict[str, int] = {}

    def summarize(self, scheduler_output: Any) -> ScheduleSummary:
        """Split a `SchedulerOutput` into prefill and decode requests and tokens.

        A request is in prefill while the tokens it has computed are fewer than its prompt
        (new requests, chunked-prefill continuations, resumed requests); otherwise it decodes,
        and its scheduled tokens (1 + speculative drafts) count as decode tokens.
        """
        if scheduler_output is None:
            return EMPTY_SCHEDULE
        scheduled: dict[str, int] = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        lengths = self._lengths
        for req_id in getattr(scheduler_output, "finished_req_ids", None) or ():
            lengths.pop(req_id, None)
        prefill_reqs = prefill_tokens = 0
        for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
            req_id = new.req_id
            prompt = getattr(new, "prompt_token_ids", None)
            lengths[req_id] = len(prompt) if prompt is not None else 0
            prefill_reqs += 1
            prefill_tokens += scheduled.get(req_id, 0)
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if cached is not None:
            computed = getattr(cached, "num_computed_tokens", None) or ()
            for req_id, done in zip(getattr(cached, "req_ids", ()), computed, strict=False):
                if done < lengths.get(req_id, 0):
                    prefill_reqs += 1
                    prefill_tokens += scheduled.get(req_id, 0)
        num_reqs = len(scheduled)
        total = getattr(scheduler_output, "total_num_scheduled_tokens", None)
        if total is None:
            total = sum(scheduled.values())
        return ScheduleSummary(
            num_reqs=num_reqs,
            prefill_reqs=prefill_reqs,
            decode_reqs=num_reqs - prefill_reqs,
            prefill_tokens=prefill_tokens,
            decode_tokens=total - prefill_tokens,
        )

    def __len__(self) -> int:
        return len(self._lengths)


def count_sampled_tokens(output: Any) -> int | None:
    """Tokens a runner output carries, or None when it carries no host-side token lists yet."""
    ids = getattr(output, "sampled_token_ids", None)
    if ids is None:
        return None
    if isinstance(ids, list):
        total = 0
        for row in ids:
            total += len(row)
        return total
    return None
