"""PrefillTracker / count_sampled_tokens on vLLM's real step objects."""

from __future__ import annotations

import pytest

from guard.schedule import EMPTY_SCHEDULE, PrefillTracker, ScheduleSummary, count_sampled_tokens

sched_output = pytest.importorskip("vllm.v1.core.sched.output")
outputs = pytest.importorskip("vllm.v1.outputs")
SchedulerOutput = sched_output.SchedulerOutput
NewRequestData = sched_output.NewRequestData
CachedRequestData = sched_output.CachedRequestData
ModelRunnerOutput = outputs.ModelRunnerOutput


def new_req(req_id: str, prompt_len: int, computed: int = 0) -> NewRequestData:
    return NewRequestData(
        req_id=req_id, prompt_token_ids=list(range(prompt_len)), mm_features=[], sampling_params=None,
        pooling_params=None, block_ids=([0],), num_computed_tokens=computed, lora_request=None,
    )  # fmt: skip


def cached(*reqs: tuple[str, int, int]) -> CachedRequestData:
    """(req_id, num_computed_tokens, num_output_tokens) per cached request."""
    return CachedRequestData(
        req_ids=[r[0] for r in reqs], resumed_req_ids=set(), new_token_ids=[[] for _ in reqs],
        all_token_ids={}, new_block_ids=[None for _ in reqs], num_computed_tokens=[r[1] for r in reqs],
        num_output_tokens=[r[2] for r in reqs],
    )  # fmt: skip


def step(
    new=(),
    cached_reqs: CachedRequestData | None = None,
    tokens: dict[str, int] | None = None,
    spec: dict[str, list[int]] | None = None,
    finished: set[str] | None = None,
) -> SchedulerOutput:
    tokens = tokens or {}
    return SchedulerOutput(
        scheduled_new_reqs=list(new), scheduled_cached_reqs=cached_reqs or CachedRequestData.make_empty(),
        num_scheduled_tokens=tokens, total_num_scheduled_tokens=sum(tokens.values()),
        scheduled_spec_decode_tokens=spec or {}, scheduled_encoder_inputs={},
        finished_req_ids=finished or set(), free_encoder_mm_hashes=[],
    )  # fmt: skip


def test_new_requests_are_prefill():
    prompts = PrefillTracker()
    summary = prompts.summarize(
        step(new=[new_req("a", 10), new_req("b", 100)], tokens={"a": 10, "b": 64})
    )
    assert summary == ScheduleSummary(
        num_reqs=2, prefill_reqs=2, decode_reqs=0, prefill_tokens=74, decode_tokens=0
    )
    assert len(prompts) == 1  # a computed its whole prompt; b has 36 prompt tokens to go


def test_chunked_prefill_then_decode_with_spec_tokens_then_finish():
    prompts = PrefillTracker()
    prompts.summarize(step(new=[new_req("a", 10), new_req("b", 100)], tokens={"a": 10, "b": 64}))

    # a decodes (1 token + 2 drafts), b continues its prefill (chunked), c is new
    wave2 = step(
        new=[new_req("c", 5)],
        cached_reqs=cached(("a", 10, 1), ("b", 64, 0)),
        tokens={"a": 3, "b": 36, "c": 5},
        spec={"a": [7, 8]},
    )
    assert prompts.summarize(wave2) == ScheduleSummary(
        num_reqs=3, prefill_reqs=2, decode_reqs=1, prefill_tokens=41, decode_tokens=3
    )

    # a finished; b and c decode (c with one draft)
    wave3 = step(
        cached_reqs=cached(("b", 100, 1), ("c", 5, 1)),
        tokens={"b": 1, "c": 2},
        spec={"c": [9]},
        finished={"a"},
    )
    assert prompts.summarize(wave3) == ScheduleSummary(
        num_reqs=2, prefill_reqs=0, decode_reqs=2, prefill_tokens=0, decode_tokens=3
    )
    assert len(prompts) == 0  # nobody is in prefill any more: only prefilling requests are kept


def test_cached_request_exactly_at_prompt_length_decodes():
    prompts = PrefillTracker()
    prompts.summarize(step(new=[new_req("a", 8)], tokens={"a": 4}))
    partial = prompts.summarize(step(cached_reqs=cached(("a", 4, 0)), tokens={"a": 4}))
    assert (partial.prefill_reqs, partial.prefill_tokens, partial.decode_tokens) == (1, 4, 0)
    done = prompts.summarize(step(cached_reqs=cached(("a", 8, 1)), tokens={"a": 1}))
    assert (done.prefill_reqs, done.decode_reqs, done.decode_tokens) == (0, 1, 1)


