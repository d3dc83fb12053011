"""The one home of trace and span ids: derived from (run id, wave, rank), never drawn at random.

The spans of one wave built by different sidecars on different nodes, or built again later from
the store (`ascend-guard trace`, the OTLP exporter), join into one trace in any OTel backend:

    wave                      (built from the row of the replica's rank tp0 pp0)
    └─ rank                   one per rank: execute_model entry .. sample_tokens exit
       ├─ execute_model
       ├─ sample_tokens
       ├─ collective:<op>     one per (op, group) the rank ran in the wave
       └─ incident:<type>     one per incident of the rank in the wave

A replica is one DP engine (its own scheduler and wave numbering), so a trace is one wave of one
replica: its id is `wave_trace_key(run, dp) << 64 | wave`. The high half is a hash of the run
and DP rank, the low half the wave number, so `ascend-guard trace ID` finds the wave from the id
alone (the store keeps each rank's key). Span ids are hashes of what names the span.
"""

from __future__ import annotations

import functools
import hashlib


def _digest(text: str, size: int) -> int:
    value = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=size).digest(), "big")
    return value or 1  # zero is the invalid id in OTel


@functools.lru_cache(maxsize=1024)
def wave_trace_key(run_id: str, dp: int) -> int:
    """The high 64 bits of every wave trace id of one replica (run, DP rank)."""
    return _digest(f"ascend-guard/wave/{run_id}/dp{dp}", 8)


def wave_trace_id(run_id: str, wave: int, dp: int) -> int:
    """The trace id of one replica's wave: the same in every process that knows run id, wave
    and DP rank."""
    return wave_trace_key(run_id, dp) << 64 | wave


def split_trace_id(trace_id: int) -> tuple[int, int]:
    """(run key, wave) of a wave trace id."""
    return trace_id >> 64, trace_id & (2**64 - 1)


def wave_span_id(run_id: str, wave: int, dp: int) -> int:
    return _digest(f"ascend-guard/wave-span/{run_id}/dp{dp}/{wave}", 8)


def rank_span_id(run_id: str, wave: int, dp: int, tp: int, pp: int) -> int:
    return _digest(f"ascend-guard/rank-span/{run_id}/{wave}/{dp}/{tp}/{pp}", 8)


def lockstep_links(run_id: str, wave: int, dp: int, dp_size: int) -> list[tuple[int, int, int]]:
    """(trace id, wave span id, dp) of wave `wave` of every other DP rank, for a replica whose
    DP engines step in lockstep."""
    return [
        (wave_trace_id(run_id, wave, other), wave_span_id(run_id, wave, other), other)
        for other in range(dp_size)
        if other != dp
    ]


def phase_span_id(run_id: str, wave: int, dp: int, tp: int, pp: int, phase: str) -> int:
    return _digest(f"ascend-guard/phase-span/{run_id}/{wave}/{dp}/{tp}/{pp}/{phase}", 8)


def incident_span_id(incident_id: str) -> int:
    return _digest(f"ascend-guard/incident/{incident_id}", 8)


def format_trace_id(trace_id: int) -> str:
    return format(trace_id, "032x")


def format_span_id(span_id: int) -> str:
    return format(span_id, "016x")


# -- request traces: one trace per vLLM request of one replica ----------------------
#
#     request                  arrival (its first wave) .. finish
#     ├─ prefill | decode      one per wave it ran in (per PP stage), tokens scheduled / sampled,
#     │                        linked to that wave's trace (and the wave span links back)
#     └─ incident:<type>       one per incident raised on the request
def request_trace_id(run_id: str, engine: str, dp: int, request_id: str) -> int:
    """The trace id of one vLLM request: the same in every process that knows the request id
    and its replica (run, engine, DP rank), so two replicas' requests never share a trace."""
    return _digest(f"ascend-guard/request/{run_id}/{engine}/dp{dp}/{request_id}", 16)


@functools.lru_cache(maxsize=65536)  # a request's root is linked from every wave it ran in
def request_span_id(trace_id: int) -> int:
    return _digest(f"ascend-guard/request-span/{trace_id:032x}", 8)


def request_wave_span_id(trace_id: int, wave: int, pp: int) -> int:
    return _digest(f"ascend-guard/request-wave/{trace_id:032x}/{wave}/{pp}", 8)


def request_incident_span_id(trace_id: int, incident_id: str) -> int:
    return _digest(f"ascend-guard/request-incident/{trace_id:032x}/{incident_id}", 8)
