"""End to end, real `vllm serve` on CPU at TP=2 WITHOUT `--enforce-eager` (torch.compile on,
vLLM's default), with a real sidecar: the compiled model's collectives are seen per compiled-graph call (found
in the graph at compile time, counted at each call of the compiled graph).

Two servers, one after the other (compile start-up is the slow part on these machines): a
guarded one (counts and bytes against the tiny model's shape, the fire drill's straggler by
collective skew, and its compile log), then an unguarded one (token identity, and the same
number of compiled graphs). Tests run in file order. On CPU nothing is captured as a device
graph, so every collective here is a host call inside the compiled graph.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from tests.support.http import get_json
from tests.support.metrics import value
from tests.support.ports import free_port
from tests.support.sidecar import SidecarProcess
from tests.support.vllm_server import VllmServer, cpu_tp_backend, token_ids

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

ENGINE = "compiled"
DRILL_WAVE = 40
DRILL_DELAY_S = 0.5
PROMPTS = [
    "Compiled graphs hide their collectives",
    "Every layer reduces twice",
    "The embedding is reduced once",
    "Logits are gathered per request",
]
# Dynamo's own log: each traced graph's code (with its compile id "[frame/recompile]"), graph
# breaks and recompiles. The compile cache is off so both servers trace (a cached artifact logs
# nothing).
COMPILE_ENV = {
    "TORCH_LOGS": "graph_breaks,recompiles,graph_code",
    "VLLM_DISABLE_COMPILE_CACHE": "1",
}
GUARD_OP = "torch.ops.ascend_guard."  # the earlier design's per-call guard op: none now


def compile_log(log_path: Path) -> dict[str, dict[str, int]]:
    """Per worker rank: traced graphs, distinct compile ids, graph breaks, recompiles and the
    all-reduce nodes (guard op vs the backend's kernel) in the traced code."""
    ranks: dict[str, dict[str, int]] = {}
    ids: dict[str, set[str]] = {}
    for line in log_path.read_text(errors="replace").splitlines():
        m = re.match(r"\[rank(\d+)\]:", line)
        if not m:
            continue
        r = ranks.setdefault(m.group(1), dict.fromkeys(
            ("graphs", "compile_ids", "breaks", "recompiles", "guard_ops", "backend_ops"), 0))  # fmt: skip
        if "[__graph_code]" in line:
            cid = re.search(r"\] \[(\d+/\d+)\] \[__graph_code\]", line)
            if cid:
                ids.setdefault(m.group(1), set()).add(cid.group(1))
            if line.rstrip().endswith("TRACED GRAPH"):
                r["graphs"] += 1
            code = line.split("[__graph_code]", 1)[1]
            if "# File:" not in code:
                r["guard_ops"] += code.count(GUARD_OP)
                r["backend_ops"] += code.count(cpu_tp_backend()[1])
        if "[__graph_breaks]" in line or "Graph break" in line:
            r["breaks"] += 1
        if "[__recompiles]" in line or "Recompiling function" in line:
            r["recompiles"] += 1
    for rank, found in ids.items():
        ranks[rank]["compile_ids"] = len(found)
    return ranks


def assert_one_graph_of_backend_collectives(log_path: Path, layers: int) -> dict:
    """A guarded TP=2 server's Dynamo log: one traced graph per rank (compile id 0/0 only), no
    graph break, no recompile, and every all-reduce in it the backend's own kernel (1 + 2 x
    layers, no guard op); what `compile_log` found, per rank."""
    found = compile_log(log_path)
    assert set(found) == {"0", "1"}, found
    for tp, r in found.items():
        assert r["graphs"] == 1 and r["compile_ids"] == 1, (tp, r)
        assert r["breaks"] == 0 and r["recompiles"] == 0, (tp, r)
        assert r["guard_ops"] == 0 and r["backend_ops"] == 1 + 2 * layers, (tp, r)
    return found


class Deployment:
    def __init__(self, root: Path, model: Path) -> None:
        self.root = root
        self.model = model
        self.health_port = free_port()
        sock = root / "guard.sock"
        self.sidecar = SidecarProcess.start(
            root, address=f"unix://{sock}",
            extra_args=("--health-port", str(self.health_port), "--health-host", "127.0.0.1"),
        )  # fmt: skip
        guard = {
            "sidecar": f"unix://{sock}", "engine": ENGINE, "flush_interval_ms": 20,
            "fault_injection": {"enabled": True, "tp_rank": 1, "at_wave": DRILL_WAVE,
                                "delay_ms": DRILL_DELAY_S * 1000, "where": "execute_model"},
        }  # fmt: skip
        self.started = time.monotonic()
        try:
            self.server = VllmServer.start(
                model, root, tp=2, guard=guard, eager=False, env=COMPILE_ENV, timeout=600
            )
        except BaseException:
            self.sidecar.stop()
            raise
        self.startup_s = time.monotonic() - self.started
        self.guarded_tokens: list[list[int]] = []

    def get(self, path: str) -> tuple[int, dict]:
        return get_json(f"http://127.0.0.1:{self.health_port}{path}")

    def stop(self) -> None:
        self.server.stop()
        self.sidecar.stop()


@pytest.fixture(scope="module")
def dep(tiny_model, tmp_path_factory):
    d = Deployment(tmp_path_factory.mktemp("compiled"), tiny_model)
    yield d
    d.stop()


def rank(tp: int) -> dict[str, str]:
    return {"engine": ENGINE, "dp": "0", "tp": str(tp), "pp": "0"}


def model_shape(model: Path) -> tuple[int, int, int]:
    config = json.loads((model / "config.json").read_text())
    return config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]


