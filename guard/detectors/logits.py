"""Row checks and health statistics on the logits, without forcing a device sync by default.

`finite_rows` reduces each row to its maximum: NaN and +Inf propagate through max, and a row
that is -Inf everywhere (nothing can be sampled) stays -Inf, so one reduction finds all three.
-Inf entries alone are normal (grammar and bad-word masks) and pass. The reduced row vector
is tiny; on an accelerator it is copied to the host with `non_blocking=True` and read after
sampling, when the copy has long finished.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch


class PendingCheck:
    """A device→host copy in flight, with what is needed to read it later.

    `req_ids` is the batch's request ids as of the wave, taken when the check is read after
    the batch may have changed; None when it is read in the same wave (on the host, or with
    the sync gate), where the runner's own list is still the wave's.
    """

    __slots__ = ("event", "host", "logits", "req_ids", "rows_per_req", "runner", "stats", "wave")

    def __init__(
        self,
        wave: int,
        host: torch.Tensor,
        event: Any,
        req_ids: list[str] | None,
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
        self.runner = runner  # evidence (KV blocks), and the request ids when read at once

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


def row_max(logits: torch.Tensor) -> torch.Tensor:
    """Per-row max (NaN and +Inf propagate; an all -Inf row stays -Inf)."""
    return logits.amax(dim=-1)


STATS_ROWS = 8
HEALTH_FIELDS = 3  # the rows of `health_rows`: row max, p·log p summed, max |logit|


def health_rows(logits: torch.Tensor, rows: int = STATS_ROWS) -> torch.Tensor:
    """Per-row readings of the first `rows` rows, as a [3, n] tensor, for `health_summary`:
    each row's max, the sum of p·log p over its tokens (its entropy in nats, negated), and
    its largest finite |logit|.

    A sample of rows keeps the cost flat in the batch size; the statistics are for drift.
    -Inf is a masked token, not a fault: structured outputs (grammar bitmask), min_tokens,
    logit bias and allowed-token lists set it, so the readings skip masked entries rather
    than whole rows. A row with NaN or +Inf, or with nothing left unmasked, has a row max
    that is not finite; `health_summary` leaves it out (the finite-logits gate reports those).

    The rows are reduced to two numbers on the host, after the copy: a dozen elementwise ops
    and row reductions here, each one launch on a device, and no boolean indexing or scalar
    read (either would make the host wait for the device).
    """
    values = logits[:rows].float()
    if values.numel() == 0:  # shapes live on the host: no sync
        return torch.empty((HEALTH_FIELDS, 0), device=logits.device)
    logp = torch.log_softmax(values, dim=-1)
    # a masked token's p · log p is 0 · -Inf = NaN: it counts as 0
    plogp = (logp.exp() * logp).nan_to_num(nan=0.0).sum(dim=-1)
    row_abs = values.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).abs().amax(dim=-1)
    return torch.stack([values.amax(dim=-1), plogp, row_abs])


def host_rows(logits: torch.Tensor, rows: int = STATS_ROWS) -> np.ndarray:
    """A float32, C-ordered copy of the first `rows` rows of host logits, for
    `logits_kernel.health_readings` (a copy: the sampler may change the logits in place)."""
    head = logits[:rows]
    if head.dtype != torch.float32:
        return head.float().contiguous().numpy()  # .float() made the copy
    return np.array(head.numpy(), dtype=np.float32, order="C")


def host_health_summary(rows: np.ndarray) -> tuple[float, float] | None:
    """`health_summary` of a `host_rows` copy, with torch's ops (while the compiled kernel,
    `logits_kernel.health_readings`, is not in)."""
    return health_summary(health_rows(torch.from_numpy(rows)).tolist())


def health_summary(readings: list[list[float]]) -> tuple[float, float] | None:
    """(max |logit|, mean entropy in nats) over the healthy rows of `health_rows`, or None
    when no row was healthy (no reading: the sidecar refuses NaN)."""
    row_max, plogp, row_abs = readings
    healthy = [i for i, top in enumerate(row_max) if math.isfinite(top)]
    if not healthy:
        return None
    max_abs = max(row_abs[i] for i in healthy)
    entropy = -sum(plogp[i] for i in healthy) / len(healthy)
    if not (math.isfinite(max_abs) and math.isfinite(entropy)):
        return None
    return max_abs, entropy


def start_copy(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """Copy a small tensor to the host; on an accelerator without waiting (returns an event
    that completes with the copy). A device with no event type is copied at once."""
    if tensor.device.type == "cpu":
        return tensor, None
    module = getattr(torch, tensor.device.type, None)  # torch.cuda, torch.npu (torch_npu), ...
    event_cls = getattr(module, "Event", None) if module is not None else None
    if event_cls is None:
        return tensor.to("cpu"), None  # nothing to wait on later: the read must not race
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    event = event_cls()
    event.record()
    return host, event


# below this many rows the row maxima are summed as Python floats: cheaper than a tensor op
SMALL_BATCH = 64


def bad_rows(row_maxes: torch.Tensor) -> list[int]:
    """Row indexes whose max is NaN, +Inf or -Inf (`row_maxes` is on the host).

    The common case costs one reduction and one scalar read: the sum of the row maxima is
    finite exactly when every row max is (NaN, +Inf and -Inf all survive a sum).
    """
    small = len(row_maxes) < SMALL_BATCH
    total = sum(row_maxes.tolist()) if small else float(row_maxes.sum())
    if math.isfinite(total):
        return []
    finite = torch.isfinite(row_maxes)
    return [int(i) for i in (~finite).nonzero().flatten().tolist()]


def all_finite(row_maxes: list[torch.Tensor]) -> bool:
    """Whether every row max of several waves (host tensors) is finite: one sum over them all.
    A sum that overflows reads as not finite too; the caller then checks each wave."""
    joined = torch.cat(row_maxes) if len(row_maxes) > 1 else row_maxes[0]
    return math.isfinite(float(joined.sum()))


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
