"""Scheduler behaviour, driven by a fake runner whose tokens depend on the K/V it reads back.

Every test that generates compares the tokens with `reference_tokens` (the fake
model run on the plain token list): batching, chunking, prefix caching,
preemption and recompute must not change a single token.
"""

import itertools

import pytest
from sched_fake_runner import (
    check_pool_invariants,
    make_request,
    make_setup,
    prompt_logprob_entry,
    reference_tokens,
)

from tokenriver.errors import ContextLengthError, InvalidParameterError
from tokenriver.outputs import FinishReason
from tokenriver.sched.output import RequestStepResult, RunnerOutput
from tokenriver.sched.request import RequestStatus

EOS = 2


def prompt_of(length: int, seed: int = 0) -> list[int]:
    return [10 + (seed * 7919 + i * 31) % 900 for i in range(length)]


def scheduled_ids(output) -> list[str]:
    return [s.request_id for s in output.scheduled]


def test_single_request_matches_reference_and_frees_everything():
    scheduler, runner, driver = make_setup()
    request = make_request("a", prompt_of(10), max_tokens=6)
    scheduler.add_request(request)
    assert (scheduler.num_waiting, scheduler.num_running) == (1, 0)
    driver.run()
    assert driver.tokens["a"] == reference_tokens(prompt_of(10), 6) == request.output_token_ids
    assert driver.finish_reasons["a"] is FinishReason.LENGTH
    assert scheduler.get_request("a") is request and request.status is RequestStatus.FINISHED_LENGTH
    assert scheduler.block_manager.num_used_blocks == 0
    assert not scheduler.has_unfinished_requests()
    # The runner hears about the finish on the next step; after that the request is gone.
    output = scheduler.schedule()
    assert output.finished_request_ids == ["a"] and output.is_empty
    assert scheduler.get_request("a") is None


def test_scheduled_request_carries_shared_references():
    scheduler, _, _ = make_setup()
    request = make_request("a", prompt_of(5), eos_token_ids=(EOS, 3))
    scheduler.add_request(request)
    (scheduled,) = scheduler.schedule().scheduled
    assert scheduled.prompt_token_ids is request.prompt_token_ids
    assert scheduled.output_token_ids is request.output_token_ids
    assert scheduled.sampling_params is request.sampling_params
    assert scheduled.eos_token_ids == [EOS, 3]
    assert (scheduled.token_ids, scheduled.start_position, scheduled.sample) == (prompt_of(5), 0, True)
    assert scheduled.block_ids == request.block_ids and len(scheduled.block_ids) == 2


def test_chunked_prefill_interleaves_with_decodes():
    scheduler, _, driver = make_setup(block_size=16, max_num_batched_tokens=256)
    short, long = (
        make_request("short", prompt_of(8), max_tokens=20),
        make_request("long", prompt_of(1000, 1), max_tokens=3, arrival_time=1.0),
    )
    scheduler.add_request(short)
    scheduler.add_request(long)
    long_chunks, long_samples = [], []
    for step in range(4):
        output, _ = driver.step()
        assert output.num_batched_tokens <= 256
        by_id = {s.request_id: s for s in output.scheduled}
        assert by_id["short"].sample and by_id["short"].num_tokens == (8 if step == 0 else 1)
        long_chunks.append((by_id["long"].start_position, by_id["long"].num_tokens))
        long_samples.append(by_id["long"].sample)
    assert long_chunks == [(0, 248), (248, 255), (503, 255), (758, 242)]
    assert long_samples == [False, False, False, True]
    assert len(driver.tokens["short"]) == 4 and len(driver.tokens["long"]) == 1
    driver.run()
    assert driver.tokens["short"] == reference_tokens(prompt_of(8), 20)
    assert driver.tokens["long"] == reference_tokens(prompt_of(1000, 1), 3)


