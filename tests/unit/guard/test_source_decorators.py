"""The decorators carried in source by a runner subclass, the way vllm-ascend's MRV2
`NPUModelRunner` carries them: `@torch.inference_mode()` outside, the guard decorator inside.

The subclass here derives from the real upstream MRV2 `GPUModelRunner` installed with vLLM; its
method bodies stand in for the NPU ones, which need torch_npu and an NPU.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from ascend_runtime.attach.binder import bind_runner_class
from guard.config.runtime_guard import GuardConfig
from guard.decorators import install, is_guarded, runtime_guard_sample_tokens, runtime_guard_step
from guard.processor import GuardProcessor
from telemetry.wire.proto import guard_pb2

pytest.importorskip("vllm.v1.worker.cpu.shm")  # makes MRV2 importable on a CPU host
mrv2 = pytest.importorskip("vllm.v1.worker.gpu.model_runner")
sched = pytest.importorskip("vllm.v1.core.sched.output")
outputs = pytest.importorskip("vllm.v1.outputs")


class NPULikeRunner(mrv2.GPUModelRunner):
    @torch.inference_mode()
    @runtime_guard_step
    def execute_model(
        self, scheduler_output, intermediate_tensors=None, dummy_run=False,
        skip_attn_for_dummy_run=False, is_profile=False, context_len=0,
        valid_dummy_state_slots=False, randomize_inputs=False,
    ):  # fmt: skip
        self.seen.append(("execute", torch.is_inference_mode_enabled(), dummy_run))
        return None

    @runtime_guard_sample_tokens
    def sample_tokens(self, grammar_output):
        self.seen.append(("sample", torch.is_inference_mode_enabled(), None))
        ids = [[7] for _ in self.req_ids]
        return outputs.ModelRunnerOutput(
            req_ids=self.req_ids, req_id_to_index={r: i for i, r in enumerate(self.req_ids)},
            sampled_token_ids=ids,
        )  # fmt: skip


def make_runner(req_ids):
    runner = object.__new__(NPULikeRunner)  # the real __init__ needs a device and a config
    runner.seen = []
    runner.req_ids = req_ids
    return runner


def decode_step(req_ids):
    return sched.SchedulerOutput(
        scheduled_new_reqs=[], scheduled_cached_reqs=sched.CachedRequestData.make_empty(),
        num_scheduled_tokens={r: 1 for r in req_ids}, total_num_scheduled_tokens=len(req_ids),
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )  # fmt: skip


class Collect:
    def __init__(self, *args, **kwargs):
        self.records = []

    def start(self, rank=None, spool=None):
        pass

    def offer_probe(self, name, value, labels):
        pass

    def offer_incident(self, incident):
        pass

    def offer(self, record):
        self.records.append(record)

    def stop(self):
        pass


@pytest.fixture
def processor():
    proc = GuardProcessor(
        GuardConfig(sidecar="unix:///tmp/none.sock"),
        lambda runner: guard_pb2.RankInfo(run_id="r"),
        Collect,
    )
    install(proc)
    yield proc
    install(None)


def test_source_decorators_keep_signature_below_inference_mode():
    sig = inspect.signature(NPULikeRunner.execute_model)
    assert list(sig.parameters)[:3] == ["self", "scheduler_output", "intermediate_tensors"]
    sig.bind(object(), decode_step(["a"]), None, dummy_run=True, is_profile=True)
    # the inference_mode wrapper copies the guard's marker, so the plugin does not wrap it again
    assert is_guarded(NPULikeRunner.execute_model) and is_guarded(NPULikeRunner.sample_tokens)
    before = NPULikeRunner.__dict__["execute_model"]
    assert bind_runner_class(NPULikeRunner) == ["execute_model", "sample_tokens"]
    assert NPULikeRunner.__dict__["execute_model"] is before


def test_guard_off_runs_the_bare_bodies_under_inference_mode():
    install(None)
    runner = make_runner(["a", "b"])
    assert runner.execute_model(decode_step(["a", "b"])) is None
    out = runner.sample_tokens(None)
    assert out.sampled_token_ids == [[7], [7]]
    assert runner.seen == [("execute", True, False), ("sample", False, None)]


def test_guard_on_records_the_wave_and_returns_the_same_output(processor):
    runner = make_runner(["a", "b", "c"])
    assert runner.execute_model(decode_step(["a", "b", "c"])) is None
    out = runner.sample_tokens(None)
    assert out.sampled_token_ids == [[7], [7], [7]]
    assert runner.seen[0] == ("execute", True, False)  # inference mode still applies inside
    (record,) = processor.streamer.records
    assert (record.wave, record.num_reqs, record.decode_tokens, record.sampled_tokens) == (
        1,
        3,
        3,
        3,
    )
    assert record.sampled and not record.dummy


def test_dummy_run_is_a_dummy_wave(processor):
    runner = make_runner([])
    runner.execute_model(decode_step([]), dummy_run=True)
    runner.execute_model(decode_step(["a"]))  # flushes the dummy wave that was never sampled
    record = processor.streamer.records[0]
    assert record.dummy and not record.sampled and record.wave == 1
