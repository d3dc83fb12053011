"""A stand-in for vLLM's V1 scheduler and runner step objects, for request-membership tests.

It cannot be vLLM here (unit and integration tests start no server): it makes the objects the
guard reads duck-typed (`SchedulerOutput`, `ModelRunnerOutput`) the way vLLM 0.32 makes them,
and keeps the truth to check against: which waves each request was scheduled in, with how many
tokens, and how many it sampled. What it copies from vLLM:

- the scheduler output crosses a process boundary (TP > 1), so its request id strings are new
  objects every wave; the runner's `req_ids` are the runner's own strings, the same objects wave
  after wave (`CachedRequestState.req_id`, from the request's first `NewRequestData`);
- chunked prefill: a prompt longer than the token budget runs over several waves, and a partial
  chunk's sampled list is empty;
- a finished request is named in `finished_req_ids` of the next wave;
- a preempted request leaves the batch and comes back in `resumed_req_ids`, recomputing its
  prompt and output so far;
- a request's `traceparent` (vLLM's tracing on) rides on its NewRequestData, put there by the
  guard's engine-core hook;
- with `layout="slots"`, the runner's order is its persistent batch's (`InputBatch`): a request
  that leaves frees its slot, joining ones (new first, then those back in the batch) take the
  lowest free slots or go last, and the last ones then slide down into the holes left
  (`condense`); `swap_every` swaps the first and last slot every so many waves, as an attention
  backend's reorder does. The default, `layout="list"`, keeps the order requests joined in.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

from guard import trace_context
from guard.config.runtime_guard import GuardConfig
from guard.processor import GuardProcessor
from guard.stream.streamer import Streamer
from telemetry.ingest.validation import validate_batch
from telemetry.pipeline.writer import Item, RankSource
from telemetry.store import Store
from telemetry.wire.labels import EngineLabels
from telemetry.wire.proto import guard_pb2


def _fresh(text: str) -> str:
    return text.encode().decode()  # an equal string, another object (as unpickled)


@dataclasses.dataclass
class SimRequest:
    req_id: str
    prompt: int
    max_tokens: int
    arrive_wave: int = 1
    computed: int = 0
    output: int = 0
    preempted: bool = False
    waves: dict[int, tuple[int, int]] = dataclasses.field(
        default_factory=dict
    )  # wave: (sched, sampled)
    preemptions: int = 0
    traceparent: str | None = None  # the W3C header it came with (vLLM's tracing on)

    @property
    def done(self) -> bool:
        return self.output >= self.max_tokens


class Sim:
    """Schedules requests wave by wave under a token budget."""

    def __init__(
        self,
        requests: list[SimRequest],
        budget: int = 64,
        preempt: dict | None = None,
        layout: str = "list",
        swap_every: int = 0,
    ):
        assert layout in ("list", "slots"), layout
        self.layout, self.swap_every = layout, swap_every
        self.slots: list[str | None] = []
        self.requests = {r.req_id: r for r in requests}
        self.budget = budget
        self.preempt = preempt or {}  # wave -> req_id preempted before that wave is scheduled
        self.wave = 0
        self.running: list[str] = []
        self.seen: set[str] = set()
        self.finished_last: set[str] = set()
        self.runner_ids: dict[str, str] = {}  # the runner's own string per request

    def pending(self) -> bool:
        return any(not r.done for r in self.requests.values())

    def step(self) -> tuple[Any, Any]:
        self.wave += 1
        wave = self.wave
        budget = self.budget
        resumed: set[str] = set()
        gone = self.preempt.get(wave)
        preempted: set[str] = set()
        if gone in self.running:
            preempted.add(gone)
            self.running.remove(gone)
            req = self.requests[gone]
            req.preempted, req.computed = True, 0
            req.preemptions += 1
        scheduled: dict[str, int] = {}
        new_reqs = []
        for req_id in list(self.running):
            req = self.requests[req_id]
            need = req.prompt + req.output - req.computed
            tokens = min(need, budget) if need > 1 else 1
            if tokens <= 0 or budget <= 0:
                continue
            scheduled[req_id] = tokens
            budget -= tokens
        for req in self.requests.values():
            if budget <= 0:
                break
            if req.done or req.req_id in self.running or req.arrive_wave > wave:
                continue
            if req.preempted and gone == req.req_id:
                continue  # preempted this wave: back from the next one
            need = req.prompt + req.output - req.computed
            tokens = min(need, budget)
            scheduled[req.req_id] = tokens
            budget -= tokens
            self.running.append(req.req_id)
            if req.preempted:
                resumed.add(req.req_id)
                req.preempted = False
            else:
                self.seen.add(req.req_id)
                new_reqs.append(
                    SimpleNamespace(req_id=req.req_id, prompt_token_ids=[0] * req.prompt,
                                    num_computed_tokens=0)
                )  # fmt: skip
        order = [r for r in self.running if r in scheduled]
        if self.layout == "slots":
            new_ids = [n.req_id for n in new_reqs]
            order = self._persistent_batch(scheduled, new_ids, order)
        so = SimpleNamespace(
            num_scheduled_tokens={_fresh(r): scheduled[r] for r in order},
            total_num_scheduled_tokens=sum(scheduled.values()),
            scheduled_new_reqs=[
                SimpleNamespace(req_id=_fresh(n.req_id), prompt_token_ids=n.prompt_token_ids,
                                num_computed_tokens=0)
                for n in new_reqs
            ],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[_fresh(r) for r in order if r not in {n.req_id for n in new_reqs}],
                resumed_req_ids={_fresh(r) for r in resumed},
                num_computed_tokens=[], all_token_ids={},
            ),
            finished_req_ids={_fresh(r) for r in self.finished_last},
            preempted_req_ids={_fresh(r) for r in preempted},  # vLLM 0.32 sets it for V1
        )  # fmt: skip
        # the engine core's schedule() hook puts each new request's traceparent on its
        # NewRequestData (the real one: guard/trace_context.py), from vLLM's Request
        if any(r.traceparent for r in self.requests.values()):
            headers = {
                r.req_id: SimpleNamespace(
                    trace_headers={"traceparent": r.traceparent} if r.traceparent else None
                )
                for r in self.requests.values()
            }
            trace_context.stamp_new(SimpleNamespace(requests=headers), so)
        # the runner keeps the string of the request's first NewRequestData
        for new in so.scheduled_new_reqs:
            self.runner_ids[new.req_id] = new.req_id
        runner_req_ids = [self.runner_ids[r] for r in order]
        sampled_ids = []
        self.finished_last = set()
        for req_id in order:
            req = self.requests[req_id]
            tokens = scheduled[req_id]
            req.computed += tokens
            sampled = 1 if req.computed >= req.prompt + req.output else 0
            req.output += sampled
            if sampled:
                req.computed = req.prompt + req.output - 1  # the new token is not computed yet
            req.waves[wave] = (tokens, sampled)
            sampled_ids.append([7] * sampled)
            if req.done:
                self.running.remove(req_id)
                self.finished_last.add(req_id)
        output = SimpleNamespace(req_ids=runner_req_ids, sampled_token_ids=sampled_ids)
        return so, output

    def _persistent_batch(self, scheduled: dict, new_ids: list[str], order: list[str]) -> list:
        slots = self.slots
        for at, req_id in enumerate(slots):
            if req_id is not None and req_id not in scheduled:
                slots[at] = None  # finished, preempted or not scheduled this wave
        holes = [at for at, req_id in enumerate(slots) if req_id is None]
        present = set(slots)
        joining = new_ids + [r for r in order if r not in present and r not in new_ids]
        for req_id in joining:
            if holes:
                slots[holes.pop(0)] = req_id
            else:
                slots.append(req_id)
        while holes:
            taken = [at for at, req_id in enumerate(slots) if req_id is not None]
            if not taken or holes[0] >= taken[-1]:
                break
            last = taken[-1]
            slots[holes.pop(0)], slots[last] = slots[last], None
        while slots and slots[-1] is None:
            slots.pop()
        if self.swap_every and self.wave % self.swap_every == 0 and len(slots) > 1:
            slots[0], slots[-1] = slots[-1], slots[0]
        return list(slots)


class _QuietStreamer(Streamer):
    """The real Streamer, never started: tests pull its batches with `batches()`."""

    def start(self, rank=None, spool=None) -> None:
        if rank is not None:  # named as the real one is, never sending
            self._rank = rank

    def stop(self, timeout: float = 2.0) -> None:
        return

    def batches(self, membership) -> list[guard_pb2.Batch]:
        out = []
        while self._buffer or (membership is not None and len(membership)):
            out.append(self._make_batch(self._drain(), False))
        return out


RANK = dict(run_id="run-sim", engine="sim", dp_size=1, tp_size=2, pp_size=1, node="n", pid=77)


def guarded(tp: int = 0, sidecar: str | None = None, **config: Any) -> GuardProcessor:
    """A real GuardProcessor on one rank. With `sidecar`, its real streamer sends there;
    without, the streamer is never started (tests pull its batches from `drive`)."""
    rank = guard_pb2.RankInfo(tp_rank=tp, **RANK)
    cfg = GuardConfig(sidecar=sidecar or "localhost:1", liveness_record=False,
                      flush_interval_ms=20, **config)  # fmt: skip
    return GuardProcessor(cfg, lambda runner: rank, Streamer if sidecar else _QuietStreamer)


def drive(processor: GuardProcessor, sim: Sim, max_waves: int = 10_000) -> list[guard_pb2.Batch]:
    """Run the simulation through the processor's decorator entry points; return the batches
    its streamer would send (none when it streams to a sidecar)."""
    runner = SimpleNamespace(requests={}, max_model_len=4096)
    while sim.pending() and sim.wave < max_waves:
        so, output = sim.step()
        processor.run_step(lambda r, s: None, runner, (so,), {})
        processor.run_sample(lambda r, out=output: out, runner, (), {})
    streamer = processor.streamer
    if isinstance(streamer, _QuietStreamer):
        return streamer.batches(processor.membership)
    return []


def items_of(batches: list[guard_pb2.Batch], engine: str) -> list[Item]:
    """One rank's batches (validated as ingest does) as ingest hands them to the sinks."""
    rank = None
    items = []
    for batch in batches:
        validate_batch(batch, rank_known=rank is not None)
        rank = rank or batch.rank
        if not batch.HasField("rank"):
            batch.rank.CopyFrom(rank)
        labels = (engine, str(rank.dp_rank), str(rank.tp_rank), str(rank.pp_rank))
        process = (rank.run_id, engine, rank.dp_rank, rank.tp_rank, rank.pp_rank, rank.pid)
        source = RankSource(rank, engine, labels, process)
        items.append(Item(source, batch, batch.ByteSize(), len(batch.wave_columns.wave)))
    return items


def store_batches(tmp_path: Any, batches: list[guard_pb2.Batch]) -> tuple[Store, str]:
    """A real store at `tmp_path`/store.db holding `batches` (validated as ingest does), for the
    request traces and wave records built from it; engine label "sim"."""
    path = str(tmp_path / "store.db")
    store = Store(path)
    store.write(items_of(batches, EngineLabels().label("sim")))
    return store, path
