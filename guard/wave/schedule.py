"""Reads what a wave scheduled and what it sampled from vLLM's step objects, by attribute only.

Nothing here imports vLLM: the objects are read duck-typed, so the same code serves the V1 and
MRV2 runners and survives small version skews (a missing attribute reads as "nothing").

What is counted, and how it relates to vLLM's own counters (docs: README, "Metrics"):
- prefill tokens: prompt tokens computed for the first time. With prefix caching that is the
  prompt less its cache hits, vLLM's `vllm:prompt_tokens_by_source{source="local_compute"}`.
- recompute tokens: what a preempted request computes again when it resumes (its prompt and
  output so far, less cache hits). vLLM counts these in no exported token counter; it counts
  the preemptions (`vllm:num_preemptions`).
- decode tokens: everything else scheduled (one token per decoding request, plus its drafts).
- sampled tokens: tokens the runner returned that the scheduler keeps. Drafts accepted past a
  stop (max_tokens, EOS, a stop token, the model length) are trimmed by the scheduler, so they
  are trimmed here too (`vllm:generation_tokens_total` never sees them).
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from guard.config.reload import STAMP_ATTR


class ScheduleSummary(NamedTuple):
    num_reqs: int
    prefill_reqs: int  # requests computing prompt or recompute tokens this wave
    decode_reqs: int
    prefill_tokens: int
    decode_tokens: int
    recompute_tokens: int = 0


EMPTY_SCHEDULE = ScheduleSummary(0, 0, 0, 0, 0, 0)

_new_tuple = tuple.__new__  # builds a NamedTuple without its Python-level __new__ frame


class ScheduleFields(NamedTuple):
    """What the guard reads off a scheduler output, read once a wave (`read_schedule`) and
    shared by the prefill tracker and the request membership, which queues these in place of
    the output (whose whole tree would otherwise live until the streamer's next batch)."""

    scheduled: Any  # num_scheduled_tokens: req_id -> tokens this wave
    new: Any  # scheduled_new_reqs
    finished: Any  # finished_req_ids
    preempted: Any  # preempted_req_ids (None: an older scheduler that does not say)
    resumed: Any  # scheduled_cached_reqs.resumed_req_ids
    total: Any  # total_num_scheduled_tokens
    stamp: Any  # a live config change riding on the output (`guard.config.reload`), else None


def read_schedule(scheduler_output: Any) -> ScheduleFields:
    """The fields of `scheduler_output` the guard reads (None for each one it lacks)."""
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    return _new_tuple(
        ScheduleFields,
        (
            getattr(scheduler_output, "num_scheduled_tokens", None),
            getattr(scheduler_output, "scheduled_new_reqs", None),
            getattr(scheduler_output, "finished_req_ids", None),
            getattr(scheduler_output, "preempted_req_ids", None),
            getattr(cached, "resumed_req_ids", None),
            getattr(scheduler_output, "total_num_scheduled_tokens", None),
            getattr(scheduler_output, STAMP_ATTR, None),
        ),
    )


class PrefillTracker:
    """Splits each wave into prefill, recompute and decode work, at a cost that does not grow
    with the batch.

    It remembers only the requests whose prompt is not fully computed yet (new requests,
    chunked-prefill continuations, resumed requests): how many tokens each still has to
    compute, and how many of those are recompute (computed before it was preempted). Every
    scheduled request it does not hold is decoding, so a wave costs O(new + still-prefilling
    + preempted requests), not O(running requests).
    """

    __slots__ = ("_preempted", "_remaining")

    def __init__(self) -> None:
        # req_id -> [tokens left to compute, of which recompute]
        self._remaining: dict[str, list[int]] = {}
        # preempted, not yet resumed: req_id -> prompt tokens it had never computed
        self._preempted: dict[str, int] = {}

    def summarize(self, scheduler_output: Any) -> ScheduleSummary:
        if scheduler_output is None:
            return EMPTY_SCHEDULE
        return self.summarize_fields(read_schedule(scheduler_output), scheduler_output)

    def summarize_fields(self, fields: ScheduleFields, scheduler_output: Any) -> ScheduleSummary:
        """`summarize` from the fields already read; `scheduler_output` is read further only
        for a resumed request's tokens."""
        scheduled, new_reqs, _, preempted_ids, resumed, total, _ = fields
        scheduled = scheduled or {}
        if self._remaining or self._preempted or new_reqs or preempted_ids or resumed:
            prefill_reqs, prefill_tokens, recompute_tokens = self._prefill_work(
                fields, scheduled, scheduler_output
            )
        else:  # the usual decode wave: no request owes prompt tokens, none joins or leaves
            # the running set but by finishing (nothing held to forget): all of it is decode
            prefill_reqs = prefill_tokens = recompute_tokens = 0
        num_reqs = len(scheduled)
        if total is None:
            total = sum(scheduled.values())
        return _new_tuple(
            ScheduleSummary,
            (
                num_reqs,
                prefill_reqs,
                num_reqs - prefill_reqs,
                prefill_tokens,
                total - prefill_tokens - recompute_tokens,
                recompute_tokens,
            ),
        )

    def _prefill_work(
        self, fields: ScheduleFields, scheduled: dict[str, int], scheduler_output: Any
    ) -> tuple[int, int, int]:
        """A wave where some request owes prompt tokens, or joins, leaves or comes back:
        (requests prefilling, prefill tokens, recompute tokens), the held state moved on."""
        _, new_reqs, finished, preempted_ids, resumed, _, _ = fields
        remaining = self._remaining
        preempted = self._preempted
        for req_id in finished or ():
            remaining.pop(req_id, None)
            preempted.pop(req_id, None)
        for req_id in preempted_ids or ():
            entry = remaining.pop(req_id, None)
            preempted[req_id] = entry[0] - entry[1] if entry else 0
        for new in new_reqs or ():
            left = _prompt_len(new) - (getattr(new, "num_computed_tokens", 0) or 0)
            # MRV2 sends a resumed request as a new one, its tokens so far as its prompt
            fresh = preempted.pop(new.req_id, None)
            remaining[new.req_id] = [left, 0 if fresh is None else max(0, left - fresh)]
        if resumed:
            cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
            self._resume(cached, resumed, scheduled)

        prefill_reqs = prefill_tokens = recompute_tokens = 0
        finished_prefill = []
        for req_id, entry in remaining.items():
            tokens = scheduled.get(req_id)
            if not tokens:
                continue
            left, recompute = entry
            prefill_reqs += 1
            again = min(tokens, recompute)
            recompute_tokens += again
            # past `left`: drafts, e.g. the scheduler pads a request with one token left
            # (all but the last cached) to 1 + num_speculative_tokens; those are decode
            prefill_tokens += min(tokens, left) - again
            if tokens >= left:
                finished_prefill.append(req_id)
            else:
                entry[0], entry[1] = left - tokens, recompute - again
        for req_id in finished_prefill:
            del remaining[req_id]
        return prefill_reqs, prefill_tokens, recompute_tokens

    def _resume(self, cached: Any, resumed: Any, scheduled: dict[str, int]) -> None:
        """A preempted request that comes back computes its prompt and its output so far again.

        What it had computed before is recompute; prompt tokens it never reached (preempted in
        the middle of its prefill) are still prefill. The V1 runner's step objects carry the
        resumed request's tokens; where they do not, a resumed request scheduled for more than
        one token counts as recompute for this wave only.
        """
        all_tokens = getattr(cached, "all_token_ids", None) or {}
        req_ids = list(getattr(cached, "req_ids", ()))
        computed = getattr(cached, "num_computed_tokens", None) or ()
        for req_id in resumed:
            fresh = self._preempted.pop(req_id, None)
            if fresh is None:  # no preemption seen: an unfinished prefill is still owed
                entry = self._remaining.get(req_id)
                fresh = entry[0] - entry[1] if entry else 0
            tokens = all_tokens.get(req_id)
            if tokens is not None and req_id in req_ids:
                index = req_ids.index(req_id)
                done = computed[index] if index < len(computed) else 0
                left = len(tokens) - done
            elif scheduled.get(req_id, 0) > 1:
                left = scheduled[req_id]
            else:
                continue
            self._remaining[req_id] = [left, max(0, left - fresh)]

    def __len__(self) -> int:
        """Requests whose prefill (or recompute) is still under way."""
        return len(self._remaining)


def _prompt_len(new_request: Any) -> int:
    prompt = getattr(new_request, "prefill_token_ids", None)  # MRV2: prompt + output so far
    if prompt is None:
        prompt = getattr(new_request, "prompt_token_ids", None)
    if prompt is not None:
        return len(prompt)
    embeds = getattr(new_request, "prompt_embeds", None)
    shape = getattr(embeds, "shape", None)
    return int(shape[0]) if shape else 0


class WaveTokens:
    """One wave's sampled tokens: `ids` (all of them, row by row) and, unless every row has
    exactly one token (`uniform`, a plain decode wave), `lengths` per row.

    `sampled` is the runner's list of token lists; the processor reads it once a wave here
    (`read_sampled`), at C speed, for its own counts and the detectors' checks alike, so later
    changes to those lists (the scheduler trims tokens past a stop) do not reach the detectors.
    No numpy runs here: inside the engine numpy's first calls after the model's own work cost
    several times their figure in a loop, so arrays are built per batch, not per wave.
    `packed` (the ids as 8-byte machine integers, about 20 ns an id) and `flat` (an array over
    `packed`, no copy) are made on first use.
    """

    __slots__ = ("_packed", "ids", "lengths", "rows", "width")

    def __init__(self, sampled: Sequence[Sequence[int]]) -> None:
        rows = len(sampled)
        self.rows = rows
        self._packed: array | None = None
        try:
            # a plain decode wave: one pass that unpacks each row, and fails on a longer one
            self.ids = [token for (token,) in sampled]
        except ValueError:
            lengths = list(map(len, sampled))
            self.ids = list(itertools.chain.from_iterable(sampled))
            self.lengths: list[int] | None = lengths
            self.width = max(lengths)
        else:
            self.lengths = None
            self.width = 1 if rows else 0

    @property
    def uniform(self) -> bool:
        return self.lengths is None

    @property
    def packed(self) -> array:
        """`ids` as 8-byte integers (an id past that range raises OverflowError)."""
        if self._packed is None:
            self._packed = array("q", self.ids)
        return self._packed

    @property
    def flat(self) -> np.ndarray:
        """`ids` as an int64 array (over `packed`)."""
        return np.frombuffer(self.packed, dtype=np.int64)

    def row(self, index: int) -> list[int]:
        """Row `index`'s ids."""
        lengths = self.lengths
        if lengths is None:
            return self.ids[index : index + 1]
        start = sum(lengths[:index])
        return self.ids[start : start + lengths[index]]

    def row_of_each(self) -> np.ndarray:
        """The row of each id in `ids`."""
        if self.lengths is None:
            return np.arange(self.rows)
        return np.repeat(np.arange(self.rows), self.lengths)


class _OneEach:
    """The per-request counts of a wave where every request keeps exactly one token (no array
    made). Compared by identity; it has no length, so a check that forgets that fails loudly."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "ONE_EACH"


ONE_EACH = _OneEach()


def count_sampled_tokens(output: Any, runner: Any = None) -> int | None:
    """Tokens a runner output carries that the scheduler keeps, or None when it carries no
    host-side token lists yet (`read_sampled`'s first value)."""
    return read_sampled(output, runner)[0]


def read_sampled(output: Any, runner: Any = None) -> tuple[int | None, Any, WaveTokens | None]:
    """The wave's sampled tokens, read once: (tokens the scheduler keeps of this output, how
    many each request keeps, and the tokens themselves as returned), or (None, None, None)
    when the output carries no host-side token lists yet. The per-request counts are
    `ONE_EACH` in the usual wave, where every request got one token, and otherwise an array
    in the output's order.

    A request gets more than one token in a wave only when drafts were accepted; those lists
    are cut where the scheduler stops the request (`_kept`). One token per request needs no
    look at the request: the scheduler keeps a lone token. The request membership queues the
    per-request counts in place of the output's token lists; the detectors take the tokens.
    """
    ids = getattr(output, "sampled_token_ids", None)
    if not isinstance(ids, list):
        return None, None, None
    tokens = WaveTokens(ids)  # one pass in the usual wave: it tells one each apart too
    lengths = tokens.lengths
    if lengths is None:  # none empty, none longer: one each
        return tokens.rows, ONE_EACH, tokens
    total = len(tokens.ids)
    counts = array("I", lengths)
    if tokens.width <= 1:
        return total, counts, tokens
    requests = getattr(runner, "requests", None) if runner is not None else None
    req_ids = getattr(output, "req_ids", None)
    if not isinstance(requests, dict) or not isinstance(req_ids, list):
        return total, counts, tokens
    max_model_len = getattr(runner, "max_model_len", 0) or 0
    for index in [i for i, c in enumerate(counts) if c > 1 and i < len(req_ids)]:
        state = requests.get(req_ids[index])
        if state is not None:
            kept = _kept(ids[index], state, max_model_len)
            total -= counts[index] - kept
            counts[index] = kept
    return total, counts, tokens


def _kept(tokens: list[int], state: Any, max_model_len: int) -> int:
    """How many of `tokens` (just appended to the V1 runner's request state) the scheduler
    keeps: it appends them one by one and stops at the first EOS, stop token, max_tokens or
    model length, as `vllm.v1.core.sched.utils.check_stop` does."""
    params = getattr(state, "sampling_params", None)
    outputs = getattr(state, "output_token_ids", None)
    if params is None or not isinstance(outputs, list) or len(outputs) < len(tokens):
        return len(tokens)
    before = len(outputs) - len(tokens)
    prompt = getattr(state, "num_prompt_tokens", 0) or 0
    eos = getattr(params, "eos_token_id", None)
    stop_ids = getattr(params, "stop_token_ids", None) or ()
    max_tokens = getattr(params, "max_tokens", None)
    end = before + len(tokens)  # output tokens once all of these are appended
    if (
        (max_tokens is None or end < max_tokens)
        and (not max_model_len or prompt + end < max_model_len)
        and eos not in tokens
        and (not stop_ids or not any(t in tokens for t in stop_ids))
    ):  # the usual case, in C: nothing in these tokens stops the request
        return len(tokens)
    for count, token in enumerate(tokens, 1):
        produced = before + count
        if token == eos or token in stop_ids:
            return count
        if (max_model_len and prompt + produced >= max_model_len) or (
            max_tokens is not None and produced >= max_tokens
        ):
            return count
    return len(tokens)
