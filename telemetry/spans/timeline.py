"""Stored waves as a Chrome Trace Event timeline (Perfetto UI, chrome://tracing, MindStudio Insight).

The file is the JSON object form, `{"traceEvents": [...], "displayTimeUnit": "ms", "otherData":
{...}}`. Spans come from the builder `ascend-guard trace` uses (telemetry/spans/builders.py), so every
slice carries the same trace and span ids and the same start and duration as the span the CLI
prints; `ts`/`dur` are microseconds since `otherData.base_unix_ns`, with three decimals (ns).
`displayTimeUnit` is "ms": older Perfetto builds read "ns" as "ts is in ns", against the spec.

Layout. One process (`pid`) per rank, named by `process_name` (engine, dp/tp/pp, node, host
pid), labelled with its run (`process_labels`) and ordered by `process_sort_index` (run,
engine, dp, pp, tp). Its threads:

- "waves": per wave, the rank span as "wave N" with execute_model and sample_tokens under it;
- "collective OP GROUP", one per (op, group): the per-wave aggregate span of that collective
  (it starts at the wave's first collective and lasts the host time summed over its calls,
  as in `trace`);
- "slow calls": the slow collective calls the worker reported, at their own start and length;
- an "(overlap N)" thread next to any of these for a slice that would overlap another on the
  same thread without nesting (the viewers need B/X slices nested per thread: Perfetto moves
  such slices to an overflow track, chrome://tracing draws them on top of each other).

Incidents are process-scoped instants ("i", `s: "p"`) on their rank's process, or on an
"incidents (no rank)" process for the ones that belong to no rank in the timeline (the
sidecar's own, such as hang verdicts).

Flow arrows, "who waited for whom". A collective returns on every rank only once the last one
entered it, so the ranks that got there first spend the difference inside it. Per wave and per
tensor-parallel group (run, engine, dp, pp: the replica stage `telemetry/crossrank/ranksync.py` aligns),
the rank that spent the least host time inside the wave's collectives (`wait_ns`; the later
first arrival breaks a tie) is the one the others waited for: the rule ranksync uses to name
a straggler. An arrow goes from it to each rank that spent at least `min_wait_ns` more; it
joins the two ranks' slices of the (op, group) with the most host time in that wave across
the group, at a moment inside both slices (v1 flow events "s" then "f" with `bp: "e"` and one
id per arrow: Perfetto binds both to the enclosing slice, Chrome's viewer and msprof timelines
use the same form; the v2 `bind_id` form allows one arrow out of a slice only). A pair whose
slices do not overlap in time gets no arrow; `otherData.flows_unbound` counts them."""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
import tempfile
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from telemetry.spans.builders import (
    Span,
    incident_span,
    slow_call_span_id,
)
from telemetry.spans.timeline_select import (
    RankCollectives,
    RankWave,
    TimelineQuery,
    read_collectives,
    select_waves,
)
from telemetry.store import RankRow
from telemetry.wire import build_info, schema
from telemetry.wire.trace_ids import format_span_id

WAVE_TRACK = "waves"


SLOW_TRACK = "slow calls"


NO_RANK_PROCESS = "incidents (no rank)"


_TID_STRIDE = 1000  # tid = pid * stride + thread index: tids unique across processes


FLOW_CAT = "wait"


FLOW_NAME = "waited for"


@dataclasses.dataclass
class _Slice:
    pid: int
    track: str
    name: str
    cat: str
    start_ns: int
    end_ns: int
    args: dict[str, Any]
    key: tuple | None = None  # how flows find it: (rank id, wave, op, group)
    lane: int = 0
    tid: int = 0


def _lanes(slices: list[_Slice]) -> dict[int, int]:
    """id(slice) -> lane: each lane holds slices that nest or follow one another, never
    partial overlaps; a slice goes to the first lane where it fits."""
    lanes: list[list[int]] = []  # per lane, the end times of the open slices (a stack)
    out = {}
    for s in sorted(slices, key=lambda s: (s.start_ns, -s.end_ns)):
        for index, stack in enumerate(lanes):
            while stack and stack[-1] <= s.start_ns:
                stack.pop()
            if not stack or s.end_ns <= stack[-1]:
                stack.append(s.end_ns)
                out[id(s)] = index
                break
        else:
            lanes.append([s.end_ns])
            out[id(s)] = len(lanes) - 1
    return out


