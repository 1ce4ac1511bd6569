"""Speculative sampling keeps the target distribution exact: a toy target and draft over a 4-token vocabulary.

Thousands of independent chains generate 3 tokens each by speculation (the draft
proposes k tokens, `Sampler.verify` accepts or rejects them); the frequencies of
the 64 possible sequences must match the target's exact sequence distribution
p(x1) p(x2 | x1) p(x3 | x1 x2) to within a total variation that sampling noise
stays under. The same harness with a common mistake in the rule (after a
rejection, draw from p instead of the residual max(0, p - q)) lands far above
that threshold, so the test can tell a right rule from a wrong one.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tokenriver.params import SamplingParams
from tokenriver.sampling import verify as verify_module
from tokenriver.sampling.sampler import DraftCheck, Sampler, SamplingState

VOCAB_SIZE = 4
NUM_GENERATED = 3
NUM_DRAFTS = 2
NUM_CHAINS = 8_000
# Sampling noise over 64 cells with 8k chains gives a TV of about 0.02; a wrong residual gives 0.12 or more.
MAX_TOTAL_VARIATION = 0.05


def toy_logits(context: tuple[int, ...], seed: int) -> torch.Tensor:
    """A fixed function of the context: [VOCAB_SIZE] logits."""
    generator = torch.Generator().manual_seed(seed * 7919 + hash(context) % 1_000_003)
    return torch.randn(VOCAB_SIZE, generator=generator) * 1.5


def target_logits(context: tuple[int, ...]) -> torch.Tensor:
    return toy_logits(context, seed=1)


def draft_logits(context: tuple[int, ...]) -> torch.Tensor:
    """A draft that disagrees with the target often (so rejections, and the residual, matter)."""
    return toy_logits(context, seed=2)


def processed_target_probs(context: tuple[int, ...], params: SamplingParams) -> torch.Tensor:
    """The target distribution the sampler draws from without speculation: temperature, then top-k."""
    logits = target_logits(context) / params.temperature
    if 0 < params.top_k < VOCAB_SIZE:
        kth = logits.topk(params.top_k).values[-1]
        logits = torch.where(logits < kth, float("-inf"), logits)
    return logits.softmax(dim=0)


def exact_sequence_distribution(params: SamplingParams) -> dict[tuple[int, ...], float]:
    distribution = {}
    for sequence in itertools.product(range(VOCAB_SIZE), repeat=NUM_GENERATED):
        probability = 1.0
        for position in range(NUM_GENERATED):
            probability *= float(processed_target_probs(sequence[:position], params)[sequence[position]])
        distribution[sequence] = probability
    return distribution


def speculative_frequencies(params: SamplingParams, deterministic_draft: bool) -> dict[tuple[int, ...], float]:
    """Run NUM_CHAINS chains to NUM_GENERATED tokens through Sampler.verify; the frequency of each sequence.

    deterministic_draft: the draft proposes its argmax (q is a point mass, as for n-gram drafts); otherwise it
    samples from softmax(draft logits), and that distribution goes to the verifier.
    """
    sampler = Sampler(torch.Generator().manual_seed(0))
    draft_generator = torch.Generator().manual_seed(1)
    target_rows: dict[tuple[int, ...], torch.Tensor] = {}
    draft_rows: dict[tuple[int, ...], torch.Tensor] = {}

    def target_row(context: tuple[int, ...]) -> torch.Tensor:
        if context not in target_rows:
            target_rows[context] = target_logits(context)
        return target_rows[context]

    def draft_row(context: tuple[int, ...]) -> torch.Tensor:
        if context not in draft_rows:
            draft_rows[context] = draft_logits(context).softmax(dim=0)
        return draft_rows[context]

    outputs: list[list[int]] = [[] for _ in range(NUM_CHAINS)]
    while True:
        running = [chain for chain in outputs if len(chain) < NUM_GENERATED]
        if not running:
            break
        checks, rows = [], []
        for chain in running:
            drafts, draft_probs = [], []
            for _ in range(NUM_DRAFTS):
                q = draft_row(tuple(chain + drafts))
                token = (
                    int(q.argmax()) if deterministic_draft else int(torch.multinomial(q, 1, generator=draft_generator))
                )
                drafts.append(token)
                draft_probs.append(q)
            rows += [target_row(tuple(chain + drafts[:j])) for j in range(NUM_DRAFTS + 1)]
            checks.append(
                DraftCheck(
                    SamplingState(params, [], list(chain), None, []),
                    drafts,
                    None if deterministic_draft else torch.stack(draft_probs),
                )
            )
        for chain, result in zip(running, sampler.verify(torch.stack(rows), checks)):
            chain.extend(sample.token_id for sample in result.samples)
    counts: dict[tuple[int, ...], int] = {}
    for chain in outputs:
        key = tuple(chain[:NUM_GENERATED])
        counts[key] = counts.get(key, 0) + 1
    return {key: count / NUM_CHAINS for key, count in counts.items()}


def total_variation(expected: dict[tuple[int, ...], float], observed: dict[tuple[int, ...], float]) -> float:
    keys = set(expected) | set(observed)
    return 0.5 * sum(abs(expected.get(k, 0.0) - observed.get(k, 0.0)) for k in keys)


CASES = [
    pytest.param(SamplingParams(temperature=1.0), False, id="draft-model-q"),
    pytest.param(SamplingParams(temperature=1.0), True, id="point-mass-draft"),
    pytest.param(SamplingParams(temperature=0.8, top_k=3), False, id="temperature-top-k"),
]


@pytest.mark.parametrize("params, deterministic_draft", CASES)
def test_speculative_sampling_reproduces_the_target_distribution(params, deterministic_draft):
    distance = total_variation(
        exact_sequence_distribution(params), speculative_frequencies(params, deterministic_draft)
    )
    assert distance < MAX_TOTAL_VARIATION


@pytest.mark.parametrize("deterministic_draft", [False, True], ids=["draft-model-q", "point-mass-draft"])
def test_a_wrong_residual_is_caught(monkeypatch, deterministic_draft):
    """After a rejection, drawing from p (forgetting to subtract q) over-weights the draft's favourites."""
    monkeypatch.setattr(verify_module, "residual_distribution", lambda target, draft: target)
    params = SamplingParams(temperature=1.0)
    distance = total_variation(
        exact_sequence_distribution(params), speculative_frequencies(params, deterministic_draft)
    )
    assert distance > MAX_TOTAL_VARIATION


