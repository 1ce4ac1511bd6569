"""What the sampler, draft verification and tracing share: one row's state and result, and per-row helpers.

A row is one request's position to sample (or, in verification, one draft position). Nothing here knows
about the stages; the helpers only select rows, draw from distributions and score tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tokenriver.outputs import TokenLogprobs
from tokenriver.params import SamplingParams
from tokenriver.trace import StepTrace


class LazyGrammar(Protocol):
    """A row's grammar, asked only what the row needs (sampling/grammar.py's GrammarRow): a plain greedy row whose
    argmax the grammar accepts never needs the whole mask, which costs far more than checking one token."""

    def accepts(self, token_id: int) -> bool:
        """Whether the grammar allows token_id next; when it does, the grammar has advanced past it."""
        ...

    def mask(self) -> torch.Tensor | None:
        """[W] int32: every token the grammar allows next (None before the constraint starts)."""
        ...


@dataclass
class SamplingState:
    """One row of the batch: the request's controls and the history the penalties read."""

    params: SamplingParams
    # Shared references are fine: the sampler only reads them.
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # The request's own generator when it has a seed; None = the sampler's default generator.
    generator: torch.Generator | None
    # Ids blocked (with params.stop_token_ids) while len(output_token_ids) < params.min_tokens.
    eos_token_ids: list[int]
    # [W] int32: the tokens params.structured_output allows next, as a bitmask (sampling/grammar.py); None = all.
    allowed_token_mask: torch.Tensor | None = None
    # Instead of the mask, when the runner left it to be asked for: the sampler fills allowed_token_mask from it
    # for the rows that need their logits processed.
    grammar: LazyGrammar | None = None


@dataclass
class SampleResult:
    """What the sampler chose for one row."""

    token_id: int
    # The chosen token's raw logprob and rank; `.top` holds params.logprobs best alternatives when logprobs is set.
    logprob: TokenLogprobs
    # Filled when params.trace is set.
    trace: StepTrace | None


def select_rows(tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """tensor[rows] without a copy when rows is every row in order."""
    return tensor if len(rows) == tensor.shape[0] else tensor[torch.tensor(rows, dtype=torch.int64)]


def draw_rows(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: per row, the first token whose cumulative probability exceeds u * total.

    probs [n, V], uniforms [n] in [0, 1). One uniform per row keeps each row's draw a function of its own
    random stream. A token of probability 0 adds nothing to the cumulative sum, so it can never be the first to
    exceed the target; the target is kept strictly below the total so rounding cannot run past the last token.
    """
    cdf = probs.cumsum(dim=1)  # [n, V], accumulated in float64 by PyTorch's CPU kernel
    total = cdf[:, -1:]  # [n, 1]
    target = torch.minimum(uniforms.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))  # [n, 1]
    return torch.searchsorted(cdf, target, right=True).squeeze(1)  # [n]


def raw_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    num_top: list[int],
    is_rank_one: list[bool],
    log_normalizer: torch.Tensor,
) -> list[TokenLogprobs]:
    """Logprob and rank of token_ids[i] under log_softmax(logits[i]), plus the num_top[i] best alternatives.

    rank = 1 + the number of tokens with a strictly larger logit (ties share a rank; the argmax is always 1).
    Rows flagged in is_rank_one are known to hold an argmax, which saves a pass over their vocabulary.
    log_normalizer: logsumexp of each row [N] (Sampler.log_normalizers).
    """
    num_rows = logits.shape[0]
    chosen_logits = logits.gather(1, token_ids.unsqueeze(1))  # [N, 1]
    chosen_logprobs = (chosen_logits.squeeze(1) - log_normalizer).tolist()
    ranks = [1] * num_rows
    rank_rows = [i for i in range(num_rows) if not is_rank_one[i]]
    if rank_rows:
        index = torch.tensor(rank_rows, dtype=torch.int64)  # [n]
        num_above = (select_rows(logits, rank_rows) > chosen_logits[index]).sum(dim=1, dtype=torch.int32)  # [n]
        for i, count in zip(rank_rows, num_above.tolist()):
            ranks[i] = count + 1
    tops: list[list[tuple[int, float]]] = [[] for _ in range(num_rows)]
    top_rows = [i for i in range(num_rows) if num_top[i] > 0]
    if top_rows:
        index = torch.tensor(top_rows, dtype=torch.int64)  # [n]
        best = select_rows(logits, top_rows).topk(min(max(num_top), logits.shape[1]), dim=1)  # [n, k] each
        best_logprobs = (best.values - log_normalizer[index].unsqueeze(1)).tolist()
        best_ids = best.indices.tolist()
        for j, i in enumerate(top_rows):
            tops[i] = list(zip(best_ids[j][: num_top[i]], best_logprobs[j][: num_top[i]]))
    ids = token_ids.tolist()
    return [TokenLogprobs(ids[i], chosen_logprobs[i], ranks[i], tops[i]) for i in range(num_rows)]