def test_max_num_seqs_caps_the_running_requests():
    scheduler, _, driver = make_setup(max_num_seqs=2)
    prompts = {f"r{i}": prompt_of(5 + i, i) for i in range(5)}
    for i, (request_id, prompt) in enumerate(prompts.items()):
        scheduler.add_request(make_request(request_id, prompt, max_tokens=3 + i, arrival_time=float(i)))
    seen, first_step = set(), {}
    while scheduler.has_unfinished_requests():
        output, _ = driver.step()
        assert len(output.scheduled) <= 2 and scheduler.num_running <= 2
        for request_id in scheduled_ids(output):
            first_step.setdefault(request_id, len(driver.outputs))
        seen.update(scheduled_ids(output))
    assert [first_step[f"r{i}"] for i in range(5)] == sorted(first_step.values())
    assert first_step["r2"] > 1  # admitted only once a slot freed up
    for request_id, prompt in prompts.items():
        assert driver.tokens[request_id] == reference_tokens(prompt, len(driver.tokens[request_id]))


def test_priority_then_arrival_order():
    scheduler, _, driver = make_setup(max_num_seqs=1)
    for request_id, priority, arrival in (("low", 5, 0.0), ("high", 0, 1.0), ("mid", 3, 2.0), ("high2", 0, 3.0)):
        scheduler.add_request(
            make_request(request_id, prompt_of(4), max_tokens=2, priority=priority, arrival_time=arrival)
        )
    driver.run()
    order = []
    for output in driver.outputs:
        for request_id in scheduled_ids(output):
            if request_id not in order:
                order.append(request_id)
    assert order == ["high", "high2", "mid", "low"]


def test_shared_system_prompt_hits_the_prefix_cache():
    scheduler, _, driver = make_setup(block_size=16)
    system = prompt_of(32, 5)
    first, second = system + prompt_of(5, 1), system + prompt_of(8, 2)
    scheduler.add_request(make_request("a", first, max_tokens=4))
    driver.step()  # computes a's prompt: its two full system blocks enter the cache
    second_request = make_request("b", second, max_tokens=4)
    scheduler.add_request(second_request)
    output, _ = driver.step()
    (scheduled,) = [s for s in output.scheduled if s.request_id == "b"]
    assert (scheduled.start_position, scheduled.num_tokens) == (32, 8)
    assert scheduled.block_ids[:2] == scheduler.get_request("a").block_ids[:2]
    assert second_request.num_cached_tokens == 32
    driver.run()
    assert driver.tokens["a"] == reference_tokens(first, 4) and driver.tokens["b"] == reference_tokens(second, 4)
    stats = scheduler.stats()
    assert (stats.prefix_cache_queried_tokens, stats.prefix_cache_hit_tokens) == (37 + 40, 32)
    assert stats.prefix_cache_hit_rate == pytest.approx(32 / 77)


@pytest.mark.parametrize("length, expected_hit", [(40, 32), (32, 16), (33, 32), (15, 0)])
def test_fork_of_one_prompt_reuses_all_but_the_last_token(length, expected_hit):
    scheduler, _, driver = make_setup(block_size=16)
    prompt = prompt_of(length, 3)
    scheduler.add_request(make_request("first", prompt, max_tokens=3))
    driver.step()
    fork = make_request("fork", prompt, max_tokens=3)
    scheduler.add_request(fork)
    driver.run()
    assert fork.num_cached_tokens == expected_hit
    assert driver.tokens["fork"] == driver.tokens["first"] == reference_tokens(prompt, 3)


def test_candidates_added_together_share_the_prompt_in_the_first_step():
    scheduler, _, driver = make_setup(block_size=16)
    prompt = prompt_of(40, 5)
    forks = [make_request(f"r#{i}", prompt, max_tokens=4) for i in range(3)]
    for fork in forks:
        scheduler.add_request(fork)
    output, _ = driver.step()
    assert [(s.start_position, s.num_tokens) for s in output.scheduled] == [(0, 40), (32, 8), (32, 8)]
    assert output.scheduled[1].block_ids[:2] == output.scheduled[2].block_ids[:2] == forks[0].block_ids[:2]
    assert [fork.num_cached_tokens for fork in forks] == [0, 32, 32]
    driver.run()
    assert all(driver.tokens[fork.request_id] == reference_tokens(prompt, 4) for fork in forks)


def test_multi_turn_reuses_the_previous_turns_prompt_and_output():
    scheduler, _, driver = make_setup(block_size=16)
    turn1 = prompt_of(40, 4)
    scheduler.add_request(make_request("turn1", turn1, max_tokens=10))
    driver.run()
    turn2 = turn1 + driver.tokens["turn1"] + prompt_of(5, 9)
    request = make_request("turn2", turn2, max_tokens=5)
    scheduler.add_request(request)
    driver.run()
    # Turn 1 computed 40 + 10 - 1 tokens (its last token was sampled, never computed): 3 full blocks.
    assert request.num_cached_tokens == 48
    assert driver.tokens["turn2"] == reference_tokens(turn2, 5)