def test_greedy_verification_accepts_exactly_the_argmax_prefix():
    sampler = Sampler(torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.0, logprobs=1)
    logits = torch.tensor(
        [
            [0.0, 3.0, 1.0, 0.0],  # argmax 1: draft 1 accepted
            [2.0, 0.0, 1.0, 0.0],  # argmax 0: draft 2 rejected, replaced by 0
            [0.0, 0.0, 0.0, 5.0],
        ]
    )  # never reached
    (result,) = sampler.verify(logits, [DraftCheck(SamplingState(params, [], [], None, []), [1, 2])])
    assert [s.token_id for s in result.samples] == [1, 0] and result.num_accepted == 1
    expected = logits[:2].log_softmax(dim=1)
    assert [s.logprob.logprob for s in result.samples] == pytest.approx(
        [float(expected[0, 1]), float(expected[1, 0])], abs=1e-6
    )
    (bonus,) = sampler.verify(logits, [DraftCheck(SamplingState(params, [], [], None, []), [1, 0])])
    assert [s.token_id for s in bonus.samples] == [1, 0, 3] and bonus.num_accepted == 2


def test_verification_applies_penalties_with_each_positions_history():
    """Row j is processed as if the drafts before it had been generated: here a frequency penalty on token 1
    (generated once before, plus once as the first draft) flips the second row's argmax."""
    sampler = Sampler(torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    logits = torch.tensor([[0.0, 5.0, 0.0, 0.0], [0.0, 3.5, 2.0, 0.0]])
    state = SamplingState(params, [], [1], None, [])
    (result,) = sampler.verify(logits, [DraftCheck(state, [1])])
    # Row 0: 5 - 1 = 4 wins, the draft stands; row 1 sees token 1 twice: 3.5 - 2 = 1.5 < 2, so the bonus is 2.
    assert [s.token_id for s in result.samples] == [1, 2]
    plain = sampler.sample(logits[1:], [SamplingState(params, [], [1, 1], None, [])])
    assert plain[0].token_id == 2
