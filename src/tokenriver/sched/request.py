"""Request: one sequence's scheduling state, and the state machine it moves through.

```
WAITING ──schedule──▶ RUNNING ──preempt──▶ PREEMPTED ──schedule──▶ RUNNING ...
   │                     │                     │
   └──────────── finish (stop, length, abort) ─┴──▶ FINISHED_STOPPED | FINISHED_LENGTH | FINISHED_ABORTED
```
Finished states are final. Every transition goes through `_move`, which refuses
any other, so a scheduler bug shows up where it happens instead of as a wrong token
three steps later.

The scheduling arithmetic needs two numbers: `num_tokens` (prompt + output, every
token known so far) and `num_computed_tokens` (those whose K/V is in the cache).
A step computes some of the tokens in between; when it reaches `num_tokens`, the
last position's logits are sampled and one more token becomes known.

Stdlib only: no tensors, no block pool (the scheduler owns those and hands this
request its block ids).
"""

from __future__ import annotations

import dataclasses
from enum import Enum

from tokenriver.outputs import FinishReason, RequestMetrics
from tokenriver.params import PoolingParams, SamplingParams


class RequestStatus(str, Enum):
    """Where a request is in its life."""

    # Queued, holding no blocks, never scheduled yet.
    WAITING = "waiting"
    # Admitted: holds blocks and gets tokens to compute each step (budget permitting).
    RUNNING = "running"
    # Gave its blocks back to make room; queued again, to recompute prompt + output from its first token.
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED})

_STATUS_OF_REASON = {
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
    FinishReason.ABORT: RequestStatus.FINISHED_ABORTED,
}

# Which status may follow which.
_TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    RequestStatus.WAITING: frozenset({RequestStatus.RUNNING}) | _FINISHED,
    RequestStatus.RUNNING: frozenset({RequestStatus.PREEMPTED}) | _FINISHED,
    RequestStatus.PREEMPTED: frozenset({RequestStatus.RUNNING}) | _FINISHED,
    RequestStatus.FINISHED_STOPPED: frozenset(),
    RequestStatus.FINISHED_LENGTH: frozenset(),
    RequestStatus.FINISHED_ABORTED: frozenset(),
}


class Request:
    """One sequence being generated: its tokens, its progress through the cache, its blocks, its timings."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: list[int],
        arrival_time: float,
        priority: int = 0,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        # Set for a pooling request (an embedding or a score): its whole prompt runs in one step, which pools
        # the final hidden states instead of sampling and finishes it; sampling_params are then unused.
        self.pooling_params = pooling_params
        # Lower value = served first; equal priorities are served in arrival order.
        self.priority = priority
        self.arrival_time = arrival_time
        # The model's end-of-sequence ids (ignored for stopping when sampling_params.ignore_eos).
        self.eos_token_ids = list(eos_token_ids)
        self.status = RequestStatus.WAITING
        # Own copies, shared by reference with the runner through ScheduledRequest.
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        # prompt_token_ids + output_token_ids, kept as one list so slicing a step's tokens is cheap.
        self.all_token_ids = list(prompt_token_ids)
        # Tokens whose K/V is in this request's blocks (prefix-cache hits included).
        self.num_computed_tokens = 0
        # The block table: the blocks holding positions 0.., in order.
        self.block_ids: list[int] = []
        # Chain hash of each full block of all_token_ids (filled lazily by the scheduler).
        self.block_hashes: list[bytes] = []
        # Leading blocks of block_ids already offered to the prefix cache.
        self.num_committed_blocks = 0
        # Prompt logprobs already reported (a recompute after preemption does not report them twice).
        self.num_prompt_logprobs = 0
        # Speculative decoding: tokens a proposer guessed to follow all_token_ids, verified by the next step
        # (scheduled after the last known token, in the same forward pass); consumed when scheduled.
        self.draft_token_ids: list[int] = []
        # Beam search: this request is one beam, and a step that reaches its last token reports this many most
        # likely next tokens (RequestStepResult.beam_candidates) instead of sampling one; 0 = sample as usual.
        # The beam search decides which tokens beams continue with (`Scheduler.fork_request`).
        self.num_beam_candidates = 0
        self.finish_reason: FinishReason | None = None
        # The stop token id or stop string that ended the request (None for EOS, length, abort).
        self.stop_reason: int | str | None = None
        self.metrics = RequestMetrics(arrival_time=arrival_time)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, computed={self.num_computed_tokens}/"
            f"{self.num_tokens}, output={self.num_output_tokens}, blocks={self.block_ids})"
        )

    # ---- counts ----

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache at the first admission."""
        return self.metrics.num_cached_tokens

    @num_cached_tokens.setter
    def num_cached_tokens(self, value: int) -> None:
        self.metrics.num_cached_tokens = value

    @property
    def num_preemptions(self) -> int:
        return self.metrics.num_preemptions

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_pooling(self) -> bool:
        return self.pooling_params is not None

    @property
    def is_beam(self) -> bool:
        return self.num_beam_candidates > 0

    @property
    def is_awaiting_fork(self) -> bool:
        """A beam whose next-token candidates are computed: nothing to do until the beam search forks it."""
        return self.is_beam and self.num_computed_tokens == self.num_tokens

    def fork(self, request_id: str, token_id: int) -> "Request":
        """A new waiting request whose tokens are this one's plus token_id (a beam's continuation).

        It holds no blocks: the scheduler shares the parent's with it, or lets it recompute them.
        """
        child = Request(
            request_id,
            self.prompt_token_ids,
            self.sampling_params,
            self.eos_token_ids,
            self.arrival_time,
            self.priority,
        )
        child.output_token_ids = self.output_token_ids + [token_id]
        child.all_token_ids = self.all_token_ids + [token_id]
        child.block_hashes = list(self.block_hashes)
        child.num_prompt_logprobs = self.num_prompt_logprobs
        child.num_beam_candidates = self.num_beam_candidates
        child.metrics = dataclasses.replace(self.metrics)
        return child

    # ---- transitions ----

    def start_running(self, now: float) -> None:
        """Admitted by the scheduler (first time, or back after a preemption)."""
        self._move(RequestStatus.RUNNING)
        if self.metrics.first_scheduled_time is None:
            self.metrics.first_scheduled_time = now

    def preempt(self) -> None:
        """Lost its blocks to make room: everything is recomputed on the next admission; output tokens are kept."""
        if self.block_ids:
            raise RuntimeError(f"request {self.request_id!r} is preempted while holding blocks {self.block_ids}")
        self._move(RequestStatus.PREEMPTED)
        self.num_computed_tokens = 0
        self.num_committed_blocks = 0
        self.draft_token_ids = []
        self.metrics.num_preemptions += 1

    def append_output_token(self, token_id: int, now: float) -> None:
        """A token was sampled for this request."""
        if self.status is not RequestStatus.RUNNING:
            raise RuntimeError(f"token appended to request {self.request_id!r} in status {self.status.value}")
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        self.metrics.last_token_time = now

    def finish(self, reason: FinishReason, stop_reason: int | str | None, now: float) -> None:
        """Ends the request for good (the scheduler frees its blocks)."""
        self._move(_STATUS_OF_REASON[reason])
        self.draft_token_ids = []
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.metrics.finished_time = now

    def _move(self, status: RequestStatus) -> None:
        if status not in _TRANSITIONS[self.status]:
            raise RuntimeError(f"request {self.request_id!r} cannot go from {self.status.value} to {status.value}")
        self.status = status
