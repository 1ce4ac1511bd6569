"""The two plain-data contracts around one step.

`SchedulerOutput` (scheduler → runner): which requests compute which tokens
this step, and where their K/V lives. `RunnerOutput` (runner → scheduler):
what was sampled. No tensors on either side, so the scheduler can be driven by
a scripted fake runner in tests. Then, scheduler → engine: one `RequestUpdate`
per request that produced something, and `SchedulerStats` for metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenriver.outputs import FinishReason, RequestMetrics, TokenLogprobs
from tokenriver.params import PoolingParams, SamplingParams


@dataclass
class ScheduledRequest:
    """One request's share of a step."""

    request_id: str
    # Tokens to compute this step: positions start_position .. start_position + len(token_ids) - 1.
    token_ids: list[int]
    # Tokens of this request whose K/V is already in the cache (num_computed_tokens before the step).
    start_position: int
    # The request's block table: every block it holds, in order.
    block_ids: list[int]
    # True when the step reaches the end of the known tokens, so the last position's logits are sampled.
    sample: bool
    # The request's sampling controls (shared reference, not a copy).
    sampling_params: SamplingParams
    # The prompt's token ids (shared reference; repetition penalty and prompt logprobs read it).
    prompt_token_ids: list[int]
    # Tokens generated so far (shared reference; penalties and min_tokens read it).
    output_token_ids: list[int]
    # Extra ids treated as end-of-sequence for min_tokens blocking (model EOS ids, unless ignore_eos).
    eos_token_ids: list[int] = field(default_factory=list)
    # Speculative decoding: draft tokens computed after token_ids (positions start_position + len(token_ids) ..),
    # whose logits, with the last known token's, verify them. Only with sample; empty otherwise.
    draft_token_ids: list[int] = field(default_factory=list)
    # Beam search: report this many most likely next tokens instead of sampling (0 = sample).
    num_beam_candidates: int = 0
    # A pooling request: its whole prompt is scheduled, and the step pools it instead of sampling.
    pooling_params: PoolingParams | None = None

    @property
    def num_tokens(self) -> int:
        """Known tokens computed this step (draft tokens not included)."""
        return len(self.token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Every token of the forward pass: known plus draft."""
        return len(self.token_ids) + len(self.draft_token_ids)


@dataclass
class SchedulerOutput:
    """Everything the runner needs for one forward pass.

    Requests of one step may share blocks that this very step fills (a prefix-cache
    hit on a prompt computed alongside): the runner must write the step's K/V of
    each layer before any attention of that layer reads the cache.
    """

    # The requests that run this step, in batch order.
    scheduled: list[ScheduledRequest]
    # Requests that left since the previous step (finished or aborted): the runner drops their state.
    finished_request_ids: list[str] = field(default_factory=list)
    # Block copies to do before the forward pass (source id, destination id), e.g. copy-on-write.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Forward passes of this step (multi-step scheduling): after the first, each feeds every request the token the
    # pass before sampled. Above 1 only when every request is a plain greedy decode (Scheduler docstring); each
    # request's block_ids then hold slots for all of the passes' tokens.
    num_decode_passes: int = 1

    @property
    def num_batched_tokens(self) -> int:
        return sum(r.num_scheduled_tokens for r in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class RequestStepResult:
    """What one request got out of a step."""

    # Newly sampled tokens: one per step without speculation; with draft tokens, the accepted drafts followed
    # by one token the target chose itself (so len - 1 drafts were accepted); empty for a prompt chunk that
    # does not sample.
    token_ids: list[int] = field(default_factory=list)
    # One entry per sampled token: its raw logprob and rank always, `top` only when logprobs were asked.
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # One StepTrace per sampled token, when SamplingParams.trace is set.
    traces: list = field(default_factory=list)
    # Prompt logprobs for the prompt positions computed this step (when prompt_logprobs is set).
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Beam search: the most likely next tokens and their raw logprobs, best first (token_ids stays empty).
    beam_candidates: list[TokenLogprobs] = field(default_factory=list)
    # A pooling request: its embedding, or [score] for task "score" (token_ids stays empty).
    pooled: list[float] | None = None


@dataclass
class RunnerOutput:
    """What the runner returns for a step, keyed by request id."""

    results: dict[str, RequestStepResult] = field(default_factory=dict)


@dataclass
class RequestUpdate:
    """What one request produced in a step, after token-level stops (scheduler → engine)."""

    request_id: str
    # Tokens appended this step (tokens sampled past a stop are dropped).
    new_token_ids: list[int] = field(default_factory=list)
    # One entry per new token, aligned with new_token_ids.
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # One StepTrace per new token, when SamplingParams.trace is set.
    new_traces: list = field(default_factory=list)
    # Prompt logprobs not reported before, in prompt order (positions recomputed after a preemption are not repeated).
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Set when the request finished this step by a token-level stop (EOS, stop token id, max_tokens, context full).
    finish_reason: FinishReason | None = None
    # The stop token id that matched (None for EOS or length).
    stop_reason: int | str | None = None
    # Prompt tokens served from the prefix cache at the request's first admission.
    num_cached_tokens: int = 0
    # The request's timings (shared reference: final once finished).
    metrics: RequestMetrics | None = None
    # Beam search: the beam's most likely next tokens, best first (new_token_ids stays empty).
    beam_candidates: list[TokenLogprobs] = field(default_factory=list)
    # A pooling request, finished this step: its embedding, or [score] (RequestStepResult.pooled).
    pooled: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SchedulerStats:
    """A snapshot of the scheduler and its KV pool, for logs, /metrics and the visualizer."""

    num_running: int
    num_waiting: int
    # Preemptions since the start (a request preempted twice counts twice).
    num_preempted_total: int
    num_blocks_total: int
    num_blocks_used: int
    # Free blocks, including cached ones nobody holds (they are evicted on demand).
    num_blocks_free: int
    # num_blocks_used / num_blocks_total.
    kv_usage: float
    # Tokens looked up in the prefix cache at admissions, and how many of them were found.
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    # prefix_cache_hit_tokens / prefix_cache_queried_tokens (0 before any lookup).
    prefix_cache_hit_rate: float
    # Tokens computed in the last scheduled step: prompt (and recomputed) tokens vs one-token decodes.
    num_prefill_tokens_last_step: int
    num_decode_tokens_last_step: int
    num_prefill_tokens_total: int
    num_decode_tokens_total: int
    # Non-empty steps scheduled since the start.
    num_steps: int
    # Speculative decoding since the start: draft tokens verified, accepted by the target (rejected = the
    # difference), and verification passes (one per request and step that carried drafts).
    num_draft_tokens_total: int = 0
    num_accepted_draft_tokens_total: int = 0
    num_speculative_steps_total: int = 0

    @property
    def num_rejected_draft_tokens_total(self) -> int:
        return self.num_draft_tokens_total - self.num_accepted_draft_tokens_total

    @property
    def draft_acceptance_rate(self) -> float:
        """Accepted / verified draft tokens (0 before any)."""
        return (
            self.num_accepted_draft_tokens_total / self.num_draft_tokens_total if self.num_draft_tokens_total else 0.0
        )

    @property
    def mean_accepted_length(self) -> float:
        """Tokens gained per verification pass: 1 + accepted / passes (0 before any)."""
        if not self.num_speculative_steps_total:
            return 0.0
        return 1 + self.num_accepted_draft_tokens_total / self.num_speculative_steps_total
