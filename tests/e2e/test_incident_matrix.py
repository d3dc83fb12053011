"""The incident matrix end to end (tests/support/incident_matrix.py): a real TP=2 `vllm serve`
and a real sidecar, faults held HOLD_S each and judged from `/live` polled every second.

The full 150 s holds run in bench/incidents.py. Here the holds are 15 s, and the timeout that
ended a stopped rank's stream after 60 s (gRPC's ping-ack timeout) is shortened to 5 s, with a
ping every second, so that the same path (a stopped rank whose stream gRPC drops) runs within
each hold. One server serves the module; the tests run in file order, the kill last.

Each verdict's evidence bundle is read while the fault stands and checked against what the
fault is: a stopped rank shows state T, its ring and no stack (it cannot answer); its peer
answers with its engine thread's stack; a rank waiting in a collective shows that call not
returned.
"""

from __future__ import annotations

import json

import pytest

from tests.support.incident_matrix import HANG_WAIT_S, RECOVERY_WITHIN_S, Matrix, Outcome

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

HOLD_S = 15.0
STREAM_ARGS = ("--stream-keepalive", "1s", "--stream-ping-timeout", "5s")


@pytest.fixture(scope="module")
def matrix(tiny_model, tmp_path_factory):
    m = Matrix(tmp_path_factory.mktemp("matrix"), tiny_model, HOLD_S, STREAM_ARGS)
    yield m
    m.stop()


def judged(out: Outcome, within_s: float = 2.0, down_s: int = 0) -> None:
    """The verdict named the right rank(s) in time, stood at every poll the sidecar answered
    until the fault ended (it was down for at most `down_s` polls), never named another rank,
    and never recovered meanwhile."""
    text = json.dumps(out.row())
    assert out.detect_s is not None and out.detect_s <= within_s, text
    assert out.polls + out.unanswered >= HOLD_S - within_s - 2, text
    assert out.unanswered <= down_s and out.stood == out.polls, text
    assert out.wrong_ranks == 0 and out.recovered_during == 0, text
    assert out.false_verdicts == 0, text


def stopped_and_peer(out: Outcome, stopped: int) -> None:
    """The bundle of a verdict on a SIGSTOPped rank: the stopped one could not answer and its
    process says T. Its peer answered with its engine thread's stack; where the verdict has it
    waiting in a collective, that call has not returned in its ring. (A peer may also be past
    its last collective, waiting for the engine's next step: then it is a plain peer.)"""
    text = json.dumps(out.row())
    peer = out.bundle.get(1 - stopped, {})
    assert set(out.bundle) == {0, 1}, text
    assert out.bundle[stopped]["role"] == "stopped" and out.bundle[stopped]["state"] == "T", text
    assert out.bundle[stopped]["ring"] > 0 and not out.bundle[stopped]["stack"], text
    assert peer["ring"] > 0 and peer["stack"] and peer["engine_frames"] > 0, text
    assert peer["role"] == "peer" or (peer["role"] == "waiting" and peer["open"]), text


def test_a_starved_sidecar_gives_no_verdict(matrix: Matrix) -> None:
    (out,) = matrix.run(("starvation",))
    assert out.false_verdicts == 0 and out.stood == out.polls, json.dumps(out.row())


def test_every_rank_stuck_inside_one_collective(matrix: Matrix) -> None:
    (out,) = matrix.run(("stuck",))
    judged(out, within_s=HANG_WAIT_S + 2.0)
    assert out.recovery_s is not None and out.recovery_s <= RECOVERY_WITHIN_S, out.row()
    # both inside the same call, both able to answer
    assert set(out.bundle) == {0, 1}, out.row()
    for rank in out.bundle.values():
        assert rank["open"] and rank["open_op"] == "all_reduce", out.row()
        assert rank["stack"] and rank["engine_frames"] > 0, out.row()


@pytest.mark.parametrize("name", ["tp1_stop", "tp0_stop"])
def test_a_stopped_worker_is_named_until_it_runs_again(matrix: Matrix, name: str) -> None:
    (out,) = matrix.run((name,))
    judged(out)
    assert out.recovery_s is not None and out.recovery_s <= RECOVERY_WITHIN_S, out.row()
    assert "rank_disconnected" in matrix.sidecar.log(), "gRPC dropped the stopped rank's stream"
    stopped_and_peer(out, stopped=out.expect[0])


def test_a_sidecar_restarted_during_the_fault_finds_it_again(matrix: Matrix) -> None:
    (out,) = matrix.run(("sidecar_restart",))
    judged(out, down_s=6)  # the restart itself: a Python process starting on a busy 2-core host
    assert out.recovery_s is not None and out.recovery_s <= RECOVERY_WITHIN_S, out.row()
    stopped_and_peer(out, stopped=1)  # the new sidecar's bundle, of a rank found from its record


def test_a_killed_worker_is_its_own_incident_and_never_a_recovery(matrix: Matrix) -> None:
    (out,) = matrix.run(("tp1_kill",))
    text = json.dumps(out.row())
    assert out.detect_s is not None and out.detect_s <= 2.0, text
    assert out.stood == out.polls and out.wrong_ranks == 0 and out.recovered_during == 0, text
    print(text)  # what vLLM did: in the notes
