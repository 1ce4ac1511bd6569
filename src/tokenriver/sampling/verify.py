"""Speculative decoding's verification: the target scores k draft tokens in one pass and keeps a prefix.

The rejection-sampling rule below keeps every emitted token distributed exactly as `Sampler.sample` would
have drawn it. Each verified position is processed with the token history it would have had (the drafts
before it count as generated), so penalties, min_tokens, logprobs and traces are those of a run without
speculation. Only the random stream differs: verification draws its own uniforms, so a seeded request gives
different (equally distributed) tokens with and without speculation; greedy rows give identical tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenriver.sampling.rows import SampleResult, SamplingState, draw_rows, raw_logprobs
from tokenriver.sampling.tracer import Tracer

# The sampler's stages: (logits [R, V], one state per row, tracer) → (processed logits [R, V], modified rows).
ProcessLogits = Callable[[torch.Tensor, list[SamplingState], "Tracer | None"], tuple[torch.Tensor, set[int]]]
# One uniform in [0, 1) per state, each from that state's random stream.
Uniforms = Callable[[list[SamplingState]], torch.Tensor]


@dataclass
class DraftCheck:
    """One request whose draft tokens the target model scores this step."""

    state: SamplingState
    draft_token_ids: list[int]
    # [len(draft_token_ids), V]: the distribution q each draft token was drawn from (the draft model's processed
    # distribution). None when the drafts are a deterministic function of the context (n-gram lookup): q is then
    # a point mass on each draft token.
    draft_probs: torch.Tensor | None = None
    # [1 + len(draft_token_ids), W] int32: row j is what the request's grammar allows after its j-th draft
    # (sampling/grammar.py); None without a grammar. Every draft must be one the grammar allows.
    allowed_token_masks: torch.Tensor | None = None


@dataclass
class VerifyResult:
    """What the target made of one request's drafts."""

    # The accepted drafts, then one token of the target's own: the replacement of the first rejected draft, or a
    # bonus token when every draft was accepted. One SampleResult per emitted token.
    samples: list[SampleResult]
    num_accepted: int