def test_prompt_logprobs_requests_skip_the_prefix_cache():
    scheduler, _, driver = make_setup(block_size=4)
    prompt = prompt_of(21, 6)
    scheduler.add_request(make_request("plain", prompt, max_tokens=2))
    driver.run()
    request = make_request("logprobs", prompt, max_tokens=2, prompt_logprobs=1)
    scheduler.add_request(request)
    driver.run()
    assert request.num_cached_tokens == 0
    assert driver.prompt_logprobs["logprobs"] == [prompt_logprob_entry(prompt, p) for p in range(20)]
    assert driver.tokens["logprobs"] == reference_tokens(prompt, 2)


def run_workload(num_blocks: int, max_num_batched_tokens: int = 64):
    scheduler, _, driver = make_setup(
        num_blocks=num_blocks, block_size=4, max_num_seqs=4, max_num_batched_tokens=max_num_batched_tokens
    )
    prompts = {f"r{i}": prompt_of(length, i) for i, length in enumerate((9, 13, 6, 11, 17))}
    requests = [
        make_request(request_id, prompt, max_tokens=14, arrival_time=float(i))
        for i, (request_id, prompt) in enumerate(prompts.items())
    ]
    for request in requests:
        scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        driver.step()
        check_pool_invariants(scheduler, requests)
    assert scheduler.block_manager.num_used_blocks == 0
    return prompts, driver, scheduler


@pytest.mark.parametrize("max_num_batched_tokens", [64, 5])
def test_preemption_under_pressure_does_not_change_tokens(max_num_batched_tokens):
    prompts, roomy, roomy_scheduler = run_workload(num_blocks=200, max_num_batched_tokens=max_num_batched_tokens)
    _, tight, tight_scheduler = run_workload(num_blocks=10, max_num_batched_tokens=max_num_batched_tokens)
    assert roomy_scheduler.stats().num_preempted_total == 0
    assert tight_scheduler.stats().num_preempted_total > 0
    for request_id, prompt in prompts.items():
        assert tight.tokens[request_id] == roomy.tokens[request_id] == reference_tokens(prompt, 14)
        assert tight.finish_reasons[request_id] is FinishReason.LENGTH


def test_the_worst_ranked_running_request_is_preempted():
    scheduler, _, driver = make_setup(num_blocks=6, block_size=4)
    background = make_request("background", prompt_of(8, 1), max_tokens=10, priority=1, arrival_time=0.0)
    urgent = make_request("urgent", prompt_of(8, 2), max_tokens=10, priority=0, arrival_time=1.0)
    scheduler.add_request(background)
    scheduler.add_request(urgent)
    driver.run()
    assert urgent.num_preemptions == 0 and background.num_preemptions >= 1
    assert driver.tokens["urgent"] == reference_tokens(prompt_of(8, 2), 10)
    assert driver.tokens["background"] == reference_tokens(prompt_of(8, 1), 10)


def test_preempted_request_goes_back_ahead_of_later_arrivals():
    scheduler, _, driver = make_setup(num_blocks=6, block_size=4, max_num_seqs=2)
    first = make_request("first", prompt_of(8, 1), max_tokens=10, arrival_time=0.0)
    second = make_request("second", prompt_of(8, 2), max_tokens=10, arrival_time=1.0)
    third = make_request("third", prompt_of(4, 3), max_tokens=2, arrival_time=2.0)
    for request in (first, second, third):
        scheduler.add_request(request)
    while second.num_preemptions == 0:
        driver.step()
    assert second.status is RequestStatus.PREEMPTED and third.status is RequestStatus.WAITING
    while third.status is RequestStatus.WAITING:
        driver.step()
    assert second.status is RequestStatus.RUNNING or second.is_finished
    driver.run()


