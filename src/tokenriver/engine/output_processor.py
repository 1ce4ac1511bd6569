"""OutputProcessor: scheduler updates → RequestOutput deltas.

Owns everything about text: incremental detokenization, stop strings (which
end a request the scheduler could not see end, so they are reported back),
logprob dicts with token text, trace token text, and fanning n / best_of
candidates of one user request back into a single RequestOutput. A beam search
has no stream of deltas (its beams change until the end): its one output is
built from the finished hypotheses (`beam_output`), with the text of its
recorded steps' tokens (beam_trace). A pooling request has no text either: its
one output carries the embedding or score it finished with.

Invariant: for every candidate, the concatenation of the streamed `delta_text`
equals the final `text`.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass, field

from tokenriver.decoding.beam import Hypothesis
from tokenriver.outputs import (
    CompletionOutput,
    FinishReason,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
    TokenLogprobs,
)
from tokenriver.params import PoolingParams, SamplingParams
from tokenriver.sched.output import RequestUpdate
from tokenriver.tokenizer.detokenizer import IncrementalDetokenizer
from tokenriver.tokenizer.stop_strings import StopStringChecker
from tokenriver.tokenizer.tokenizer import Tokenizer
from tokenriver.trace import BeamStep


@dataclass
class _Candidate:
    """Text state of one engine request (one of a user request's n / best_of candidates)."""

    output: CompletionOutput
    detokenizer: IncrementalDetokenizer
    stop_checker: StopStringChecker
    metrics: RequestMetrics


@dataclass
class _PoolingRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: PoolingParams
    metrics: RequestMetrics


@dataclass
class _UserRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    candidates: dict[str, _Candidate]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # Candidates whose output changed in the current batch of updates.
    changed: set[str] = field(default_factory=set)
    # Only the finished output is wanted (LLM.generate): no per-step copies of the growing outputs.
    final_only: bool = False


class OutputProcessor:
    """Builds user-facing outputs from the scheduler's per-step updates."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _UserRequest] = {}
        # engine request id → user request id
        self._parent_of: dict[str, str] = {}
        # Pooling requests (one engine request each, same id).
        self._pooling: dict[str, _PoolingRequest] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        children: dict[str, RequestMetrics],
        final_only: bool = False,
    ) -> None:
        """Track a user request whose candidates run as the engine requests in `children` (id → metrics)."""
        candidates = {}
        for index, (child_id, metrics) in enumerate(children.items()):
            candidates[child_id] = _Candidate(
                output=CompletionOutput(
                    index=index,
                    logprobs=[] if params.logprobs is not None else None,
                    trace=[] if params.trace else None,
                ),
                detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens),
                stop_checker=StopStringChecker(params.stop, params.include_stop_str_in_output),
                metrics=metrics,
            )
            self._parent_of[child_id] = request_id
        self._requests[request_id] = _UserRequest(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            params=params,
            candidates=candidates,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            final_only=final_only,
        )

    def add_pooling_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: PoolingParams,
        metrics: RequestMetrics,
    ) -> None:
        """Track a pooling request: it reports once, finished, with its embedding or score."""
        self._pooling[request_id] = _PoolingRequest(request_id, prompt, prompt_token_ids, params, metrics)

    def add_beam_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        """Track a beam search (its beams are the beam search's business, not candidates of this request)."""
        self._requests[request_id] = _UserRequest(
            request_id=request_id, prompt=prompt, prompt_token_ids=prompt_token_ids, params=params, candidates={}
        )

    def beam_output(
        self, request_id: str, hypotheses: list[Hypothesis], metrics: RequestMetrics, steps: list[BeamStep]
    ) -> RequestOutput:
        """The final output of a beam search: one candidate per hypothesis, best first, and its recorded steps
        (beam_trace) with their text; forgets the request."""
        user = self._requests.pop(request_id)
        params = user.params
        outputs = []
        for index, hypothesis in enumerate(hypotheses):
            detokenizer = IncrementalDetokenizer(self.tokenizer, user.prompt_token_ids, params.skip_special_tokens)
            text = detokenizer.add_tokens(hypothesis.token_ids) + detokenizer.flush()
            finish_reason, stop_reason = hypothesis.finish_reason, hypothesis.stop_reason
            if len(hypothesis.token_ids) >= params.min_tokens:
                checker = StopStringChecker(params.stop, params.include_stop_str_in_output)
                text, matched = checker.process(text)
                if matched is None:
                    text += checker.flush()
                else:
                    finish_reason, stop_reason = FinishReason.STOP, matched
            logprobs = None
            if params.logprobs is not None:
                logprobs = [self._position_logprobs(entry, params.logprobs) for entry in hypothesis.logprobs]
            outputs.append(
                CompletionOutput(
                    index=index,
                    text=text,
                    token_ids=list(hypothesis.token_ids),
                    cumulative_logprob=hypothesis.cumulative_logprob,
                    logprobs=logprobs,
                    finish_reason=finish_reason,
                    stop_reason=stop_reason,
                    beam_score=hypothesis.score,
                    delta_text=text,
                    delta_token_ids=list(hypothesis.token_ids),
                )
            )
        return RequestOutput(
            request_id=request_id,
            prompt=user.prompt,
            prompt_token_ids=user.prompt_token_ids,
            outputs=outputs,
            finished=True,
            metrics=metrics,
            beam_steps=self._name_beam_steps(steps) if params.beam_trace else None,
        )

    def _name_beam_steps(self, steps: list[BeamStep]) -> list[BeamStep]:
        """Fill in the text of each step's beams and continuations (the beam search knows only ids)."""
        for step in steps:
            for beam in step.beams:
                beam.text = self.tokenizer.decode(beam.token_ids)
            for continuation in step.continuations:
                continuation.text = self.tokenizer.token_text(continuation.token_id)
        return steps

    def remove_request(self, request_id: str) -> list[str]:
        """Forget a user request (aborted); returns its engine request ids."""
        if self._pooling.pop(request_id, None) is not None:
            return [request_id]
        user = self._requests.pop(request_id, None)
        if user is None:
            return []
        for child_id in user.candidates:
            self._parent_of.pop(child_id, None)
        return list(user.candidates)

    def child_ids(self, request_id: str) -> list[str]:
        user = self._requests.get(request_id)
        return [] if user is None else list(user.candidates)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests or request_id in self._pooling

    def process(self, updates: list[RequestUpdate]) -> tuple[list[RequestOutput], list[tuple[str, str]]]:
        """Apply one step's updates; return the outputs that changed and (engine id, stop string) pairs to finish."""
        stopped: list[tuple[str, str]] = []
        touched: dict[str, _UserRequest] = {}
        outputs = []
        for update in updates:
            if update.pooled is not None:
                outputs += self._pooled_output(update)
                continue
            parent_id = self._parent_of.get(update.request_id)
            if parent_id is None:
                continue
            user = self._requests[parent_id]
            candidate = user.candidates[update.request_id]
            if update.prompt_logprobs and user.prompt_logprobs is not None:
                user.prompt_logprobs.extend(self._position_logprobs(entry) for entry in update.prompt_logprobs)
            matched = self._apply(user.params, candidate, update)
            if matched is not None:
                stopped.append((update.request_id, matched))
            user.changed.add(update.request_id)
            touched[parent_id] = user
        for user in touched.values():
            finished = all(c.output.finished for c in user.candidates.values())
            output = self._request_output(user) if finished or not user.final_only else None
            user.changed.clear()
            if output is not None:
                outputs.append(output)
            if finished:
                self.remove_request(user.request_id)
        return outputs, stopped

    def _pooled_output(self, update: RequestUpdate) -> list[RequestOutput]:
        """The one output of a pooling request (none if it was aborted meanwhile); forgets the request."""
        request = self._pooling.pop(update.request_id, None)
        if request is None:
            return []
        is_score = request.params.task == "score"
        return [
            RequestOutput(
                request_id=request.request_id,
                prompt=request.prompt,
                prompt_token_ids=request.prompt_token_ids,
                outputs=[],
                finished=True,
                metrics=dataclasses.replace(request.metrics),
                embedding=None if is_score else update.pooled,
                score=update.pooled[0] if is_score else None,
            )
        ]

    def _apply(self, params: SamplingParams, candidate: _Candidate, update: RequestUpdate) -> str | None:
        """Append one update to a candidate; return the stop string if one matched now."""
        output = candidate.output
        candidate.metrics.num_cached_tokens = update.num_cached_tokens
        output.delta_token_ids = list(update.new_token_ids)
        output.delta_text = ""
        if output.finished:
            return None
        output.token_ids.extend(update.new_token_ids)
        for entry in update.new_logprobs:
            output.cumulative_logprob += entry.logprob
            if output.logprobs is not None:
                output.logprobs.append(self._position_logprobs(entry, params.logprobs))
        for trace in update.new_traces:
            for candidate_token in trace.candidates:
                candidate_token.text = self.tokenizer.token_text(candidate_token.token_id)
            draw = trace.extra.get("draw")
            for neighbor in draw["neighbors"] if isinstance(draw, dict) else []:
                neighbor["text"] = self.tokenizer.token_text(neighbor["token_id"])
            if output.trace is not None:
                output.trace.append(trace)
        new_text = candidate.detokenizer.add_tokens(update.new_token_ids) if update.new_token_ids else ""
        if update.finish_reason is not None:
            # Generation ended: release text held back for an unfinished multi-byte character.
            new_text += candidate.detokenizer.flush()
        matched = None
        if len(output.token_ids) >= params.min_tokens:
            emitted, matched = candidate.stop_checker.process(new_text)
        else:
            # Stop strings, like EOS, only count once min_tokens were generated.
            emitted = new_text
        finish_reason, stop_reason = update.finish_reason, update.stop_reason
        if matched is not None:
            finish_reason, stop_reason = FinishReason.STOP, matched
        elif finish_reason is not None:
            emitted += candidate.stop_checker.flush()
        output.delta_text = emitted
        output.text += emitted
        if finish_reason is not None:
            output.finish_reason = finish_reason
            output.stop_reason = stop_reason
            candidate.metrics.finished_time = candidate.metrics.finished_time or time.time()
        return matched

    def _position_logprobs(self, entry: TokenLogprobs, num_top: int | None = None) -> PositionLogprobs:
        """{token id: Logprob} for one position: the token itself plus the top alternatives."""
        top = entry.top if num_top is None else entry.top[:num_top]
        result: PositionLogprobs = {
            token_id: Logprob(logprob=logprob, rank=rank, decoded_token=self.tokenizer.token_text(token_id))
            for rank, (token_id, logprob) in enumerate(top, start=1)
        }
        result[entry.token_id] = Logprob(
            logprob=entry.logprob, rank=entry.rank, decoded_token=self.tokenizer.token_text(entry.token_id)
        )
        return result

    def _request_output(self, user: _UserRequest) -> RequestOutput | None:
        """The user-facing state of a request, or None while best_of candidates are still running."""
        candidates = list(user.candidates.values())
        finished = all(c.output.finished for c in candidates)
        if user.params.num_generated > user.params.n:
            if not finished:
                return None
            best = sorted(candidates, key=lambda c: c.output.cumulative_logprob, reverse=True)[: user.params.n]
            outputs = [
                _snapshot(c.output, index=i, delta_text=c.output.text, delta_token_ids=list(c.output.token_ids))
                for i, c in enumerate(best)
            ]
        else:
            outputs = [
                _snapshot(c.output) if key in user.changed else _snapshot(c.output, delta_text="", delta_token_ids=[])
                for key, c in user.candidates.items()
            ]
        return RequestOutput(
            request_id=user.request_id,
            prompt=user.prompt,
            prompt_token_ids=user.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            metrics=_merge_metrics([c.metrics for c in candidates]),
            prompt_logprobs=user.prompt_logprobs,
        )


def _snapshot(output: CompletionOutput, **changes: object) -> CompletionOutput:
    """A copy the engine will not mutate later: outputs cross threads to the async consumers."""
    return dataclasses.replace(
        output,
        token_ids=list(output.token_ids),
        logprobs=None if output.logprobs is None else list(output.logprobs),
        trace=None if output.trace is None else list(output.trace),
        **changes,
    )


def _merge_metrics(metrics: list[RequestMetrics]) -> RequestMetrics:
    """One request's timings from its candidates': earliest start and first token, latest finish."""
    if len(metrics) == 1:
        return copy.copy(metrics[0])

    def earliest(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return min(present) if present else None

    def latest(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return max(present) if present else None

    return RequestMetrics(
        arrival_time=min(m.arrival_time for m in metrics),
        first_scheduled_time=earliest([m.first_scheduled_time for m in metrics]),
        first_token_time=earliest([m.first_token_time for m in metrics]),
        last_token_time=latest([m.last_token_time for m in metrics]),
        finished_time=latest([m.finished_time for m in metrics]) if all(m.finished_time for m in metrics) else None,
        num_cached_tokens=metrics[0].num_cached_tokens,
        num_preemptions=sum(m.num_preemptions for m in metrics),
        num_draft_tokens=sum(m.num_draft_tokens for m in metrics),
        num_accepted_draft_tokens=sum(m.num_accepted_draft_tokens for m in metrics),
        num_speculative_steps=sum(m.num_speculative_steps for m in metrics),
        num_forward_passes=max(m.num_forward_passes for m in metrics),  # the candidates share their passes
    )
