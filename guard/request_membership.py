"""Which vLLM requests ran in each wave, with their tokens: the worker side of request traces.

Only the rank that owns scheduling records it (tp0 of each replica and PP stage: every rank of
a TP group runs the same requests). The engine thread makes two calls per wave: `on_schedule`
(after execute_model: new, finished and preempted requests, from the scheduler output) and
`on_wave` (when the wave's record is emitted: who ran, with what tokens). The streamer thread
turns the rows into `RequestColumns` with `fill_batch`. Neither call raises: an error is
counted as a guard error (`on_error`) and costs only that wave's membership.

Cost (bench/request_membership.py). A request id becomes a small integer once, when the
request is new. The runner output's `req_ids` are the runner's own string objects, the same
ones wave after wave, so comparing this wave's list with the last one's is a pointer compare
per element (C): while the batch make-up is unchanged the last wave's index list is reused,
and the streamer sends it once per batch (`same_members`). Tokens are "every member got `each`
but these": only requests that may be prefilling (new, resumed after a preemption, not yet
sampled since) are looked at, and the wave's totals say whether every other one got exactly
one token scheduled and one sampled (each scheduled request has at least one token, and one
scheduled token samples at most one). So a steady decode wave does no per-request work, a
wave whose make-up changed pays one C-level `map` over its requests, and only drafts
(spec decode: tokens differ per request) list every member.

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

# (wave, members, (each, indexes, tokens) scheduled, the same sampled or None, finished,
#  preempted); `members` is the same array object while the make-up is unchanged
Row = tuple


class RequestMembership:
    """Per-wave request membership of one worker process (engine thread in, streamer out)."""

    def __init__(
        self,
        capacity: int,
        max_live: int = DEFAULT_MAX_LIVE,
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        self._on_error = on_error
        self._capacity = capacity
        self._max_live = max_live
        self._index: dict[str, int] = {}  # live request id -> index (engine thread)
        self._retired: dict[str, int] = {}  # recently finished id -> index
        self._names: dict[int, str] = {}  # index -> id, until its finish is packed
        self._new_names: collections.deque[int] = collections.deque()  # not yet sent
        self._next = 0
        self._pending: dict[int, tuple] = {}
        self._rows: collections.deque[Row] = collections.deque()
        self._last_ids: list | None = None
        self._last_members: list | None = None
        # requests that may be prefilling (new, resumed, not sampled since): runner id -> index
        self._prefilling: dict[str, int] = {}
        self.dropped_rows = 0
        self.dropped_names = 0

    # -- engine thread ------------------------------------------------------------------------
    def on_schedule(self, wave: int, scheduler_output: Any) -> None:
        """Note the wave's scheduled requests (call after execute_model)."""
        try:
            self._on_schedule(wave, scheduler_output)
        except Exception:  # noqa: BLE001 - membership must not cost the wave record
            self._failed("request_membership_schedule")

    def on_wave(self, wave: int, output: Any, runner: Any, tokens: int | None) -> None:
        """Record wave `wave`: `output` is the runner output (None: it sampled nothing here),
        `tokens` the sampled tokens the processor counted for it."""
        try:
            self._on_wave(wave, output, runner, tokens)
        except Exception:  # noqa: BLE001
            self._pending.pop(wave, None)
            self._last_ids = None
            self._failed("request_membership_wave")

    def _failed(self, where: str) -> None:
        if self._on_error is not None:
            self._on_error(where)

    def _on_schedule(self, wave: int, scheduler_output: Any) -> None:
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None)
        if scheduled is None:
            return
        index = self._index
        new = getattr(scheduler_output, "scheduled_new_reqs", None)
        if new:
            for request in new:
                req_id = getattr(request, "req_id", None)
                if req_id is not None and req_id not in index:
                    self._prefilling[req_id] = self._name(req_id)
        finished: tuple = ()
        done = getattr(scheduler_output, "finished_req_ids", None)
        if done:
            finished = tuple(self._retire(r) for r in done if r in index)
            for req_id in done:
                self._prefilling.pop(req_id, None)
        preempted: tuple = ()
        # preempted in this step (vLLM >= 0.11 sets it for both runners); older V1 schedulers
        # leave it None, and a request back from a preemption is then in resumed_req_ids
        gone = getattr(scheduler_output, "preempted_req_ids", None)
        if gone is None:
            cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
            gone = getattr(cached, "resumed_req_ids", None)
        if gone:
            preempted = tuple(index[r] for r in gone if r in index)
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        back = getattr(cached, "resumed_req_ids", None)
        if back:  # recomputes its prompt and output so far: may take several waves
            for req_id in back:
                number = index.get(req_id)
                if number is not None:
                    self._prefilling[req_id] = number
        total = getattr(scheduler_output, "total_num_scheduled_tokens", None)
        pending = self._pending
        if len(pending) >= PENDING_WAVES:
            del pending[next(iter(pending))]
        pending[wave] = (scheduled, total, finished, preempted)

    def _on_wave(self, wave: int, output: Any, runner: Any, tokens: int | None) -> None:
        opened = self._pending.pop(wave, None)
        if opened is None:
            return
        scheduled, total, finished, preempted = opened
        n = len(scheduled)
        if not n and not finished and not preempted:
            return
        req_ids = getattr(output, "req_ids", None)
        if isinstance(req_ids, list) and len(req_ids) == n:
            if req_ids == self._last_ids:
                members = self._last_members
            else:
                members = self._members(req_ids)
                self._last_ids, self._last_members = req_ids, members
            sched = self._scheduled(scheduled, total, n, req_ids, members)
            sampled, done = self._sampled(output, runner, tokens, n, sched[0], req_ids, members)
            for req_id in done:
                del self._prefilling[req_id]
        else:  # no runner output for this wave (a PP stage before the last, a wave cut short)
            members = self._members(list(scheduled))
            sched = (0, tuple(members), tuple(scheduled.values()))
            sampled = None
        rows = self._rows
        if len(rows) >= self._capacity:
            try:  # noqa: SIM105 - hot path
                rows.popleft()
            except IndexError:
                pass
            self.dropped_rows += 1
        rows.append((wave, members, sched, sampled, finished, preempted))

    def _scheduled(self, scheduled: dict, total, n: int, req_ids: list, members: list):
        """(each, indexes, tokens): every member got `each` tokens but the listed ones.

        Only requests that may be prefilling (new, resumed, or not yet sampled since) are
        looked at; the others got one token each exactly when the wave's total says so (each
        scheduled request has at least one token)."""
        cands = self._prefilling
        if cands:
            got = [(i, scheduled.get(r, 0)) for r, i in cands.items()]
            listed = [(i, t) for i, t in got if t]  # those scheduled this wave
            rest = total - sum(t for _, t in listed) if total is not None else -1
            if rest == n - len(listed):
                keep = [(i, t) for i, t in listed if t != 1]
                return 1, tuple(i for i, _ in keep), tuple(t for _, t in keep)
        elif total == n:
            return 1, (), ()
        # drafts (n-gram, EAGLE...) or a request we did not see join: each one listed
        return 0, tuple(members), tuple(map(scheduled.get, req_ids, itertools.repeat(0)))

    def _sampled(self, output: Any, runner: Any, tokens, n: int, sched_each: int, req_ids,
                 members: list):  # fmt: skip
        """(each, indexes, tokens) of the tokens the scheduler keeps of this output (None when
        not known), and the prefilling requests that sampled (their prefill is over). With one
        token scheduled for every request but the prefilling ones, those sampled at most one
        each, so the wave's count says whether they all did."""
        ids = getattr(output, "sampled_token_ids", None)
        if tokens is None or not isinstance(ids, list) or len(ids) != n:
            return None, ()
        cands = self._prefilling
        if sched_each == 1:
            if not cands:
                if tokens == n:
                    return (1, (), ()), ()
            else:
                where = getattr(output, "req_id_to_index", None)
                listed, done = [], []
                for req_id, number in cands.items():
                    at = (
                        where.get(req_id) if isinstance(where, dict) else _position(req_ids, req_id)
                    )
                    if at is not None:
                        kept = self._kept(ids, at, req_ids, runner)
                        listed.append((number, kept))
                        if kept:
                            done.append(req_id)
                if tokens - sum(t for _, t in listed) == n - len(listed):
                    keep = [(i, t) for i, t in listed if t != 1]
                    return (1, tuple(i for i, _ in keep), tuple(t for _, t in keep)), done
        counts = array("I", map(len, ids))
        if runner is not None and n and max(counts) > 1:
            for at, count in enumerate(counts):
                if count > 1:
                    counts[at] = self._kept(ids, at, req_ids, runner)
        done = ()
        if cands:
            got = dict(zip(members, counts, strict=True))
            done = [r for r, i in cands.items() if got.get(i)]
        return (0, tuple(members), tuple(counts)), done

    @staticmethod
    def _kept(ids: list, at: int, req_ids: list, runner: Any) -> int:
        tokens = ids[at]
        if len(tokens) <= 1 or runner is None:
            return len(tokens)
        requests = getattr(runner, "requests", None)
        state = requests.get(req_ids[at]) if isinstance(requests, dict) else None
        if state is None:
            return len(tokens)
        return _kept(tokens, state, getattr(runner, "max_model_len", 0) or 0)

    def _members(self, req_ids: list) -> list[int]:
        index = self._index
        try:
            return list(map(index.__getitem__, req_ids))
        except KeyError:  # a request first seen here, or finished a wave ago (async)
            retired = self._retired
            out: list[int] = []
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
        self._new_names.append(number)
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
        """Move waiting rows into `batch.request_columns`. A stream's first batch (the one
        naming the rank) names every request still known; later batches the new ones.
        Never raises (a batch filler must not break the stream): on an error the batch goes
        without membership, and the error is counted."""
        try:
            self._fill(batch)
        except Exception:  # noqa: BLE001
            batch.ClearField("request_columns")
            self._failed("request_membership_fill")

    def _fill(self, batch: guard_pb2.Batch) -> None:
        rows = self._rows
        fresh_stream = batch.HasField("rank")
        if not (rows or fresh_stream or self.dropped_rows or self.dropped_names):
            return
        cols = batch.request_columns
        cols.dropped_rows_total = self.dropped_rows
        cols.dropped_names_total = self.dropped_names
        taken = []
        for _ in range(min(len(rows), ROWS_PER_BATCH)):
            try:
                taken.append(rows.popleft())
            except IndexError:
                break
        # names after rows: the engine thread names a request before its first row
        self._add_names(cols, fresh_stream)
        previous = None
        names = self._names
        for wave, members, sched, sampled, finished, gone in taken:
            same = members is previous
            cols.wave.append(wave)
            cols.members.append(len(members))
            cols.same_members.append(same)
            if not same:
                cols.req_index.extend(members)
                previous = members
            each, listed, counts = sched
            cols.scheduled_each.append(each)
            cols.scheduled_count.append(len(listed))
            cols.scheduled_index.extend(listed)
            cols.scheduled_tokens.extend(counts)
            cols.sampled.append(sampled is not None)
            each, listed, counts = sampled if sampled is not None else (0, (), ())
            cols.sampled_each.append(each)
            cols.sampled_count.append(len(listed))
            cols.sampled_index.extend(listed)
            cols.sampled_tokens.extend(counts)
            cols.finished_count.append(len(finished))
            cols.finished_index.extend(finished)
            cols.preempted_count.append(len(gone))
            cols.preempted_index.extend(gone)
            for number in finished:
                names.pop(number, None)

    def _add_names(self, cols: guard_pb2.RequestColumns, fresh_stream: bool) -> None:
        queue, names = self._new_names, self._names
        pending = []
        while queue:
            try:
                pending.append(queue.popleft())
            except IndexError:
                break
        if fresh_stream:
            known = list(names.items())
            cols.name_index.extend(k for k, _ in known)
            cols.name_request_id.extend(v for _, v in known)
            sent = {k for k, _ in known}
            pending = [i for i in pending if i not in sent]
        for number in pending:
            req_id = names.get(number)
            if req_id is not None:
                cols.name_index.append(number)
                cols.name_request_id.append(req_id)


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


def _position(req_ids: list, req_id: str) -> int | None:
    try:
        return req_ids.index(req_id)  # the runner's own strings: compared by identity first
    except ValueError:
        return None