def test_a_step_that_preempts_admits_nobody():
    scheduler, _, driver = make_setup(num_blocks=6, block_size=4, max_num_seqs=3)
    first = make_request("first", prompt_of(8, 1), max_tokens=10, priority=0, arrival_time=0.0)
    second = make_request("second", prompt_of(8, 2), max_tokens=10, priority=1, arrival_time=1.0)
    scheduler.add_request(first)
    scheduler.add_request(second)
    for _ in range(5):
        driver.step()
    assert scheduler.block_manager.num_free_blocks == 0
    newcomer = make_request("newcomer", prompt_of(4, 3), max_tokens=2, priority=0, arrival_time=2.0)
    scheduler.add_request(newcomer)
    output, _ = driver.step()  # first needs a block: second is preempted, its room is not handed out
    assert second.status is RequestStatus.PREEMPTED and scheduled_ids(output) == ["first"]
    output, _ = driver.step()
    assert "newcomer" in scheduled_ids(output)
    driver.run()


def test_prompt_logprobs_are_not_repeated_after_preemption():
    scheduler, _, driver = make_setup(num_blocks=7, block_size=4)
    prompt = prompt_of(12, 8)
    keeper = make_request("keeper", prompt_of(12, 7), max_tokens=12, priority=0)
    victim = make_request("victim", prompt, max_tokens=12, priority=1, prompt_logprobs=2)
    scheduler.add_request(keeper)
    scheduler.add_request(victim)
    driver.run()
    assert victim.num_preemptions >= 1
    assert driver.prompt_logprobs["victim"] == [prompt_logprob_entry(prompt, p) for p in range(11)]
    assert driver.tokens["victim"] == reference_tokens(prompt, 12)


def test_a_sequence_that_outgrows_the_pool_ends_with_length():
    scheduler, _, driver = make_setup(num_blocks=4, block_size=4, max_model_len=100)
    scheduler.add_request(make_request("a", prompt_of(10), max_tokens=None))
    driver.run()
    assert driver.tokens["a"] == reference_tokens(prompt_of(10), 6)  # 16 tokens: the whole pool
    assert driver.finish_reasons["a"] is FinishReason.LENGTH
    assert scheduler.stats().num_preempted_total == 0


def test_max_model_len_ends_with_length():
    scheduler, _, driver = make_setup(max_model_len=14)
    scheduler.add_request(make_request("a", prompt_of(10), max_tokens=None))
    driver.run()
    assert len(driver.tokens["a"]) == 4 and driver.finish_reasons["a"] is FinishReason.LENGTH


def scripted_model(prompt_length: int, script: list[int]):
    return lambda context: script[len(context) - prompt_length]


def test_eos_stop_token_min_tokens_and_ignore_eos_through_the_scheduler():
    script = [20, EOS, 7, 21, EOS, 22, 23, 24]
    cases = {
        "eos": ({}, [20, EOS], FinishReason.STOP, None),
        "stop_token": ({"stop_token_ids": [7]}, [20, EOS], FinishReason.STOP, None),
        "min_tokens": ({"min_tokens": 3, "stop_token_ids": [7]}, [20, EOS, 7], FinishReason.STOP, 7),
        "ignore_eos": ({"ignore_eos": True, "stop_token_ids": [21]}, [20, EOS, 7, 21], FinishReason.STOP, 21),
        "length": ({"ignore_eos": True, "max_tokens": 6}, script[:6], FinishReason.LENGTH, None),
    }
    for name, (params, expected, reason, stop_reason) in cases.items():
        params = {"max_tokens": 8, **params}
        scheduler, _, driver = make_setup(model=scripted_model(3, script))
        request = make_request(name, [11, 12, 13], eos_token_ids=(EOS,), **params)
        scheduler.add_request(request)
        eos_seen = scheduler.schedule().scheduled[0].eos_token_ids
        assert eos_seen == ([] if params.get("ignore_eos") else [EOS])
        scheduler.abort_request(name)
        scheduler.schedule()
        request = make_request(name, [11, 12, 13], eos_token_ids=(EOS,), **params)
        scheduler.add_request(request)
        driver.run()
        assert (driver.tokens[name], driver.finish_reasons[name], driver.stop_reasons[name]) == (
            expected,
            reason,
            stop_reason,
        ), name
        assert request.stop_reason == stop_reason


