"""Collective instrumentation inside a worker: sequence numbers, per-wave aggregates, the call
a rank is in right now.

The wrappers (`wrap_collective`) sit on vLLM's `GroupCoordinator` methods (bound by
`ascend_runtime.attach.collectives`). Each call takes a per-group sequence number — the same
program order on every rank gives the same number for the same call — and adds its host time
and payload to the aggregate of (op, group) for the current wave. Calls slower than
`slow_call_ms` are also kept one by one. While a call runs, `current` names it, so the
heartbeat (streamer thread) and the watchdog can say what a rank waits in even when its engine
thread is blocked.

Captured device graphs (CUDA graph, ACL graph; piecewise or FULL) replay their collectives
with no Python. While a graph is captured (`begin_capture` ... `end_capture`, called from the
device graph class's own capture hooks), each collective the capture passes through is noted
on the graph (op, group, bytes for that graph's batch size) instead of being counted: nothing
is communicated yet. Each `replay` of such a graph then counts its collectives into the wave,
marked as replayed (`replayed` of their `CollectiveStat`), advances the groups' sequence
numbers as the device will, and times the replay with device events that are resolved later
without a sync. While a replay has not finished on the device, `in_replay` names the graph and
its collective list, so the heartbeat and the watchdog say which graph a rank hangs in.

torch.compile'd graphs are counted the same way, per call of the compiled graph rather than
per collective: the collectives a compiled graph holds are found once in its FX graph
(`ascend_runtime/attach/compiled_collectives.py`: op, group, bytes as a function of the symbolic batch
size) and each call of the compiled callable counts them all at once (`run_graph`), marked as
graph-counted (`graph_counted` of their `CollectiveStat`), with no Python inside the graph.

Everything here runs on the engine thread except `fill_batch` (streamer thread) and the
watchdog's reads of `current` / `in_replay`, each replaced as a whole so readers see one call.
No torch import: tensors are read through `.nbytes` and `.dtype` only; device events come
from `ascend_runtime` as a factory."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog

from guard.collectives.columns import add_waves
from guard.collectives.graphs import (
    GRAPH_COUNTED,
    PARK_WAVES,
    REPLAYED,
    CapturedGraph,
    CompiledGraph,
    InReplay,
)
from guard.collectives.payload import Payload, tensor_size
from guard.collectives.records import (
    META_ATTR,
    CurrentCall,
    FinishedWave,
    GroupMeta,
    _describe_group_generic,
    _new_tuple,
)
from guard.config.collectives import CollectivesConfig

if TYPE_CHECKING:  # the messages are built by the caller: counting needs no protobuf
    from telemetry.wire.liveness_record import LivenessRecord
    from telemetry.wire.proto import guard_pb2


log = structlog.get_logger("ascend_guard.collectives")


class CollectiveTracker:
    """Per-process collective accounting; one lives in each guarded worker."""

    def __init__(
        self,
        config: CollectivesConfig,
        wave_source: Callable[[], int] = lambda: 0,
        describe_group: Callable[[Any], GroupMeta] | None = None,
        new_event: Callable[[], Any] | None = None,
    ) -> None:
        self.config = config
        self._wave_source = wave_source
        self._describe_group = describe_group or _describe_group_generic
        self._slow_ns = int(config.slow_call_ms * 1e6)
        self._max_slow = config.max_slow_calls_per_wave
        self.current: CurrentCall | None = None
        self.finished: collections.deque[FinishedWave] = collections.deque(maxlen=4096)
        self.completed_waves = 0
        self.errors = 0
        self.injected_delay_ns = 0  # the fault injector adds here; read at wave roll-over
        self.before_call: Callable[[str, str], None] | None = None  # fault injector hook
        self.inside_call: Callable[[str, str], None] | None = None  # ... once a call is entered
        self.record: LivenessRecord | None = None  # shared-memory liveness record
        self._depth = 0
        self.capturing: CapturedGraph | None = None  # a device graph being captured
        self.in_replay: InReplay | None = None
        self._new_event = new_event  # device timing events (None on CPU)
        # (wave, start event, end event) of replays not resolved yet; bounded
        self._replay_events: collections.deque[tuple[int, Any, Any]] = collections.deque()
        self._replay_device_ns: dict[int, int] = {}
        # finished waves held back until the device times of their replays resolve
        self._parked: collections.deque[FinishedWave] = collections.deque()
        self.replay_events_dropped = 0
        self._dtype_names: dict[Any, str] = {}
        self._wall_offset_ns = time.time_ns() - time.perf_counter_ns()
        self._latest_wave = 0
        # the wave in progress (0: none) and its aggregates, reset by `roll`
        self.wave = 0
        self._stats: dict[tuple[str, str], list] = {}
        self._slow: list[tuple] = []
        self._slow_dropped = 0
        self._first_arrival = 0
        self._wait_ns = 0

    # -- wave boundaries (engine thread) -------------------------------------------------------
    def roll(self, wave: int) -> None:
        """Close the aggregates of the wave in progress (if any) and start `wave`.

        Runs twice a wave, with or without collectives in it (a TP=1 engine has none), so the
        reset is in line: no further frame."""
        if self._replay_events or self._parked:
            self.poll_replays()
        if self.wave and (self._stats or self.injected_delay_ns):
            # tuple.__new__: no Python frame for the NamedTuple's __new__ (frames cost most
            # where this runs from compiled code)
            item = _new_tuple(
                FinishedWave,
                (
                    self.wave,
                    self._first_arrival,
                    self._wait_ns,
                    self._stats,
                    self._slow,
                    self._slow_dropped,
                    self.injected_delay_ns,
                    self._replay_device_ns.pop(self.wave, 0),
                ),
            )
            events = self._replay_events
            if events and any(w == self.wave for w, _, _ in events):
                self._parked.append(item)  # its replays' device times are not resolved yet
            else:
                self.finished.append(item)
            self.completed_waves += 1
        elif self.wave:
            self.completed_waves += 1
        self.injected_delay_ns = 0
        self._stats = {}  # new ones: an item holds the old; what came outside a wave is dropped
        self._slow = []
        self.wave = wave
        if wave > self._latest_wave:
            self._latest_wave = wave
        self._slow_dropped = 0
        self._first_arrival = 0
        self._wait_ns = 0

    def end_wave(self, wave: int) -> None:
        """The wave finished on this rank: hand its aggregates over now rather than at the
        next wave, so an idle engine does not hold them back."""
        if wave == self.wave:
            self.roll(0)

    # -- the wrapped call (engine thread) ------------------------------------------------------
    def run(
        self,
        op: str,
        fn: Callable[..., Any],
        group: Any,
        args: tuple,
        kwargs: dict,
        payload: Payload,
    ) -> Any:
        """Call `fn` as the collective `op` of `group`, numbered, timed and aggregated.

        Written for cost (it runs for every collective): one method frame, two clock reads,
        the payload's `nbytes`, and a handful of list updates.
        """
        if self._depth:  # a collective made of collectives (broadcast_tensor_dict): count once
            return fn(group, *args, **kwargs)
        if self.capturing is not None:
            return self._run_captured(op, fn, group, args, kwargs, payload)
        try:
            meta = getattr(group, META_ATTR, None)
            if meta is None:
                meta = self._describe_group(group)
                setattr(group, META_ATTR, meta)
            if meta.world_size > 1:  # vLLM short-cuts the others; nothing is communicated
                meta.seq = seq = meta.seq + 1
                wave = self._wave_source()
                if wave != self.wave:
                    self.roll(wave)
                if self.before_call is not None:
                    self.before_call(op, meta.label)
            else:
                meta = None
        except Exception:  # noqa: BLE001 - never break the collective
            self.errors += 1
            meta = None
        if meta is None:
            return fn(group, *args, **kwargs)
        start = time.perf_counter_ns()
        self.current = (op, meta.label, meta.backend, seq, start)
        record = self.record
        if record is not None:  # its ring keeps the bytes sent (what comes back is not known yet)
            try:
                data = payload(args, kwargs, None)
            except Exception:  # noqa: BLE001 - never break the collective
                data = None
            record.enter(op, meta.label, seq, start, data)
        self._depth = 1
        try:
            if self.inside_call is not None:
                self.inside_call(op, meta.label)
            result = fn(group, *args, **kwargs)
        finally:
            end = time.perf_counter_ns()
            self._depth = 0
            self.current = None
            if record is not None:
                record.leave(end)
        if self.wave:  # outside any wave (model load, warm-up): sequence numbers only
            try:
                self._record(op, meta, seq, start, end - start, payload(args, kwargs, result))
            except Exception:  # noqa: BLE001
                self.errors += 1
        return result

    def _meta(self, group: Any) -> GroupMeta:
        meta = getattr(group, META_ATTR, None)
        if meta is None:
            meta = self._describe_group(group)
            setattr(group, META_ATTR, meta)
        return meta

    def _run_captured(
        self,
        op: str,
        fn: Callable[..., Any],
        group: Any,
        args: tuple,
        kwargs: dict,
        payload: Payload,
    ) -> Any:
        """A collective met while a device graph is captured: enqueued into the graph, not run
        now. Noted on the graph (counted at each replay); no sequence number is taken."""
        self._depth = 1
        try:
            result = fn(group, *args, **kwargs)
        finally:
            self._depth = 0
        try:
            graph = self.capturing
            meta = self._meta(group)
            if graph is not None and meta.world_size > 1:
                data = payload(args, kwargs, result)
                nbytes = getattr(data, "nbytes", None)
                if nbytes is None:
                    nbytes = tensor_size(data)[0] if data is not None else 0
                graph.calls.append((op, meta, int(nbytes), self._dtype(data)))
        except Exception:  # noqa: BLE001
            self.errors += 1
        return result

    # -- captured device graphs (engine thread) ------------------------------------------------
    def begin_capture(self, label: str) -> CapturedGraph:
        """A device graph's capture begins: collectives until `end_capture` belong to it."""
        graph = CapturedGraph(label)
        self.capturing = graph
        return graph

    def end_capture(self) -> CapturedGraph | None:
        graph, self.capturing = self.capturing, None
        if graph is not None and graph.calls:
            log.debug("graph_collectives_captured", graph=graph.label, holds=graph.holds())
        return graph

    def replay(self, graph: CapturedGraph, replay: Callable[..., Any], target: Any) -> Any:
        """Replay `graph` (`replay(target)`) and count the collectives it holds into the wave,
        marked as replayed; device events around it give its device time later."""
        calls = graph.calls
        if not calls or self._depth or self.capturing is not None:
            return replay(target)
        try:
            wave = self._wave_source()
            if wave != self.wave:
                self.roll(wave)
            first_op, first_meta = calls[0][0], calls[0][1]
            first_seq = first_meta.seq + 1
            start_event = end_event = None
            if self._new_event is not None and self.wave:
                start_event = self._new_event()
                start_event.record()
        except Exception:  # noqa: BLE001 - never break the replay
            self.errors += 1
            return replay(target)
        start = time.perf_counter_ns()
        self.current = (first_op, first_meta.label, first_meta.backend, first_seq, start)
        self.in_replay = InReplay(
            graph, first_op, first_meta.label, first_meta.backend, first_seq, start, None
        )
        try:
            result = replay(target)
        finally:
            self.current = None
        try:
            if start_event is not None:
                end_event = self._new_event()  # type: ignore[misc]
                end_event.record()
                self._replay_events.append((self.wave, start_event, end_event))
                if len(self._replay_events) > 256:  # the device is far behind: drop the oldest
                    self._replay_events.popleft()
                    self.replay_events_dropped += 1
            # the host call has returned; the device may still be inside the graph
            self.in_replay = self.in_replay._replace(end_event=end_event) if end_event else None
            graph.replays += 1
            self._record_replay(graph, start)
        except Exception:  # noqa: BLE001
            self.errors += 1
        return result

    # -- torch.compile'd graphs (engine thread) ------------------------------------------------
    def run_graph(
        self, graph: CompiledGraph, fn: Callable[..., Any], args: tuple, kwargs: dict
    ) -> Any:
        """Call the compiled graph `fn(*args, **kwargs)` and count the collectives it holds
        into the wave, all at once and marked graph-counted: one Python call per compiled
        call, none per collective. Host time is not measured per collective (host_ns 0); the
        wave's wait time takes the whole call's host time (compute included, alike on every
        rank, so a late peer still shows as the others' longer wait). While the call runs,
        `current` is its first collective and `in_replay` names the graph and its list, so a
        hang inside it is named like one inside a replay."""
        if self._depth:
            return fn(*args, **kwargs)
        if self.capturing is not None:  # a device graph captured around the compiled call
            return self._run_graph_captured(graph, fn, args, kwargs)
        try:
            rows = graph.rows
            if rows is None:
                rows = graph.bind(self._meta)
            first = graph.first
            if first is None:
                return fn(*args, **kwargs)
            wave = self._wave_source()
            if wave != self.wave:
                self.roll(wave)
            first_op, first_meta = first
            first_seq = first_meta.seq + 1
            if self.wave:
                sizes = []  # graph.sizes(args), inline: one Python frame fewer per call
                for i, dim in graph.locations:
                    sizes.append(args[i] if dim < 0 else args[i].shape[dim])
                graph.last_sizes = sizes
                stats = self._stats
                for key, n, nbytes, terms, meta, dtype, first_off, last_off, exacts in rows:
                    for k, coef in terms:
                        nbytes += coef * sizes[k]
                    for exact in exacts:
                        nbytes += exact(sizes)
                    base = meta.seq
                    stat = stats.get(key)
                    if stat is None:
                        stats[key] = [
                            n,
                            nbytes,
                            0,
                            0,
                            base + first_off,
                            base + last_off,
                            meta.backend,
                            dtype,
                            0,
                            n,
                        ]
                    else:
                        stat[0] += n
                        stat[1] += nbytes
                        stat[5] = base + last_off
                        stat[GRAPH_COUNTED] += n
            for meta, n in graph.groups:
                meta.seq += n
            start = time.perf_counter_ns()
            if self.wave and not self._first_arrival:
                self._first_arrival = start + self._wall_offset_ns
            if self.before_call is not None:
                for key in [row[0] for row in rows]:
                    if self.before_call is not None:
                        self.before_call(*key)
        except Exception:  # noqa: BLE001 - never break the compiled call
            self.errors += 1
            return fn(*args, **kwargs)
        label, backend = first_meta.label, first_meta.backend
        self.current = (first_op, label, backend, first_seq, start)
        previous = self.in_replay
        # tuple.__new__: the NamedTuple's own __new__ is a Python frame (~100 ns more)
        self.in_replay = _new_tuple(
            InReplay, (graph, first_op, label, backend, first_seq, start, None)
        )
        record = self.record
        if record is not None:
            record.enter(first_op, label, first_seq, start)
        bypass = graph.bypass
        for namespace, name, method in bypass:
            namespace[name] = method
        self._depth = 1
        try:
            return fn(*args, **kwargs)
        finally:
            self._depth = 0
            for namespace, name, _ in bypass:
                namespace.pop(name, None)
            self.current = None
            self.in_replay = previous
            if record is not None:
                record.leave()
            if self.wave:  # the whole call, compute included: what a peer's lateness adds to
                spent = time.perf_counter_ns() - start
                self._wait_ns += spent
                if spent > graph.longest_ns:
                    graph.longest_ns = spent

    def _run_graph_captured(
        self, graph: CompiledGraph, fn: Callable[..., Any], args: tuple, kwargs: dict
    ) -> Any:
        """A compiled call inside a device graph capture (FULL graphs): its collectives are
        noted on the captured graph at this call's sizes, counted at each replay."""
        self._depth = 1
        try:
            result = fn(*args, **kwargs)
        finally:
            self._depth = 0
        try:
            if graph.rows is None:
                graph.bind(self._meta)
            capturing = self.capturing
            if capturing is not None:
                sizes = graph.sizes(args) if graph.locations else []
                capturing.calls.extend(graph.calls_at(sizes))
        except Exception:  # noqa: BLE001
            self.errors += 1
        return result

    def _record_replay(self, graph: CapturedGraph, start: int) -> None:
        stats = self._stats
        counting = bool(self.wave)
        for op, meta, nbytes, dtype in graph.calls:
            meta.seq = seq = meta.seq + 1
            if not counting:
                continue
            key = (op, meta.label)
            stat = stats.get(key)
            if stat is None:
                stats[key] = [1, nbytes, 0, 0, seq, seq, meta.backend, dtype, 1, 0]
            else:
                stat[0] += 1
                stat[1] += nbytes
                stat[5] = seq
                stat[REPLAYED] += 1
        if counting and not self._first_arrival:
            self._first_arrival = start + self._wall_offset_ns

    def poll_replays(self) -> None:
        """Resolve replay device times the device has finished, oldest first; never waits."""
        pending = self._replay_events
        while pending:
            wave, start_event, end_event = pending[0]
            try:
                if not end_event.query():
                    break
                ns = int(float(start_event.elapsed_time(end_event)) * 1e6)
            except Exception:  # noqa: BLE001
                self.errors += 1
                ns = 0
            pending.popleft()
            parked = self._parked
            if wave == self.wave:
                self._replay_device_ns[wave] = self._replay_device_ns.get(wave, 0) + ns
            else:
                for i, item in enumerate(parked):
                    if item.wave == wave:
                        parked[i] = item._replace(replay_device_ns=item.replay_device_ns + ns)
                        break
        parked = self._parked
        while parked:
            item = parked[0]
            waiting = any(w == item.wave for w, _, _ in pending)
            if waiting and self._latest_wave - item.wave < PARK_WAVES:
                break
            if waiting:  # the device is far behind: hand the wave over without them
                self.replay_events_dropped += 1
            self.finished.append(parked.popleft())
        if self.in_replay is not None and not pending:
            self.in_replay = None

    def replay_pending(self) -> InReplay | None:
        """The replay the device has not finished (streamer/watchdog thread; query only)."""
        in_replay = self.in_replay
        if in_replay is None or in_replay.end_event is None:
            return None
        try:
            return None if in_replay.end_event.query() else in_replay
        except Exception:  # noqa: BLE001
            return None

    def _record(
        self, op: str, meta: GroupMeta, seq: int, start: int, host_ns: int, data: Any
    ) -> None:
        nbytes = getattr(data, "nbytes", None)  # a tensor: the common case
        if nbytes is None:
            nbytes = tensor_size(data)[0] if data is not None else 0
        key = (op, meta.label)
        stat = self._stats.get(key)
        if stat is None:
            self._stats[key] = [
                1,
                nbytes,
                host_ns,
                host_ns,
                seq,
                seq,
                meta.backend,
                self._dtype(data),
                0,
                0,
            ]
        else:
            stat[0] += 1
            stat[1] += nbytes
            stat[2] += host_ns
            if host_ns > stat[3]:
                stat[3] = host_ns
            stat[5] = seq
        if not self._first_arrival:
            self._first_arrival = start + self._wall_offset_ns
        self._wait_ns += host_ns
        if host_ns >= self._slow_ns:
            if len(self._slow) < self._max_slow:
                self._slow.append(
                    (
                        op,
                        meta.label,
                        meta.backend,
                        self._dtype(data),
                        seq,
                        nbytes,
                        start + self._wall_offset_ns,
                        host_ns,
                    )
                )
            else:
                self._slow_dropped += 1

    def _dtype(self, data: Any) -> str:
        """The payload's dtype as text ("float32"), cached per dtype object."""
        dtype = getattr(data, "dtype", None) if data is not None else None
        if dtype is None:
            dtype = tensor_size(data)[1] if data is not None else None
        if dtype is None:
            return ""
        name = self._dtype_names.get(dtype)
        if name is None:
            name = self._dtype_names[dtype] = str(dtype).removeprefix("torch.")
        return name

    # -- streamer thread ------------------------------------------------------------------------
    def fill_batch(self, batch: guard_pb2.Batch, with_heartbeat: bool) -> None:
        """Add finished waves' aggregates, and the current collective to the heartbeat."""
        self._wall_offset_ns = time.time_ns() - time.perf_counter_ns()
        finished = self.finished
        items = []
        while finished:
            try:
                items.append(finished.popleft())
            except IndexError:
                break
        if items:
            add_waves(batch.collective_columns, items)
        if with_heartbeat:
            current = self.current
            replaying = self.in_replay
            if current is None and replaying is not None:
                # the host call returned; is the device still inside the graph?
                replaying = self.replay_pending()
                if replaying is not None:
                    # a table: one row per line, columns aligned (fmt: skip)
                    current = (
                        replaying.op, replaying.group, replaying.backend, replaying.seq,
                        replaying.start_ns,
                    )  # fmt: skip
            if current is not None:
                op, group, backend, seq, start = current
                hb = batch.heartbeat
                hb.collective_op = op
                hb.collective_group = group
                hb.collective_backend = backend
                hb.collective_seq = seq
                hb.collective_age_ns = max(0, time.perf_counter_ns() - start)
                if replaying is not None and replaying.seq == seq and replaying.op == op:
                    hb.collective_graph = replaying.graph.label
                    hb.collective_graph_holds = replaying.graph.holds()
