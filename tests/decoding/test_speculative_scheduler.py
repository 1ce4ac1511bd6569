"""Draft tokens through the scheduler, with a fake runner that reads its context back from the KV slots.

The fake "model" is a fixed function of the context. Its runner writes every
computed token (drafts included) into the slot the block table gives it and
reads each prediction's context back from the slots, so a draft whose K/V was
not rolled back, or a block freed while still needed, changes the tokens. Every
run must give exactly the tokens of plain decoding, whatever the drafts were.
"""

from __future__ import annotations

import random

import pytest

from tokenriver.decoding.ngram import NgramProposer
from tokenriver.decoding.proposer import Proposal
from tokenriver.decoding.speculative import Speculator
from tokenriver.kv.block_manager import BlockManager
from tokenriver.outputs import FinishReason
from tokenriver.params import SamplingParams
from tokenriver.sched.output import RequestStepResult, RunnerOutput, SchedulerOutput
from tokenriver.sched.request import Request
from tokenriver.sched.scheduler import Scheduler

BLOCK_SIZE = 4


def next_token(context: list[int]) -> int:
    """A deterministic 'model' that often repeats itself (so n-gram drafts hit): period-7 patterns plus noise."""
    value = sum(t * (i % 5 + 1) for i, t in enumerate(context[-6:])) + len(context) // 9
    return 10 + (context[-7] if len(context) >= 7 and value % 3 else value) % 50


def reference_tokens(prompt: list[int], num_tokens: int) -> list[int]:
    context = list(prompt)
    for _ in range(num_tokens):
        context.append(next_token(context))
    return context[len(prompt) :]


