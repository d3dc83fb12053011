"""What the detector suite reads off the runner and the logits: the request id of each row, the
requests in a batch of rows, the vocabulary size. Engine thread, by attribute only.
"""

from __future__ import annotations

from typing import Any


def request_ids(runner: Any, count: int) -> list[str]:
    """The request id of each batch row, in logits order (V1 runners' input batch)."""
    try:
        ids = runner.input_batch.req_ids
    except AttributeError:
        return [f"row{i}" for i in range(count)]
    return ids[:count] if type(ids) is list else list(ids[:count])  # a list's slice: a copy


def requests_in_rows(rows_per_req: list[int] | None, rows: Any) -> int:
    """Requests in a batch of logits rows (`rows`: the logits or their row maxima)."""
    return len(rows_per_req) if rows_per_req is not None else int(rows.shape[0])


def vocab_size(runner: Any, logits: Any) -> int | None:
    try:
        return int(runner.model_config.get_vocab_size())
    except Exception:  # noqa: BLE001
        pass
    if logits is not None:
        return int(logits.shape[-1])
    return None
