"""Stores of waves, collectives and incidents written through the real writer sink (and the
real incident ledger), for the TraceQL tests and bench/query.py."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from telemetry.ingest.validation import validate_batch
from telemetry.pipeline.writer import Item, RankSource
from telemetry.store import Store
from telemetry.store.incidents import IncidentLedger
from telemetry.wire.proto import guard_pb2
from telemetry.wire.wave_columns import to_columns

MS = 1_000_000


def rank_info(
    tp: int, *, run_id: str = "run-t", dp: int = 0, tp_size: int = 2
) -> guard_pb2.RankInfo:
    return guard_pb2.RankInfo(
        run_id=run_id,
        engine="eng",
        dp_rank=dp,
        tp_rank=tp,
        pp_rank=0,
        dp_size=1,
        tp_size=tp_size,
        pp_size=1,
        node=f"node{tp // 8}",
        pid=100 + tp,
    )


def wave_record(wave: int, start: int, execute_ns: int, sample_ns: int = MS, reqs: int = 2):
    return guard_pb2.WaveRecord(
        wave=wave,
        start_unix_nano=start,
        execute_ns=execute_ns,
        sample_ns=sample_ns,
        sample_offset_ns=execute_ns + 100_000,
        num_reqs=reqs,
        decode_reqs=reqs,
        decode_tokens=reqs,
        sampled_tokens=reqs,
        sampled=True,
    )


def collective_wave(wave: int, start: int, all_reduce_ns: int, bytes_: int = 4096):
    cw = guard_pb2.CollectiveWave(wave=wave, first_arrival_unix_nano=start, wait_ns=all_reduce_ns)
    cw.stats.add(op="all_reduce", group="tp", backend="gloo", dtype="float32", calls=4,
                 bytes=bytes_, host_ns=all_reduce_ns, max_host_ns=all_reduce_ns // 4,
                 first_seq=4 * wave - 3, last_seq=4 * wave)  # fmt: skip
    cw.stats.add(op="all_gather", group="tp", backend="gloo", dtype="float32", calls=1,
                 bytes=bytes_ // 4, host_ns=200_000, max_host_ns=200_000, first_seq=wave,
                 last_seq=wave)  # fmt: skip
    return cw


def batch_item(
    rank: guard_pb2.RankInfo,
    waves: Iterable[guard_pb2.WaveRecord],
    collectives: Iterable[guard_pb2.CollectiveWave] = (),
) -> Item:
    """One batch as ingest hands it to the writer (wire v2 columns, validated)."""
    batch = guard_pb2.Batch(rank=rank)
    batch.waves.extend(waves)
    batch.collective_waves.extend(collectives)
    to_columns(batch)
    records = validate_batch(batch)
    labels = ("eng", str(rank.dp_rank), str(rank.tp_rank), str(rank.pp_rank))
    process = (rank.run_id, "eng", rank.dp_rank, rank.tp_rank, 0, rank.pid)
    return Item(RankSource(rank, "eng", labels, process), batch, batch.ByteSize(), records)


def write_store(path: Path, items: list[Item]) -> Store:
    sink = Store(path, prune_every_s=10**12, retention_s=10**9)
    sink.write(items)
    sink.close()
    return sink


def add_incident(
    path: Path, rank: guard_pb2.RankInfo, *, wave: int, at: int, request_id: str, kind: str
) -> None:
    ledger = IncidentLedger(str(path), retention_s=10**9)
    ledger.add(
        "eng",
        rank,
        guard_pb2.Incident(
            schema_version=1,
            id=f"inc-{wave}-{kind}",
            type=kind,
            severity="error",
            wave=wave,
            request_id=request_id,
            time_unix_nano=at,
            summary="test incident",
            evidence_json="{}",
        ),
    )
    ledger.close()
