"""Detectors on each request's sampled token stream: loops and n-gram repeats, ids out of range.

They run on the token lists the runner already hands back to the scheduler (no device work).
Each wave's ids are only queued as they came (`WaveTokens`: no numpy, no Python per request);
every `batch_waves(requests)` waves (8-32, about `BATCH_IDS` ids) the batch is screened by
one call of a compiled kernel (`guard/detectors/repeat_kernel.py`), which goes through every
token in order with each request's state in arrays indexed by a slot
(`guard/detectors/slots.py`): its history ring, the exact count of every n-gram of its window,
its episodes. Python runs per finding, not per token or per request.

A loop or repeat raises one finding when it starts and another only after the stream has left
it ("episodes"), not one per token. A finding names the wave its token arrived in, though it
is reported at the batch's end (at most `MAX_BATCH_WAVES - 1` waves later; when the engine goes
idle, the streamer thread screens what is left, `DetectorSuite.flush_idle`). The batch rules
(an episode open when a batch begins is judged at its end; loops are looked for at a batch's
end in requests with `CHECK_EVERY` new tokens) are the kernel's docstring's."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np

from guard.config.detectors import TokenRepeatConfig
from guard.detectors import compiled
from guard.detectors.repeat_layout import GRAM_ENTRY, KIND_LOOP, KIND_NGRAM
from guard.detectors.slots import (
    SlotMap,
    batch_waves,
    grown,
    packed_batch,
    power_of_two,
)
from guard.wave.schedule import WaveTokens

CHECK_EVERY = 8  # new tokens of a request before its stream is looked at for loops again


# batches left queued for another thread's screen before the engine thread screens them itself
OVERDUE_BATCHES = 4


BATCH_TOKENS = 256  # most tokens of one request in one batch (a longer `add` is cut up)


# (kind "loop" or "ngram", period or n, span or count, the repeated block)
RepeatFinding = tuple[str, int, int, list[int]]


# a finding with the wave it belongs to and its request
WaveFinding = tuple[int, str, RepeatFinding]


_KINDS = {KIND_LOOP: "loop", KIND_NGRAM: "ngram"}


_ONE_EACH = np.zeros(0, dtype=np.int64)  # `screen`'s lengths when every row has one token


# the kernel's parameters row, in order (the config's fields, and CHECK_EVERY)
PARAMS = (
    "ngram_size",
    "ngram_max_count",
    "window",
    "max_period",
    "min_repeats",
    "min_span",
    "check_every",
)


class RepeatDetector:
    """Loop and n-gram episodes of every request, batched over waves."""

    def __init__(self, config: TokenRepeatConfig, *, load_in_background: bool = False) -> None:
        """`load_in_background`: the first screens wait (their waves stay queued) while the
        kernel loads on a thread, instead of the constructor loading it."""
        self.config = config
        if load_in_background:
            compiled.load_in_background()
        else:
            compiled.load()
        self.requests = SlotMap()
        self.requests.register(self._grow, self._clear)
        window, size = config.window, config.ngram_size
        self._batch_tokens = max(window, BATCH_TOKENS)
        # the window and a batch (evidence bundles read the newest tokens from here); a power
        # of two, so a stream position's place is one bitwise and
        self._ring = power_of_two(window + self._batch_tokens)
        self._mask = self._ring - 1
        # each request's n-gram table: at most half full, so probes stay short
        table = power_of_two(2 * (window - size + 1))
        values = {**dataclasses.asdict(config), "check_every": CHECK_EVERY}
        self._params = np.array([values[name] for name in PARAMS], dtype=np.int64)
        rows = self.requests.capacity
        # ids past 2**31 wrap here: token_range reads the runner's own lists
        self.hist = np.zeros((rows, self._ring), dtype=np.int32)
        self.total = np.zeros(rows, dtype=np.int64)  # tokens seen
        self.since_check = np.zeros(rows, dtype=np.int64)
        self.hot = np.zeros(rows, dtype=np.int64)  # n-grams of the window at the limit
        self.in_loop = np.zeros(rows, dtype=bool)
        self.in_ngram = np.zeros(rows, dtype=bool)
        self.grams = np.zeros((rows, table), dtype=GRAM_ENTRY)
        # waves queued as they came: (wave, slots of its rows, its tokens)
        self._queue: list[tuple[int, np.ndarray, WaveTokens]] = []
        self._queued_tokens = 0  # the most tokens any one request may have in the batch
        self._held: list[WaveFinding] = []  # found by a screen an evidence read asked for
        self.off = False  # the kernel could not load: the detector stopped

    # -- slot lifecycle -------------------------------------------------------------------
    def _grow(self, rows: int) -> None:
        self.hist = grown(self.hist, rows)
        self.total = grown(self.total, rows)
        self.since_check = grown(self.since_check, rows)
        self.hot = grown(self.hot, rows)
        self.in_loop = grown(self.in_loop, rows, False)
        self.in_ngram = grown(self.in_ngram, rows, False)
        self.grams = grown(self.grams, rows)

    def _clear(self, slots: np.ndarray) -> None:
        self.total[slots] = 0
        self.since_check[slots] = 0
        self.hot[slots] = 0
        self.in_loop[slots] = False
        self.in_ngram[slots] = False
        self.grams[slots] = 0  # an empty table

    @property
    def pending(self) -> bool:
        """Waves queued for the next screen, or findings held for the next report."""
        return bool(self._queue or self._held)

    def forget(self, request_id: str) -> None:
        """A finished request; its queued tokens are still screened."""
        self.requests.release([request_id])
        if not self._queue:
            self.requests.apply_releases()

    def recent_tokens(self, request_id: str) -> list[int]:
        """The request's recent sampled tokens, oldest first, as many as its ring holds (the
        window and a batch; for evidence dumps). The queued waves are screened first, and
        what that finds is returned with the next batch."""
        if self._queue:
            self._held += self.flush(wait=True)
        slot = self.requests.lookup(request_id)
        if slot is None:
            return []
        end = int(self.total[slot])
        return self._history(slot, max(0, end - self._ring), end)

    def _history(self, slot: int, start: int, end: int) -> list[int]:
        """Tokens at stream positions [start, end) of a slot (all within the ring)."""
        return self.hist[slot, np.arange(start, end) & self._mask].tolist()

    # -- the per-wave update --------------------------------------------------------------
    def add(self, request_id: str, new_tokens: Sequence[int]) -> list[RepeatFinding]:
        """One request's tokens of one wave, screened at once; the episodes that start."""
        tokens, step = list(new_tokens), self._batch_tokens
        found = []
        for i in range(0, len(tokens), step):
            self.add_wave(0, [request_id], WaveTokens([tokens[i : i + step]]))
            found += self.flush()
        return [finding for _, _, finding in found]

    def add_wave(
        self, wave: int, req_ids: Sequence[str], tokens: WaveTokens, *, screen_full: bool = True
    ) -> list[WaveFinding]:
        """Queue one wave's tokens (row i's are request `req_ids[i]`'s): `add_waves` of one."""
        return self.add_waves([(wave, req_ids, tokens)], screen_full=screen_full)

    def add_waves(
        self, waves: Sequence[tuple[int, Sequence[str], WaveTokens]], *, screen_full: bool = True
    ) -> list[WaveFinding]:
        """Queue waves' tokens, in order; screens the batch each time it is full and returns
        those batches' findings, else nothing. No numpy runs here unless a batch's requests
        changed (their slots).

        `screen_full=False`: a full batch is left for another thread (`batch_ready`, then
        `flush`); this one screens only past `OVERDUE_BATCHES` batches, or when a request's
        tokens in the batch would pass their bound."""
        if self.off:
            return []
        found: list[WaveFinding] = []
        slots = self.requests.slots
        limit = self._batch_tokens
        rows, full = -1, 0
        for wave, req_ids, tokens in waves:
            if self._queued_tokens + tokens.width > limit:
                found += self.flush()  # a request's tokens in one batch stay bounded
            self._queue.append((wave, slots(req_ids), tokens))
            self._queued_tokens += tokens.width
            if tokens.rows != rows:
                rows = tokens.rows
                full = batch_waves(rows) * (1 if screen_full else OVERDUE_BATCHES)
            if len(self._queue) >= full:
                found += self.flush()
        return found

    @property
    def batch_ready(self) -> bool:
        """A full batch is queued (by the waves' own measure, `batch_waves`)."""
        queue = self._queue
        return bool(queue) and len(queue) >= batch_waves(queue[-1][2].rows)

    # -- the batch screen -----------------------------------------------------------------
    def flush(self, wait: bool = False) -> list[WaveFinding]:
        """Screen every queued wave; returns the episodes that started, in wave order. While
        the kernel is still loading in the background the waves stay queued, unless `wait`."""
        kernels = compiled.loaded()
        if kernels is None:
            if self.off or (compiled.loading() and not wait):
                return []
            try:
                kernels = compiled.load()  # waits for a load under way
            except Exception:
                self.off = True  # raised once (and counted by the caller); nothing queues now
                self._queue, self._queued_tokens = [], 0
                raise
        queue, self._queue = self._queue, []
        held, self._held = self._held, []
        self._queued_tokens = 0
        if not queue:
            self.requests.apply_releases()
            return held
        first = queue[0][1]
        if all(slots is first for _, slots, _ in queue):
            slots = np.tile(first, len(queue))  # the same requests every wave: the common case
        else:
            slots = np.concatenate([slots for _, slots, _ in queue])
        if all(tokens.uniform for _, _, tokens in queue):
            lengths = _ONE_EACH
        else:
            each = (tokens.lengths or [1] * tokens.rows for _, _, tokens in queue)
            lengths = np.fromiter(itertools.chain.from_iterable(each), np.int64, len(slots))
        found, blocks = kernels.repeat.screen(
            self.hist,
            self.total,
            self.since_check,
            self.hot,
            self.in_loop,
            self.in_ngram,
            self.grams,
            slots,
            np.array([tokens.rows for _, _, tokens in queue], dtype=np.int64),
            lengths,
            packed_batch([tokens for _, _, tokens in queue]),
            self._params,
        )
        out = held + self._findings(queue, found, blocks) if len(found) else held
        self.requests.apply_releases()  # after the findings named their requests
        out.sort(key=lambda item: item[0])
        return out

    def _findings(
        self, queue: list[tuple[int, np.ndarray, WaveTokens]], found: np.ndarray, blocks: np.ndarray
    ) -> list[WaveFinding]:
        id_of = self.requests.id_of
        out: list[WaveFinding] = []
        for (kind, index, slot, size, extent), block in zip(
            found.tolist(), blocks.tolist(), strict=True
        ):
            finding = (_KINDS[kind], size, extent, block[:size])
            out.append((queue[index][0], id_of[slot], finding))
        return out


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


# below this many ids a wave's range check runs on the list: builtins stay fast in the engine,
# where numpy's first calls after the model's own work cost several times their loop figure
SMALL_WAVE = 64


def rows_out_of_range(tokens: WaveTokens, vocab_size: int) -> list[int]:
    """Rows holding a sampled id outside [0, vocab_size); the common case is one reduction.

    Read as unsigned, a negative id is larger than any vocabulary, so the largest id alone
    tells whether every id is in range."""
    ids = tokens.ids
    if not ids:
        return []
    if len(ids) < SMALL_WAVE:
        if min(ids) >= 0 and max(ids) < vocab_size:
            return []
    elif int(tokens.flat.view(np.uint64).max()) < vocab_size:
        return []
    flat = tokens.flat
    bad = (flat < 0) | (flat >= vocab_size)
    return np.unique(tokens.row_of_each()[bad]).tolist()
