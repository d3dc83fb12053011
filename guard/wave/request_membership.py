"""Which vLLM requests ran in each wave, with their tokens: the worker side of request traces.

Only the rank that owns scheduling records it (tp0 of each replica and PP stage: every rank of
a TP group runs the same requests). Each wave has two steps: its schedule (new, finished and
preempted requests, from the scheduler output: `note_schedule`, or `queue_schedule` with the
fields already read) and its output (who ran, with what tokens: `note_wave`). The processor
queues both in one call as it hands the wave's record over (`on_record`, with the fields it read
for its prefill tracker). They only queue what they were given (a tuple and a deque append
each): the streamer thread works the queued steps out, oldest first, when it packs a batch
(`fill_batch`: rows, then `RequestColumns`), so the work below runs off the engine's path,
while the engine thread is in the model without the GIL.
That is safe because vLLM makes these objects fresh per wave and does not change them
afterwards (the runner output's `req_ids` and `req_id_to_index` are copies), with one
exception: the scheduler cuts a token list where its request stops. So of the runner output
only those two and the engine thread's counts are queued (`tokens`, and `kept` per request:
made before any cut, and an array, which the garbage collector does not track, in place of one
list per request that would each count towards its next young collection); of the scheduler
output, only the fields read (`guard.wave.schedule.ScheduleFields`, new requests by their ids), not
its whole tree. At most `STEPS_KEPT` waves wait: past that (no stream, a starved streamer) the
engine thread works the oldest out itself, so nothing is lost and the objects held stay
bounded. Neither call raises: an error is counted as a guard error (`on_error`) and costs only
that wave's membership.

A request that came with a W3C `traceparent` (guard/trace_context.py: vLLM keeps trace headers
when its tracing is on) has it read off its NewRequestData when it joins, and sent once with its
name (`traceparent_index` / `traceparent`); the sidecar parses it.

Cost (bench/request_membership.py). A request id becomes a small integer once, when the
request is new. The runner output's `req_ids` are the runner's own string objects, the same
ones wave after wave, so comparing this wave's list with the last one's is a pointer compare
per element (C): while the batch make-up is unchanged the last wave's index list is reused,
and the streamer sends it once per batch (`same_members`). Tokens are "every member got `each`
but these": only requests that may be prefilling (new, resumed after a preemption, not yet
sampled since) are looked at, and the wave's totals say whether every other one got exactly
one token scheduled and one sampled (each scheduled request has at least one token, and one
scheduled token samples at most one). So a steady decode wave does no per-request work.
When requests leave and join, the new list is predicted the way vLLM's persistent batch
changes (freed slots reused lowest first, then condensed: `_predicted`) and checked with the
same one compare; only a list it did not predict (a reorder) pays a lookup per request. Drafts
(spec decode: tokens differ per request) list every member, with the per-request kept counts
the processor already made for the wave's total (`guard.wave.schedule.read_sampled`).

Bounds: steps wait up to `STEPS_KEPT` waves (then worked out on the engine thread); rows
wait in a deque of `capacity` (the oldest dropped, counted); names of live requests are kept
up to `max_live` (the oldest forgotten, counted). Both counts travel cumulatively in every
batch.
"""

from __future__ import annotations

import collections
import itertools
import threading
from array import array
from collections.abc import Callable
from typing import Any

from guard import trace_context
from guard.wave.schedule import ONE_EACH, ScheduleFields, read_schedule
from telemetry.wire.proto import guard_pb2

DEFAULT_MAX_LIVE = 1 << 16  # names of unfinished requests kept per worker process
RETIRED_KEPT = 4096  # finished requests still resolvable (an async output a wave late)
PENDING_WAVES = 8  # scheduled waves whose output has not come back yet
ROWS_PER_BATCH = 4096
PREDICTION_PAUSE = 16  # changed waves mapped in full after a wrong prediction
STEPS_KEPT = 64  # waves queued for the streamer; past it the engine thread works them out

_SCHEDULED, _SAMPLED = 0, 1  # the kinds of queued step

