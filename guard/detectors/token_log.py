"""The token log: a worker's engine thread appends each wave's sampled ids to it, and the
streamer thread hands it over to token_range and token_repeat a batch at a time
(`DetectorSuite._hand_over`). Its entries, when the engine thread must hand over itself, and
the range check over a whole batch.
"""

from __future__ import annotations

import itertools

from guard.detectors.slots import batch_waves
from guard.detectors.tokens import OVERDUE_BATCHES
from guard.wave.schedule import WaveTokens

# an entry of the token log: a wave's (wave, request ids, tokens), or the requests that
# finished before a wave, (wave, their ids)
LoggedWave = tuple[int, list[str], WaveTokens]


LoggedFinish = tuple[int, tuple[str, ...]]


def overdue_waves(rows: int) -> int:
    """Logged waves of `rows` requests past which a worker's engine thread hands them over
    itself, the streamer thread not having come for `OVERDUE_BATCHES` batches' worth."""
    return batch_waves(rows) * OVERDUE_BATCHES


def all_in_range(waves: list[LoggedWave], vocab: int) -> bool:
    """Every id of `waves` is in [0, vocab): one min and one max over all of them."""
    ids = list(itertools.chain.from_iterable([tokens.ids for _, _, tokens in waves]))
    return not ids or (min(ids) >= 0 and max(ids) < vocab)
