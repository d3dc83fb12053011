"""The rotary-table and speculator probes on real tensors and vLLM-shaped inputs."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from ascend_runtime.probes import report, rotary, speculators


def test_rotary_capacity_against_max_requests_times_decode_query_len():
    cos = torch.ones(256, 1, 1, 64)
    assert rotary.check_rotary_capacity(cos, cos.clone(), 64, 4) is None  # 256 rows needed
    short = rotary.check_rotary_capacity(cos, torch.zeros(200, 1, 1, 64), 64, 4)
    assert short == {
        "rows": {"cos": 256, "sin": 200}, "needed": 256, "max_num_reqs": 64, "decode_query_len": 4,
    }  # fmt: skip


@pytest.fixture
def rotary_module(monkeypatch):
    """A stand-in for `vllm_ascend.ops.rotary_embedding` (vllm-ascend needs torch_npu to
    import): the two module globals vllm-ascend's `set_cos_and_sin` fills, as real tensors sized
    by max_num_batched_tokens."""
    module = types.ModuleType(rotary.ROTARY_MODULE)
    monkeypatch.setitem(sys.modules, rotary.ROTARY_MODULE, module)
    return module


def test_rotary_probe_reads_the_runner_and_reports(rotary_module):
    """Stand-in vllm_ascend rotary module (see fixture)."""
    runner = types.SimpleNamespace(max_num_reqs=32, decode_query_len=3)  # MRV2 names
    rotary_module._cos_mla = torch.ones(64, 1, 1, 64)
    rotary_module._sin_mla = torch.zeros(64, 1, 1, 64)
    with report.capture() as seen:
        shortfall = rotary.probe_runner(runner)
    assert shortfall["needed"] == 96
    assert seen.incident_types() == ["rotary_capacity"]
    assert (
        "hold 64 rows; a full decode step needs 96 (32 requests x 3 tokens)"
        in (seen.incidents[0]["summary"])
    )
    assert seen.probe_values("rotary_table_rows") == [(64.0, {})]
    v1_runner = types.SimpleNamespace(max_num_reqs=16, uniform_decode_query_len=4)  # V1 names
    with report.capture() as seen:
        assert rotary.probe_runner(v1_runner) is None
    assert seen.incidents == []


def test_non_mla_model_has_no_tables_and_no_report(rotary_module):
    """Stand-in vllm_ascend rotary module (see fixture)."""
    rotary_module._cos_mla = rotary_module._sin_mla = None
    with report.capture() as seen:
        assert rotary.probe_runner(types.SimpleNamespace(max_num_reqs=8)) is None
    assert seen.probes == [] and seen.incidents == []


def test_speculator_counts_from_v1_host_lists(monkeypatch):
    monkeypatch.setattr(speculators, "REPORT_INTERVAL_S", 0.0)
    stats = speculators.SpeculatorStats()
    with report.capture() as seen:
        # step 1: drafts for 2 requests, nothing verified yet (one sampled token each)
        stats.on_propose("ngram", "NgramProposer", [[5, 6, 7], [8, 9, 10]],
                         sampled_token_ids=[[1], [2]])  # fmt: skip
        # step 2: request 0 accepted 2 of 3 drafts (3 tokens sampled), request 1 none
        stats.on_propose("ngram", "NgramProposer", [[1, 2, 3], [4, 5, 6]],
                         sampled_token_ids=[[11, 12, 13], [14]])  # fmt: skip
    assert stats.proposed == {"ngram": 12} and stats.accepted == {"ngram": 2}
    assert seen.probe_values("speculator_info") == [
        (1.0, {"method": "ngram", "speculator": "NgramProposer"})
    ]
    assert seen.probe_values("spec_drafts_proposed")[-1] == (12.0, {"method": "ngram"})
    assert seen.probe_values("spec_drafts_accepted")[-1] == (2.0, {"method": "ngram"})


def test_speculator_counts_from_mrv2_tensors():
    stats = speculators.SpeculatorStats()
    drafts = torch.zeros(4, 2, dtype=torch.int64)  # [num_reqs, num_speculative_steps]
    num_sampled = torch.tensor([3, 1, 2, 0])  # 0: a request that sampled nothing this step
    stats.on_propose("eagle", "EagleSpeculator", drafts, num_sampled=num_sampled)
    assert stats.proposed == {"eagle": 8} and stats.accepted == {"eagle": 3}
    assert stats.dispatched == {"eagle": "EagleSpeculator"}


def test_v1_proposal_hook_reads_both_runner_signatures(monkeypatch):
    """Upstream V1 passes (scheduler_output, sampled_token_ids, ...); vllm-ascend's V1 runner
    passes (valid_sampled_token_ids, sampling_metadata, ...). Both count the same."""
    from ascend_runtime.attach import actions

    for build_args in (
        lambda sampled: ((object(), sampled), {}),  # upstream V1
        lambda sampled: ((sampled, object()), {}),  # vllm-ascend V1
        lambda sampled: ((), {"valid_sampled_token_ids": sampled}),
    ):
        stats = speculators.SpeculatorStats()
        monkeypatch.setattr(speculators, "STATS", stats)
        runner = types.SimpleNamespace(
            drafter=types.SimpleNamespace(), speculative_config=types.SimpleNamespace(method="mtp")
        )
        args, kwargs = build_args([[7, 8, 9], [4]])
        with report.capture():
            actions._speculator(runner, args, kwargs, [[1, 2], [3, 4]])
        assert stats.proposed == {"mtp": 4} and stats.accepted == {"mtp": 2}
        assert stats.dispatched == {"mtp": "SimpleNamespace"}


def test_accepted_from_host_lists():
    assert speculators.accepted_from_host([[1, 2, 3], [4], [], [5, 6]]) == 3
    assert speculators.accepted_from_host([]) == 0
    assert speculators.accepted_from_host(None) == 0
    assert speculators.count_drafts([[1, 2], [], [3]]) == 3
    assert speculators.count_drafts(None) == 0
