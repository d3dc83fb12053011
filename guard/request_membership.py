"""Which vLLM requests ran in each wave, with their tokens: the worker side of request traces.

Only the rank that owns scheduling records it (tp0 of each replica and PP stage: every rank of
a TP group runs the same requests). The engine thread does two calls per wave:
`on_schedule` (after execute_model: new, finished and preempted requests, from the scheduler
output) and `on_wave` (when the wave's record is emitted: who ran, with what tokens). The
streamer thread turns the rows into `RequestColumns` with `fill_batch`.

Cost. A request id is a string; it is turned into a small integer once, when the request is
new. The runner output's `req_ids` are the runner's own string objects, the same ones wave
after wave, so comparing this wave's list with the last one's is a pointer compare per
element (C, no hashing): while the batch make-up is unchanged the last wave's index array is
reused. In steady decode every request was scheduled one token and sampled one, which the
wave totals already say (`scheduled_each` / `sampled_each`), so no per-request work is done
at all. Only a wave whose make-up or per-request tokens changed pays a C-level `map` over its
requests (bench/request_membership.py measures both).

Bounds: rows wait in a deque of `capacity` (the oldest dropped, counted); names of live
requests are kept up to `max_live` (the oldest forgotten, counted). Both counts travel
cumulatively in every batch.
"""

from __future__ import annotations

import collections
import itertools
from array import array
from collections.abc import Callable
from typing import Any

from guard.schedule import _kept
from telemetry.proto import guard_pb2

DEFAULT_MAX_LIVE = 1 << 16  # names of unfinished requests kept per worker process
RETIRED_KEPT = 4096  # finished requests still resolvable (an async output a wave late)
PENDING_WAVES = 8  # scheduled waves whose output has not come back yet
ROWS_PER_BATCH = 4096

# (wave, members, scheduled_each, scheduled, sampled_known, sampled_each, sampled,
#  finished, preempted); `members` is the same array object while the make-up is unchanged
Row = tuple


