"""A guarded `vllm serve` with its sidecar, and the counters an accounting check reads.

Every phase of an accounting test reads the same counters before and after: vLLM's own
(`/metrics` on the API port), the guard's (the sidecar's `/metrics`, per TP rank), and the
API's usage. `settle()` waits on conditions, never on a fixed sleep: vLLM's scheduler has
nothing running or waiting, and every rank's guard has sent a heartbeat taken after that,
with every wave it had started by then already received.
"""

from __future__ import annotations

import http.client
import json
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from guard.detectors.suite import IDLE_FLUSH_S
from tests.support.http import get_json
from tests.support.metrics import samples, value
from tests.support.ports import free_port
from tests.support.sidecar import SidecarProcess
from tests.support.vllm_server import VllmServer

ENGINE = "acct"
# the waves' transport under test: the shared-memory ring (ASCEND_GUARD_TEST_WAVE_RING=1) or
# the gRPC stream (the default while the ring is opt-in)
WAVE_RING = os.environ.get("ASCEND_GUARD_TEST_WAVE_RING", "") == "1"


@dataclass(frozen=True)
class Counters:
    """One reading of vLLM's and the guard's counters."""

    vllm: str
    guard: str
    tp: int

    def v(self, name: str, **labels: str) -> float:
        return value(self.vllm, name, **labels)

    def g(self, name: str, tp: int = 0, **labels: str) -> float:
        return value(self.guard, name, engine=ENGINE, dp="0", tp=str(tp), pp="0", **labels)

    def sampled(self, tp: int = 0) -> float:
        return self.g("ascend_guard_sampled_tokens_total", tp)

    def scheduled(self, kind: str, tp: int = 0) -> float:
        return self.g("ascend_guard_scheduled_tokens_total", tp, kind=kind)

    def minus(self, before: Counters) -> Delta:
        return Delta(self, before)


class Delta:
    """Growth of every counter between two readings."""

    def __init__(self, after: Counters, before: Counters) -> None:
        self.after, self.before = after, before

    def v(self, name: str, **labels: str) -> float:
        return self.after.v(name, **labels) - self.before.v(name, **labels)

    def g(self, name: str, tp: int = 0, **labels: str) -> float:
        return self.after.g(name, tp, **labels) - self.before.g(name, tp, **labels)

    def sampled(self, tp: int = 0) -> float:
        return self.after.sampled(tp) - self.before.sampled(tp)

    def scheduled(self, kind: str, tp: int = 0) -> float:
        return self.after.scheduled(kind, tp) - self.before.scheduled(kind, tp)

    @property
    def generation(self) -> float:
        return self.v("vllm:generation_tokens_total")

    @property
    def prompt(self) -> float:
        return self.v("vllm:prompt_tokens_total")

    def row(self, name: str) -> str:
        """One line of figures for the log (`pytest -s`): guard tp0 against vLLM."""
        figures = {
            "sampled": self.sampled(),
            "generation": self.generation,
            "prefill": self.scheduled("prefill"),
            "recompute": self.scheduled("recompute"),
            "decode": self.scheduled("decode"),
            "prompt": self.prompt,
            "cache_hits": self.v("vllm:prefix_cache_hits_total"),
            "preemptions": self.v("vllm:num_preemptions_total"),
            "drafts": self.v("vllm:spec_decode_num_draft_tokens_total"),
            "accepted": self.v("vllm:spec_decode_num_accepted_tokens_total"),
        }
        line = f"ROW {name}: " + " ".join(f"{k}={v:g}" for k, v in figures.items())
        print(line)
        return line

    def per_rank(self) -> list[tuple[float, float, float, float]]:
        """(sampled, prefill, recompute, decode) on every rank: TP ranks run the same steps."""
        return [
            (
                self.sampled(tp),
                self.scheduled("prefill", tp),
                self.scheduled("recompute", tp),
                self.scheduled("decode", tp),
            )
            for tp in range(self.after.tp)
        ]


