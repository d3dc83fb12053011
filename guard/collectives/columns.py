"""A batch's finished collective waves as wire columns (`CollectiveColumns`). Streamer thread."""

from __future__ import annotations

from typing import TYPE_CHECKING

from guard.collectives.graphs import GRAPH_COUNTED
from guard.collectives.records import FinishedWave

if TYPE_CHECKING:  # the batch is built by the caller
    from telemetry.wire.proto import guard_pb2


def add_waves(cols: guard_pb2.CollectiveColumns, items: list[FinishedWave]) -> None:
    """Append finished waves to a batch's collective columns (wire v3): Python lists first,
    then one `extend` per column; (op, group, backend, dtype) once per batch in `keys`."""
    keys: dict[tuple[str, str, str, str], int] = {}
    waves, arrivals, waits, dropped, injected, replay = [], [], [], [], [], []
    wave_index, key_index, calls, nbytes, host, max_host, first, last, replayed, counted = (
        [],
        [],
        [],
        [],
        [],
        [],
        [],
        [],
        [],
        [],
    )
    slow_rows: list[int] = []
    row = len(cols.wave)
    for item in items:
        waves.append(item.wave)
        arrivals.append(item.first_arrival_unix_nano)
        waits.append(item.wait_ns)
        dropped.append(item.slow_calls_dropped)
        injected.append(item.injected_delay_ns)
        replay.append(item.replay_device_ns)
        for (op, group), stat in item.stats.items():
            n, b, h, m, f, last_seq, backend, dtype, r = stat[:GRAPH_COUNTED]
            g = stat[GRAPH_COUNTED] if len(stat) > GRAPH_COUNTED else 0  # a 9-field row: none
            key = (op, group, backend, dtype)
            index = keys.get(key)
            if index is None:
                index = keys[key] = len(cols.keys)
                cols.keys.add(op=op, group=group, backend=backend, dtype=dtype)
            wave_index.append(row)
            key_index.append(index)
            calls.append(n)
            nbytes.append(b)
            host.append(h)
            max_host.append(m)
            first.append(f)
            last.append(last_seq)
            replayed.append(r)
            counted.append(g)
        for op, group, backend, dtype, seq, size, start, host_ns in item.slow_calls:
            cols.slow_calls.add(
                op=op,
                group=group,
                backend=backend,
                dtype=dtype,
                seq=seq,
                bytes=size,
                start_unix_nano=start,
                host_ns=host_ns,
            )
            slow_rows.append(row)
        row += 1
    cols.wave.extend(waves)
    cols.first_arrival_unix_nano.extend(arrivals)
    cols.wait_ns.extend(waits)
    cols.slow_calls_dropped.extend(dropped)
    cols.injected_delay_ns.extend(injected)
    cols.replay_device_ns.extend(replay)
    stats = cols.stats
    stats.wave_index.extend(wave_index)
    stats.key.extend(key_index)
    stats.calls.extend(calls)
    stats.bytes.extend(nbytes)
    stats.host_ns.extend(host)
    stats.max_host_ns.extend(max_host)
    stats.first_seq.extend(first)
    stats.last_seq.extend(last)
    stats.device_ns.extend([0] * len(calls))  # no per-stat device time measured yet
    stats.replayed.extend(replayed)
    stats.graph_counted.extend(counted)
    if slow_rows:
        cols.slow_call_wave_index.extend(slow_rows)