def test_recompute_every_step_recomputes_the_whole_sequence():
    scheduler, _, driver = make_setup(block_size=4, recompute_every_step=True)
    prompts = {"a": prompt_of(7, 1), "b": prompt_of(12, 2), "a_again": prompt_of(7, 1)}
    requests = [make_request(request_id, prompt, max_tokens=5) for request_id, prompt in prompts.items()]
    for request in requests:
        scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        output, _ = driver.step()
        for scheduled in output.scheduled:
            assert scheduled.start_position == 0 and scheduled.sample
            assert scheduled.token_ids == scheduled.prompt_token_ids + scheduled.output_token_ids[:-1]
        assert all(not r.block_ids for r in requests)
        check_pool_invariants(scheduler, requests)
    for request_id, prompt in prompts.items():
        assert driver.tokens[request_id] == reference_tokens(prompt, 5)
    assert requests[2].num_cached_tokens == 0
    assert scheduler.stats().prefix_cache_queried_tokens == 0
    assert scheduler.stats().num_decode_tokens_total == 0


def test_recompute_every_step_with_chunks():
    scheduler, _, driver = make_setup(block_size=4, recompute_every_step=True, max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", prompt_of(10), max_tokens=4))
    driver.run()
    assert driver.tokens["a"] == reference_tokens(prompt_of(10), 4)
    assert [s.scheduled[0].num_tokens for s in driver.outputs] == [8, 2, 8, 3, 8, 4, 8, 5]


def test_abort_frees_blocks_and_drops_late_tokens():
    scheduler, runner, driver = make_setup()
    keep, drop = make_request("keep", prompt_of(9, 1)), make_request("drop", prompt_of(9, 2))
    scheduler.add_request(keep)
    scheduler.add_request(drop)
    driver.step()
    used = scheduler.block_manager.num_used_blocks
    output = scheduler.schedule()
    runner_output = runner.execute(output)
    assert scheduler.abort_request("drop")
    assert drop.status is RequestStatus.FINISHED_ABORTED and drop.finish_reason is FinishReason.ABORT
    assert scheduler.block_manager.num_used_blocks == used - 3
    updates = scheduler.update(output, runner_output)
    assert [u.request_id for u in updates] == ["keep"]
    assert len(drop.output_token_ids) == 1
    assert not scheduler.abort_request("drop") and not scheduler.abort_request("unknown")
    assert scheduler.schedule().finished_request_ids == ["drop"]
    check_pool_invariants(scheduler, [keep, drop])


def test_abort_a_waiting_request():
    scheduler, _, _ = make_setup()
    request = make_request("a", prompt_of(4))
    scheduler.add_request(request)
    assert scheduler.abort_request("a") and scheduler.num_waiting == 0
    assert not scheduler.has_unfinished_requests()
    assert scheduler.schedule().finished_request_ids == ["a"]


def test_finish_request_for_a_stop_string():
    scheduler, _, driver = make_setup()
    request = make_request("a", prompt_of(6), max_tokens=10)
    scheduler.add_request(request)
    driver.step()
    driver.step()
    assert scheduler.finish_request("a", FinishReason.STOP, "###")
    assert (request.status, request.finish_reason, request.stop_reason) == (
        RequestStatus.FINISHED_STOPPED,
        FinishReason.STOP,
        "###",
    )
    assert scheduler.block_manager.num_used_blocks == 0 and not scheduler.has_unfinished_requests()
    assert not scheduler.finish_request("a", FinishReason.STOP, "###")
    assert scheduler.schedule().finished_request_ids == ["a"]
    # The id can be used again once the request finished.
    scheduler.add_request(make_request("a", prompt_of(6), max_tokens=1))
    driver.run()


def test_prompt_longer_than_the_context_is_refused_with_both_numbers():
    scheduler, _, _ = make_setup(max_model_len=100)
    with pytest.raises(ContextLengthError) as error:
        scheduler.add_request(make_request("a", prompt_of(100)))
    assert (error.value.num_tokens, error.value.max_tokens, error.value.param) == (100, 100, "prompt")
    assert "100" in str(error.value) and "max_model_len" in str(error.value)
    scheduler.add_request(make_request("b", prompt_of(99)))


def test_prompt_larger_than_the_pool_is_refused_with_both_numbers():
    scheduler, _, driver = make_setup(num_blocks=4, block_size=4)
    with pytest.raises(ContextLengthError) as error:
        scheduler.add_request(make_request("a", prompt_of(17)))
    assert (error.value.num_tokens, error.value.max_tokens) == (17, 16)
    assert "17" in str(error.value) and "16" in str(error.value)
    scheduler.add_request(make_request("b", prompt_of(16)))
    driver.run()
    assert driver.tokens["b"] == reference_tokens(prompt_of(16), 1)


def test_duplicate_and_empty_requests_are_refused():
    scheduler, _, _ = make_setup()
    scheduler.add_request(make_request("a", prompt_of(4)))
    with pytest.raises(InvalidParameterError) as error:
        scheduler.add_request(make_request("a", prompt_of(5)))
    assert error.value.param == "request_id" and "'a'" in str(error.value)
    with pytest.raises(InvalidParameterError) as error:
        scheduler.add_request(make_request("b", []))
    assert error.value.param == "prompt"


@pytest.mark.parametrize("name", ["max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_scheduler_steps"])
def test_bad_limits_name_the_parameter(name):
    with pytest.raises(InvalidParameterError) as error:
        make_setup(**{name: 0})
    assert error.value.param == name


def test_stats_count_steps_and_tokens():
    scheduler, _, driver = make_setup(num_blocks=10, block_size=4)
    scheduler.add_request(make_request("a", prompt_of(10), max_tokens=3))
    driver.step()
    stats = scheduler.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_steps) == (1, 0, 1)
    assert (stats.num_prefill_tokens_last_step, stats.num_decode_tokens_last_step) == (10, 0)
    assert (stats.num_blocks_total, stats.num_blocks_used, stats.num_blocks_free) == (10, 3, 7)
    assert stats.kv_usage == pytest.approx(0.3)
    driver.run()
    stats = scheduler.stats()
    assert (stats.num_prefill_tokens_total, stats.num_decode_tokens_total, stats.num_steps) == (10, 2, 3)
    assert (stats.num_prefill_tokens_last_step, stats.num_decode_tokens_last_step) == (0, 1)
    assert (stats.num_running, stats.num_blocks_used, stats.kv_usage) == (0, 0, 0.0)