class GuardedServer:
    """A sidecar and a guarded `vllm serve` (TP ranks report to the sidecar). The server is
    launched only; `started` waits for several at once and sends each its first request."""

    def __init__(self, root: Path, model: Path, tp: int, extra_args: tuple[str, ...]) -> None:
        self.tp = tp
        sock = root / "guard.sock"
        self.health_port = free_port()
        live = root / "live"  # liveness records and wave rings, shared by workers and sidecar
        self.sidecar = SidecarProcess.start(
            root,
            address=f"unix://{sock}",
            extra_args=("--health-port", str(self.health_port), "--liveness-dir", str(live)),
        )
        guard = {
            "sidecar": f"unix://{sock}",
            "engine": ENGINE,
            "flush_interval_ms": 20,
            "heartbeat_interval_s": 0.2,
            "reconnect_max_backoff_s": 0.5,
            "liveness_dir": str(live),
            "wave_ring": WAVE_RING,
        }
        try:
            self.server = VllmServer.launch(model, root, tp=tp, guard=guard, extra_args=extra_args)
        except BaseException:
            self.sidecar.stop()
            raise
        self.model = self.server.model

    @staticmethod
    def started(servers: list[GuardedServer]) -> list[GuardedServer]:
        """Wait for servers launched side by side (they import vLLM at once), then warm each
        up: the guard streams from the first wave, so one request connects every rank. If one
        fails, all are stopped."""
        try:
            VllmServer.start_together([s.server for s in servers])
            for s in servers:
                s.post("/v1/completions", {"prompt": "warm up", "max_tokens": 2})
        except BaseException:
            for s in servers:
                s.stop()
            raise
        return servers

    def stop(self) -> None:
        self.server.stop()
        self.sidecar.stop()

    # -- requests ---------------------------------------------------------------------------
    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(
            f"{self.server.base}{path}",
            data=json.dumps({"model": self.model, **body}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=300) as resp:
            return json.loads(resp.read())

    def stream(self, path: str, body: dict[str, Any], *, read_chunks: int | None = None) -> dict:
        """A streaming request. Returns the last usage seen, the number of chunks read and the
        response id; with `read_chunks`, hangs up after that many chunks (the client goes away)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=300)
        payload = {"model": self.model, "stream": True, **body}
        if read_chunks is None:
            payload["stream_options"] = {"include_usage": True}
        conn.request("POST", path, json.dumps(payload), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        chunks, usage, response_id = 0, None, None
        try:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[len("data: ") :])
                response_id = response_id or data.get("id")
                if data.get("usage"):
                    usage = data["usage"]
                if data.get("choices"):
                    chunks += 1
                if read_chunks is not None and chunks >= read_chunks:
                    break
        finally:
            conn.close()
        return {"usage": usage, "chunks": chunks, "id": response_id}

    def all_at_once(self, calls: list[Any]) -> list[Any]:
        """Run zero-argument callables concurrently (requests back to back, no pauses)."""
        with ThreadPoolExecutor(max_workers=len(calls)) as pool:
            return list(pool.map(lambda call: call(), calls))

    # -- counters -----------------------------------------------------------------------------
    def read(self) -> Counters:
        return Counters(self.server.metrics_text(), self.sidecar.metrics_text(), self.tp)

    def live(self) -> dict[str, Any]:
        return get_json(f"http://127.0.0.1:{self.health_port}/live/{ENGINE}")[1]

    def settle(self, timeout: float = 60.0) -> Counters:
        """Counters once every request of the phase is done on both sides.

        1. vLLM: nothing running or waiting in the scheduler (aborts included, which
           `vllm:request_success_total` does not count).
        2. guard: each rank sent a heartbeat more than `IDLE_FLUSH_S` after (1), and the
           sidecar holds the wave that heartbeat named (a rank's stream is ordered: every
           earlier wave arrived or was counted as dropped; `assert_clean` checks that none
           was). The detectors judge their token batches a batch at a time; by that heartbeat
           the streamer has judged what the idle engine left queued (`flush_idle`), so its
           acceptance readings count every wave. A heartbeat sooner after (1) may carry totals
           that are a partial batch short.
        """
        deadline = time.monotonic() + timeout
        while True:
            text = self.server.metrics_text()
            if (
                value(text, "vllm:num_requests_running") == 0
                and value(text, "vllm:num_requests_waiting") == 0
            ):
                break
            _check(deadline, "vLLM still has requests running or waiting")
        flushed_after = time.time() + IDLE_FLUSH_S
        while True:
            guard = self.sidecar.metrics_text()
            ranks = {r["tp"]: r for r in self.live().get("ranks", [])}
            flushed = len(ranks) == self.tp
            for tp in range(self.tp):
                labels = {"engine": ENGINE, "dp": "0", "tp": str(tp), "pp": "0"}
                last = value(guard, "ascend_guard_last_wave", **labels)
                heartbeat = value(guard, "ascend_guard_last_heartbeat_timestamp_seconds", **labels)
                flushed = flushed and heartbeat > flushed_after and last >= ranks[tp]["last_wave"]
            if flushed:
                return Counters(self.server.metrics_text(), guard, self.tp)
            _check(deadline, f"guard records not flushed: {ranks}")


def _check(deadline: float, what: str) -> None:
    if time.monotonic() > deadline:
        raise TimeoutError(what)
    time.sleep(0.05)


def usage_sum(responses: list[dict[str, Any]], key: str) -> int:
    return sum(r["usage"][key] for r in responses)


def guard_lines(text: str) -> str:
    """The guard's counter lines, for assertion messages."""
    return "\n".join(
        f"{name}{labels} {val}"
        for name in (
            "ascend_guard_sampled_tokens_total",
            "ascend_guard_scheduled_tokens_total",
            "ascend_guard_records_dropped_total",
            "ascend_guard_ingest_rejected_total",
        )
        for labels, val in samples(text, name)
    )
