"""The scheduler: which requests compute how many tokens each step, and what happens to what they sample.

Scheduling is arithmetic, not modes (vLLM v1): every request has `num_tokens`
(known tokens) and `num_computed_tokens` (tokens with K/V in the cache); each step
hands out at most `max_num_batched_tokens` tokens to at most `max_num_seqs`
requests. A decode is a request one token behind, a prompt is a request many
tokens behind, and

- chunked prefill: a long prompt takes what the budget leaves, over several steps,
  next to other requests' decodes;
- prefix caching: an admission starts with num_computed_tokens = the cached prefix
  (never all of it: the last known token is always computed, for its logits); a
  block is cached as soon as a step is scheduled to fill it, so requests admitted
  in the same step share it too;
- preemption by recompute: the request gives its blocks back and starts again at
  num_computed_tokens = 0, keeping its output tokens, which are recomputed with the
  prompt (its full blocks stay in the prefix cache, so this is often cheap);
- recompute_every_step (use_kv_cache=False): after each sampled token the blocks
  are dropped, so every step computes the whole sequence again;
- speculative decoding: a request one token behind may carry draft tokens
  (`Request.draft_token_ids`, set by a proposer through `set_draft_tokens`); they
  are scheduled after its last token, and the runner returns the drafts the model
  accepted plus one token of its own. The accepted drafts' K/V stays (num_computed
  grows by 1 + accepted), the rejected ones' is rolled back: num_computed_tokens
  does not cover them and blocks holding nothing but them are freed;
- multi-step scheduling (num_scheduler_steps > 1, vLLM's --num-scheduler-steps):
  a step in which every scheduled request is a plain greedy decode (one token, its
  raw argmax taken, nothing else read from the logits, no stop strings) runs up to
  num_scheduler_steps forward passes, each decoding the token the pass before
  sampled (SchedulerOutput.num_decode_passes). The blocks for all those tokens are
  taken up front, and only if the pool has them without preempting anyone; fewer
  passes when no request wants that many more tokens (or one would outgrow the
  context). Scheduling, this bookkeeping and the engine's output processing then
  run once per step, not once per token; tokens sampled past a stop (EOS,
  max_tokens) are dropped, as are speculation's;
- beam search: a beam is a request that reports its most likely next tokens
  instead of sampling one, then waits ("awaiting fork", nothing to compute)
  until the beam search has every beam's candidates and calls `fork_request`
  for each surviving (beam, token): the child shares all its parent's blocks,
  and the first time it writes into a block it still shares (the parent's last,
  partial block) it gets its own copy (copy-on-write, SchedulerOutput.block_copies).
  A beam search's first request is admitted only with room for all its beams
  under max_num_seqs. Should every running request await a fork while a beam
  they wait for cannot be admitted, they are preempted to make room (their
  candidates are already known), so beams never deadlock.
- pooling requests (embeddings, scores): the whole prompt in one step, never a
  chunk, since the pooled vector reads every position's final hidden state (and
  an encoder's attention sees the whole input at once). They neither use nor
  fill the prefix cache (an encoder writes no K/V), and they finish in the step
  that computes them, so their blocks are back in the pool before the next.

Order: requests are ranked by (priority, arrival time, order added), lower first.
Running requests are served first, best rank first; then waiting requests are
admitted best rank first while tokens, sequence slots and blocks last (no skipping:
a big request at the head is not starved by small ones behind it). When a running
request needs a block and none is free, the worst-ranked running request is
preempted, which may be the request itself; it goes back to the waiting queue at
its rank, ahead of everything that arrived after it. Waiting requests never preempt.

No request fails for lack of blocks: the oldest running request can always take
the whole pool, and a sequence is stopped (LENGTH) before it outgrows the pool or
max_model_len, so one that fits can always finish.

The scheduler knows nothing about tensors or text: the runner turns
`SchedulerOutput` into tensors, the engine turns token ids into text and checks
stop strings (and calls `finish_request`).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

from tokenriver.errors import ContextLengthError, DuplicateRequestIdError, InvalidParameterError
from tokenriver.kv.block_manager import BlockManager
from tokenriver.outputs import FinishReason, TokenLogprobs
from tokenriver.params import is_plain_greedy
from tokenriver.prompts import check_pooling_length, check_prompt_length
from tokenriver.sched.output import (
    RequestStepResult,
    RequestUpdate,
    RunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
)
from tokenriver.sched.request import Request, RequestStatus
from tokenriver.sched.stop import check_stop

_NO_RESULT = RequestStepResult()


def _needs_nothing_between_passes(request: Request) -> bool:
    """Whether the request's next tokens need nothing between forward passes: plain greedy (params.is_plain_greedy,
    the sampler's own test) and no stop strings, which the engine checks on text. Multi-step passes decode such
    requests only."""
    params = request.sampling_params
    eos_token_ids = [] if params.ignore_eos else request.eos_token_ids
    return is_plain_greedy(params, request.num_output_tokens, eos_token_ids) and not params.stop


class Scheduler:
    """Decides each step's batch and applies its results; owns every unfinished Request."""

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        recompute_every_step: bool = False,
        num_scheduler_steps: int = 1,
        clock: Callable[[], float] = time.time,
    ) -> None:
        for name, value in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_model_len", max_model_len),
            ("num_scheduler_steps", num_scheduler_steps),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidParameterError(f"{name}={value!r} must be an integer >= 1", param=name)
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.recompute_every_step = recompute_every_step
        self.num_scheduler_steps = num_scheduler_steps
        self._clock = clock
        self._use_prefix_cache = block_manager.enable_prefix_caching and not recompute_every_step
        # Tokens the whole pool holds: a request alone may use all of it, never more.
        self._pool_num_tokens = block_manager.num_total_blocks * block_manager.block_size
        # The longest a sequence may grow (prompt + output) before it is stopped with LENGTH.
        self._max_num_tokens = min(max_model_len, self._pool_num_tokens)
        # Every unfinished request, by id.
        self._requests: dict[str, Request] = {}
        # Rank of each unfinished request: (priority, arrival_time, order added); lower is served first.
        self._ranks: dict[str, tuple[int, float, int]] = {}
        self._num_added = 0
        # Both sorted by rank.
        self._waiting: list[Request] = []
        self._running: list[Request] = []
        # Requests that finished since the last schedule(): reported to the runner, still visible to get_request.
        self._finished_ids: list[str] = []
        self._recently_finished: dict[str, Request] = {}
        self._num_preemptions = 0
        self._num_steps = 0
        self._num_prefill_tokens_last_step = 0
        self._num_decode_tokens_last_step = 0
        self._num_prefill_tokens_total = 0
        self._num_decode_tokens_total = 0
        self._num_draft_tokens_total = 0
        self._num_accepted_draft_tokens_total = 0
        self._num_speculative_steps_total = 0
        # Copy-on-write block copies of the step being scheduled (source id, destination id).
        self._block_copies: list[tuple[int, int]] = []

    # ---- requests in and out ----

    def add_request(self, request: Request) -> None:
        """Queue a request; raises if its prompt could never run here."""
        if request.request_id in self._requests:
            raise DuplicateRequestIdError(request.request_id)
        num_prompt_tokens = request.num_prompt_tokens
        check_prompt_length(num_prompt_tokens, self.max_model_len, is_pooling=request.is_pooling)
        if request.is_pooling:
            check_pooling_length(num_prompt_tokens, self.max_num_batched_tokens, self._pool_num_tokens)
        if num_prompt_tokens > self._pool_num_tokens:
            raise ContextLengthError(
                f"the prompt has {num_prompt_tokens} tokens but the KV cache holds only {self._pool_num_tokens} "
                f"({self.block_manager.num_total_blocks} blocks of {self.block_manager.block_size}): "
                f"shorten the prompt or give the KV cache more memory (kv_cache_memory)",
                num_tokens=num_prompt_tokens,
                max_tokens=self._pool_num_tokens,
            )
        if request.status is not RequestStatus.WAITING:
            raise RuntimeError(f"request {request.request_id!r} is added in status {request.status.value}")
        self._recently_finished.pop(request.request_id, None)
        self._requests[request.request_id] = request
        self._ranks[request.request_id] = (request.priority, request.arrival_time, self._num_added)
        self._num_added += 1
        bisect.insort(self._waiting, request, key=self._rank)

    def abort_request(self, request_id: str) -> bool:
        """Drop a request and everything it holds; False if it is unknown or already finished."""
        return self.finish_request(request_id, FinishReason.ABORT)

    def finish_request(self, request_id: str, reason: FinishReason, stop_reason: int | str | None = None) -> bool:
        """End a request from outside (a stop string matched, or an abort); False if unknown or already finished."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        self._finish(request, reason, stop_reason)
        return True

    def get_request(self, request_id: str) -> Request | None:
        """An unfinished request, or one that finished since the last schedule(); else None."""
        return self._requests.get(request_id) or self._recently_finished.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Requests queued, preempted ones included."""
        return len(self._waiting)

    @property
    def max_num_tokens(self) -> int:
        """The longest a sequence may grow (prompt + output) before it is stopped with LENGTH."""
        return self._max_num_tokens

    # ---- speculative decoding ----

    def decoding_requests(self) -> list[Request]:
        """Running requests whose next step computes just their last token: those a proposer may draft for."""
        return [r for r in self._running if r.num_tokens - r.num_computed_tokens == 1 and not r.is_beam]

    def set_draft_tokens(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Give requests draft tokens to verify in the next step (request id → drafts; unknown ids are skipped)."""
        for request_id, token_ids in draft_token_ids.items():
            request = self._requests.get(request_id)
            if request is not None and request.status is RequestStatus.RUNNING:
                request.draft_token_ids = list(token_ids)

    # ---- beam search ----

    def fork_request(self, parent_id: str, child_id: str, token_id: int) -> Request:
        """Start child_id as parent_id's tokens plus token_id, sharing every block the parent holds.

        A running parent's child runs at once, with the parent's computed tokens; a
        parent that lost its blocks (preempted) leaves its child to wait and recompute.
        The child keeps the parent's rank. The caller finishes the parent when done forking.
        """
        parent = self._requests[parent_id]
        if child_id in self._requests:
            raise RuntimeError(f"fork to request id {child_id!r}, which is already in use")
        child = parent.fork(child_id, token_id)
        self._requests[child_id] = child
        self._ranks[child_id] = self._ranks[parent_id]
        if parent.status is RequestStatus.RUNNING and parent.block_ids:
            self.block_manager.share(parent.block_ids)
            child.block_ids = list(parent.block_ids)
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_committed_blocks = parent.num_committed_blocks
            child.start_running(self._clock())
            bisect.insort(self._running, child, key=self._rank)
        else:
            bisect.insort(self._waiting, child, key=self._rank)
        return child

    # ---- one step ----

    def schedule(self) -> SchedulerOutput:
        """Choose this step's tokens: running requests first, then admissions; preempt if blocks run out."""
        now = self._clock()
        finished_ids, self._finished_ids = self._finished_ids, []
        self._recently_finished.clear()
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        num_preemptions_before = self._num_preemptions
        self._block_copies = []

        index = 0
        while index < len(self._running) and budget > 0:
            request = self._running[index]
            if request.is_awaiting_fork:
                index += 1
                continue
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
            draft_token_ids = request.draft_token_ids[: self._num_drafts(request, budget)]
            request.draft_token_ids = []
            if not self._grow(request, num_new_tokens + len(draft_token_ids)):
                break
            scheduled.append(self._scheduled_request(request, num_new_tokens, draft_token_ids))
            budget -= num_new_tokens + len(draft_token_ids)
            index += 1

        # No admissions in a step that preempted: the room is what the preempted requests need back.
        if self._num_preemptions == num_preemptions_before:
            budget = self._admit_waiting(scheduled, budget, now)
        awaiting = [r for r in self._running if r.is_awaiting_fork]
        if not scheduled and self._waiting and len(awaiting) == len(self._running):
            # Every running beam awaits beams that cannot be admitted: make room for them.
            for request in reversed(awaiting):
                self._running.remove(request)
                self._preempt(request)
            budget = self._admit_waiting(scheduled, budget, now)

        num_passes = self._num_decode_passes(scheduled)
        self._count_step(scheduled, num_passes)
        return SchedulerOutput(
            scheduled=scheduled,
            finished_request_ids=finished_ids,
            block_copies=self._block_copies,
            num_decode_passes=num_passes,
        )

    def _num_decode_passes(self, scheduled: list[ScheduledRequest]) -> int:
        """Forward passes for this step (multi-step scheduling, module docstring); takes the blocks of the passes
        after the first and gives every scheduled request its grown block table."""
        if self.num_scheduler_steps == 1 or self.recompute_every_step or not scheduled:
            return 1
        requests = [self._requests[item.request_id] for item in scheduled]
        if not all(
            item.num_tokens == 1
            and item.pooling_params is None
            and item.sample
            and not item.draft_token_ids
            and not item.num_beam_candidates
            and _needs_nothing_between_passes(request)
            for item, request in zip(scheduled, requests)
        ):
            return 1
        # As many as the request furthest from max_tokens wants (the others' rows past theirs are computed and
        # dropped), never past any request's room in the context.
        num_passes = min(
            self.num_scheduler_steps,
            max(self._num_tokens_wanted(request) for request in requests),
            *(self._max_num_tokens - request.num_tokens for request in requests),
        )
        if num_passes <= 1:
            return 1
        # Pass k (from 0) computes position num_computed_tokens + k.
        manager = self.block_manager
        growth = [
            manager.num_blocks_for(request.num_computed_tokens + num_passes) - len(request.block_ids)
            for request in requests
        ]
        if not manager.can_allocate(sum(growth)):
            return 1
        for item, request, num_new_blocks in zip(scheduled, requests, growth):
            request.block_ids.extend(manager.allocate(num_new_blocks))
            item.block_ids = list(request.block_ids)
        return num_passes

    def _num_tokens_wanted(self, request: Request) -> int:
        """Tokens the request may still append before check_stop ends it on length."""
        left = self._max_num_tokens - request.num_tokens
        max_tokens = request.sampling_params.max_tokens
        return left if max_tokens is None else min(left, max_tokens - request.num_output_tokens)

    def _admit_waiting(self, scheduled: list[ScheduledRequest], budget: int, now: float) -> int:
        """Admit waiting requests best rank first while tokens, seats and blocks last; returns the budget left."""
        while (
            self._waiting and budget > 0 and len(self._running) + self._num_seats(self._waiting[0]) <= self.max_num_seqs
        ):
            num_new_tokens = self._admit(self._waiting[0], budget, now)
            if num_new_tokens == 0:
                break
            request = self._waiting.pop(0)
            bisect.insort(self._running, request, key=self._rank)
            scheduled.append(self._scheduled_request(request, num_new_tokens))
            budget -= num_new_tokens
        return budget

    def update(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput) -> list[RequestUpdate]:
        """Apply a step's results: advance the computed tokens, append sampled ones, stop, free, report."""
        now = self._clock()
        updates: list[RequestUpdate] = []
        multi_step = scheduler_output.num_decode_passes > 1
        for scheduled in scheduler_output.scheduled:
            request = self._requests.get(scheduled.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                # Aborted or finished after it was scheduled: whatever it sampled is dropped.
                continue
            request.num_computed_tokens += scheduled.num_tokens
            result = runner_output.results.get(request.request_id, _NO_RESULT)
            if request.is_pooling:
                updates.append(self._finish_pooling(request, result))
                continue
            prompt_logprobs = self._new_prompt_logprobs(request, scheduled, result.prompt_logprobs)
            # A chunk that does not reach the last known token has nothing to sample.
            sampled_token_ids = result.token_ids if scheduled.sample else []
            if scheduled.draft_token_ids and sampled_token_ids:
                self._count_verification(request, len(scheduled.draft_token_ids), len(sampled_token_ids) - 1)
            new_token_ids: list[int] = []
            stop = None
            for token_id in sampled_token_ids:
                request.append_output_token(token_id, now)
                new_token_ids.append(token_id)
                stop = check_stop(request, self._max_num_tokens)
                if stop is not None:
                    # Tokens sampled past a stop (speculation, multi-step passes) are dropped.
                    break
            if multi_step and new_token_ids:
                # Each pass after the first computed the K/V of the token sampled before it.
                request.num_computed_tokens += len(new_token_ids) - 1
            # The passes past a multi-step request's stop computed only the others' tokens.
            request.metrics.num_forward_passes += len(new_token_ids) if multi_step else 1
            if stop is not None:
                self._finish(request, stop.reason, stop.stop_reason)
            elif self.recompute_every_step and new_token_ids:
                self._free_blocks(request)
            elif scheduled.draft_token_ids or multi_step:
                self._free_blocks_past_end(request)
            beam_candidates = result.beam_candidates if scheduled.sample else []
            if new_token_ids or prompt_logprobs or request.is_finished or beam_candidates:
                num_new = len(new_token_ids)
                updates.append(
                    RequestUpdate(
                        request_id=request.request_id,
                        new_token_ids=new_token_ids,
                        new_logprobs=result.logprobs[:num_new],
                        new_traces=result.traces[:num_new],
                        prompt_logprobs=prompt_logprobs,
                        finish_reason=request.finish_reason,
                        stop_reason=request.stop_reason,
                        num_cached_tokens=request.num_cached_tokens,
                        metrics=request.metrics,
                        beam_candidates=beam_candidates,
                    )
                )
        return updates

    def _finish_pooling(self, request: Request, result: RequestStepResult) -> RequestUpdate:
        """A pooling request's one step is done: it finishes with its vector, and its blocks go back."""
        if result.pooled is None:
            raise RuntimeError(f"pooling request {request.request_id!r} ran but the runner pooled nothing")
        request.metrics.num_forward_passes += 1
        self._finish(request, FinishReason.STOP, None)
        return RequestUpdate(
            request_id=request.request_id,
            finish_reason=request.finish_reason,
            num_cached_tokens=request.num_cached_tokens,
            metrics=request.metrics,
            pooled=result.pooled,
        )

    def stats(self) -> SchedulerStats:
        manager = self.block_manager
        return SchedulerStats(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            num_preempted_total=self._num_preemptions,
            num_blocks_total=manager.num_total_blocks,
            num_blocks_used=manager.num_used_blocks,
            num_blocks_free=manager.num_free_blocks,
            kv_usage=manager.usage,
            prefix_cache_queried_tokens=manager.num_prefix_queried_tokens,
            prefix_cache_hit_tokens=manager.num_prefix_hit_tokens,
            prefix_cache_hit_rate=manager.prefix_cache_hit_rate,
            num_prefill_tokens_last_step=self._num_prefill_tokens_last_step,
            num_decode_tokens_last_step=self._num_decode_tokens_last_step,
            num_prefill_tokens_total=self._num_prefill_tokens_total,
            num_decode_tokens_total=self._num_decode_tokens_total,
            num_steps=self._num_steps,
            num_draft_tokens_total=self._num_draft_tokens_total,
            num_accepted_draft_tokens_total=self._num_accepted_draft_tokens_total,
            num_speculative_steps_total=self._num_speculative_steps_total,
        )

    # ---- helpers ----

    def _rank(self, request: Request) -> tuple[int, float, int]:
        return self._ranks[request.request_id]

    def _grow(self, request: Request, num_new_tokens: int) -> bool:
        """Give a running request the blocks for num_new_tokens more, preempting the worst-ranked if needed.

        Returns False when the request itself was the one preempted. The running
        list is walked best rank first and victims come off its end, so a victim
        was never scheduled earlier in this step.
        """
        manager = self.block_manager
        num_new_blocks = manager.num_blocks_for(request.num_computed_tokens + num_new_tokens) - len(request.block_ids)
        while not manager.can_allocate(num_new_blocks + self._needs_copy(request)):
            victim = self._running.pop()
            self._preempt(victim)
            if victim is request:
                return False
        if self._needs_copy(request):
            index = request.num_computed_tokens // manager.block_size
            shared_block_id = request.block_ids[index]
            (request.block_ids[index],) = manager.allocate(1)
            self._block_copies.append((shared_block_id, request.block_ids[index]))
            manager.free([shared_block_id])
        request.block_ids.extend(manager.allocate(num_new_blocks))
        return True

    def _needs_copy(self, request: Request) -> bool:
        """Whether the block this step writes first is shared with another request (copy-on-write)."""
        index = request.num_computed_tokens // self.block_manager.block_size
        return index < len(request.block_ids) and self.block_manager.ref_count(request.block_ids[index]) > 1

    def _admit(self, request: Request, budget: int, now: float) -> int:
        """Start a waiting request: reuse its cached prefix, take blocks for its first chunk.

        Returns the number of tokens it computes this step, 0 if the blocks are not there.
        """
        manager = self.block_manager
        cached_block_ids = self._find_cached_blocks(request)
        num_cached_tokens = len(cached_block_ids) * manager.block_size
        num_new_tokens = min(request.num_tokens - num_cached_tokens, budget)
        if request.is_pooling and num_new_tokens < request.num_tokens:
            return 0  # never a chunk: it waits for a step with room for its whole input
        num_new_blocks = manager.num_blocks_for(num_cached_tokens + num_new_tokens) - len(cached_block_ids)
        if not manager.can_allocate(num_new_blocks, cached_block_ids):
            return 0
        request.block_ids = cached_block_ids + manager.allocate(num_new_blocks, cached_block_ids)
        request.num_computed_tokens = num_cached_tokens
        request.num_committed_blocks = len(cached_block_ids)
        if request.status is RequestStatus.WAITING:
            request.num_cached_tokens = num_cached_tokens
        if self._may_reuse_prefix(request):
            manager.record_prefix_query(request.num_tokens, num_cached_tokens)
        request.start_running(now)
        return num_new_tokens

    def _num_seats(self, request: Request) -> int:
        """Sequence slots an admission takes: a beam search's first request holds the room for all its beams."""
        if request.is_beam and request.num_output_tokens == 0:
            return request.sampling_params.beam_width or 1
        return 1

    def _may_reuse_prefix(self, request: Request) -> bool:
        # Prompt logprobs need the logits of every prompt position, and pooling every position's hidden state,
        # so nothing may be skipped.
        return self._use_prefix_cache and request.sampling_params.prompt_logprobs is None and not request.is_pooling

    def _find_cached_blocks(self, request: Request) -> list[int]:
        if not self._may_reuse_prefix(request):
            return []
        self.block_manager.extend_block_hashes(request.block_hashes, request.all_token_ids)
        # At least the last known token is computed, so that its logits exist to sample from.
        max_num_blocks = (request.num_tokens - 1) // self.block_manager.block_size
        return self.block_manager.find_cached_blocks(request.block_hashes[:max_num_blocks])

    def _commit_full_blocks(self, request: Request, num_new_tokens: int) -> None:
        """Offer the blocks this step fills to the prefix cache, before they are computed.

        Their tokens are known, and a request admitted later in the same step may
        already reuse them (n > 1 candidates, prompts sent together): the runner
        writes each layer's K/V for the whole step before any attention reads it.
        """
        if not self._use_prefix_cache or request.is_pooling:
            return
        num_full_blocks = (request.num_computed_tokens + num_new_tokens) // self.block_manager.block_size
        start = request.num_committed_blocks
        if num_full_blocks <= start:
            return
        self.block_manager.extend_block_hashes(request.block_hashes, request.all_token_ids)
        self.block_manager.cache_blocks(
            request.block_ids[start:num_full_blocks], request.block_hashes[start:num_full_blocks]
        )
        request.num_committed_blocks = num_full_blocks

    def _new_prompt_logprobs(
        self, request: Request, scheduled: ScheduledRequest, prompt_logprobs: list[TokenLogprobs]
    ) -> list[TokenLogprobs]:
        """Keep the prompt logprobs not reported yet.

        Entry i belongs to position scheduled.start_position + i; a recompute after
        a preemption produces the early positions again, which were already reported.
        """
        num_known = request.num_prompt_logprobs - scheduled.start_position
        new = prompt_logprobs[max(num_known, 0) :]
        request.num_prompt_logprobs += len(new)
        return new

    def _num_drafts(self, request: Request, budget: int) -> int:
        """How many of the request's draft tokens fit this step.

        Only a request one token behind verifies drafts. They must fit the budget
        after its own token, and the tokens they can add (drafts + 1) must not run
        past max_tokens or the longest allowed sequence.
        """
        if not request.draft_token_ids or request.num_tokens - request.num_computed_tokens != 1:
            return 0
        limit = min(len(request.draft_token_ids), budget - 1, self._max_num_tokens - request.num_tokens - 1)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            limit = min(limit, max_tokens - request.num_output_tokens - 1)
        return max(limit, 0)

    def _count_verification(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """The target accepted num_accepted of num_drafts drafts: their K/V stays, and the counts grow."""
        request.num_computed_tokens += num_accepted
        metrics = request.metrics
        metrics.num_draft_tokens += num_drafts
        metrics.num_accepted_draft_tokens += num_accepted
        metrics.num_speculative_steps += 1
        self._num_draft_tokens_total += num_drafts
        self._num_accepted_draft_tokens_total += num_accepted
        self._num_speculative_steps_total += 1

    def _free_blocks_past_end(self, request: Request) -> None:
        """Give back the blocks past the request's known tokens: they hold only rejected drafts' K/V."""
        num_kept = self.block_manager.num_blocks_for(request.num_tokens)
        if len(request.block_ids) > num_kept:
            self.block_manager.free(request.block_ids[num_kept:])
            del request.block_ids[num_kept:]

    def _scheduled_request(
        self, request: Request, num_new_tokens: int, draft_token_ids: list[int] | None = None
    ) -> ScheduledRequest:
        self._commit_full_blocks(request, num_new_tokens)
        start = request.num_computed_tokens
        params = request.sampling_params
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start : start + num_new_tokens],
            start_position=start,
            block_ids=list(request.block_ids),
            sample=start + num_new_tokens == request.num_tokens,
            sampling_params=params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            eos_token_ids=[] if params.ignore_eos else request.eos_token_ids,
            draft_token_ids=draft_token_ids or [],
            num_beam_candidates=request.num_beam_candidates,
            pooling_params=request.pooling_params,
        )

    def _count_step(self, scheduled: list[ScheduledRequest], num_passes: int) -> None:
        # A decode computes one known token, plus the drafts it verifies; one per pass in a multi-step step.
        num_decode = num_passes * sum(
            s.num_scheduled_tokens
            for s in scheduled
            if s.num_tokens == 1 and s.start_position >= len(s.prompt_token_ids)
        )
        num_prefill = sum(s.num_scheduled_tokens for s in scheduled) - num_decode
        self._num_prefill_tokens_last_step = num_prefill
        self._num_decode_tokens_last_step = num_decode
        self._num_prefill_tokens_total += num_prefill
        self._num_decode_tokens_total += num_decode
        if scheduled:
            self._num_steps += 1

    def _free_blocks(self, request: Request) -> None:
        """Give the request's blocks back (its full ones stay in the prefix cache); nothing is computed any more."""
        self.block_manager.free(request.block_ids)
        request.block_ids = []
        request.num_computed_tokens = 0
        request.num_committed_blocks = 0

    def _preempt(self, request: Request) -> None:
        self._free_blocks(request)
        request.preempt()
        self._num_preemptions += 1
        bisect.insort(self._waiting, request, key=self._rank)

    def _finish(self, request: Request, reason: FinishReason, stop_reason: int | str | None) -> None:
        if request.status is RequestStatus.RUNNING:
            self._running.remove(request)
        else:
            self._waiting.remove(request)
        self._free_blocks(request)
        request.finish(reason, stop_reason, self._clock())
        del self._requests[request.request_id]
        del self._ranks[request.request_id]
        self._finished_ids.append(request.request_id)
        self._recently_finished[request.request_id] = request
