"""Speculative decoding: guess a few tokens cheaply, let the model check them all in one forward pass.

Each step, before scheduling, a *proposer* guesses up to k draft tokens for every
running request that is one token behind. The scheduler computes them right
after the request's last known token, so one forward pass of the model yields
its prediction at every draft position; the sampler's `verify` keeps the drafts
the model agrees with (rejection sampling: the output distribution is exactly
the model's) and adds one token of the model's own. A step then gains between 1
and k + 1 tokens for the cost of one pass over 1 + k tokens, which on a CPU
costs little more than a pass over one token: the weights are read once.

Proposers (the `Proposer` protocol, proposer.py):
- `NgramProposer` (ngram.py): the request's own earlier text; free, and right
  whenever the output repeats the input (rewriting, editing code, quoting);
- `DraftModelProposer` (draft_model.py): a smaller model with the same
  tokenizer, or the model's own first layers ("self:N").

This module wires a proposer into the engine step; it knows nothing about the
forward pass or the acceptance rule.
"""

from __future__ import annotations

import torch

from tokenriver.config import EngineConfig
from tokenriver.decoding.draft_model import DraftModelProposer
from tokenriver.decoding.ngram import NgramProposer
from tokenriver.decoding.proposer import Proposer
from tokenriver.errors import InvalidParameterError
from tokenriver.loader.load import LoadedModel
from tokenriver.sched.request import Request
from tokenriver.sched.scheduler import Scheduler


class Speculator:
    """Runs a proposer for the scheduler's decoding requests each step."""

    def __init__(self, proposer: Proposer, num_speculative_tokens: int) -> None:
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens
        # Requests the proposer was asked about, to tell it when they are gone.
        self._known_ids: set[str] = set()

    def propose(self, scheduler: Scheduler) -> dict[str, torch.Tensor]:
        """Set draft tokens on the scheduler's decoding requests; returns the draft distributions the runner needs."""
        self.drop_finished(scheduler)
        requests, limits = [], []
        for request in scheduler.decoding_requests():
            limit = self._num_drafts(request, scheduler.max_num_tokens)
            if limit > 0:
                requests.append(request)
                limits.append(limit)
        if not requests:
            return {}
        self._known_ids.update(request.request_id for request in requests)
        draft_token_ids: dict[str, list[int]] = {}
        draft_probs: dict[str, torch.Tensor] = {}
        for request, proposal in zip(requests, self.proposer.propose(requests, limits)):
            if proposal is None or not proposal.token_ids:
                continue
            draft_token_ids[request.request_id] = proposal.token_ids
            if proposal.probs is not None:
                draft_probs[request.request_id] = proposal.probs
        scheduler.set_draft_tokens(draft_token_ids)
        return draft_probs

    def drop_finished(self, scheduler: Scheduler) -> None:
        """Let the proposer free what it keeps for requests that are gone (call after every step)."""
        gone = [
            request_id
            for request_id in self._known_ids
            if (request := scheduler.get_request(request_id)) is None or request.is_finished
        ]
        if gone:
            self.proposer.drop(gone)
            self._known_ids.difference_update(gone)

    def _num_drafts(self, request: Request, max_num_tokens: int) -> int:
        """Drafts worth proposing: a step adds at most drafts + 1 tokens, so stay inside max_tokens and the context."""
        params = request.sampling_params
        if params.use_beam_search:
            return 0
        limit = min(self.num_speculative_tokens, max_num_tokens - request.num_tokens - 1)
        if params.max_tokens is not None:
            limit = min(limit, params.max_tokens - request.num_output_tokens - 1)
        return limit


def build_speculator(config: EngineConfig, target: LoadedModel, num_kv_blocks: int) -> Speculator | None:
    """The proposer SpeculativeConfig.speculative_draft names, wrapped for the engine (None when speculation is off)."""
    speculative = config.speculative
    draft = speculative.speculative_draft
    if draft is None:
        return None
    if draft == "ngram":
        proposer: Proposer = NgramProposer(speculative.ngram_min, speculative.ngram_max)
    elif draft.startswith("self:"):
        num_layers = int(draft.removeprefix("self:"))
        if num_layers >= target.config.num_layers:
            raise InvalidParameterError(
                f"speculative_draft={draft!r}: the model has {target.config.num_layers} layers, so a self-draft "
                f"runs fewer, e.g. self:{max(1, target.config.num_layers // 4)}",
                param="speculative_draft",
            )
        proposer = DraftModelProposer.from_target_layers(target, num_layers, config, num_kv_blocks)
    else:
        proposer = DraftModelProposer.from_path(draft, target, config, num_kv_blocks)
    return Speculator(proposer, speculative.num_speculative_tokens)
