"""Per-request checks against a sidecar's store: request traces vs the API's usage, and the
membership of every wave vs the stored wave records (issue 12 item 1, issue 15 item 4)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from telemetry import store
from telemetry.spans import requests as request_spans
from telemetry.store import requests as request_store
from telemetry.wire.request_columns import entries


def wait_stored(path: Path, engine: str, last_wave: float, timeout: float = 30.0) -> None:
    """Until tp0's stored wave blocks reach `last_wave` (the writer runs after ingest)."""
    deadline = time.monotonic() + timeout
    while True:
        conn = store.connect(path, readonly=True)
        try:
            (top,) = conn.execute(
                "SELECT MAX(b.last_wave) FROM wave_blocks b JOIN ranks r ON r.id = b.rank "
                "WHERE r.engine = ? AND r.tp = 0",
                (engine,),
            ).fetchone()
        finally:
            conn.close()
        if top is not None and top >= last_wave:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"store holds tp0 waves up to {top}, the sidecar saw {last_wave}")
        time.sleep(0.05)


def sampled_per_response(path: Path, engine: str, responses: list[dict[str, Any]]) -> list[int]:
    """Tokens the request traces of each response's engine requests sampled (n > 1: its
    children summed), in the order of `responses` (each needs its API `id`)."""
    conn = store.connect(path, readonly=True)
    try:
        out = []
        for response in responses:
            traces = request_spans.request_traces(conn, response["id"], engine=engine)
            assert traces, f"no request trace for {response['id']}"
            out.append(sum(t.sampled_tokens() for t in traces))
        return out
    finally:
        conn.close()


def membership_vs_wave_records(path: Path, engine: str, first_wave: int = 1) -> tuple[int, list]:
    """Per wave of tp0 from `first_wave` on: the membership's request count, scheduled tokens
    and sampled tokens against the wave record's num_reqs, prefill + decode + recompute tokens
    and sampled_tokens. Returns (waves compared, mismatches)."""
    conn = store.connect(path, readonly=True)
    try:
        (rank,) = store.ranks(conn, "ranks.engine = ? AND ranks.tp = 0", (engine,))
        records: dict[int, tuple[int, int, int, bool]] = {}
        for _, cols in store.wave_blocks(conn, [rank.id]):
            for i, wave in enumerate(cols.wave):
                if wave >= first_wave:
                    tokens = cols.prefill_tokens[i] + cols.decode_tokens[i]
                    tokens += cols.recompute_tokens[i]
                    records[wave] = (cols.num_reqs[i], tokens, cols.sampled_tokens[i],
                                     cols.sampled[i])  # fmt: skip
        members: dict[int, list[int]] = {}
        for (blob,) in conn.execute(
            "SELECT columns FROM request_blocks WHERE rank = ? AND last_wave >= ?",
            (rank.id, first_wave),
        ):
            got = entries(request_store.decode(blob))
            for wave in np.unique(got.wave):
                if wave < first_wave:
                    continue
                mask = got.wave == wave
                sampled = got.sampled[mask]
                members[int(wave)] = [int(mask.sum()), int(got.scheduled[mask].sum()),
                                      int(sampled[sampled > 0].sum())]  # fmt: skip
        mismatches = []
        for wave, (num_reqs, tokens, sampled, _) in records.items():
            if not num_reqs:
                continue  # an empty step: no membership row
            mine = members.get(wave)
            if mine is None or mine != [num_reqs, tokens, sampled]:
                mismatches.append((wave, (num_reqs, tokens, sampled), mine))
        extra = sorted(set(members) - set(records))
        mismatches += [(wave, None, members[wave]) for wave in extra if members[wave][0]]
        return len(records), mismatches
    finally:
        conn.close()


def preempted_while_speculating(path: Path, engine: str, response: dict[str, Any]) -> int:
    """How often a response's engine requests were preempted while speculating: the wave they
    ran in just before the preemption verified drafts (a decode wave with more than one token
    scheduled). Without async scheduling that wave's output is back when the next step
    preempts, and the n-gram proposer has by then drafted again for the step that never
    comes: those drafts are dropped with the preemption."""
    conn = store.connect(path, readonly=True)
    try:
        count = 0
        for trace in request_spans.request_traces(conn, response["id"], engine=engine):
            waves = trace.waves
            for before, wave in zip(waves, waves[1:], strict=False):
                if wave.preempted and before.kind == "decode" and before.scheduled > 1:
                    count += 1
        return count
    finally:
        conn.close()


def last_wave(path: Path, engine: str, response: dict[str, Any]) -> request_spans.RequestWave:
    """The last wave a response's (one) engine request ran in."""
    conn = store.connect(path, readonly=True)
    try:
        (trace,) = request_spans.request_traces(conn, response["id"], engine=engine)
        return trace.waves[-1]
    finally:
        conn.close()