def test_new_request_with_prefix_cache_hit_is_still_prefill():
    prompts = PrefillTracker()
    summary = prompts.summarize(step(new=[new_req("a", 32, computed=16)], tokens={"a": 16}))
    assert (summary.prefill_reqs, summary.prefill_tokens, summary.decode_tokens) == (1, 16, 0)


def test_finished_id_forgotten_so_a_reused_id_starts_over():
    prompts = PrefillTracker()
    prompts.summarize(step(new=[new_req("x", 50)], tokens={"x": 50}))
    prompts.summarize(step(finished={"x"}))
    assert len(prompts) == 0
    # a cached request the tracker does not know (prompt length unknown) counts as decode
    summary = prompts.summarize(step(cached_reqs=cached(("x", 10, 0)), tokens={"x": 1}))
    assert (summary.prefill_reqs, summary.decode_reqs) == (0, 1)


def test_empty_and_none_schedules():
    prompts = PrefillTracker()
    assert prompts.summarize(None) == EMPTY_SCHEDULE
    assert prompts.summarize(step()) == EMPTY_SCHEDULE
    assert prompts.summarize(SchedulerOutput.make_empty()) == EMPTY_SCHEDULE


def test_count_sampled_tokens_on_real_model_runner_output():
    output = ModelRunnerOutput(
        req_ids=["a", "b", "c"],
        req_id_to_index={"a": 0, "b": 1, "c": 2},
        sampled_token_ids=[[1], [2, 3], []],
    )
    assert count_sampled_tokens(output) == 3
    assert count_sampled_tokens(ModelRunnerOutput(req_ids=[], req_id_to_index={})) == 0
    assert count_sampled_tokens(outputs.EMPTY_MODEL_RUNNER_OUTPUT) == 0


def test_count_sampled_tokens_without_host_lists_is_none():
    class Pending(outputs.AsyncModelRunnerOutput):
        def get_output(self):
            raise AssertionError("must not be resolved by counting")

    assert count_sampled_tokens(Pending()) is None
    assert count_sampled_tokens(None) is None
    assert count_sampled_tokens(object()) is None


def test_request_finished_during_prefill_is_forgotten():
    prompts = PrefillTracker()
    prompts.summarize(step(new=[new_req("a", 100)], tokens={"a": 32}))
    assert len(prompts) == 1
    prompts.summarize(step(finished={"a"}))
    assert len(prompts) == 0


def test_resumed_request_recomputes_prompt_and_output_as_prefill():
    prompts = PrefillTracker()
    prompts.summarize(step(new=[new_req("a", 6)], tokens={"a": 6}))
    resumed = CachedRequestData(
        req_ids=["a"], resumed_req_ids={"a"}, new_token_ids=[[]], all_token_ids={"a": list(range(10))},
        new_block_ids=[None], num_computed_tokens=[0], num_output_tokens=[4],
    )  # fmt: skip
    first = prompts.summarize(step(cached_reqs=resumed, tokens={"a": 8}))
    assert (first.prefill_reqs, first.prefill_tokens, first.decode_tokens) == (1, 8, 0)
    rest = prompts.summarize(step(cached_reqs=cached(("a", 8, 4)), tokens={"a": 2}))
    assert (rest.prefill_reqs, rest.prefill_tokens) == (1, 2)
    decode = prompts.summarize(step(cached_reqs=cached(("a", 10, 5)), tokens={"a": 1}))
    assert (decode.prefill_reqs, decode.decode_reqs, decode.decode_tokens) == (0, 1, 1)


def test_cost_does_not_depend_on_running_decode_requests():
    """Only prefilling requests are visited: 512 decoding requests are not looked at one by one."""
    prompts = PrefillTracker()

    class CountingDict(dict):
        lookups = 0

        def get(self, key, default=None):
            CountingDict.lookups += 1
            return super().get(key, default)

    tokens = CountingDict({f"r{i}": 1 for i in range(512)})
    summary = prompts.summarize(
        step(cached_reqs=cached(*[(f"r{i}", 10, 1) for i in range(512)]), tokens=tokens)
    )
    assert summary == ScheduleSummary(512, 0, 512, 0, 512)
    assert CountingDict.lookups == 0
