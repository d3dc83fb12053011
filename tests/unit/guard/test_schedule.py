"""PrefillTracker / count_sampled_tokens on vLLM's real step objects."""

from __future__ import annotations

import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guard.wave.schedule import (
    EMPTY_SCHEDULE,
    PrefillTracker,
    ScheduleSummary,
    _kept,
    count_sampled_tokens,
    read_sampled,
)

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
    preempted: set[str] | None = None,
) -> SchedulerOutput:
    tokens = tokens or {}
    return SchedulerOutput(
        scheduled_new_reqs=list(new), scheduled_cached_reqs=cached_reqs or CachedRequestData.make_empty(),
        num_scheduled_tokens=tokens, total_num_scheduled_tokens=sum(tokens.values()),
        scheduled_spec_decode_tokens=spec or {}, scheduled_encoder_inputs={},
        finished_req_ids=finished or set(), free_encoder_mm_hashes=[], preempted_req_ids=preempted,
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


def resumed(req_id: str, all_tokens: int, computed: int, outputs: int) -> CachedRequestData:
    return CachedRequestData(
        req_ids=[req_id], resumed_req_ids={req_id}, new_token_ids=[[]],
        all_token_ids={req_id: list(range(all_tokens))}, new_block_ids=[None],
        num_computed_tokens=[computed], num_output_tokens=[outputs],
    )  # fmt: skip


def test_resumed_request_recomputes_prompt_and_output_as_recompute_not_prefill():
    """A request preempted while decoding computes prompt + output again: recompute, not prompt."""
    prompts = PrefillTracker()
    first = prompts.summarize(step(new=[new_req("a", 6)], tokens={"a": 6}))
    assert (first.prefill_tokens, first.recompute_tokens) == (6, 0)
    prompts.summarize(step(preempted={"a"}))  # preempted after 4 outputs
    again = prompts.summarize(step(cached_reqs=resumed("a", 10, 0, 4), tokens={"a": 8}))
    assert again == ScheduleSummary(1, 1, 0, 0, 0, 8)
    rest = prompts.summarize(step(cached_reqs=cached(("a", 8, 4)), tokens={"a": 2}))
    assert (rest.prefill_reqs, rest.prefill_tokens, rest.recompute_tokens) == (1, 0, 2)
    decode = prompts.summarize(step(cached_reqs=cached(("a", 10, 5)), tokens={"a": 1}))
    assert decode == ScheduleSummary(1, 0, 1, 0, 1, 0)
    assert len(prompts) == 0


def test_request_preempted_in_its_prefill_still_owes_its_unseen_prompt_as_prefill():
    """Prompt of 100: 40 computed, preempted, resumed with 16 cache hits. vLLM counts the prompt
    once (100 computed locally); the guard too: 40 + 60 prefill, 24 recompute (40 - 16)."""
    prompts = PrefillTracker()
    prompts.summarize(step(new=[new_req("a", 100)], tokens={"a": 40}))
    prompts.summarize(step(preempted={"a"}))
    back = prompts.summarize(step(cached_reqs=resumed("a", 100, 16, 0), tokens={"a": 30}))
    assert (back.prefill_tokens, back.recompute_tokens, back.decode_tokens) == (6, 24, 0)
    done = prompts.summarize(step(cached_reqs=cached(("a", 46, 0)), tokens={"a": 54}))
    assert (done.prefill_tokens, done.recompute_tokens) == (54, 0)
    assert len(prompts) == 0


def test_drafts_padded_onto_a_last_prefill_token_are_decode():
    """vLLM pads a waiting request with one token left to compute (all the rest cached) to
    1 + num_speculative_tokens; the padding is drafts (seen at TP=2: 3 tokens too many)."""
    prompts = PrefillTracker()
    prompts.summarize(step(new=[new_req("a", 27)], tokens={"a": 27}))
    prompts.summarize(step(preempted={"a"}))
    back = prompts.summarize(
        step(cached_reqs=resumed("a", 36, 35, 9), tokens={"a": 4}, spec={"a": [-1, -1, -1]})
    )
    assert back == ScheduleSummary(1, 1, 0, 0, 3, 1)
    fresh = prompts.summarize(step(new=[new_req("b", 40, computed=39)], tokens={"b": 4}))
    assert (fresh.prefill_tokens, fresh.decode_tokens, fresh.recompute_tokens) == (1, 3, 0)


def test_resumed_without_a_preemption_seen_keeps_an_unfinished_prefill():
    """Older step objects without preempted_req_ids: the tracker still holds the prefill."""
    prompts = PrefillTracker()
    prompts.summarize(step(new=[new_req("a", 20)], tokens={"a": 8}))
    back = prompts.summarize(step(cached_reqs=resumed("a", 20, 0, 0), tokens={"a": 20}))
    assert (back.prefill_tokens, back.recompute_tokens) == (12, 8)


def test_mrv2_resumed_request_arrives_as_new_with_all_its_tokens():
    prompts = PrefillTracker()
    prompts.summarize(step(new=[new_req("a", 6)], tokens={"a": 6}))
    prompts.summarize(step(preempted={"a"}))
    again = new_req("a", 6)
    again.prefill_token_ids = list(range(9))  # prompt + 3 outputs
    summary = prompts.summarize(step(new=[again], tokens={"a": 9}))
    assert (summary.prefill_tokens, summary.recompute_tokens) == (0, 9)


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
    assert summary == ScheduleSummary(512, 0, 512, 0, 512, 0)
    assert CountingDict.lookups == 0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 2),  # new requests joining this wave
            st.integers(1, 6),  # their prompt length
            st.integers(1, 4),  # the chunk each prefilling request computes this wave
            st.integers(0, 1),  # drafts each decoding request carries
            st.booleans(),  # one running request finishes before this wave
        ),
        min_size=1,
        max_size=12,
    )
)
def test_summary_matches_a_per_request_count_over_any_schedule(waves):
    """A schedule of requests joining with a prompt, prefilling in chunks, decoding (some with
    drafts) and finishing, summarised wave by wave, against an independent count: a request's
    scheduled tokens are prefill up to its prompt, and decode after. Decode waves with no
    request mid-prefill take the tracker's short path, the others its full one."""
    tracker = PrefillTracker()
    prompt: dict[str, int] = {}  # reference: running request -> prompt length
    computed: dict[str, int] = {}  # reference: tokens computed so far
    count = 0
    for joining, length, chunk, drafts, finishing in waves:
        finished = set()
        if finishing and computed:
            gone = next(iter(computed))
            finished.add(gone)
            del computed[gone], prompt[gone]
        new = []
        for _ in range(joining):
            req_id = f"r{count}"
            count += 1
            new.append(new_req(req_id, length))
            prompt[req_id], computed[req_id] = length, 0
        tokens: dict[str, int] = {}
        prefill_reqs = prefill_tokens = 0
        for req_id, done in computed.items():
            owed = prompt[req_id] - done
            tokens[req_id] = min(chunk, owed) if owed > 0 else 1 + drafts
            if owed > 0:
                prefill_reqs += 1
                prefill_tokens += tokens[req_id]
        for req_id, scheduled in tokens.items():
            computed[req_id] += scheduled
        summary = tracker.summarize(step(new=new, tokens=tokens, finished=finished))
        total = sum(tokens.values())
        assert summary == ScheduleSummary(
            len(tokens), prefill_reqs, len(tokens) - prefill_reqs, prefill_tokens,
            total - prefill_tokens, 0,
        )  # fmt: skip
        assert len(tracker) == sum(1 for r in computed if computed[r] < prompt[r])


