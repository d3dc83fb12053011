"""MLA rotary tables: vllm-ascend keeps one cos and one sin table (`_cos_mla`, `_sin_mla` in
`vllm_ascend.ops.rotary_embedding`) sized once at start-up; a decode step of max requests, each
with the decode query length (1 + speculative tokens), must fit, or rows past the end are read."""

from __future__ import annotations

import sys
from typing import Any

from ascend_runtime.probes import report

ROTARY_MODULE = "vllm_ascend.ops.rotary_embedding"


def check_rotary_capacity(
    cos: Any, sin: Any, max_num_reqs: int, decode_query_len: int
) -> dict[str, Any] | None:
    """The shortfall, or None when both tables hold max_num_reqs x decode_query_len rows."""
    need = int(max_num_reqs) * int(decode_query_len)
    rows = {name: int(t.shape[0]) for name, t in (("cos", cos), ("sin", sin)) if t is not None}
    if not rows:
        return None
    short = {name: n for name, n in rows.items() if n < need}
    if not short:
        return None
    return {
        "rows": rows,
        "needed": need,
        "max_num_reqs": max_num_reqs,
        "decode_query_len": decode_query_len,
    }


def probe_runner(runner: Any) -> dict[str, Any] | None:
    module = sys.modules.get(ROTARY_MODULE)
    if module is None:
        return None
    cos, sin = getattr(module, "_cos_mla", None), getattr(module, "_sin_mla", None)
    if cos is None and sin is None:
        return None  # not an MLA model
    max_reqs = int(getattr(runner, "max_num_reqs", 0) or 0)
    query_len = int(
        getattr(runner, "decode_query_len", 0) or getattr(runner, "uniform_decode_query_len", 1)
    )
    report.probe("rotary_table_rows", int(cos.shape[0]) if cos is not None else 0)
    shortfall = check_rotary_capacity(cos, sin, max_reqs, query_len)
    if shortfall is not None:
        report.incident(
            "rotary_capacity",
            "error",
            f"MLA cos/sin tables hold {min(shortfall['rows'].values())} rows; a full decode step "
            f"needs {shortfall['needed']} ({max_reqs} requests x {query_len} tokens)",
            evidence=shortfall,
        )
    return shortfall
