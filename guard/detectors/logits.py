"""Row checks and health statistics on the logits, without forcing a device sync by default.

`row_max` reduces each row to its maximum: NaN and +Inf propagate through max, and a row
that is -Inf everywhere (nothing can be sampled) stays -Inf, so one reduction on the logits'
device finds all three. -Inf entries alone are normal (grammar and bad-word masks) and pass.
That one reduction is all the logits see per wave. The reduced row vector is tiny; on an
accelerator it is copied into a preallocated pinned host buffer with `non_blocking=True`, an
event is recorded behind it, and it is read after sampling, when the copy has long finished
(`HostCopies`). Nothing on this path waits for the device.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch


class PendingCheck:
    """A device→host copy in flight, with what is needed to read it later."""

    __slots__ = ("event", "host", "logits", "req_ids", "rows_per_req", "runner", "stats", "wave")

    def __init__(
        self,
        wave: int,
        host: torch.Tensor,
        event: Any,
        req_ids: list[str],
        rows_per_req: list[int] | None,
        logits: torch.Tensor | None,
        stats: torch.Tensor | None,
        runner: Any = None,
    ) -> None:
        self.wave = wave
        self.host = host
        self.event = event
        self.req_ids = req_ids
        self.rows_per_req = rows_per_req
        self.logits = logits  # kept only when evidence may be dumped
        self.stats = stats
        self.runner = runner  # kept only when evidence may be dumped (KV blocks)

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


def row_max(logits: torch.Tensor) -> torch.Tensor:
    """Per-row max (NaN and +Inf propagate; an all -Inf row stays -Inf)."""
    return logits.amax(dim=-1)


STATS_ROWS = 8


def health_stats(logits: torch.Tensor, rows: int = STATS_ROWS) -> torch.Tensor:
    """[max |logit|, mean entropy in nats] over the healthy rows among the first `rows`.

    A sample of rows keeps the cost flat in the batch size; the statistics are for drift.
    -Inf is a masked token, not a fault: structured outputs (grammar bitmask), min_tokens,
    logit bias and allowed-token lists set it, so the stats skip masked entries rather than
    whole rows. A row with NaN or +Inf, or with nothing left unmasked, is left out (the
    finite-logits gate reports those). With no healthy row the result is NaN: no reading.
    """
    values = logits[:rows].float()
    if values.numel() == 0:  # shapes live on the host: no sync
        return torch.tensor([float("nan"), float("nan")], device=logits.device)
    masked = values == float("-inf")
    healthy = ~(torch.isnan(values) | (values == float("inf"))).any(dim=-1) & ~masked.all(dim=-1)
    # No boolean indexing (`values[healthy]`): on CUDA or NPU that reads the mask back to the
    # host, a device sync. Unhealthy rows are zeroed instead and weighted out; with no healthy
    # row, 0 / 0 gives the NaN "no reading" on the device.
    unhealthy = ~healthy.unsqueeze(-1)
    values = values.masked_fill(unhealthy, 0.0)
    ignored = masked | unhealthy
    count = healthy.sum()
    max_abs = values.masked_fill(ignored, 0.0).abs().amax()
    max_abs = torch.where(count > 0, max_abs, torch.full_like(max_abs, float("nan")))
    logp = torch.log_softmax(values, dim=-1)
    row_entropy = -(logp.exp() * logp).masked_fill(ignored, 0.0).sum(dim=-1)
    entropy = (row_entropy * healthy).sum() / count
    return torch.stack([max_abs, entropy])


def start_copy(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """Copy a small tensor to the host; on an accelerator without waiting (returns an event).

    Allocates a pinned buffer per call: for occasional copies. The per-wave row check uses a
    `HostCopies` ring instead.
    """
    if tensor.device.type == "cpu":
        return tensor, None
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    event = _device_event(tensor.device)
    if event is not None:
        event.record()
    return host, event


def _device_event(device: torch.device) -> Any:
    module = getattr(torch, device.type, None)  # torch.cuda, torch.npu (torch_npu), ...
    event_cls = getattr(module, "Event", None) if module is not None else None
    return event_cls() if event_cls is not None else None


class HostCopies:
    """A ring of preallocated pinned host buffers and events for the per-wave row check.

    `DEPTH` buffers: a check is read within two waves (`DetectorSuite.resolve_ready`), so a
    buffer is never overwritten while its copy may still be in flight. Buffers grow (rarely)
    when a wave has more rows than before.
    """

    DEPTH = 4

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._events: list[Any] = []
        self._next = 0
        self._key: tuple[str, torch.dtype] | None = None
        self._rows = 0

    def copy(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Start copying a 1-D device tensor to the host; returns (host view, event)."""
        if tensor.device.type == "cpu":
            return tensor, None
        rows = tensor.shape[0]
        key = (str(tensor.device), tensor.dtype)
        if key != self._key or rows > self._rows:
            self._allocate(key, max(rows, 2 * self._rows, 256), tensor.device)
        index = self._next
        self._next = (index + 1) % self.DEPTH
        host = self._buffers[index][:rows]
        host.copy_(tensor, non_blocking=True)
        event = self._events[index]
        if event is not None:
            event.record()
        return host, event

    def _allocate(self, key: tuple[str, torch.dtype], rows: int, device: torch.device) -> None:
        self._buffers = [
            torch.empty(rows, dtype=key[1], device="cpu", pin_memory=True)
            for _ in range(self.DEPTH)
        ]
        self._events = [_device_event(device) for _ in range(self.DEPTH)]
        self._key, self._rows, self._next = key, rows, 0


def bad_rows(row_maxes: torch.Tensor) -> list[int]:
    """Row indexes whose max is NaN, +Inf or -Inf (a host tensor, read as numpy).

    The common case costs one reduction and one scalar read: the sum of the row maxima is
    finite exactly when every row max is (NaN, +Inf and -Inf all survive a sum).
    """
    values = row_maxes.numpy() if row_maxes.dtype != torch.bfloat16 else row_maxes.float().numpy()
    with np.errstate(invalid="ignore", over="ignore"):
        if math.isfinite(float(values.sum(dtype=np.float64))):
            return []
    return np.flatnonzero(~np.isfinite(values)).tolist()


def describe_row(row: torch.Tensor) -> dict[str, Any]:
    """Evidence for one bad row: how many NaN, +Inf, -Inf; costs a pass, only on incidents."""
    row = row.float()
    return {
        "nan": int(torch.isnan(row).sum()),
        "pos_inf": int(torch.isposinf(row).sum()),
        "neg_inf": int(torch.isneginf(row).sum()),
        "width": int(row.numel()),
    }


def rows_to_requests(
    bad: list[int], req_ids: list[str], rows_per_req: list[int] | None
) -> dict[str, list[int]]:
    """Map bad row indexes to request ids (several rows per request on the verify path)."""
    out: dict[str, list[int]] = {}
    if rows_per_req is None:
        for row in bad:
            req = req_ids[row] if row < len(req_ids) else f"row{row}"
            out.setdefault(req, []).append(row)
        return out
    owner = []
    for index, count in enumerate(rows_per_req):
        owner.extend([index] * count)
    for row in bad:
        index = owner[row] if row < len(owner) else -1
        req = req_ids[index] if 0 <= index < len(req_ids) else f"row{row}"
        out.setdefault(req, []).append(row)
    return out
