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


class PrefillTracker:
    """Splits each wave into prefill and decode work, at a cost that does not grow with the batch.

    It remembers only the requests whose prompt is not fully computed yet (new requests,
    chunked-prefill continuations, resumed requests) and how many prompt tokens each still has
    to compute. Every scheduled request it does not hold is decoding, so a wave costs O(new +
    still-prefilling requests), not O(running requests).
    """

    __slots__ = ("_remaining",)

    def __init__(self) -> None:
        self._remaining: dict[str, int] = {}

    def summarize(self, scheduler_output: Any) -> ScheduleSummary:
        if scheduler_output is None:
            return EMPTY_SCHEDULE
        scheduled: dict[str, int] = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        remaining = self._remaining
        for req_id in getattr(scheduler_output, "finished_req_ids", None) or ():
            remaining.pop(req_id, None)
        for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
            remaining[new.req_id] = _prompt_len(new) - (getattr(new, "num_computed_tokens", 0) or 0)
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        resumed = getattr(cached, "resumed_req_ids", None)
        if resumed:
            self._resume(cached, resumed, scheduled)

        prefill_reqs = prefill_tokens = 0
        finished_prefill = []
        for req_id, left in remaining.items():
            tokens = scheduled.get(req_id)
            if not tokens:
                continue
            prefill_reqs += 1
            prefill_tokens += tokens
            if tokens >= left:
                finished_prefill.append(req_id)
            else:
                remaining[req_id] = left - tokens
        for req_id in finished_prefill:
            del remaining[req_id]

        num_reqs = len(scheduled)
        total = getattr(scheduler_output, "total_num_scheduled_tokens", None)
        if total is None:
            total = sum(scheduled.values())
        return ScheduleSummary(
            num_reqs, prefill_reqs, num_reqs - prefill_reqs, prefill_tokens, total - prefill_tokens
        )

    def _resume(self, cached: Any, resumed: Any, scheduled: dict[str, int]) -> None:
        """A preempted request that comes back recomputes its prompt and its output so far.

        The V1 runner's step objects carry the resumed request's tokens; where they do not
        (MRV2), a resumed request scheduled for more than one token counts as prefill for
        this wave only.
        """
        all_tokens = getattr(cached, "all_token_ids", None) or {}
        req_ids = list(getattr(cached, "req_ids", ()))
        computed = getattr(cached, "num_computed_tokens", None) or ()
        for req_id in resumed:
            tokens = all_tokens.get(req_id)
            if tokens is not None and req_id in req_ids:
                index = req_ids.index(req_id)
                done = computed[index] if index < len(computed) else 0
                self._remaining[req_id] = len(tokens) - done
            elif scheduled.get(req_id, 0) > 1:
                self._remaining[req_id] = scheduled[req_id]

    def __len__(self) -> int:
        """Requests whose prefill is still under way."""
        return len(self._remaining)


def _prompt_len(new_request: Any) -> int:
    prompt = getattr(new_request, "prompt_token_ids", None)
    if prompt is not None:
        return len(prompt)
    embeds = getattr(new_request, "prompt_embeds", None)
    shape = getattr(embeds, "shape", None)
    return int(shape[0]) if shape else 0


def count_sampled_tokens(output: Any) -> int | None:
    """Tokens a runner output carries, or None when it carries no host-side token lists yet."""
    ids = getattr(output, "sampled_token_ids", None)
    if isinstance(ids, list):
        return sum(map(len, ids))
    return None