NOTHING = ()  # no request joined this wave (None: unknown, no prediction)
STEADY = (1, (), ())  # every member got one token (scheduled, or sampled)

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
        # recently finished id -> index, oldest first: an OrderedDict, because a plain
        # dict's oldest key (`next(iter(d))`) is found by skipping every slot its earlier
        # deletions left, which cost 4 us a finish once RETIRED_KEPT requests had finished
        self._retired: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._names: dict[int, str] = {}  # index -> id, until its finish is packed
        # index -> the W3C traceparent the request came with (guard/trace_context.py), as
        # long as its name is kept: sent with the name
        self._traceparents: dict[int, str] = {}
        self._new_names: collections.deque[int] = collections.deque()  # not yet sent
        self._next = 0
        self._pending: dict[int, tuple] = {}
        # the engine thread's calls, not yet worked out: (kind, wave, objects...), oldest first
        self._steps: collections.deque[tuple] = collections.deque()
        self._steps_kept = 2 * STEPS_KEPT
        # held by whoever works steps out or packs rows: the streamer (blocking), or the
        # engine thread catching up (only when free: it never waits)
        self._lock = threading.Lock()
        self._rows: collections.deque[Row] = collections.deque()
        # the runner's batch as last seen: its request ids (our own list, changed in place
        # as vLLM's persistent batch changes), their indexes (a new array per change, kept by
        # the rows) and each index's position (built when first needed)
        self._shadow: list | None = None
        self._shadow_owned = False  # False: the runner's own list, copied before a change
        self._shadow_members: array = array("I")
        self._slot: dict[int, int] | None = None
        self._skip_predictions = 0  # after a wrong prediction (the runner reorders): a pause
        # requests that may be prefilling (new, resumed, not sampled since): runner id -> index
        self._prefilling: dict[str, int] = {}
        self.dropped_rows = 0
        self.dropped_names = 0
        self.full_maps = 0  # waves whose every id was looked up (the rest: reused or predicted)

    # -- engine thread ------------------------------------------------------------------------
    def note_schedule(self, wave: int, scheduler_output: Any) -> None:
        """Note the wave's scheduled requests (call after execute_model); with `note_wave`,
        the two-call form of `on_record`."""
        self.queue_schedule(wave, read_schedule(scheduler_output))

    def queue_schedule(self, wave: int, fields: ScheduleFields) -> None:
        """`note_schedule` from the fields the processor already read. Only those are queued,
        not the scheduler output: its whole tree (a dozen objects the garbage collector
        tracks, in a decode wave) would live until the streamer's next batch, and each one
        counts towards the next young collection."""
        new = fields.new
        traceparents = None
        if new:  # their ids only: a new request's data holds its prompt, params and features
            try:
                traceparents = trace_context.of_new(new)
                fields = fields._replace(new=[r.req_id for r in new])
            except Exception:  # noqa: BLE001 - costs this wave's membership only
                self._failed("request_membership_schedule")
                return
        steps = self._steps
        steps.append((_SCHEDULED, wave, fields, traceparents))
        if len(steps) > self._steps_kept:
            self._catch_up()

    def note_wave(self, wave: int, output: Any, tokens: int | None, kept: Any = None) -> None:
        """Record wave `wave`: `output` is the runner output (None: it sampled nothing here),
        `tokens` the sampled tokens the processor counted for it and `kept` how many tokens
        each request keeps (`read_sampled`: `ONE_EACH`, or an array in the output's order;
        made here from the token lists when not given, as they are now: a list the scheduler
        cuts later keeps its count from here).

        Only the output's request ids, its index of them and `kept` are queued, not the output:
        a queued object lives until the streamer's next batch, and its token lists (one per
        request) would each count towards the garbage collector's next young collection."""
        self.on_record(wave, None, output, tokens, kept)

    def on_record(
        self,
        wave: int,
        fields: ScheduleFields | None,
        output: Any,
        tokens: int | None,
        kept: Any = None,
    ) -> None:
        """The wave observer's hook (guard/wave/observers.py), called as the processor hands
        the wave's record over: the wave's schedule (`queue_schedule`; None for a dummy wave,
        which schedules nothing) and its output (`note_wave`), queued in one call on the
        engine thread, not two."""
        steps = self._steps
        if fields is not None:
            if fields.new:  # new requests: their ids only
                self.queue_schedule(wave, fields)
            else:
                steps.append((_SCHEDULED, wave, fields, None))
        if output is None:
            steps.append((_SAMPLED, wave, None, None, tokens, None))
        else:
            if kept is None:
                ids = getattr(output, "sampled_token_ids", None)
                if isinstance(ids, list):
                    kept = array("I", map(len, ids))
            steps.append(
                (
                    _SAMPLED,
                    wave,
                    getattr(output, "req_ids", None),
                    getattr(output, "req_id_to_index", None),
                    tokens,
                    kept,
                )
            )
        if len(steps) > self._steps_kept:
            self._catch_up()

    def _catch_up(self) -> None:
        """Too many steps wait (no stream, or a starved streamer): work the oldest out here,
        down to the bound, when the streamer is not at it (then it is draining them)."""
        lock = self._lock
        if lock.acquire(blocking=False):
            try:
                self._work(self._steps_kept)
            finally:
                lock.release()

    # -- either thread, holding the lock ------------------------------------------------------
    def drain(self) -> None:
        """Work every queued step out into rows (the streamer does this as it packs)."""
        with self._lock:
            self._work(0)

    def _work(self, leave: int) -> None:
        """Work queued steps out, oldest first, until `leave` are left."""
        steps = self._steps
        while len(steps) > leave:
            try:
                step = steps.popleft()
            except IndexError:
                return
            if step[0] == _SCHEDULED:
                try:
                    self._on_schedule(step[1], step[2], step[3])
                except Exception:  # noqa: BLE001 - membership must not cost the wave record
                    self._failed("request_membership_schedule")
            else:
                try:
                    self._on_wave(*step[1:])
                except Exception:  # noqa: BLE001
                    self._pending.pop(step[1], None)
                    self._shadow = None
                    self._failed("request_membership_wave")

    def _failed(self, where: str) -> None:
        if self._on_error is not None:
            self._on_error(where)

    def _on_schedule(
        self, wave: int, fields: ScheduleFields, traceparents: dict[str, str] | None = None
    ) -> None:
        """The scheduler output's scheduled tokens per request, new requests' ids, finished
        ids, preempted ids (None: a scheduler that does not say), resumed ids and total
        tokens; `traceparents`: the new requests' W3C traceparent headers, by id."""
        scheduled, new, done = fields.scheduled, fields.new, fields.finished
        gone, back, total = fields.preempted, fields.resumed, fields.total
        if scheduled is None:
            return
        index = self._index
        joined: Any = None if new is None else NOTHING
        if new:
            joined = list(new)
            prefilling = self._prefilling
            for req_id in joined:
                if req_id not in index:
                    number = prefilling[req_id] = self._name(req_id)
                    if traceparents is not None and req_id in traceparents:
                        self._traceparents[number] = traceparents[req_id]
        finished: tuple = ()
        if done:
            retired, prefilling, numbers = self._retired, self._prefilling, []
            for req_id in done:
                number = index.pop(req_id, None)
                if number is not None:
                    numbers.append(number)
                    retired[req_id] = number
                    if len(retired) > RETIRED_KEPT:
                        retired.popitem(last=False)
                prefilling.pop(req_id, None)
            finished = tuple(numbers)
        preempted: tuple = ()
        # preempted in this step (vLLM >= 0.11 sets it for both runners); older V1 schedulers
        # leave it None, and a request back from a preemption is then in resumed_req_ids
        if gone is None:
            gone = back
        if gone:
            preempted = tuple(index[r] for r in gone if r in index)
        if back:  # recomputes its prompt and output so far: may take several waves
            joined = None  # rejoins in an order the runner picks: no prediction
            for req_id in back:
                number = index.get(req_id)
                if number is not None:
                    self._prefilling[req_id] = number
        pending = self._pending
        if len(pending) >= PENDING_WAVES:
            del pending[next(iter(pending))]
        pending[wave] = (scheduled, total, finished, preempted, joined)

    def _on_wave(self, wave: int, req_ids: Any, where: Any, tokens: int | None, kept) -> None:
        """`req_ids` and `where` (id -> position) are the runner output's, `kept` its tokens
        kept per request (None: it carried no host-side token lists)."""
        opened = self._pending.pop(wave, None)
        if opened is None:
            return
        scheduled, total, finished, preempted, joined = opened
        n = len(scheduled)
        if not n and not finished and not preempted:
            return
        if isinstance(req_ids, list) and len(req_ids) == n:
            if finished or preempted or joined:
                members = None
                if self._skip_predictions:
                    self._skip_predictions -= 1
                elif joined is not None and self._shadow is not None:
                    members = self._predicted(finished + preempted, joined)
                    if members is None or req_ids != self._shadow:
                        members = None
                        self._skip_predictions = PREDICTION_PAUSE
                if members is None:
                    members = self._remap(req_ids)
            elif req_ids == self._shadow:  # the usual wave: the same batch
                members = self._shadow_members
            else:
                members = self._remap(req_ids)
            if self._prefilling or total != n:
                sched = self._scheduled(scheduled, total, n, req_ids, members)
                sampled, done = self._sampled(where, kept, tokens, n, sched[0], req_ids, members)
                for req_id in done:
                    del self._prefilling[req_id]
            else:  # the usual wave: none may be prefilling, one token each scheduled
                sched = STEADY
                if tokens == n and (kept is ONE_EACH or (kept is not None and len(kept) == n)):
                    sampled = STEADY
                else:
                    sampled = self._sampled(where, kept, tokens, n, 1, req_ids, members)[0]
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
            if total is not None:
                rest, seen, listed, counts = total, 0, [], []
                for req_id, number in cands.items():
                    got = scheduled.get(req_id, 0)
                    if got:  # scheduled this wave
                        rest -= got
                        seen += 1
                        if got != 1:
                            listed.append(number)
                            counts.append(got)
                if rest == n - seen:
                    return (1, tuple(listed), tuple(counts)) if listed else STEADY
        elif total == n:
            return STEADY
        # drafts (n-gram, EAGLE...) or a request we did not see join: each one listed
        return 0, members, tuple(map(scheduled.get, req_ids, itertools.repeat(0)))

    def _sampled(self, where: Any, kept, tokens, n: int, sched_each: int, req_ids, members: list):
        """(each, indexes, tokens) of the tokens the scheduler keeps of this output (None when
        not known), and the prefilling requests that sampled (their prefill is over). With one
        token scheduled for every request but the prefilling ones, those sampled at most one
        each, so the wave's count says whether they all did. `kept`: the tokens each request
        keeps (`ONE_EACH`, or in the output's order); `where`: the output's id -> position."""
        if tokens is None or kept is None:
            return None, ()
        one_each = kept is ONE_EACH
        if (tokens if one_each else len(kept)) != n:  # one each: one list per token
            return None, ()
        cands = self._prefilling
        if sched_each == 1:
            if not cands:
                if tokens == n:
                    return STEADY, ()
            else:
                rest, seen, listed, counts, done = tokens, 0, [], [], []
                for req_id, number in cands.items():
                    at = (
                        where.get(req_id) if isinstance(where, dict) else _position(req_ids, req_id)
                    )
                    if at is not None:
                        got = 1 if one_each else kept[at]
                        rest -= got
                        seen += 1
                        if got:
                            done.append(req_id)
                        if got != 1:
                            listed.append(number)
                            counts.append(got)
                if rest == n - seen:
                    return (1, tuple(listed), tuple(counts)), done
        counts = array("I", [1]) * n if one_each else kept
        done = ()
        if cands:
            got = dict(zip(members, counts, strict=True))
            done = [r for r, i in cands.items() if got.get(i)]
        return (0, members, counts), done

    def _predicted(self, left: tuple, joined: list) -> array | None:
        """This wave's members, made from the last wave's the way vLLM's persistent batch
        (`InputBatch`) changes: requests that left free their slots, joining ones take the
        lowest free slots (the rest are appended), then the last ones slide down into the
        holes still free (`condense`). Changes the shadow in place; the caller checks it
        against the runner's list in one compare (pointers, in C) and maps every id when it
        differs (a reorder, a request not scheduled this wave). So the usual change, a
        request finishing and another taking its slot, costs an array copy and a few dict
        operations instead of a lookup per request."""
        shadow, members = self._shadow, array("I", self._shadow_members)
        if not self._shadow_owned:
            shadow = self._shadow = list(shadow)
            self._shadow_owned = True
        slot = self._slot
        if slot is None:
            slot = self._slot = {number: at for at, number in enumerate(members)}
        if len(left) == 1:  # the usual change: one request left (or none, one joins)
            at = slot.pop(left[0], None)
            holes = [] if at is None else [at]
        else:
            holes = sorted((slot.pop(n) for n in left if n in slot), reverse=True)  # lowest last
        index = self._index
        for req_id in joined:
            number = index.get(req_id)
            if number is None:
                return None
            if holes:
                at = holes.pop()
                shadow[at] = req_id
                members[at] = number
            else:
                at = len(shadow)
                shadow.append(req_id)
                members.append(number)
            slot[number] = at
        if holes:
            for at in holes:
                shadow[at] = None
            last = len(shadow) - 1
            while holes:
                while last >= 0 and shadow[last] is None:
                    last -= 1
                low = holes[-1]
                if low >= last:
                    break
                holes.pop()
                moved = members[last]
                shadow[low], members[low], shadow[last] = shadow[last], moved, None
                slot[moved] = low
            while shadow and shadow[-1] is None:
                shadow.pop()
                members.pop()
        self._shadow_members = members
        return members

    def _remap(self, req_ids: list) -> array:
        """Every id of the runner's list looked up; the shadow starts again from it (the
        runner's list itself: it makes a new one per wave)."""
        self.full_maps += 1
        members = array("I", self._members(req_ids))
        self._shadow, self._shadow_owned = req_ids, False
        self._shadow_members, self._slot = members, None
        return members

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
            oldest = next(iter(names))
            del names[oldest]
            self._traceparents.pop(oldest, None)
        return number

    def __len__(self) -> int:
        """Entries waiting for the streamer: steps not yet worked out (two a wave), and rows."""
        return len(self._steps) + len(self._rows)

    # -- streamer thread ----------------------------------------------------------------------
    def fill_batch(self, batch: guard_pb2.Batch, with_heartbeat: bool = False) -> None:
        """Move waiting rows into `batch.request_columns`. A stream's first batch (the one
        naming the rank) names every request still known; later batches the new ones.
        Never raises (a batch filler must not break the stream): on an error the batch goes
        without membership, and the error is counted."""
        try:
            with self._lock:
                self._work(0)
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
        names, traceparents = self._names, self._traceparents
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
                if traceparents:
                    traceparents.pop(number, None)

    def _add_names(self, cols: guard_pb2.RequestColumns, fresh_stream: bool) -> None:
        queue, names = self._new_names, self._names
        pending = []
        while queue:
            try:
                pending.append(queue.popleft())
            except IndexError:
                break
        traceparents = self._traceparents
        if fresh_stream:
            known = list(names.items())
            cols.name_index.extend(k for k, _ in known)
            cols.name_request_id.extend(v for _, v in known)
            sent = {k for k, _ in known}
            pending = [i for i in pending if i not in sent]
            for number in sent & traceparents.keys():
                cols.traceparent_index.append(number)
                cols.traceparent.append(traceparents[number])
        for number in pending:
            req_id = names.get(number)
            if req_id is not None:
                cols.name_index.append(number)
                cols.name_request_id.append(req_id)
                traceparent = traceparents.get(number)
                if traceparent is not None:
                    cols.traceparent_index.append(number)
                    cols.traceparent.append(traceparent)


def _position(req_ids: list, req_id: str) -> int | None:
    try:
        return req_ids.index(req_id)  # the runner's own strings: compared by identity first
    except ValueError:
        return None
