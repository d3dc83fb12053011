"""A request preempted while speculating: the worker's counts, per request and per wave, are
what vLLM's scheduler keeps, with no vLLM running.

The step objects are vLLM's own classes (SchedulerOutput, CachedRequestData,
ModelRunnerOutput, CachedRequestState), filled in the order a V1 engine without async
scheduling (vLLM's choice with n-gram drafts) makes them; the processor, request membership,
streamer batches, validation, store and request traces are the real ones. The truth is vLLM's
rules, written out per wave below: the scheduler appends a request's returned tokens one by
one and stops at max_tokens; drafts the proposer made for a step that preempts the request
are dropped with it (`Scheduler._preempt_request` clears `spec_token_ids`) and never reach a
step object; the resumed request recomputes its prompt and output so far and samples one token.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from telemetry import store
from telemetry.spans import requests as request_spans
from tests.support.request_checks import membership_vs_wave_records, preempted_while_speculating
from tests.support.request_sim import guarded, store_batches

sched_output = pytest.importorskip("vllm.v1.core.sched.output")
ModelRunnerOutput = pytest.importorskip("vllm.v1.outputs").ModelRunnerOutput
CachedRequestState = pytest.importorskip("vllm.v1.worker.gpu_input_batch").CachedRequestState
SamplingParams = pytest.importorskip("vllm.sampling_params").SamplingParams
SchedulerOutput = sched_output.SchedulerOutput
CachedRequestData = sched_output.CachedRequestData
NewRequestData = sched_output.NewRequestData

PROMPT = 8
MAX_TOKENS = {"a": 6, "b": 8}


def _new(req_id: str) -> NewRequestData:
    return NewRequestData(
        req_id=req_id, prompt_token_ids=list(range(PROMPT)), mm_features=[],
        sampling_params=None, pooling_params=None, block_ids=([0],), num_computed_tokens=0,
        lora_request=None,
    )  # fmt: skip


def _cached(reqs, resumed=(), all_tokens=None) -> CachedRequestData:
    """(req_id, num_computed_tokens, num_output_tokens) per request."""
    return CachedRequestData(
        req_ids=[r[0] for r in reqs], resumed_req_ids=set(resumed),
        new_token_ids=[[] for _ in reqs], all_token_ids=all_tokens or {},
        new_block_ids=[([1],) if r[0] in resumed else None for r in reqs],
        num_computed_tokens=[r[1] for r in reqs], num_output_tokens=[r[2] for r in reqs],
    )  # fmt: skip


def _step(tokens, new=(), cached=None, spec=None, finished=(), preempted=()):
    return SchedulerOutput(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached or CachedRequestData.make_empty(),
        num_scheduled_tokens=tokens, total_num_scheduled_tokens=sum(tokens.values()),
        scheduled_spec_decode_tokens=spec or {}, scheduled_encoder_inputs={},
        finished_req_ids=set(finished), free_encoder_mm_hashes=[],
        preempted_req_ids=set(preempted),
    )  # fmt: skip


# (scheduler output, tokens returned per request) per wave, and what the scheduler keeps
WAVES = [
    # 1: both prefill their prompt and sample one token
    (_step({"a": PROMPT, "b": PROMPT}, new=[_new("a"), _new("b")]), {"a": [11], "b": [21]}),
    # 2: both speculate (3 drafts each): a accepts 2, b accepts 1 (plus the bonus token);
    #    the proposer then drafts again for both
    (
        _step(
            {"a": 4, "b": 4},
            cached=_cached([("a", 8, 1), ("b", 8, 1)]),
            spec={"a": [1, 1, 1], "b": [2, 2, 2]},
        ),
        {"a": [12, 12, 12], "b": [22, 22]},
    ),  # fmt: skip
    # 3: b is preempted with its new drafts in flight (dropped: never scheduled); a verifies
    #    its 3 drafts, all accepted: 4 tokens back, but max_tokens 6 leaves room for 2
    (
        _step({"a": 4}, cached=_cached([("a", 11, 4)]), spec={"a": [1, 1, 1]}, preempted={"b"}),
        {"a": [13, 13, 13, 13]},
    ),  # fmt: skip
    # 4: a finished; b comes back and recomputes prompt + 3 outputs (11 tokens), samples one
    (
        _step(
            {"b": PROMPT + 3},
            finished={"a"},
            cached=_cached(
                [("b", 0, 3)], resumed={"b"}, all_tokens={"b": list(range(PROMPT)) + [21, 22, 22]}
            ),
        ),
        {"b": [23]},
    ),  # fmt: skip
    # 5: b speculates again, all 3 accepted: 4 tokens, exactly its max_tokens of 8
    (
        _step({"b": 4}, cached=_cached([("b", 11, 4)]), spec={"b": [2, 2, 2]}),
        {"b": [24, 24, 24, 24]},
    ),  # fmt: skip
]
KEPT_PER_WAVE = [2, 3 + 2, 2, 1, 4]  # a's 4th wave-3 token onwards is past max_tokens
KEPT = {"a": 1 + 3 + 2, "b": 1 + 2 + 1 + 4}
# vLLM's spec counters: drafts scheduled, and returned - 1 per request that had drafts
# (counted before the scheduler trims at max_tokens, as vLLM's scheduler counts them)
DRAFTED, ACCEPTED = 3 + 3 + 3 + 3, (2 + 1) + 3 + 3
# per wave: prefill, recompute, decode tokens
KINDS = [(16, 0, 0), (0, 0, 8), (0, 0, 4), (0, 11, 0), (0, 0, 4)]


def _runner() -> SimpleNamespace:
    """The V1 runner's request states: it appends every returned token before
    sample_tokens returns, and keeps a preempted request's state until it resumes."""
    states = {
        req_id: CachedRequestState(
            req_id=req_id,
            prompt_token_ids=list(range(PROMPT)),
            mm_features=[],
            sampling_params=SamplingParams(max_tokens=limit, ignore_eos=True),
            generator=None,
            block_ids=([0],),
            num_computed_tokens=0,
            output_token_ids=[],
        )  # fmt: skip
        for req_id, limit in MAX_TOKENS.items()
    }
    return SimpleNamespace(
        requests=states, max_model_len=256, speculative_config=SimpleNamespace(method="ngram")
    )