# what a rank's process name already says: left out of each slice's arguments
_PROCESS_ATTRS = frozenset(
    schema.attr(k) for k in ("run_id", "engine", "dp", "tp", "pp", "node", "pid")
)


_PREFIX = schema.attr("")


_COLLECTIVE_IMPLIED = frozenset(("op", "group", "host_ns"))


_COLLECTIVE_OPTIONAL = frozenset(("device_ns", "replayed", "graph_counted"))


def _span_args(span: Span) -> dict[str, Any]:
    """The span's ids and its own attributes (names without the `ascend_guard.` prefix)."""
    args: dict[str, Any] = {"trace_id": span.trace_hex, "span_id": span.span_hex}
    if span.parent_id is not None:
        args["parent_span_id"] = span.parent_hex
    for key, value in span.attributes.items():
        if key not in _PROCESS_ATTRS:
            args[key.removeprefix(_PREFIX)] = value
    return args


def _rank_slices(pid: int, rw: RankWave, coll: RankCollectives | None) -> list[_Slice]:
    out = []
    for span in rw.spans:
        args = _span_args(span)
        if span.name == "rank":  # the rank's span of the wave: `trace` names it "rank"
            name, cat = f"wave {rw.wave}", "wave"
            args["span"] = "rank"
        else:
            name, cat = span.name, "phase"
        out.append(_Slice(pid, WAVE_TRACK, name, cat, span.start_ns, span.end_ns, args))
    if coll is None:
        return out
    for span in coll.spans:
        op = span.attributes.get(schema.attr("collective.op"), span.name)
        group = span.attributes.get(schema.attr("collective.group"), "")
        backend = span.attributes.get(schema.attr("collective.backend"), "")
        args = {}
        for key, value in _span_args(span).items():
            key = key.removeprefix("collective.")
            # op and group name the thread, host_ns is the slice's length; zeros say nothing
            if key not in _COLLECTIVE_IMPLIED and not (key in _COLLECTIVE_OPTIONAL and not value):
                args[key] = value
        args.update(first_arrival_ns=coll.first_arrival_ns, wave_wait_ns=coll.wait_ns)
        if coll.injected_ns:
            args["injected_delay_ns"] = coll.injected_ns
        out.append(
            _Slice(
                pid,
                f"collective {op} {group}",
                span.name,
                f"collective,{backend}",
                span.start_ns,
                span.end_ns,
                args,
                key=(rw.rank.id, rw.wave, op, group),
            )
        )
    for call in coll.slow_calls:
        args = dataclasses.asdict(call)
        r = rw.rank
        span_id = slow_call_span_id(
            r.run_id, rw.wave, (r.dp, r.tp, r.pp), call.op, call.group, call.seq
        )
        args.update(
            wave=rw.wave,
            trace_id=rw.spans[0].trace_hex if rw.spans else "",
            span_id=format_span_id(span_id),
        )
        out.append(
            _Slice(
                pid,
                SLOW_TRACK,
                f"slow {call.op} {call.group} #{call.seq}",
                "slow_call",
                call.start_ns,
                call.start_ns + call.host_ns,
                args,
            )
        )
    return out


