"""Beam search, step by step, with transformers' exact rules; pure Python, no model, no scheduler.

`BeamSearch` holds one request's running beams and finished hypotheses. Each
step it gets, for every running beam, that beam's most likely next tokens with
their raw log-probabilities, and decides which (beam, token) pairs live on.
The rules are those of transformers' `generate(num_beams=k, do_sample=False)`
(`GenerationMixin._beam_search`, transformers 4.50+):

- a beam's score is the sum of log_softmax(raw logits) of its tokens;
- the 2k best continuations over all beams are kept ((1 + number of stop
  tokens) * k, at least 2k, so k of them can always go on running); each beam
  only needs its own top that many to find them;
- a continuation that ends in a stop token, or reaches max_tokens, is finished;
  only those among the k best may join the hypotheses, scored
  sum_logprobs / (generated_length ** length_penalty), where the length counts
  every generated token, the stop token included; the k best hypotheses are kept;
- the k best unfinished continuations are the next running beams;
- early_stopping=True ends the search once k hypotheses exist. Otherwise, once k
  exist, it ends when the best running beam cannot beat the worst hypothesis:
  judged at its current length (False), or at max_tokens when length_penalty > 0
  ("never", which is then exact: with length_penalty <= 0 the current length is
  already the best a beam can do). It also ends when every kept continuation is
  finished (max_tokens reached).
The result is the hypotheses, best score first (transformers' sequences_scores).
With params.beam_trace each step is also kept as a trace.BeamStep (`steps`): the
kept continuations ranked, each running on, finished or pruned, as decided here.

Before min_tokens tokens exist, stop tokens (and stop strings) cannot end a
beam: stop tokens are not candidates at all, as transformers' min_new_tokens
processor makes them -inf.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tokenriver.outputs import FinishReason, TokenLogprobs
from tokenriver.params import SamplingParams
from tokenriver.trace import BeamContinuation, BeamState, BeamStep


@dataclass
class Beam:
    """A running beam."""

    # The engine request that computes it.
    request_id: str
    # Generated tokens so far, and their log-probabilities.
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Sum of the log-probabilities of token_ids.
    cumulative_logprob: float = 0.0


@dataclass
class Hypothesis:
    """A finished beam."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    cumulative_logprob: float
    # cumulative_logprob / (len(token_ids) ** length_penalty): what hypotheses are ranked by.
    score: float
    finish_reason: FinishReason
    # The stop token id or stop string that ended it (None for EOS and length).
    stop_reason: int | str | None = None


@dataclass
class Continuation:
    """One surviving (beam, next token) pair of a step: the parent forks into `beam`."""

    parent: Beam
    token_id: int
    beam: Beam


@dataclass
class _Candidate:
    cumulative_logprob: float
    beam_index: int
    token_id: int
    logprob: TokenLogprobs


def num_candidates_per_beam(params: SamplingParams, stop_token_ids: list[int]) -> int:
    """How many most likely tokens each beam must report per step: enough to hold the best (1 + stops) * k
    continuations of all beams even after the stop tokens min_tokens blocks are dropped."""
    width = params.beam_width or 1
    return max(2, 1 + len(stop_token_ids)) * width + len(stop_token_ids)


