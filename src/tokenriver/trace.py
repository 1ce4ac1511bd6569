"""Per-step generation trace: why each token was chosen.

A `StepTrace` records, for one generated token, the top candidates of the
model's distribution and what each sampling stage did to them. It is plain
data (stdlib only) so it can travel from the sampler to the API, the CLI
table and the visualizer unchanged.

Stage names, in the order the sampler applies them, are listed in `STAGES`. With `trace_stages` the trace also
keeps, for each stage that ran on the row, the candidates' distribution right after it (`TraceStage`): what a
reader sees is the step itself, not a replay of it.

A beam search has no per-token draw; with `beam_trace` it records a `BeamStep` per step instead: the running beams,
their best continuations ranked by cumulative log-probability, and which ran on, finished or were pruned.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The sampler's processing order; `TraceCandidate.removed_by` is one of these.
STAGES: tuple[str, ...] = ("penalty", "bias", "min_tokens", "grammar", "temperature", "top_k", "top_p", "min_p")


@dataclass
class TraceCandidate:
    """One token of the distribution at a step."""

    # Vocabulary id of the candidate.
    token_id: int
    # Its text, decoded alone; filled in by the engine, which owns the tokenizer (the sampler leaves "").
    text: str
    # The model's raw logit, before any processing.
    logit: float
    # Probability under softmax(raw logits): what the model itself believes.
    prob_raw: float
    # Probability in the distribution actually sampled from (0 when removed).
    prob_final: float
    # Rank by raw probability, 1 = most likely.
    rank: int
    # The first stage that removed this candidate (probability forced to 0), or None if it survived.
    removed_by: str | None = None
    # Logit after penalties and bias, before temperature (equals `logit` when no such stage applied).
    logit_processed: float | None = None


@dataclass
class TraceStage:
    """The candidates' distribution right after one sampling stage, as the sampler computed it at this step."""

    # One of STAGES.
    name: str
    # Per candidate, in StepTrace.candidates' order: its logit after this stage (None once a stage removed it).
    logits: list[float | None]
    # Per candidate: softmax over the whole vocabulary of the logits after this stage.
    probs: list[float]
    # How many vocabulary entries are still possible after this stage.
    num_kept: int


@dataclass
class StepTrace:
    """Everything the sampler knew when it chose one token."""

    # Index of the generated token this step produced (0 = first generated token).
    index: int
    # The top candidates by raw probability, best first (plus the chosen one if it ranked lower).
    candidates: list[TraceCandidate]
    # The token that was sampled.
    chosen_token_id: int
    # Rank of the chosen token under the raw distribution (1 = argmax).
    chosen_rank: int
    # Probability of the chosen token in the raw distribution.
    chosen_prob_raw: float
    # Probability of the chosen token in the processed distribution it was drawn from.
    chosen_prob_final: float
    # Shannon entropy (nats) of the raw distribution.
    entropy_raw: float
    # Shannon entropy (nats) of the processed distribution.
    entropy_final: float
    # How many vocabulary entries survived all filters.
    num_candidates_kept: int
    # Temperature used at this step (0 = greedy).
    temperature: float
    # "greedy" or "sample": how the token was picked from the processed distribution.
    method: str = "sample"
    # Extra per-strategy facts (speculative accept/reject, beam index; for a sampled token, "draw": the uniform
    # and the span of the cumulative distribution it landed in); empty when unused.
    extra: dict[str, object] = field(default_factory=dict)
    # With trace_stages: every stage that ran on this row, in the sampler's order (None = not asked for).
    stages: list[TraceStage] | None = None

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form for the API and the visualizer."""
        return {
            "index": self.index,
            "chosen_token_id": self.chosen_token_id,
            "chosen_rank": self.chosen_rank,
            "chosen_prob_raw": self.chosen_prob_raw,
            "chosen_prob_final": self.chosen_prob_final,
            "entropy_raw": self.entropy_raw,
            "entropy_final": self.entropy_final,
            "num_candidates_kept": self.num_candidates_kept,
            "temperature": self.temperature,
            "method": self.method,
            "extra": dict(self.extra),
            "candidates": [
                {
                    "token_id": c.token_id,
                    "text": c.text,
                    "logit": c.logit,
                    "logit_processed": c.logit_processed,
                    "prob_raw": c.prob_raw,
                    "prob_final": c.prob_final,
                    "rank": c.rank,
                    "removed_by": c.removed_by,
                }
                for c in self.candidates
            ],
            "stages": None
            if self.stages is None
            else [{"name": s.name, "logits": s.logits, "probs": s.probs, "num_kept": s.num_kept} for s in self.stages],
        }


# BeamContinuation.fate values: what one ranked (beam, next token) pair of a beam-search step became.
BEAM_FATES: tuple[str, ...] = ("running", "finished", "pruned")


@dataclass
class BeamState:
    """A running beam as a beam-search step found it."""

    # The tokens it generated so far, and the sum of their raw log-probabilities.
    token_ids: list[int]
    cumulative_logprob: float
    # Its text; filled in by the engine, which owns the tokenizer (the beam search leaves "").
    text: str = ""


@dataclass
class BeamContinuation:
    """One (beam, next token) pair a beam-search step ranked, and what became of it."""

    # The beam it extends: an index into BeamStep.beams.
    beam_index: int
    token_id: int
    # log p of token_id under the beam's raw distribution, and the beam's cumulative log-probability with it: the
    # step ranks every continuation of every beam by the latter.
    logprob: float
    cumulative_logprob: float
    # 1-based rank among the step's continuations.
    rank: int
    # One of BEAM_FATES. "running": among the `width` best continuations that did not end, it is a beam of the next
    # step, BeamStep.beams[next_beam_index] there. "finished": it ended (stop token, stop string or max tokens)
    # among the `width` best and joined the finished hypotheses. "pruned": it fell out of the top `width` (or it
    # ended, but the finished hypotheses were settled or all scored better).
    fate: str
    next_beam_index: int | None = None
    # Its token's text alone; filled in by the engine.
    text: str = ""


@dataclass
class BeamStep:
    """One step of a beam search: the running beams, their best continuations ranked, and who survived."""

    # Tokens every beam had generated before the step (0 = the step that chose the first token).
    index: int
    beams: list[BeamState]
    # The (1 + number of stop tokens) * width best continuations over all beams, best first (the rest rank lower).
    continuations: list[BeamContinuation]
    # Finished hypotheses kept after the step (at most `width`), and whether the search ended with it.
    num_finished: int
    is_last: bool

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form for the API and the visualizer."""
        return {
            "index": self.index,
            "beams": [
                {"token_ids": list(b.token_ids), "text": b.text, "cumulative_logprob": b.cumulative_logprob}
                for b in self.beams
            ],
            "continuations": [
                {
                    "beam_index": c.beam_index,
                    "token_id": c.token_id,
                    "text": c.text,
                    "logprob": c.logprob,
                    "cumulative_logprob": c.cumulative_logprob,
                    "rank": c.rank,
                    "fate": c.fate,
                    "next_beam_index": c.next_beam_index,
                }
                for c in self.continuations
            ],
            "num_finished": self.num_finished,
            "is_last": self.is_last,
        }
