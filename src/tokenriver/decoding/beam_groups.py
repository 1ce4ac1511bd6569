"""Beam search inside the engine: each beam is a scheduler request, and beams fork by sharing KV blocks.

A beam-search request starts as one engine request over the prompt
("<id>#beam0"). A step that reaches a beam's last token reports its most likely
next tokens (`RequestUpdate.beam_candidates`) and the beam then waits. Once every
running beam of a request has reported, `BeamSearch.step` picks the survivors,
and each survivor (beam, token) becomes a new engine request forked from its
parent (`Scheduler.fork_request`): it shares all the parent's KV blocks, so k
beams cost one prompt plus their own diverging tails, and only the partial last
block is copied when a child first writes to it. The parents are then finished.

Many beam-search requests, and ordinary ones, share each step's batch: beams are
ordinary requests to the scheduler and the runner. When a search ends, the best
`n` hypotheses go back to the engine as a `BeamResult`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenriver.decoding.beam import BeamSearch, Hypothesis, num_candidates_per_beam
from tokenriver.outputs import FinishReason, RequestMetrics, TokenLogprobs
from tokenriver.params import SamplingParams
from tokenriver.sched.output import RequestUpdate
from tokenriver.sched.request import Request
from tokenriver.sched.scheduler import Scheduler
from tokenriver.tokenizer.tokenizer import Tokenizer
from tokenriver.trace import BeamStep


@dataclass
class BeamResult:
    """A finished beam search."""

    request_id: str
    # The n best hypotheses, best score first.
    hypotheses: list[Hypothesis]
    metrics: RequestMetrics
    # With SamplingParams.beam_trace: every step of the search (else empty).
    steps: list[BeamStep] = field(default_factory=list)


@dataclass
class _Group:
    """One beam-search request."""

    request_id: str
    params: SamplingParams
    search: BeamSearch
    metrics: RequestMetrics
    # Candidates reported by running beams this round, by engine request id.
    candidates: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


class BeamGroups:
    """Every running beam search of the engine."""

    def __init__(self, scheduler: Scheduler, tokenizer: Tokenizer) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self._groups: dict[str, _Group] = {}
        # Engine request id of every running beam → its user request id.
        self._group_of: dict[str, str] = {}

    def has_request(self, request_id: str) -> bool:
        return request_id in self._groups

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: list[int],
        arrival_time: float,
        priority: int,
    ) -> None:
        """Queue a beam search; its first beam computes the prompt."""
        stop_token_ids = ([] if params.ignore_eos else list(eos_token_ids)) + list(params.stop_token_ids)
        counter = itertools.count(1)
        root = Request(f"{request_id}#beam0", prompt_token_ids, params, eos_token_ids, arrival_time, priority)
        root.num_beam_candidates = max(num_candidates_per_beam(params, stop_token_ids), params.logprobs or 0)
        max_new_tokens = self.scheduler.max_num_tokens - len(prompt_token_ids)
        if params.max_tokens is not None:
            max_new_tokens = min(max_new_tokens, params.max_tokens)
        search = BeamSearch(
            params,
            root.request_id,
            lambda: f"{request_id}#beam{next(counter)}",
            stop_token_ids,
            max_new_tokens,
            self._stop_string_finder(params) if params.stop else None,
        )
        self.scheduler.add_request(root)
        self._groups[request_id] = _Group(request_id, params, search, RequestMetrics(arrival_time=arrival_time))
        self._group_of[root.request_id] = request_id

    def abort(self, request_id: str) -> None:
        """Stop a beam search and free every beam it runs."""
        group = self._groups.pop(request_id, None)
        if group is not None:
            self._finish_beams(group)

    def process(self, updates: list[RequestUpdate]) -> tuple[list[RequestUpdate], list[BeamResult]]:
        """Take the beams' updates out of a step's updates; fork the searches whose beams all reported.

        Returns the other requests' updates, and the searches that ended this step.
        """
        others: list[RequestUpdate] = []
        ready: dict[str, _Group] = {}
        for update in updates:
            request_id = self._group_of.get(update.request_id)
            if request_id is None:
                others.append(update)
                continue
            group = self._groups[request_id]
            if update.metrics is not None and group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = update.metrics.first_scheduled_time
                group.metrics.num_cached_tokens = update.num_cached_tokens
            if update.metrics is not None:
                # A beam forked from its parent carries the parent's count: the beams share their passes.
                passes = max(group.metrics.num_forward_passes, update.metrics.num_forward_passes)
                group.metrics.num_forward_passes = passes
            if update.beam_candidates:
                group.candidates[update.request_id] = self._with_top(group.params, update.beam_candidates)
                ready[request_id] = group
        results = []
        for group in ready.values():
            if all(beam.request_id in group.candidates for beam in group.search.running):
                result = self._advance(group)
                if result is not None:
                    results.append(result)
        return others, results

    def _advance(self, group: _Group) -> BeamResult | None:
        """One beam-search step: fork the survivors, finish their parents; the result if the search ended."""
        parents = list(group.search.running)
        continuations = group.search.step({beam.request_id: group.candidates[beam.request_id] for beam in parents})
        group.candidates.clear()
        now = time.time()
        group.metrics.first_token_time = group.metrics.first_token_time or now
        group.metrics.last_token_time = now
        for continuation in continuations:
            self.scheduler.fork_request(
                continuation.parent.request_id, continuation.beam.request_id, continuation.token_id
            )
            self._group_of[continuation.beam.request_id] = group.request_id
        for parent in parents:
            self._group_of.pop(parent.request_id, None)
            self.scheduler.finish_request(parent.request_id, FinishReason.ABORT)
        if not group.search.is_done:
            return None
        del self._groups[group.request_id]
        group.metrics.finished_time = now
        return BeamResult(group.request_id, group.search.best(group.params.n), group.metrics, group.search.steps)

    def _finish_beams(self, group: _Group) -> None:
        for beam in group.search.running:
            self._group_of.pop(beam.request_id, None)
            self.scheduler.finish_request(beam.request_id, FinishReason.ABORT)

    def _stop_string_finder(self, params: SamplingParams) -> Callable[[list[int]], str | None]:
        """The first stop string (by position) that the text of some generated tokens contains."""

        def stop_string_of(token_ids: list[int]) -> str | None:
            text = self.tokenizer.decode(token_ids, skip_special_tokens=params.skip_special_tokens)
            found = [(text.find(stop), stop) for stop in params.stop if stop in text]
            return min(found)[1] if found else None

        return stop_string_of

    @staticmethod
    def _with_top(params: SamplingParams, candidates: list[TokenLogprobs]) -> list[TokenLogprobs]:
        """Give each candidate the position's top alternatives when logprobs were asked for."""
        if params.logprobs:
            top = [(entry.token_id, entry.logprob) for entry in candidates[: params.logprobs]]
            for entry in candidates:
                entry.top = top
        return candidates