def test_drafts_accepted_past_a_stop_are_not_counted():
    """The scheduler appends accepted drafts one by one and trims at the first stop (issue 15:
    753 counted against vLLM's 733 with n-gram drafts). Real V1 request states and params."""
    SamplingParams = pytest.importorskip("vllm.sampling_params").SamplingParams
    CachedRequestState = pytest.importorskip("vllm.v1.worker.gpu_input_batch").CachedRequestState

    def state(req_id, params, outputs):
        return CachedRequestState(
            req_id=req_id, prompt_token_ids=[5] * 10, mm_features=[], sampling_params=params,
            generator=None, block_ids=([0],), num_computed_tokens=0, output_token_ids=outputs,
        )  # fmt: skip

    with_eos = SamplingParams(max_tokens=100, stop_token_ids=[42])
    with_eos.update_from_generation_config({}, eos_token_id=1)
    ignore_eos = SamplingParams(max_tokens=100, ignore_eos=True)
    ignore_eos.update_from_generation_config({}, eos_token_id=1)
    runner = types.SimpleNamespace(
        max_model_len=30,
        requests={
            # max_tokens 6: 4 before, 4 returned -> 2 kept
            "len": state("len", SamplingParams(max_tokens=6), [7] * 8),
            "eos": state("eos", with_eos, [7, 7, 1, 7]),  # EOS second of 3 -> 2 kept
            "stop": state("stop", with_eos, [42, 7]),  # a stop token first -> 1 kept
            "ignored": state("ignored", ignore_eos, [1, 1, 1]),  # EOS ignored -> all 3
            "model_len": state(
                "model_len", SamplingParams(max_tokens=100), [7] * 22
            ),  # 19 before + 1 reaches 30
            "plain": state("plain", with_eos, [7, 8]),
        },
    )
    output = ModelRunnerOutput(
        req_ids=["len", "eos", "stop", "ignored", "model_len", "plain", "prefilling"],
        req_id_to_index={},
        sampled_token_ids=[[7] * 4, [7, 1, 7], [42, 7], [1, 1, 1], [7, 7, 7], [7, 8], []],
    )
    assert count_sampled_tokens(output) == 4 + 3 + 2 + 3 + 3 + 2
    # len: 2, eos: 2, stop: 1, ignored: 3, model_len: 1, plain: 2
    assert count_sampled_tokens(output, runner) == 2 + 2 + 1 + 3 + 1 + 2


