"""The proposer protocol of speculative decoding: who guesses the next tokens, and how sure it was.

A proposer sees requests (their tokens and sampling controls) and returns draft
tokens; a proposer that draws its drafts at random also returns the
distributions it drew them from, which the acceptance rule needs. It never
touches the target model's KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tokenriver.sched.request import Request


@dataclass
class Proposal:
    """Draft tokens for one request."""

    token_ids: list[int]
    # [len(token_ids), vocab]: the distribution each draft was drawn from; None for a deterministic proposer,
    # whose every draft is a point mass (the acceptance rule needs q only where it is not).
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    """Guesses how requests continue."""

    # Forward passes of a draft model run so far, for the engine's step stats (0 for a proposer without a model).
    num_forward_passes: int

    def propose(self, requests: list[Request], max_num_tokens: list[int]) -> list[Proposal | None]:
        """At most max_num_tokens[i] drafts continuing requests[i].all_token_ids (None: no guess)."""

    def drop(self, request_ids: list[str]) -> None:
        """Forget requests that finished (free whatever the proposer keeps for them)."""
