"""Detectors on each request's sampled token stream: loops and n-gram repeats, ids out of range.

They run on the token lists the runner already hands back to the scheduler (no device work).
To keep the per-token cost flat, n-gram counts over the window are kept up to date as tokens
arrive and leave (a dict update each), and loops are looked for every `CHECK_EVERY` tokens with
C-speed list slices. A loop or repeat raises one hit when it starts and another only after the
stream has left it ("episodes"), not one per token.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from guard.detectors.config import TokenRepeatConfig

CHECK_EVERY = 8
# n-grams are packed GRAM_BITS bits per token into one int (ids above 2**24 alias; harmless)
GRAM_BITS = 24
TOKEN_MASK = (1 << GRAM_BITS) - 1


# (kind "loop" or "ngram", period or n, span or count, the repeated block)
RepeatFinding = tuple[str, int, int, list[int]]


class RequestTokens:
    """The recent sampled tokens of one request, its n-gram counts, and its open episodes."""

    __slots__ = (
        "counts", "grams", "hot", "in_loop", "in_ngram", "key", "since_check", "tokens", "total",
    )  # fmt: skip

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.since_check = 0
        self.total = 0
        self.in_loop = False
        self.in_ngram = False
        # n-grams in the window, oldest first, and how often each occurs there
        self.grams: collections.deque[int] = collections.deque()
        self.counts: dict[int, int] = {}
        self.key = 0  # the latest n-gram, packed
        self.hot = 0  # n-grams at or above ngram_max_count right now


class RepeatDetector:
    def __init__(self, config: TokenRepeatConfig) -> None:
        self.config = config
        self.requests: dict[str, RequestTokens] = {}

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def add(self, request_id: str, new_tokens: Sequence[int]) -> list[RepeatFinding]:
        """Append one wave's tokens of a request; return the repeat episodes that start now."""
        state = self.requests.get(request_id)
        if state is None:
            state = self.requests[request_id] = RequestTokens()
        config = self.config
        tokens = state.tokens
        size, limit, window = config.ngram_size, config.ngram_max_count, config.window
        counts, grams = state.counts, state.grams
        shift, mask = GRAM_BITS, (1 << (GRAM_BITS * size)) - 1
        key = state.key
        ngram_started = None
        for token in new_tokens:  # usually one token per wave
            tokens.append(token)
            # the last `size` tokens packed into one int: two integer ops instead of a tuple
            key = ((key << shift) | (token & TOKEN_MASK)) & mask
            if len(tokens) < size:
                continue
            count = counts.get(key, 0) + 1
            counts[key] = count
            grams.append(key)
            if count == limit:
                state.hot += 1
                if state.hot == 1 and not state.in_ngram:
                    ngram_started = (size, count, tokens[-size:])
            if len(grams) > window - size + 1:
                old = grams.popleft()
                left = counts[old] - 1
                if left == limit - 1:
                    state.hot -= 1
                if left:
                    counts[old] = left
                else:
                    del counts[old]
        state.key = key
        if len(tokens) > window * 2:  # trim rarely: amortised O(1) per token
            del tokens[: len(tokens) - window]
        state.total += len(new_tokens)
        state.since_check += len(new_tokens)
        findings: list[RepeatFinding] = []
        if state.since_check >= CHECK_EVERY:
            state.since_check = 0
            loop = find_loop(tokens, config.max_period, config.min_repeats, config.min_span)
            if loop is not None and not state.in_loop:
                findings.append(("loop", *loop))
            state.in_loop = loop is not None
        if ngram_started is not None and not state.in_loop:
            findings.append(("ngram", *ngram_started))
        state.in_ngram = state.hot > 0
        return findings


def find_loop(
    window: Sequence[int], max_period: int, min_repeats: int, min_span: int
) -> tuple[int, int, list[int]] | None:
    """The shortest period p ≤ max_period with which the window's tail repeats itself.

    Returns (period, span, block) when the last `span` tokens equal the `span` tokens p earlier,
    where span ≥ max(min_repeats·p, min_span) − p, i.e. the block occurs min_repeats times.
    """
    n = len(window)
    last = window[-1] if n else None
    for period in range(1, max_period + 1):
        need = max(min_repeats * period, min_span)
        if need > n:
            break
        if window[n - 1 - period] != last:  # cheap test first: most periods fail here
            continue
        tail = window[n - need + period :]
        if tail == window[n - need : n - period]:
            return period, need, list(window[n - period :])
    return None


def out_of_range(tokens: Sequence[int], vocab_size: int) -> list[int]:
    """Sampled ids outside [0, vocab_size); the common case costs one min and one max."""
    if not tokens or (min(tokens) >= 0 and max(tokens) < vocab_size):
        return []
    return [t for t in tokens if t < 0 or t >= vocab_size]
