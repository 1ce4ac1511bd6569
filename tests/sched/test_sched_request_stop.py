"""Request state machine and token-level stop conditions."""

import pytest
from sched_fake_runner import make_request

from tokenriver.outputs import FinishReason
from tokenriver.sched.request import RequestStatus
from tokenriver.sched.stop import StopDecision, check_stop

EOS = 2


def test_lifecycle_and_metrics():
    request = make_request("r", [5, 6, 7], arrival_time=1.0)
    assert (request.status, request.num_tokens, request.num_prompt_tokens) == (RequestStatus.WAITING, 3, 3)
    request.start_running(now=2.0)
    request.append_output_token(11, now=3.0)
    request.append_output_token(12, now=4.0)
    assert request.output_token_ids == [11, 12] and request.all_token_ids == [5, 6, 7, 11, 12]
    assert request.prompt_token_ids == [5, 6, 7] and request.num_tokens == 5
    request.preempt()
    assert (request.status, request.num_preemptions, request.num_computed_tokens) == (RequestStatus.PREEMPTED, 1, 0)
    request.start_running(now=5.0)
    request.finish(FinishReason.STOP, 99, now=6.0)
    assert request.status is RequestStatus.FINISHED_STOPPED and request.is_finished
    assert (request.finish_reason, request.stop_reason) == (FinishReason.STOP, 99)
    metrics = request.metrics
    assert (
        metrics.arrival_time,
        metrics.first_scheduled_time,
        metrics.first_token_time,
        metrics.last_token_time,
        metrics.finished_time,
    ) == (1.0, 2.0, 3.0, 4.0, 6.0)
    assert metrics.num_preemptions == 1


def test_prompt_list_is_copied():
    prompt = [1, 2, 3]
    request = make_request("r", prompt)
    prompt.append(4)
    assert request.prompt_token_ids == [1, 2, 3]


@pytest.mark.parametrize(
    "reason, status",
    [
        (FinishReason.STOP, RequestStatus.FINISHED_STOPPED),
        (FinishReason.LENGTH, RequestStatus.FINISHED_LENGTH),
        (FinishReason.ABORT, RequestStatus.FINISHED_ABORTED),
    ],
)
def test_finish_statuses(reason, status):
    request = make_request("r", [1])
    request.finish(reason, None, now=0.0)
    assert request.status is status


def test_illegal_transitions_are_refused():
    request = make_request("r", [1])
    with pytest.raises(RuntimeError):
        request.preempt()  # never ran
    with pytest.raises(RuntimeError):
        request.append_output_token(3, now=0.0)  # not running
    request.start_running(now=0.0)
    request.block_ids = [0]
    with pytest.raises(RuntimeError):
        request.preempt()  # blocks must be returned first
    request.block_ids = []
    request.finish(FinishReason.ABORT, None, now=0.0)
    for transition in (
        lambda: request.start_running(now=0.0),
        lambda: request.finish(FinishReason.STOP, None, now=0.0),
    ):
        with pytest.raises(RuntimeError):
            transition()


def generate(request, tokens, max_num_tokens=10_000):
    """Append tokens one by one until a stop; returns (decision, number of tokens appended)."""
    request.start_running(now=0.0)
    for count, token_id in enumerate(tokens, start=1):
        request.append_output_token(token_id, now=0.0)
        decision = check_stop(request, max_num_tokens)
        if decision is not None:
            return decision, count
    return None, len(tokens)


def test_eos_stops_with_no_stop_reason():
    request = make_request("r", [1], max_tokens=10, eos_token_ids=(EOS,))
    assert generate(request, [20, 21, EOS, 22]) == (StopDecision(FinishReason.STOP, None), 3)


def test_stop_token_id_is_the_stop_reason():
    request = make_request("r", [1], max_tokens=10, eos_token_ids=(EOS,), stop_token_ids=[7, 8])
    assert generate(request, [20, 8, 7]) == (StopDecision(FinishReason.STOP, 8), 2)


def test_stop_token_wins_over_eos_and_max_tokens():
    request = make_request("r", [1], max_tokens=2, eos_token_ids=(EOS,), stop_token_ids=[EOS])
    assert generate(request, [20, EOS]) == (StopDecision(FinishReason.STOP, EOS), 2)


def test_min_tokens_blocks_eos_and_stop_tokens():
    request = make_request("r", [1], max_tokens=10, min_tokens=3, eos_token_ids=(EOS,), stop_token_ids=[7])
    # EOS as the 1st token and the stop token as the 2nd are ignored; EOS as the 3rd counts.
    assert generate(request, [EOS, 7, EOS]) == (StopDecision(FinishReason.STOP, None), 3)


def test_ignore_eos_keeps_going_but_stop_tokens_still_stop():
    request = make_request("r", [1], max_tokens=10, eos_token_ids=(EOS,), ignore_eos=True, stop_token_ids=[7])
    assert generate(request, [EOS, EOS, 7]) == (StopDecision(FinishReason.STOP, 7), 3)


def test_max_tokens_is_length():
    request = make_request("r", [1], max_tokens=3, eos_token_ids=(EOS,))
    assert generate(request, [20, 21, 22, 23]) == (StopDecision(FinishReason.LENGTH), 3)


def test_full_context_is_length():
    request = make_request("r", [1, 1, 1, 1], max_tokens=None, eos_token_ids=(EOS,))
    assert generate(request, [20] * 10, max_num_tokens=6) == (StopDecision(FinishReason.LENGTH), 2)