def test_one_token_per_request_never_looks_at_request_states():
    class Refusing:
        max_model_len = 8

        @property
        def requests(self):
            raise AssertionError("single-token waves must not read request states")

    output = ModelRunnerOutput(req_ids=["a", "b"], req_id_to_index={}, sampled_token_ids=[[1], [2]])
    assert count_sampled_tokens(output, Refusing()) == 2


def _vllm_kept(tokens: list[int], before: list[int], params, prompt: int, max_len: int) -> int:
    """How many of `tokens` vLLM's own `check_stop` lets the scheduler append, one by one."""
    from vllm.v1.core.sched.utils import check_stop

    request = types.SimpleNamespace(
        sampling_params=params, output_token_ids=list(before), max_tokens=params.max_tokens,
        status=None, stop_reason=None, pooling_params=None,
    )  # fmt: skip
    for count, token in enumerate(tokens, 1):
        request.output_token_ids.append(token)
        request.num_output_tokens = len(request.output_token_ids)
        request.num_tokens = prompt + request.num_output_tokens
        if check_stop(request, max_len):
            return count
    return len(tokens)


@settings(max_examples=300, deadline=None)
@given(
    before=st.lists(st.integers(0, 5), max_size=12),
    tokens=st.lists(st.integers(0, 5), min_size=2, max_size=6),
    eos=st.one_of(st.none(), st.integers(0, 5)),
    stop=st.lists(st.integers(0, 5), max_size=2),
    extra=st.integers(1, 10),
    prompt=st.integers(1, 8),
    model_room=st.one_of(st.just(0), st.integers(1, 20)),
)
def test_drafts_past_a_stop_are_trimmed_as_vllms_check_stop_trims_them(
    before, tokens, eos, stop, extra, prompt, model_room
) -> None:
    """`_kept` (and its fast path, taken when nothing in the drafts can stop the request)
    against vLLM's own stop check, appending the tokens one by one as the scheduler does."""
    max_tokens = len(before) + extra  # the request had not stopped before these tokens
    max_len = prompt + len(before) + model_room if model_room else 0
    params = types.SimpleNamespace(
        eos_token_id=eos, stop_token_ids=stop, max_tokens=max_tokens, min_tokens=0,
        repetition_detection=None,
    )  # fmt: skip
    state = types.SimpleNamespace(
        sampling_params=params, output_token_ids=before + tokens, num_prompt_tokens=prompt
    )
    want = _vllm_kept(tokens, before, params, prompt, max_len or 10**9)
    assert _kept(tokens, state, max_len) == want
    output = types.SimpleNamespace(req_ids=["a", "b"], sampled_token_ids=[[1], tokens])
    runner = types.SimpleNamespace(requests={"b": state}, max_model_len=max_len)
    total, counts, read = read_sampled(output, runner)
    assert total == 1 + want and list(counts) == [1, want]
    assert read.ids == [1, *tokens] and read.lengths == [1, len(tokens)]  # as returned, untrimmed


def test_read_sampled_says_one_each_only_when_every_request_got_exactly_one_token():
    """`ONE_EACH` stands for the per-request counts only when no list is empty or longer;
    a wave with an empty list (a prefill chunk) or drafts gets its counts as an array. The
    tokens read are the detectors' too: every id, row by row, copied out of the lists."""
    from guard.wave.schedule import ONE_EACH

    def counts(lists):
        total, kept, read = read_sampled(types.SimpleNamespace(req_ids=[], sampled_token_ids=lists))
        if read is not None:
            assert read.ids == [t for row in lists for t in row] and read.rows == len(lists)
            assert read.uniform == (kept is ONE_EACH)
        return total, kept

    assert counts([[5], [6], [7]]) == (3, ONE_EACH)
    assert counts([]) == (0, ONE_EACH)
    total, kept = counts([[5], [], [6, 7]])  # the sum equals the count, but not one each
    assert total == 3 and list(kept) == [1, 0, 2]
    total, kept = counts([[], [5]])
    assert total == 1 and list(kept) == [0, 1]
    assert counts(None) == (None, None)
    lists = [[5], [6]]
    _, _, read = read_sampled(types.SimpleNamespace(sampled_token_ids=lists))
    lists[1].clear()  # the scheduler cuts a list after the read: the read keeps what came
    assert read.ids == [5, 6]
    assert read_sampled(types.SimpleNamespace(sampled_token_ids=None)) == (None, None, None)