def _drive():
    processor = guarded()
    runner = _runner()
    for so, returned in WAVES:
        order = list(returned)
        output = ModelRunnerOutput(
            req_ids=order,
            req_id_to_index={r: i for i, r in enumerate(order)},
            sampled_token_ids=[list(returned[r]) for r in order],
        )

        def sample(r, out=output, returned=returned):
            for req_id, tokens in returned.items():
                r.requests[req_id].output_token_ids.extend(tokens)
            return out

        processor.run_step(lambda r, s: None, runner, (so,), {})
        processor.run_sample(sample, runner, (), {})
    assert processor.errors.total == 0
    spec = processor.detectors.spec
    spec.flush()
    return processor.streamer.batches(processor.membership), spec


def test_a_request_preempted_with_drafts_in_flight_keeps_exactly_what_the_scheduler_keeps(
    tmp_path,
) -> None:
    batches, spec = _drive()
    cols = [b.wave_columns for b in batches if len(b.wave_columns.wave)]
    sampled = [t for c in cols for t in c.sampled_tokens]
    kinds = [
        k
        for c in cols
        for k in zip(c.prefill_tokens, c.recompute_tokens, c.decode_tokens, strict=True)
    ]
    assert sampled == KEPT_PER_WAVE
    assert kinds == KINDS
    assert (spec.drafted_total, spec.accepted_total) == (DRAFTED, ACCEPTED)

    db, path = store_batches(tmp_path, batches)
    try:
        compared, mismatches = membership_vs_wave_records(path, "sim")
        assert compared == len(WAVES) and not mismatches, mismatches
        conn = store.connect(path, readonly=True)
        try:
            for req_id, kept in KEPT.items():
                (trace,) = request_spans.request_traces(conn, req_id)
                assert trace.sampled_tokens() == kept, req_id
            (b,) = request_spans.request_traces(conn, "b")
            back = [w for w in b.waves if w.preempted]
            assert [(w.wave, w.kind, w.recompute) for w in back] == [(4, "prefill", True)]
        finally:
            conn.close()
        # the e2e check's reading of the trace: b's last wave before it verified drafts
        assert preempted_while_speculating(path, "sim", {"id": "b"}) == 1
        assert preempted_while_speculating(path, "sim", {"id": "a"}) == 0
    finally:
        db.close()
