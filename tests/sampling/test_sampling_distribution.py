"""The sampler draws from the distribution it claims: a chi-square test per parameter set.

20,000 draws from one fixed logits vector, compared with the exact processed distribution computed by
transformers' warpers (temperature → top-k → top-p → min-p, then softmax). Seeds are fixed, so the test is
deterministic; the threshold (p-value 1e-4) is shown to reject a sampler that ignores the filters or the
temperature.
"""

from __future__ import annotations

import pytest
import torch
from sampling_helpers import make_state, random_logits

from tokenriver.params import SamplingParams
from tokenriver.sampling.sampler import Sampler

transformers = pytest.importorskip("transformers")

VOCAB_SIZE = 40
NUM_ROWS = 2_000
NUM_STEPS = 10  # 20,000 draws
MIN_P_VALUE = 1e-4
LOGITS = random_logits(1, VOCAB_SIZE, scale=1.5, seed=42)[0]  # [V]

PARAMETER_SETS = [
    dict(temperature=1.0),
    dict(temperature=0.6),
    dict(temperature=1.4, top_k=8),
    dict(top_p=0.8),
    dict(temperature=0.8, top_k=12, top_p=0.9, min_p=0.05),
    dict(min_p=0.2),
    dict(temperature=1.2, top_p=0.6, min_p=0.1),
]


@pytest.fixture(autouse=True)
def one_thread():
    """[2000, 40] tensors gain nothing from a second thread; on a busy machine it only adds waiting (10x slower)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def expected_distribution(params: SamplingParams) -> torch.Tensor:
    """softmax of the logits after transformers' warpers: the distribution the sampler must draw from."""
    warpers = transformers.LogitsProcessorList()
    if params.temperature != 1.0:
        warpers.append(transformers.TemperatureLogitsWarper(params.temperature))
    if params.top_k > 0:
        warpers.append(transformers.TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(transformers.TopPLogitsWarper(params.top_p))
    if params.min_p > 0.0:
        warpers.append(transformers.MinPLogitsWarper(params.min_p))
    scores = warpers(torch.zeros(1, 1, dtype=torch.int64), LOGITS.unsqueeze(0).clone())
    return scores.softmax(dim=-1)[0].double()


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of the counts under probs; 0 when a token of probability 0 was drawn.

    Tokens expected fewer than 5 times are pooled into one bin so the chi-square approximation holds.
    """
    counts = counts.double()
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs * counts.sum()
    is_large = expected >= 5
    observed_bins = torch.cat([counts[is_large], counts[~is_large & (probs > 0)].sum().reshape(1)])
    expected_bins = torch.cat([expected[is_large], expected[~is_large & (probs > 0)].sum().reshape(1)])
    if expected_bins[-1] < 5:  # too small even pooled: fold into the last large bin
        observed_bins = torch.cat([observed_bins[:-2], observed_bins[-2:].sum().reshape(1)])
        expected_bins = torch.cat([expected_bins[:-2], expected_bins[-2:].sum().reshape(1)])
    statistic = ((observed_bins - expected_bins) ** 2 / expected_bins).sum()
    degrees_of_freedom = len(expected_bins) - 1
    if degrees_of_freedom == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(degrees_of_freedom / 2.0), statistic / 2))


def draw_counts(params: SamplingParams, *, seeded: bool) -> torch.Tensor:
    """Counts of NUM_ROWS * NUM_STEPS draws; seeded rows each own a generator, others share the default one."""
    sampler = Sampler(torch.Generator().manual_seed(1234))
    states = [make_state(params, seed=7_000 + row if seeded else None) for row in range(NUM_ROWS)]
    logits = LOGITS.expand(NUM_ROWS, VOCAB_SIZE).contiguous()  # [NUM_ROWS, V], the same vector on every row
    counts = torch.zeros(VOCAB_SIZE, dtype=torch.int64)
    for _ in range(NUM_STEPS):
        token_ids = torch.tensor([result.token_id for result in sampler.sample(logits, states)])
        counts += torch.bincount(token_ids, minlength=VOCAB_SIZE)
    return counts


@pytest.mark.parametrize("settings", PARAMETER_SETS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("seeded", [False, True], ids=["default-generator", "per-row-seed"])
def test_draws_follow_the_processed_distribution(settings, seeded):
    params = SamplingParams(**settings)
    probs = expected_distribution(params)
    counts = draw_counts(params, seeded=seeded)
    p_value = chi_square_p_value(counts, probs)
    assert p_value > MIN_P_VALUE, (
        f"{settings}: p={p_value:.2e}\nobserved {counts.tolist()}\nexpected {(probs * counts.sum()).round().tolist()}"
    )


@pytest.mark.parametrize("settings", PARAMETER_SETS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_threshold_rejects_a_wrong_sampler(settings):
    """Draws from a wrong distribution (filters ignored, or temperature 1.15x off when no filter) must fail."""
    params = SamplingParams(**settings)
    probs = expected_distribution(params)
    raw = LOGITS.double().softmax(dim=0)
    is_filtered = bool((probs == 0).any())
    wrong = raw if is_filtered else (LOGITS.double() / (params.temperature * 1.15)).softmax(dim=0)
    generator = torch.Generator().manual_seed(99)
    draws = torch.multinomial(wrong, NUM_ROWS * NUM_STEPS, replacement=True, generator=generator)
    counts = torch.bincount(draws, minlength=VOCAB_SIZE)
    assert chi_square_p_value(counts, probs) <= MIN_P_VALUE
    # And the same test accepts draws from the right distribution by another sampler.
    right = torch.multinomial(probs, NUM_ROWS * NUM_STEPS, replacement=True, generator=generator)
    assert chi_square_p_value(torch.bincount(right, minlength=VOCAB_SIZE), probs) > MIN_P_VALUE