def _flows(
    selected: list[RankWave],
    colls: dict[tuple[int, int], RankCollectives],
    slices_by_key: dict[tuple, _Slice],
    min_wait_ns: int,
) -> tuple[list[tuple[_Slice, _Slice, int, dict]], int]:
    """(from slice, to slice, at ns, args) per arrow, and the pairs left without one."""
    groups: dict[tuple, list[RankWave]] = defaultdict(list)
    for rw in selected:
        if (rw.rank.id, rw.wave) in colls:
            r = rw.rank
            groups[(r.run_id, r.engine, r.dp, r.pp, rw.wave)].append(rw)
    arrows, unbound = [], 0
    for members in groups.values():
        if len(members) < 2:
            continue
        entries = [(rw, colls[(rw.rank.id, rw.wave)]) for rw in members]
        last_rw, last = min(entries, key=lambda e: (e[1].wait_ns, -e[1].first_arrival_ns))
        waiting = [
            (rw, c)
            for rw, c in entries
            if rw is not last_rw and c.wait_ns - last.wait_ns >= min_wait_ns
        ]
        if not waiting:
            continue
        host: dict[tuple[str, str], int] = defaultdict(int)
        for _, c in entries:
            for span in c.spans:
                a = span.attributes
                host[(a[schema.attr("collective.op")], a[schema.attr("collective.group")])] += (
                    span.duration_ns
                )
        op, group = max(host, key=lambda k: (host[k], k))
        src = slices_by_key.get((last_rw.rank.id, last_rw.wave, op, group))
        for rw, c in waiting:
            dst = slices_by_key.get((rw.rank.id, rw.wave, op, group))
            low = max(src.start_ns, dst.start_ns) if src and dst else 0
            high = min(src.end_ns, dst.end_ns) if src and dst else 0
            if high - low < 2:  # no moment strictly inside both slices
                unbound += 1
                continue
            # a table: one row per line, columns aligned (fmt: skip)
            args = {
                "wave": rw.wave, "op": op, "group": group,
                "last_rank": f"dp{last_rw.rank.dp} tp{last_rw.rank.tp} pp{last_rw.rank.pp}",
                "waited_ns": c.wait_ns - last.wait_ns,
                "arrival_gap_ns": last.first_arrival_ns - c.first_arrival_ns,
            }  # fmt: skip
            arrows.append((src, dst, (low + high) // 2, args))
    return arrows, unbound


def _us(ns: int) -> float:
    """ns -> µs with ns kept (three decimals)."""
    return round(ns / 1000, 3)


@dataclasses.dataclass
class Timeline:
    """The trace object and what it holds (for the CLI's summary and for tests)."""

    trace: dict[str, Any]
    ranks: int
    waves: int
    rank_waves: int
    matched_rank_waves: int
    events: int
    flows: int
    flows_unbound: int
    incidents: int


def build_timeline(conn: sqlite3.Connection, query: TimelineQuery) -> Timeline:
    """The Chrome Trace Event object of the waves `query` selects."""
    query.validate()
    selected, matched = select_waves(conn, query)
    ranks = sorted(
        {rw.rank.id: rw.rank for rw in selected}.values(),
        key=lambda r: (r.run_id, r.engine, r.dp, r.pp, r.tp, r.id),
    )
    pids = {rank.id: index + 1 for index, rank in enumerate(ranks)}
    waves_of: dict[int, set[int]] = defaultdict(set)
    for rw in selected:
        waves_of[rw.rank.id].add(rw.wave)
    colls: dict[tuple[int, int], RankCollectives] = {}
    for rank in ranks:
        for wave, entry in read_collectives(conn, rank, waves_of[rank.id]).items():
            colls[(rank.id, wave)] = entry

    slices: list[_Slice] = []
    for rw in selected:
        slices += _rank_slices(pids[rw.rank.id], rw, colls.get((rw.rank.id, rw.wave)))
    base = min((s.start_ns for s in slices), default=0)
    end = max((s.end_ns for s in slices), default=0)

    incidents = _incident_rows(conn, query, ranks, base, end) if selected else []
    rank_pid = {(r.run_id, r.engine, r.dp, r.tp, r.pp): pids[r.id] for r in ranks}
    orphan_pid = len(ranks) + 1

    # threads: one per (pid, track, lane); tids numbered per process, tracks in a fixed order
    by_track: dict[tuple[int, str], list[_Slice]] = defaultdict(list)
    for s in slices:
        by_track[(s.pid, s.track)].append(s)
    for group in by_track.values():
        lanes = _lanes(group)
        for s in group:
            s.lane = lanes[id(s)]
    threads = sorted(
        {(s.pid, s.track, s.lane) for s in slices},
        key=lambda k: (k[0], _track_rank(k[1]), k[1], k[2]),
    )
    tids: dict[tuple[int, str, int], int] = {}
    per_pid: dict[int, int] = defaultdict(int)
    for pid, track, lane in threads:
        per_pid[pid] += 1
        tids[(pid, track, lane)] = pid * _TID_STRIDE + per_pid[pid]
    for s in slices:
        s.tid = tids[(s.pid, s.track, s.lane)]

    events: list[dict[str, Any]] = []
    for rank in ranks:
        pid = pids[rank.id]
        label = f"{rank.engine} dp{rank.dp} tp{rank.tp} pp{rank.pp} · {rank.node} pid {rank.pid}"
        events.append(_meta("process_name", pid, 0, name=label))
        events.append(_meta("process_labels", pid, 0, labels=f"run {rank.run_id}"))
        events.append(_meta("process_sort_index", pid, 0, sort_index=pid))
    for (pid, track, lane), tid in sorted(tids.items(), key=lambda kv: kv[1]):
        name = track if lane == 0 else f"{track} (overlap {lane})"
        events.append(_meta("thread_name", pid, tid, name=name))
        events.append(_meta("thread_sort_index", pid, tid, sort_index=tid % _TID_STRIDE))

    for s in sorted(slices, key=lambda s: (s.pid, s.tid, s.start_ns, -s.end_ns)):
        events.append(
            {
                "name": s.name,
                "cat": s.cat,
                "ph": "X",
                "ts": _us(s.start_ns - base),
                "dur": _us(s.end_ns - s.start_ns),
                "pid": s.pid,
                "tid": s.tid,
                "args": s.args,
            }
        )

    slices_by_key = {s.key: s for s in slices if s.key is not None}
    arrows, unbound = _flows(selected, colls, slices_by_key, query.min_wait_ns)
    for flow_id, (src, dst, at_ns, args) in enumerate(arrows, start=1):
        common = {"name": FLOW_NAME, "cat": FLOW_CAT, "id": flow_id, "ts": _us(at_ns - base)}
        events.append({**common, "ph": "s", "pid": src.pid, "tid": src.tid, "args": args})
        events.append({**common, "ph": "f", "bp": "e", "pid": dst.pid, "tid": dst.tid})

    orphans = False
    for row in incidents:
        span = incident_span(row)
        pid = rank_pid.get((row["run_id"], row["engine"], row["dp"], row["tp"], row["pp"]))
        if pid is None:
            pid, orphans = orphan_pid, True
        event = span.events[0]["attributes"]
        args = {
            "trace_id": span.trace_hex,
            "span_id": span.span_hex,
            "wave": span.wave,
            **{k.removeprefix("incident."): v for k, v in event.items()},
        }
        events.append(
            {
                "name": span.name,
                "cat": "incident",
                "ph": "i",
                "s": "p",
                "ts": _us(span.start_ns - base),
                "pid": pid,
                "tid": pid * _TID_STRIDE + 1,
                "args": args,
            }
        )
    if orphans:
        events.append(_meta("process_name", orphan_pid, 0, name=NO_RANK_PROCESS))
        events.append(_meta("process_sort_index", orphan_pid, 0, sort_index=orphan_pid))

    trace = {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "producer": build_info.version_line(),
            "base_unix_ns": base,
            "end_unix_ns": end,
            "rank_waves": len(selected),
            "rank_waves_matched": matched,
            "flows": len(arrows),
            "flows_unbound": unbound,
            "flow_rule": "from the rank with the least host time inside the wave's collectives "
            "to each peer of its (run, engine, dp, pp) that spent at least "
            f"{query.min_wait_ns} ns more",
        },
    }
    return Timeline(
        trace,
        ranks=len(ranks),
        waves=len({(rw.rank.run_id, rw.rank.engine, rw.rank.dp, rw.wave) for rw in selected}),
        rank_waves=len(selected),
        matched_rank_waves=matched,
        events=len(events),
        flows=len(arrows),
        flows_unbound=unbound,
        incidents=len(incidents),
    )


def _track_rank(track: str) -> int:
    if track == WAVE_TRACK:
        return 0
    return 2 if track == SLOW_TRACK else 1


def _meta(kind: str, pid: int, tid: int, **args: Any) -> dict[str, Any]:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _incident_rows(
    conn: sqlite3.Connection, query: TimelineQuery, ranks: Iterable[RankRow], low: int, high: int
) -> list[sqlite3.Row]:
    """Incidents inside the timeline's window, of its runs (or tied to no run) and engine."""
    runs = sorted({r.run_id for r in ranks})
    engines = sorted({r.engine for r in ranks})
    marks_r, marks_e = ",".join("?" * len(runs)), ",".join("?" * len(engines))
    try:
        return conn.execute(
            f"SELECT * FROM incidents WHERE time_ns >= ? AND time_ns <= ? "
            f"AND (run_id IN ({marks_r}) OR run_id = '' OR run_id IS NULL) "
            f"AND engine IN ({marks_e}) ORDER BY time_ns",
            (low, high, *runs, *engines),
        ).fetchall()
    except sqlite3.OperationalError:  # a store written before incidents existed
        return []


def write_timeline(timeline: Timeline, path: str | os.PathLike) -> None:
    """Write the JSON whole or not at all (a temporary file renamed over the target)."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(timeline.trace, out, separators=(",", ":"))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as open() would have made it, not mkstemp's 0600
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