def test_metrics_use_the_injected_clock():
    ticks = itertools.count(100)
    scheduler, _, driver = make_setup(clock=lambda: float(next(ticks)))
    request = make_request("a", prompt_of(4), max_tokens=3, arrival_time=50.0)
    scheduler.add_request(request)
    driver.run()
    metrics = request.metrics
    assert metrics.arrival_time == 50.0
    assert (
        100
        <= metrics.first_scheduled_time
        < metrics.first_token_time
        < metrics.last_token_time
        <= metrics.finished_time
    )
    assert metrics.time_per_output_token(3) is not None


def test_updates_carry_logprobs_traces_and_cached_tokens():
    scheduler, _, driver = make_setup(block_size=4)
    scheduler.add_request(make_request("a", prompt_of(9), max_tokens=2))
    _, (update,) = driver.step()
    assert update.new_token_ids == driver.tokens["a"] and len(update.new_logprobs) == 1
    assert update.new_traces == ["trace-a-0"] and not update.finished and update.metrics is not None
    _, (update,) = driver.step()
    assert update.finished and update.finish_reason is FinishReason.LENGTH and update.num_cached_tokens == 0


def test_empty_step():
    scheduler, runner, _ = make_setup()
    output = scheduler.schedule()
    assert output.is_empty and scheduler.update(output, RunnerOutput()) == []


# ---- multi-step scheduling ----


def greedy_request(request_id: str, prompt: list[int], **params):
    return make_request(request_id, prompt, temperature=0.0, **params)


def test_multi_step_decodes_match_the_reference_and_free_everything():
    scheduler, runner, driver = make_setup(block_size=4, num_scheduler_steps=4)
    requests = [
        greedy_request(f"r{i}", prompt_of(3 + 5 * i, seed=i), max_tokens=max_tokens)
        for i, max_tokens in enumerate((1, 6, 11, 17))
    ]
    for request in requests:
        scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        driver.step()
        check_pool_invariants(scheduler, requests)
    for i, request in enumerate(requests):
        assert driver.tokens[request.request_id] == reference_tokens(
            request.prompt_token_ids, request.sampling_params.max_tokens
        )
        assert driver.finish_reasons[request.request_id] is FinishReason.LENGTH
    assert scheduler.block_manager.num_used_blocks == 0
    passes = [output.num_decode_passes for output in driver.outputs]
    # The prefill step, then four passes while any request wants four more tokens (r1 and r2 finish mid-step:
    # their rows past max_tokens are dropped), then what the last one still wants.
    assert passes == [1, 4, 4, 4, 4]
    assert runner.num_steps == len(passes)
    assert scheduler.stats().num_decode_tokens_total == 4 * (3 + 3 + 2 + 1)