def residual_distribution(target: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """Where to draw from after a rejection: max(0, p - q), normalized (target p, draft q: [V] each).

    Accepting x with probability min(1, p(x)/q(x)) emits x with probability min(p(x), q(x)); drawing the
    rejections from the normalized residual adds exactly the missing mass p(x) - min(p(x), q(x)). When p == q
    nothing is ever rejected, except by rounding: then the residual is empty and p itself is right.
    """
    residual = (target - draft).clamp_(min=0)  # [V]
    total = float(residual.sum())
    return target if total <= 0 else residual / total


def verify(
    logits: torch.Tensor,
    checks: list[DraftCheck],
    process: ProcessLogits,
    uniforms: Uniforms,
    log_normalizers: Callable[[torch.Tensor], torch.Tensor],
) -> list[VerifyResult]:
    """Accept or reject each request's draft tokens; logits [R, V] hold 1 + len(drafts) rows per check, in order.

    Row j of a check is the target's prediction after its j-th draft (row 0: after the last known token).
    """
    row_states = [
        SamplingState(
            check.state.params,
            check.state.prompt_token_ids,
            check.state.output_token_ids + check.draft_token_ids[:j],
            check.state.generator,
            check.state.eos_token_ids,
            check.allowed_token_masks[j] if check.allowed_token_masks is not None else None,
        )
        for check in checks
        for j in range(len(check.draft_token_ids) + 1)
    ]
    if logits.dim() != 2 or logits.shape[0] != len(row_states):
        raise ValueError(
            f"logits must be [{len(row_states)} rows (1 + drafts per check), vocab_size], got {tuple(logits.shape)}"
        )
    traced_rows = [i for i, state in enumerate(row_states) if state.params.trace]
    tracer = Tracer(logits, traced_rows, row_states) if traced_rows else None
    processed, modified_rows = process(logits, row_states, tracer)

    token_ids = processed.argmax(dim=1)  # [R]: greedy verdicts; rows past a rejection keep this placeholder
    greedy_ids = token_ids.tolist()
    # [R, V] target distributions, one softmax for the whole batch (greedy rows do not need it).
    probs = processed.softmax(dim=1) if any(not state.params.is_greedy for state in row_states) else None
    emitted: list[tuple[int, int]] = []  # (check index, row) of every emitted token
    num_accepted: list[int] = []
    first = 0
    for index, check in enumerate(checks):
        num_rows = len(check.draft_token_ids) + 1
        if check.state.params.is_greedy:
            chosen = accept_greedy(greedy_ids[first : first + num_rows], check.draft_token_ids)
        else:
            chosen = accept_sampled(probs[first : first + num_rows], check, uniforms)
        token_ids[first : first + len(chosen)] = torch.tensor(chosen, dtype=torch.int64, device=token_ids.device)
        emitted += [(index, row) for row in range(first, first + len(chosen))]
        num_accepted.append(len(chosen) - 1)
        first += num_rows

    rows = [row for _, row in emitted]
    is_rank_one = [row_states[row].params.is_greedy and row not in modified_rows for row in rows]
    num_top = [row_states[row].params.logprobs or 0 for row in rows]
    index = torch.tensor(rows, dtype=torch.int64)  # [E]
    emitted_logits = logits[index]  # [E, V]
    logprobs = raw_logprobs(emitted_logits, token_ids[index], num_top, is_rank_one, log_normalizers(emitted_logits))
    traces = tracer.finish(processed, token_ids, row_states) if tracer else {}
    results = [VerifyResult(samples=[], num_accepted=count) for count in num_accepted]
    chosen_ids = token_ids.tolist()
    row_of_first = 0
    for (check_index, row), logprob in zip(emitted, logprobs):
        check, result = checks[check_index], results[check_index]
        if not result.samples:
            row_of_first = row
        trace = traces.get(row)
        if trace is not None:
            trace.extra["speculative"] = verdict(check.draft_token_ids, row - row_of_first, result.num_accepted)
        result.samples.append(SampleResult(chosen_ids[row], logprob, trace))
    return results


def accept_sampled(probs: torch.Tensor, check: DraftCheck, uniforms: Uniforms) -> list[int]:
    """The rejection-sampling rule (Leviathan et al. 2023; Chen et al. 2023), probs [1 + k, V] of the target.

    Draft x_j, drawn from q_j, is accepted with probability min(1, p_j(x_j) / q_j(x_j)); the first rejected
    one is replaced by a draw from the residual max(0, p_j - q_j) (normalized) and the rest are dropped; when
    all k are accepted, a bonus token is drawn from p_k. Every emitted token is then distributed exactly as p.
    """
    for j, token_id in enumerate(check.draft_token_ids):
        target = probs[j]  # [V]
        if check.draft_probs is None:
            draft = torch.zeros_like(target)  # [V]: the point mass of a deterministic proposer
            draft[token_id] = 1.0
        else:
            draft = check.draft_probs[j].to(target.dtype)  # [V]
        uniform = float(uniforms([check.state])[0])
        if uniform * float(draft[token_id]) < float(target[token_id]):
            continue  # accepted: u < p(x) / q(x)
        replacement = draw_rows(residual_distribution(target, draft).unsqueeze(0), uniforms([check.state]))
        return check.draft_token_ids[:j] + [int(replacement[0])]
    bonus = draw_rows(probs[-1:], uniforms([check.state]))
    return list(check.draft_token_ids) + [int(bonus[0])]


def accept_greedy(target_ids: list[int], draft_token_ids: list[int]) -> list[int]:
    """Greedy verification: drafts are accepted while each equals the target's argmax; the first mismatch is
    replaced by the argmax (after k matches, the argmax of the last row is the bonus token)."""
    num_accepted = 0
    while num_accepted < len(draft_token_ids) and draft_token_ids[num_accepted] == target_ids[num_accepted]:
        num_accepted += 1
    return target_ids[: num_accepted + 1]


def verdict(draft_token_ids: list[int], position: int, num_accepted: int) -> dict[str, object]:
    """StepTrace.extra["speculative"] of the token emitted at `position` of a verification."""
    return {
        # Every draft token of this verification, and how many of them the target accepted.
        "draft_token_ids": list(draft_token_ids),
        "num_accepted": num_accepted,
        # Which of the emitted tokens this one is (0 = right after the last known token).
        "position": position,
        # The draft proposed for this position (None for the bonus token after k accepted drafts).
        "draft_token_id": draft_token_ids[position] if position < len(draft_token_ids) else None,
        # True when this token is that draft, accepted; False when the target replaced it (or added a bonus).
        "accepted": position < num_accepted,
    }