class RequestMembership:
    """Per-wave request membership of one worker process (engine thread in, streamer out)."""

    def __init__(self, capacity: int, max_live: int = DEFAULT_MAX_LIVE) -> None:
        self._capacity = capacity
        self._max_live = max_live
        self._index: dict[str, int] = {}  # live request id -> index (engine thread)
        self._retired: dict[str, int] = {}  # recently finished id -> index
        self._names: dict[int, str] = {}  # index -> id, until its finish is packed
        self._next = 0
        self._pending: dict[int, tuple] = {}
        self._rows: collections.deque[Row] = collections.deque()
        self._last_ids: list | None = None
        self._last_members: array | None = None
        self._sent: set[int] = set()  # indexes named on the current stream (streamer thread)
        self.dropped_rows = 0
        self.dropped_names = 0

    # -- engine thread ------------------------------------------------------------------------
    def on_schedule(self, wave: int, scheduler_output: Any) -> None:
        """Note the wave's scheduled requests (call after execute_model)."""
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None)
        if scheduled is None:
            return
        index = self._index
        new = getattr(scheduler_output, "scheduled_new_reqs", None)
        if new:
            for request in new:
                req_id = getattr(request, "req_id", None)
                if req_id is not None and req_id not in index:
                    self._name(req_id)
        finished: tuple = ()
        done = getattr(scheduler_output, "finished_req_ids", None)
        if done:
            finished = tuple(self._retire(r) for r in done if r in index)
        preempted: tuple = ()
        # preempted in this step (vLLM >= 0.11 sets it for both runners); older V1 schedulers
        # leave it None, and a request back from a preemption is then in resumed_req_ids
        gone = getattr(scheduler_output, "preempted_req_ids", None)
        if gone is None:
            cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
            gone = getattr(cached, "resumed_req_ids", None)
        if gone:
            preempted = tuple(index[r] for r in gone if r in index)
        total = getattr(scheduler_output, "total_num_scheduled_tokens", None)
        pending = self._pending
        if len(pending) >= PENDING_WAVES:
            del pending[next(iter(pending))]
        pending[wave] = (scheduled, total, finished, preempted)

    def on_wave(self, wave: int, output: Any, runner: Any, tokens: int | None) -> None:
        """Record wave `wave`: `output` is the runner output (None: it sampled nothing here),
        `tokens` the sampled tokens the processor counted for it."""
        opened = self._pending.pop(wave, None)
        if opened is None:
            return
        scheduled, total, finished, preempted = opened
        n = len(scheduled)
        if not n and not finished and not preempted:
            return
        req_ids = getattr(output, "req_ids", None)
        sched_each, sched_list = (1, None) if total == n else (0, None)
        if isinstance(req_ids, list) and len(req_ids) == n:
            if req_ids == self._last_ids:
                members = self._last_members
            else:
                members = self._members(req_ids)
                self._last_ids, self._last_members = req_ids, members
            if not sched_each:
                sched_list = array("I", map(scheduled.get, req_ids, itertools.repeat(0)))
            known, sampled_each, sampled_list = self._sampled(output, runner, tokens, n, sched_each)
        else:  # no runner output for this wave (a PP stage before the last, a wave cut short)
            members = self._members(list(scheduled))
            if not sched_each:
                sched_list = array("I", scheduled.values())
            known, sampled_each, sampled_list = False, 0, None
        rows = self._rows
        if len(rows) >= self._capacity:
            try:  # noqa: SIM105 - hot path
                rows.popleft()
            except IndexError:
                pass
            self.dropped_rows += 1
        rows.append(
            (wave, members, sched_each, sched_list, known, sampled_each, sampled_list,
             finished, preempted)
        )  # fmt: skip

    def _sampled(self, output: Any, runner: Any, tokens: int | None, n: int, sched_each: int):
        """(known, each, per request) of the tokens the scheduler keeps of this output."""
        ids = getattr(output, "sampled_token_ids", None)
        if tokens is None or not isinstance(ids, list) or len(ids) != n:
            return False, 0, None
        if sched_each == 1 and tokens == n:
            return True, 1, None  # one token scheduled each, n sampled: one each
        lengths = array("I", map(len, ids))
        if runner is not None and n and max(lengths) > 1:
            requests = getattr(runner, "requests", None)
            req_ids = output.req_ids
            if isinstance(requests, dict):
                max_model_len = getattr(runner, "max_model_len", 0) or 0
                for i, count in enumerate(lengths):
                    if count > 1:
                        state = requests.get(req_ids[i])
                        if state is not None:
                            lengths[i] = _kept(ids[i], state, max_model_len)
        if n and min(lengths) == max(lengths) and lengths[0]:
            return True, lengths[0], None
        return True, 0, lengths

    def _members(self, req_ids: list) -> array:
        index = self._index
        try:
            return array("I", map(index.__getitem__, req_ids))
        except KeyError:  # a request first seen here, or finished a wave ago (async)
            retired = self._retired
            out = array("I")
            for req_id in req_ids:
                known = index.get(req_id)
                if known is None:
                    known = retired.get(req_id)
                if known is None:
                    known = self._name(req_id)
                out.append(known)
            return out

    def _name(self, req_id: str) -> int:
        number = self._next
        self._next = number + 1 if number < 0xFFFFFFFE else 0
        self._index[req_id] = number
        names = self._names
        names[number] = req_id
        if len(self._index) > self._max_live:  # finishes never seen: forget the oldest
            oldest = next(iter(self._index))
            del self._index[oldest]
            self.dropped_names += 1
        if len(names) > self._max_live + RETIRED_KEPT:
            names.pop(next(iter(names)), None)
        return number

    def _retire(self, req_id: str) -> int:
        number = self._index.pop(req_id)
        retired = self._retired
        retired[req_id] = number
        if len(retired) > RETIRED_KEPT:
            del retired[next(iter(retired))]
        return number

    def __len__(self) -> int:
        """Rows waiting for the streamer."""
        return len(self._rows)

    # -- streamer thread ----------------------------------------------------------------------
    def fill_batch(self, batch: guard_pb2.Batch, with_heartbeat: bool = False) -> None:
        """Move waiting rows into `batch.request_columns` (a stream's first batch, the one
        naming the rank, starts naming requests afresh)."""
        if batch.HasField("rank"):
            self._sent = set()
        rows = self._rows
        if not rows and not (self.dropped_rows or self.dropped_names):
            return
        cols = batch.request_columns
        cols.dropped_rows_total = self.dropped_rows
        cols.dropped_names_total = self.dropped_names
        previous = None
        names, sent = self._names, self._sent
        for _ in range(min(len(rows), ROWS_PER_BATCH)):
            try:
                row = rows.popleft()
            except IndexError:
                break
            wave, members, sched_each, sched, known, sampled_each, sampled, finished, gone = row
            same = members is previous
            cols.wave.append(wave)
            cols.members.append(len(members))
            cols.same_members.append(same)
            cols.scheduled_each.append(sched_each)
            cols.sampled_each.append(sampled_each)
            cols.sampled.append(known)
            if not same:
                cols.req_index.extend(members)
                self._name_new(cols, members, names, sent)
                previous = members
            if sched is not None:
                cols.scheduled_tokens.extend(sched)
            if sampled is not None:
                cols.sampled_tokens.extend(sampled)
            cols.finished_count.append(len(finished))
            cols.preempted_count.append(len(gone))
            if gone:
                self._name_new(cols, gone, names, sent)
                cols.preempted_index.extend(gone)
            if finished:
                self._name_new(cols, finished, names, sent)
                cols.finished_index.extend(finished)
                for number in finished:
                    names.pop(number, None)
                    sent.discard(number)

    @staticmethod
    def _name_new(cols, numbers, names: dict[int, str], sent: set[int]) -> None:
        fresh = [i for i in numbers if i not in sent]
        for number in fresh:
            req_id = names.get(number)
            if req_id is not None:
                cols.name_index.append(number)
                cols.name_request_id.append(req_id)
            sent.add(number)


def chain_fillers(
    *fillers: Callable[[guard_pb2.Batch, bool], None] | None,
) -> Callable[[guard_pb2.Batch, bool], None] | None:
    """One batch filler calling each given one in order (None: none given)."""
    present = [f for f in fillers if f is not None]
    if len(present) <= 1:
        return present[0] if present else None

    def fill(batch: guard_pb2.Batch, with_heartbeat: bool) -> None:
        for filler in present:
            filler(batch, with_heartbeat)

    return fill
