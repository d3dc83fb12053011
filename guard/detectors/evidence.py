"""Evidence bundles for detectors whose action is "dump".

A bundle is a directory holding `meta.json` (the incident's context), `tokens.json` (the
request's recent sampled tokens), and, as far as the runtime exposes them and the size cap
allows, `logits.pt` (the offending logits row) and `kv.pt` (the request's KV-cache blocks, per
layer). Before writing, the dumper checks the cap per bundle, the cap on all bundles together,
and the free space left on the filesystem; a bundle it does not write comes back as
`dump_skipped:<why>`, which the incident carries in its actions.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import structlog

from guard.config.detectors import DumpConfig

log = structlog.get_logger("ascend_guard.evidence")


def default_dump_dir() -> str:
    from telemetry.wire import paths

    return paths.dump_dir()


class EvidenceDumper:
    def __init__(self, config: DumpConfig, run_id: str, rank_label: str) -> None:
        self.config = config
        self.root = Path(config.directory or default_dump_dir())
        self.run_id = run_id
        self.rank_label = rank_label
        self.written_bytes = 0
        self.bundles = 0

    def dump(
        self,
        incident_type: str,
        wave: int,
        request_id: str,
        *,
        meta: dict[str, Any],
        tokens: list[int] | None = None,
        logits_row: Any = None,
        kv_blocks: dict[str, Any] | None = None,
    ) -> str:
        """Write one bundle; returns "dump:<dir>" or "dump_skipped:<reason>"."""
        import torch

        config = self.config
        parts: dict[str, bytes | Any] = {}
        tokens = (tokens or [])[-config.recent_tokens :] if config.recent_tokens else []
        # a table: one row per line, columns aligned (fmt: skip)
        meta = {
            **meta, "type": incident_type, "wave": wave, "request_id": request_id,
            "run_id": self.run_id, "rank": self.rank_label, "time_unix": time.time(),
        }  # fmt: skip
        sizes = {"tokens.json": len(json.dumps(tokens)) + 2}
        if logits_row is not None:
            sizes["logits.pt"] = logits_row.numel() * logits_row.element_size() + 1024
        kv_size = 0
        if kv_blocks and config.include_kv:
            kv_size = sum(t.numel() * t.element_size() for t in kv_blocks.values()) + 4096
        budget = config.max_bytes - sum(sizes.values()) - 4096
        if kv_size and kv_size > budget:
            meta["kv"] = f"left out: {kv_size} bytes exceed the bundle cap {config.max_bytes}"
            kv_blocks = None
        elif kv_size:
            sizes["kv.pt"] = kv_size
        elif config.include_kv:
            meta.setdefault("kv", "not exposed by this runtime")
        total = sum(sizes.values()) + 4096
        if total > config.max_bytes:
            return f"dump_skipped:bundle of {total} bytes exceeds max_bytes {config.max_bytes}"
        if self.written_bytes + total > config.max_total_bytes:
            return f"dump_skipped:max_total_bytes {config.max_total_bytes} reached"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(self.root).free
        except OSError as exc:
            return f"dump_skipped:cannot use {self.root}: {exc.strerror}"
        if free - total < config.min_free_bytes:
            return (
                f"dump_skipped:only {free} bytes free on {self.root}, "
                f"min_free_bytes is {config.min_free_bytes}"
            )
        safe_req = "".join(c if c.isalnum() or c in "-_." else "_" for c in request_id)[:80]
        bundle = (
            self.root
            / f"{self.run_id}-w{wave}-{self.rank_label}-{incident_type}-{safe_req or 'wave'}"
        )
        try:
            bundle.mkdir(parents=True, exist_ok=True)
            parts["meta.json"] = meta
            (bundle / "tokens.json").write_text(json.dumps(tokens))
            if logits_row is not None:
                torch.save(logits_row.detach().to("cpu").clone(), bundle / "logits.pt")
            if kv_blocks:
                torch.save(
                    {k: v.detach().to("cpu").clone() for k, v in kv_blocks.items()},
                    bundle / "kv.pt",
                )
            meta["files"] = sorted(p.name for p in bundle.iterdir()) + ["meta.json"]
            (bundle / "meta.json").write_text(json.dumps(meta, default=str, indent=1))
        except OSError as exc:
            return f"dump_skipped:write failed in {bundle}: {exc.strerror}"
        written = sum(p.stat().st_size for p in bundle.iterdir())
        self.written_bytes += written
        self.bundles += 1
        log.info("evidence_dumped", path=str(bundle), bytes=written, type=incident_type)
        return f"dump:{bundle}"


def request_kv_blocks(
    runner: Any, req_id: str, row: int | None = None, max_blocks: int = 64
) -> dict[str, Any] | None:
    """The KV-cache blocks of request `req_id` (in batch row `row`, where known), per layer,
    where exposed. None when anything is missing.

    V1 runners keep a block table per KV-cache group in their input batch, one row per batch
    row. An MRV2 runner keeps them in `block_tables`, one row per request state
    (`req_states.req_id_to_index`), and has no input batch between steps. Cache layouts
    differ (K and V stacked in dim 0, or the block dimension first), so the block dimension is
    found as the one whose length is the number of blocks.
    """
    try:
        block_ids = _mrv2_block_ids(runner, req_id, max_blocks)
        if block_ids is None:
            table = runner.input_batch.block_table[0]
            if row is None:
                row = list(runner.input_batch.req_ids).index(req_id)
            count = int(table.num_blocks_per_row[row])
            block_ids = [int(b) for b in table.block_table.np[row, : min(count, max_blocks)]]
        caches = runner.kv_caches
    except Exception:  # noqa: BLE001 - not exposed in this runtime/version
        return None
    if not block_ids or not caches:
        return None
    import torch

    index = torch.tensor(block_ids)
    out = {}
    for layer, cache in enumerate(caches):
        if not isinstance(cache, torch.Tensor):
            return None
        dim = 1 if cache.dim() >= 2 and cache.shape[0] == 2 else 0
        out[f"layer{layer}"] = cache.index_select(dim, index.to(cache.device))
    return out


def _mrv2_block_ids(runner: Any, req_id: str, max_blocks: int) -> list[int] | None:
    """The first KV-cache group's block ids of a request on an MRV2 runner (None: not MRV2).
    Its block table lives on the device; this reads one row of it (only for an incident)."""
    tables = getattr(runner, "block_tables", None)
    states = getattr(runner, "req_states", None)
    if tables is None or states is None or not hasattr(tables, "num_blocks"):
        return None
    index = states.req_id_to_index[req_id]
    count = min(int(tables.num_blocks.np[0, index]), max_blocks)
    return [int(b) for b in tables.block_tables[0].gpu[index, :count].tolist()]