class BeamSearch:
    """One request's beam search."""

    def __init__(
        self,
        params: SamplingParams,
        root_request_id: str,
        new_request_id: Callable[[], str],
        stop_token_ids: list[int],
        max_new_tokens: int,
        stop_string_of: Callable[[list[int]], str | None] | None = None,
    ) -> None:
        """root_request_id: the request computing the prompt, the one beam of the first step.
        new_request_id: names the request of each new running beam.
        stop_token_ids: tokens that end a beam (EOS unless ignore_eos, plus stop_token_ids).
        max_new_tokens: the most tokens a beam may generate (max_tokens, or what the context leaves).
        stop_string_of: the stop string the text of some generated tokens contains, if any."""
        if params.beam_width is None:
            raise ValueError("BeamSearch needs SamplingParams.beam_width")
        self.params = params
        self.width = params.beam_width
        self.stop_token_ids = list(dict.fromkeys(stop_token_ids))
        self.max_new_tokens = max_new_tokens
        self.new_request_id = new_request_id
        self.stop_string_of = stop_string_of
        self.num_kept = max(2, 1 + len(self.stop_token_ids)) * self.width
        self.running: list[Beam] = [Beam(root_request_id)]
        # At most `width` hypotheses, best score first.
        self.finished: list[Hypothesis] = []
        self.is_done = False
        # False once a step found that no running beam can beat the worst hypothesis (it stays False).
        self._is_improvement_possible = True
        # With params.beam_trace: every step as it was decided.
        self.steps: list[BeamStep] = []

    @property
    def num_generated(self) -> int:
        """Tokens every running beam has generated (they all advance together)."""
        return len(self.running[0].token_ids) if self.running else 0

    def step(self, candidates: dict[str, list[TokenLogprobs]]) -> list[Continuation]:
        """One step: candidates[beam request id] are that beam's most likely next tokens (best first, at least
        num_candidates_per_beam of them). Returns the continuations that become the running beams."""
        num_generated = self.num_generated
        length = num_generated + 1
        is_min_length = length > self.params.min_tokens
        pool = []
        for beam_index, beam in enumerate(self.running):
            for entry in candidates[beam.request_id]:
                if not is_min_length and entry.token_id in self.stop_token_ids:
                    continue
                pool.append(_Candidate(beam.cumulative_logprob + entry.logprob, beam_index, entry.token_id, entry))
        # transformers' topk over [beam, token] scores; ties go to the lower flat index.
        pool.sort(key=lambda c: (-c.cumulative_logprob, c.beam_index, c.token_id))
        kept = pool[: self.num_kept]
        endings = [self._ending(self.running[c.beam_index], c.token_id, length) for c in kept]

        # Only the `width` best continuations may finish; none once the hypotheses are settled.
        is_full = len(self.finished) == self.width
        added: dict[int, Hypothesis] = {}
        if self._is_improvement_possible and not (is_full and self.params.early_stopping is True):
            for i, (candidate, ending) in enumerate(list(zip(kept, endings))[: self.width]):
                if ending is not None:
                    added[i] = self._add_hypothesis(self.running[candidate.beam_index], candidate, length, *ending)

        unfinished = [i for i, ending in enumerate(endings) if ending is None]
        continuations = [self._continue(self.running[kept[i].beam_index], kept[i]) for i in unfinished][: self.width]
        continuing = unfinished[: self.width]
        parents = self.running
        self.running = [continuation.beam for continuation in continuations]

        if len(self.finished) == self.width:
            if self.params.early_stopping == "never" and self.params.length_penalty > 0:
                best_length = self.max_new_tokens
            else:
                best_length = length
            best_running = (
                self.running[0].cumulative_logprob / best_length**self.params.length_penalty
                if self.running
                else float("-inf")
            )
            self._is_improvement_possible = self._is_improvement_possible and best_running > self.finished[-1].score
        self.is_done = (
            not self._is_improvement_possible
            or (len(self.finished) == self.width and self.params.early_stopping is True)
            or all(ending is not None for ending in endings)
            or not continuations
        )
        if self.params.beam_trace:
            self.steps.append(self._record(num_generated, parents, kept, continuing, added))
        return [] if self.is_done else continuations

    def best(self, num: int) -> list[Hypothesis]:
        """The num best hypotheses (running beams stand in if the search ended before enough finished)."""
        hypotheses = list(self.finished)
        if len(hypotheses) < num:
            for beam in self.running:
                hypotheses.append(
                    Hypothesis(
                        beam.token_ids,
                        beam.logprobs,
                        beam.cumulative_logprob,
                        self._score(beam.cumulative_logprob, len(beam.token_ids)),
                        FinishReason.LENGTH,
                    )
                )
            hypotheses.sort(key=lambda h: -h.score)
        return hypotheses[:num]

    def _ending(self, beam: Beam, token_id: int, length: int) -> tuple[FinishReason, int | str | None] | None:
        """Why beam + token_id would be finished, or None if it runs on."""
        if token_id in self.stop_token_ids:
            is_stop_token = token_id in self.params.stop_token_ids
            return FinishReason.STOP, token_id if is_stop_token else None
        if length >= self.params.min_tokens and self.stop_string_of is not None:
            stop = self.stop_string_of(beam.token_ids + [token_id])
            if stop is not None:
                return FinishReason.STOP, stop
        if length >= self.max_new_tokens:
            return FinishReason.LENGTH, None
        return None

    def _record(
        self,
        index: int,
        parents: list[Beam],
        kept: list[_Candidate],
        continuing: list[int],
        added: dict[int, Hypothesis],
    ) -> BeamStep:
        """The step as a trace.BeamStep: kept[i] runs on if i is in `continuing`, finished if its hypothesis is
        still among the finished ones, else it was pruned."""
        next_beam_index = {i: j for j, i in enumerate(continuing)}
        entries = []
        for i, candidate in enumerate(kept):
            if i in next_beam_index:
                fate = "running"
            elif i in added and any(h is added[i] for h in self.finished):
                fate = "finished"
            else:
                fate = "pruned"
            entries.append(
                BeamContinuation(
                    beam_index=candidate.beam_index,
                    token_id=candidate.token_id,
                    logprob=candidate.logprob.logprob,
                    cumulative_logprob=candidate.cumulative_logprob,
                    rank=i + 1,
                    fate=fate,
                    next_beam_index=next_beam_index.get(i),
                )
            )
        beams = [BeamState(list(beam.token_ids), beam.cumulative_logprob) for beam in parents]
        return BeamStep(index, beams, entries, len(self.finished), self.is_done)

    def _continue(self, parent: Beam, candidate: _Candidate) -> Continuation:
        beam = Beam(
            self.new_request_id(),
            parent.token_ids + [candidate.token_id],
            parent.logprobs + [candidate.logprob],
            candidate.cumulative_logprob,
        )
        return Continuation(parent, candidate.token_id, beam)

    def _add_hypothesis(
        self, beam: Beam, candidate: _Candidate, length: int, reason: FinishReason, stop_reason: int | str | None
    ) -> Hypothesis:
        hypothesis = Hypothesis(
            beam.token_ids + [candidate.token_id],
            beam.logprobs + [candidate.logprob],
            candidate.cumulative_logprob,
            self._score(candidate.cumulative_logprob, length),
            reason,
            stop_reason,
        )
        self.finished.append(hypothesis)
        self.finished.sort(key=lambda h: -h.score)
        del self.finished[self.width :]
        return hypothesis

    def _score(self, cumulative_logprob: float, length: int) -> float:
        return cumulative_logprob / length**self.params.length_penalty