class SlotRunner:
    """Greedy verification against token-valued KV slots."""

    def __init__(self, num_blocks: int) -> None:
        self.slots: list[int | None] = [None] * (num_blocks * BLOCK_SIZE)

    def _slot(self, block_ids: list[int], position: int) -> int:
        return block_ids[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE

    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        for scheduled in output.scheduled:
            tokens = scheduled.token_ids + scheduled.draft_token_ids
            for offset, token_id in enumerate(tokens):
                self.slots[self._slot(scheduled.block_ids, scheduled.start_position + offset)] = token_id
        results = {}
        for scheduled in output.scheduled:
            if not scheduled.sample:
                continue
            end = scheduled.start_position + scheduled.num_tokens
            emitted = []
            for j in range(len(scheduled.draft_token_ids) + 1):
                context = [self.slots[self._slot(scheduled.block_ids, p)] for p in range(end + j)]
                emitted.append(next_token(context))
                if j == len(scheduled.draft_token_ids) or emitted[-1] != scheduled.draft_token_ids[j]:
                    break
            results[scheduled.request_id] = RequestStepResult(
                token_ids=emitted, logprobs=[None] * len(emitted), traces=[None] * len(emitted)
            )
        return RunnerOutput(results=results)


class NoisyOracle:
    """Proposes the true continuation with some tokens wrong, so steps accept anywhere from 0 to k drafts."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def propose(self, requests: list[Request], max_num_tokens: list[int]) -> list[Proposal | None]:
        proposals = []
        for request, limit in zip(requests, max_num_tokens):
            context = list(request.all_token_ids)
            drafts = []
            for _ in range(limit):
                token = next_token(context) if self.rng.random() < 0.7 else 9
                drafts.append(token)
                context.append(token)
            proposals.append(Proposal(drafts))
        return proposals

    def drop(self, request_ids: list[str]) -> None:
        pass


def run(
    proposer,
    prompts: list[list[int]],
    max_tokens: list[int],
    *,
    num_blocks: int = 256,
    num_speculative_tokens: int = 4,
    max_num_batched_tokens: int = 64,
):
    manager = BlockManager(num_blocks, BLOCK_SIZE)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens, max_model_len=512)
    runner = SlotRunner(num_blocks)
    speculator = Speculator(proposer, num_speculative_tokens)
    requests = [
        Request(f"r{i}", prompt, SamplingParams(max_tokens=m, temperature=0.0), [], 0.0)
        for i, (prompt, m) in enumerate(zip(prompts, max_tokens))
    ]
    for request in requests:
        scheduler.add_request(request)
    num_known_computed = dict.fromkeys((r.request_id for r in requests), 0)
    for _ in range(2000):
        if not scheduler.has_unfinished_requests():
            break
        speculator.propose(scheduler)
        output = scheduler.schedule()
        assert output.num_batched_tokens <= max_num_batched_tokens
        for scheduled in output.scheduled:
            num_known_computed[scheduled.request_id] += scheduled.num_tokens
        scheduler.update(output, runner.execute(output))
        for request in requests:
            if not request.is_finished:
                # Rejected drafts leave nothing behind: no block past the known tokens, nothing computed past them.
                assert len(request.block_ids) <= manager.num_blocks_for(request.num_tokens + num_speculative_tokens)
                assert request.num_computed_tokens <= request.num_tokens
    assert not scheduler.has_unfinished_requests()
    assert manager.num_used_blocks == 0
    if scheduler.stats().num_preempted_total == 0:
        # Accepted drafts keep their K/V: no token is computed twice (and the last one never is).
        for request in requests:
            num_computed = num_known_computed[request.request_id] + request.metrics.num_accepted_draft_tokens
            assert num_computed == request.num_tokens - 1
    return requests, scheduler


def make_prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[10 + rng.randrange(50) for _ in range(rng.randint(3, 30))] for _ in range(count)]


@pytest.mark.parametrize("proposer", [NgramProposer(1, 3), NoisyOracle(0)], ids=["ngram", "noisy-oracle"])
def test_speculation_gives_the_tokens_of_plain_decoding(proposer):
    prompts = make_prompts(8, seed=1)
    max_tokens = [random.Random(i).randint(1, 60) for i in range(len(prompts))]
    requests, scheduler = run(proposer, prompts, max_tokens)
    for request, prompt, limit in zip(requests, prompts, max_tokens):
        assert request.output_token_ids == reference_tokens(prompt, limit)
        assert request.finish_reason is FinishReason.LENGTH
    stats = scheduler.stats()
    assert stats.num_draft_tokens_total > 0 and 0 < stats.num_accepted_draft_tokens_total
    assert stats.num_rejected_draft_tokens_total > 0
    assert stats.num_draft_tokens_total == sum(r.metrics.num_draft_tokens for r in requests)
    assert stats.num_accepted_draft_tokens_total == sum(r.metrics.num_accepted_draft_tokens for r in requests)
    # Every step gains 1 + accepted tokens: the steps saved are the accepted drafts.
    for request in requests:
        metrics = request.metrics
        assert metrics.num_accepted_draft_tokens <= metrics.num_draft_tokens
        assert metrics.mean_accepted_length is None or 1 <= metrics.mean_accepted_length <= 5


def test_speculation_under_block_pressure_and_a_tight_budget():
    """Preemptions drop drafts; a small budget truncates them; the tokens still match."""
    prompts = make_prompts(8, seed=2)
    max_tokens = [40] * len(prompts)
    requests, scheduler = run(NoisyOracle(1), prompts, max_tokens, num_blocks=40, max_num_batched_tokens=16)
    for request, prompt in zip(requests, prompts):
        assert request.output_token_ids == reference_tokens(prompt, 40)
    assert scheduler.stats().num_preempted_total > 0


def test_drafts_never_overrun_max_tokens_or_a_stop_token():
    prompt = [10, 11, 12, 13]
    reference = reference_tokens(prompt, 30)
    requests, _ = run(NoisyOracle(2), [prompt], [3], num_speculative_tokens=8)
    assert requests[0].output_token_ids == reference[:3]
    stop_token = reference[5]
    manager = BlockManager(64, BLOCK_SIZE)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512)
    request = Request("s", prompt, SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop_token]), [], 0.0)
    scheduler.add_request(request)
    runner, speculator = SlotRunner(64), Speculator(NoisyOracle(3), 8)
    while scheduler.has_unfinished_requests():
        speculator.propose(scheduler)
        output = scheduler.schedule()
        scheduler.update(output, runner.execute(output))
    assert request.output_token_ids == reference[: reference.index(stop_token) + 1]
    assert request.finish_reason is FinishReason.STOP and manager.num_used_blocks == 0