def test_compiled_collective_counts_and_bytes_follow_the_model_shape(dep: Deployment) -> None:
    """Per rank and model step: 1 + 2 x layers all-reduces (embedding, then o_proj and down_proj
    of each layer, all inside the compiled graph) of tokens x hidden x 4 bytes, one logits
    all-gather (outside it) of (vocab / tp) x 4 bytes per sampled row. Tokens from the API's
    usage; both ranks agree, and so do their sequence numbers."""
    layers, hidden, vocab = model_shape(dep.model)
    per_step = 1 + 2 * layers
    sidecar = dep.sidecar
    before = sidecar.metrics_text()
    responses = [dep.server.complete(p, max_tokens=12) for p in PROMPTS]
    dep.guarded_tokens = [token_ids(r) for r in responses]
    fed = sum(r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] - 1 for r in responses)
    sampled = sum(r["usage"]["completion_tokens"] for r in responses)

    def grown(text: str, name: str, tp: int, op: str) -> float:
        return value(text, name, op=op, group="tp", **rank(tp)) - value(
            before, name, op=op, group="tp", **rank(tp)
        )

    def settled(text: str) -> bool:
        return all(
            grown(text, "ascend_guard_collective_bytes_total", tp, "all_gather")
            >= sampled * (vocab // 2) * 4
            for tp in (0, 1)
        )

    sidecar.wait_for(settled, timeout=20)
    time.sleep(0.5)
    text = sidecar.metrics_text()
    for tp in (0, 1):
        reduces = grown(text, "ascend_guard_collective_calls_total", tp, "all_reduce")
        gathers = grown(text, "ascend_guard_collective_calls_total", tp, "all_gather")
        model_waves = (
            value(text, "ascend_guard_waves_total", **rank(tp))
            - value(text, "ascend_guard_dummy_waves_total", **rank(tp))
            - value(before, "ascend_guard_waves_total", **rank(tp))
            + value(before, "ascend_guard_dummy_waves_total", **rank(tp))
        )
        assert gathers == model_waves > 0, f"tp{tp}: one logits all-gather per model step"
        assert reduces == per_step * gathers, f"tp{tp}: {reduces} all-reduces in {gathers} steps"
        assert grown(text, "ascend_guard_collective_bytes_total", tp, "all_reduce") == (
            per_step * fed * hidden * 4
        )
        assert grown(text, "ascend_guard_collective_bytes_total", tp, "all_gather") == (
            sampled * (vocab // 2) * 4
        )
    seq = [value(text, "ascend_guard_collective_last_seq", group="tp", **rank(tp)) for tp in (0, 1)]
    total = [
        value(text, "ascend_guard_collective_calls_total", group="tp", **rank(tp)) for tp in (0, 1)
    ]
    assert seq[0] == seq[1] and total[0] == total[1], (seq, total)
    # the compile warm-up's forward and dummy sampling run outside any wave: numbered (on both
    # ranks alike), not counted
    assert 0 <= seq[0] - total[0] <= 2 * (per_step + 1), (seq, total)
    assert value(text, "ascend_guard_guard_errors_total") == 0


def test_fire_drill_straggler_is_found_by_collective_skew(dep: Deployment) -> None:
    """Rank 1 is held DRILL_DELAY_S before its step at DRILL_WAVE: its first collective of the
    wave (the embedding's all-reduce, inside the compiled graph) arrives that much later."""

    def last_wave() -> float:
        text = dep.sidecar.metrics_text()
        return min(value(text, "ascend_guard_last_wave", **rank(tp)) for tp in (0, 1))

    deadline = time.monotonic() + 180
    while last_wave() < DRILL_WAVE + 3:
        assert time.monotonic() < deadline, "the server did not reach the drill wave"
        dep.server.complete_many(PROMPTS[:2], max_tokens=16)
    waves = []
    for _ in range(50):
        waves = [w for w in dep.get("/skew")[1]["waves"] if w["wave"] == DRILL_WAVE]
        if waves:
            break
        time.sleep(0.1)
    assert len(waves) == 1, "the drill wave was aligned across both ranks"
    drill = waves[0]
    assert drill["straggler_tp"] == 1
    assert DRILL_DELAY_S * 0.9 <= drill["arrival_skew_s"] <= DRILL_DELAY_S + 0.25, drill
    assert drill["waits_s"]["0"] > drill["waits_s"]["1"] + DRILL_DELAY_S * 0.9
    text = dep.sidecar.metrics_text()
    assert value(text, "ascend_guard_straggler_waves_total", **rank(1)) >= 1
    assert dep.get("/hangs")[1]["history"] == []


def test_the_guard_causes_no_graph_break_or_recompile(dep: Deployment) -> None:
    """Dynamo's log of the guarded server: one traced graph per rank (compile id 0/0 only), no
    graph break, no recompile, and every all-reduce of the graph is the backend's own kernel
    (no guard op: the graph is the unguarded one). That the guard found each of them in it is
    the counts test's per-step all-reduce count."""
    layers, _, _ = model_shape(dep.model)
    dep.compile_found = assert_one_graph_of_backend_collectives(dep.server.log_path, layers)


def test_guard_off_outputs_are_token_identical_and_compile_the_same_graphs(
    dep: Deployment, tmp_path: Path
) -> None:
    """The same server without the guard: greedy outputs token for token as with it, and
    Dynamo traced as many graphs, with the same backend all-reduces in them."""
    assert dep.guarded_tokens, "runs after the counts test"
    dep.stop()
    server = VllmServer.start(
        dep.model, tmp_path, tp=2, guard=None, eager=False, env=COMPILE_ENV, timeout=600
    )
    try:
        plain = [token_ids(server.complete(p, max_tokens=12)) for p in PROMPTS]
    finally:
        server.stop()
    assert plain == dep.guarded_tokens
    layers, _, _ = model_shape(dep.model)
    off = compile_log(server.log_path)
    on = getattr(dep, "compile_found", None) or compile_log(dep.server.log_path)
    for tp in ("0", "1"):
        assert off[tp]["graphs"] == on[tp]["graphs"] == 1, (off, on)
        assert off[tp]["compile_ids"] == on[tp]["compile_ids"]
        assert off[tp]["breaks"] == off[tp]["recompiles"] == 0
        assert off[tp]["backend_ops"] == on[tp]["backend_ops"] == 1 + 2 * layers
        assert off[tp]["guard_ops"] == on[tp]["guard_ops"] == 0