def test_multi_step_takes_blocks_for_every_pass_and_gives_back_the_unused_ones():
    scheduler, _, driver = make_setup(block_size=4, num_scheduler_steps=8)
    request = greedy_request("a", prompt_of(4), max_tokens=20)
    scheduler.add_request(request)
    driver.step()  # the prompt: 4 tokens, one sampled
    output = scheduler.schedule()
    assert output.num_decode_passes == 8
    # Passes compute positions 4..11: blocks for 12 tokens.
    assert len(output.scheduled[0].block_ids) == len(request.block_ids) == 3
    scheduler.update(output, RunnerOutput(results={"a": RequestStepResult(token_ids=[20, 21, 22])}))
    # A runner that stopped after three passes: the K/V of two of its tokens stays, the empty block goes back.
    assert (request.num_tokens, request.num_computed_tokens) == (8, 7)
    assert len(request.block_ids) == 2
    check_pool_invariants(scheduler, [request])


def test_multi_step_eos_mid_step_drops_the_rest_and_frees_the_blocks():
    script = [20, 21, EOS, 22, 23, 24, 25, 26]
    scheduler, _, driver = make_setup(block_size=4, num_scheduler_steps=4, model=scripted_model(3, script))
    request = greedy_request("a", [11, 12, 13], max_tokens=8, eos_token_ids=(EOS,))
    scheduler.add_request(request)
    driver.run()
    assert driver.tokens["a"] == [20, 21, EOS] and driver.finish_reasons["a"] is FinishReason.STOP
    assert [output.num_decode_passes for output in driver.outputs] == [1, 4]
    assert scheduler.block_manager.num_used_blocks == 0


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.7},
        {"temperature": 0.0, "stop": ["x"]},
        {"temperature": 0.0, "logprobs": 2},
        {"temperature": 0.0, "trace": True},
        {"temperature": 0.0, "repetition_penalty": 1.3},
        {"temperature": 0.0, "presence_penalty": 0.5},
        {"temperature": 0.0, "logit_bias": {30: 2.0}},
        {"temperature": 0.0, "min_tokens": 5},
    ],
)
def test_multi_step_only_for_plain_greedy_decodes(params):
    scheduler, _, driver = make_setup(block_size=4, num_scheduler_steps=4)
    scheduler.add_request(make_request("plain", prompt_of(6), max_tokens=12, temperature=0.0, eos_token_ids=(EOS,)))
    scheduler.add_request(make_request("other", prompt_of(7, seed=1), max_tokens=12, eos_token_ids=(EOS,), **params))
    driver.step()
    assert [driver.step()[0].num_decode_passes for _ in range(3)] == [1, 1, 1]


def test_multi_step_not_while_a_prompt_is_computed():
    scheduler, _, driver = make_setup(block_size=4, num_scheduler_steps=4, max_num_batched_tokens=8)
    scheduler.add_request(greedy_request("a", prompt_of(4), max_tokens=12))
    driver.step()
    scheduler.add_request(greedy_request("b", prompt_of(20, seed=1), max_tokens=12))
    # b's prompt takes three steps in chunks next to a's decodes: one pass each; then both decode, four at a time.
    assert [driver.step()[0].num_decode_passes for _ in range(4)] == [1, 1, 1, 4]


def test_multi_step_falls_back_to_one_pass_rather_than_preempt():
    scheduler, _, driver = make_setup(num_blocks=5, block_size=4, num_scheduler_steps=4)
    requests = [
        greedy_request("a", prompt_of(7), max_tokens=9),
        greedy_request("b", prompt_of(7, seed=1), max_tokens=9),
    ]
    for request in requests:
        scheduler.add_request(request)
    driver.step()
    # Four passes would need a third block each (5 blocks in all): one pass, nobody preempted.
    output, _ = driver.step()
    assert output.num_decode_passes == 1 and scheduler.stats().num_preempted_total == 0
    driver.run()
    for request in requests:
        assert driver.tokens[request.request_id] == reference_tokens(request.prompt_token_ids, 9)
