"""What the engine hands back: RequestOutput and its parts.

Shapes follow vLLM's so its users feel at home: one `RequestOutput` per
request, one `CompletionOutput` per candidate (n > 1), logprobs as one
{token_id: Logprob} dict per position. Streaming deltas and final results use
the same types; `text` is always the full text so far, `delta_text` what is
new since the previous output. Stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from tokenriver.trace import BeamStep, StepTrace


class FinishReason(str, Enum):
    """Why a candidate stopped: OpenAI's two values."""

    # EOS, a stop token id or a stop string.
    STOP = "stop"
    # max_tokens reached, or the context / KV pool has no room for more.
    LENGTH = "length"
    # Aborted by the caller (a disconnected client); never returned to a live caller.
    ABORT = "abort"


@dataclass
class Logprob:
    """The log-probability of one token at one position."""

    # log softmax of the model's raw logits (before sampling controls), as vLLM and OpenAI report.
    logprob: float
    # 1-based rank in the raw distribution.
    rank: int
    # Text of the token alone (filled in by the engine).
    decoded_token: str = ""


@dataclass
class TokenLogprobs:
    """Internal record of one position's log-probabilities (sampler → scheduler → engine); the API gets `Logprob`
    dicts."""

    # The token at this position (sampled, or the next prompt token).
    token_id: int
    logprob: float
    # 1-based rank of token_id.
    rank: int
    # The top alternatives, best first: (token id, logprob).
    top: list[tuple[int, float]] = field(default_factory=list)


# One dict per position: the sampled/prompt token plus the top alternatives.
PositionLogprobs = dict[int, Logprob]


@dataclass
class ToolCall:
    """One tool call parsed from a chat reply, in OpenAI's terms."""

    # "call_" and 24 hex digits, unique per call: a tool result names it as its tool_call_id.
    id: str
    # The function's name, one of the tools offered.
    name: str
    # The arguments as JSON text (an object), as OpenAI sends them.
    arguments: str


@dataclass
class CompletionOutput:
    """One candidate continuation of a prompt."""

    # Position among the returned candidates (0..n-1).
    index: int
    # All text generated so far (stop string cut unless asked).
    text: str = ""
    # All token ids generated so far.
    token_ids: list[int] = field(default_factory=list)
    # Sum of the raw log-probabilities of token_ids.
    cumulative_logprob: float = 0.0
    # Per generated token, when SamplingParams.logprobs is set; else None.
    logprobs: list[PositionLogprobs] | None = None
    # None while running.
    finish_reason: FinishReason | None = None
    # The stop string or stop token id that matched (None for EOS or length).
    stop_reason: str | int | None = None
    # Per generated token, when SamplingParams.trace is set; else None.
    trace: list[StepTrace] | None = None
    # Beam search only: the beam's score, cumulative_logprob / (len(token_ids) ** length_penalty)
    # (transformers' sequences_scores); None for sampled or greedy candidates.
    beam_score: float | None = None
    # Text added since the previous output of this request (streaming).
    delta_text: str = ""
    # Token ids added since the previous output of this request (streaming).
    delta_token_ids: list[int] = field(default_factory=list)
    # LLM.chat with tools only (None otherwise): the reply without its tool-call envelope (None when it is only
    # calls), and the calls parsed from `text` ([] when the model answered in prose).
    content: str | None = None
    tool_calls: list[ToolCall] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timings of one request, in seconds since the epoch (time.time())."""

    arrival_time: float
    # When the scheduler first gave it tokens to compute.
    first_scheduled_time: float | None = None
    # When its first generated token was sampled.
    first_token_time: float | None = None
    # When its last token was sampled.
    last_token_time: float | None = None
    finished_time: float | None = None
    # Prompt tokens served from the prefix cache instead of being computed.
    num_cached_tokens: int = 0
    # How many times the request lost its KV blocks and was recomputed.
    num_preemptions: int = 0
    # Speculative decoding: draft tokens proposed for this request and verified by the target model,
    # and how many of them the target accepted (the rest were rejected and their K/V rolled back).
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    # Verification passes that carried at least one draft token.
    num_speculative_steps: int = 0
    # Forward passes of the model that computed this request: one per prompt chunk and per decode step (a
    # verification of drafts is one pass however many tokens it accepts), one per token in a multi-step step.
    num_forward_passes: int = 0

    @property
    def num_rejected_draft_tokens(self) -> int:
        return self.num_draft_tokens - self.num_accepted_draft_tokens

    @property
    def draft_acceptance_rate(self) -> float | None:
        """Accepted / proposed draft tokens; None without speculation."""
        return None if self.num_draft_tokens == 0 else self.num_accepted_draft_tokens / self.num_draft_tokens

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens gained per verification pass, 1 + accepted / passes (vLLM's "mean acceptance length")."""
        if self.num_speculative_steps == 0:
            return None
        return 1 + self.num_accepted_draft_tokens / self.num_speculative_steps

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def time_per_output_token(self, num_output_tokens: int) -> float | None:
        """Mean gap between generated tokens after the first (decode speed)."""
        if self.first_token_time is None or self.last_token_time is None or num_output_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (num_output_tokens - 1)


@dataclass
class RequestOutput:
    """The state of one request: returned by LLM.generate and streamed by the async engine."""

    request_id: str
    # The prompt text, when the request was given as text.
    prompt: str | None
    prompt_token_ids: list[int]
    # One candidate per returned sequence (n of them once finished).
    outputs: list[CompletionOutput]
    # True once every candidate has finished.
    finished: bool
    metrics: RequestMetrics
    # Per prompt position (None for the first), when SamplingParams.prompt_logprobs is set.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # A pooling request (PoolingParams) only: its embedding (task "embed") or its relevance score (task "score");
    # such a request generates nothing, so `outputs` is empty.
    embedding: list[float] | None = None
    score: float | None = None
    # A beam search with SamplingParams.beam_trace only: each step's beams, ranked continuations and survivors.
    beam_steps: list[BeamStep] | None = None

    @property
    def num_cached_tokens(self) -> int:
        return self.metrics.num_cached_tokens
