"""Each logits processor against its reference: transformers' processors, or OpenAI's formula computed by hand.

Every test runs a batch whose rows use different parameters (some with the control off) and compares each
row with the reference applied to that row alone; rows with the control off must come back bit-for-bit.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from sampling_helpers import random_logits

from tokenriver.sampling import processors

transformers = pytest.importorskip("transformers")

VOCAB_SIZE = 1000


def assert_rows_equal(actual: torch.Tensor, expected: torch.Tensor, row: int, what: str) -> None:
    """Bit-for-bit equality (same -inf pattern, same values), with a readable diff."""
    if torch.equal(actual, expected):
        return
    differs = (actual != expected).nonzero().flatten().tolist()[:5]
    details = [(j, float(actual[j]), float(expected[j])) for j in differs]
    raise AssertionError(f"{what}: row {row} differs at (token, ours, reference) {details}")


def test_count_tokens_matches_counter():
    histories = [[5, 5, 7, 999], [], [0, 0, 0, 1], [3]]
    counts = processors.count_tokens(processors.pad_token_ids(histories, VOCAB_SIZE), VOCAB_SIZE)
    assert counts.shape == (4, VOCAB_SIZE)
    for row, history in enumerate(histories):
        expected = torch.zeros(VOCAB_SIZE, dtype=torch.int32)
        for token_id, count in Counter(history).items():
            expected[token_id] = count
        assert torch.equal(counts[row], expected)


def test_repetition_penalty_matches_transformers():
    penalties = [1.0, 1.3, 0.7, 2.0, 1.05]
    histories = [[1, 2, 3], [4, 4, 10, 500, 999], [7, 8, 9, 7], list(range(0, 1000, 3)), [0]]
    logits = random_logits(len(penalties), VOCAB_SIZE)
    history_ids = processors.pad_token_ids(histories, VOCAB_SIZE)
    ours = processors.apply_repetition_penalty(logits, history_ids, torch.tensor(penalties))
    for row, (penalty, history) in enumerate(zip(penalties, histories)):
        reference = transformers.RepetitionPenaltyLogitsProcessor(penalty=penalty)(
            torch.tensor([history]), logits[row : row + 1].clone()
        )[0]
        assert_rows_equal(ours[row], reference, row, f"repetition_penalty={penalty}")
        alone_ids = processors.pad_token_ids([history], VOCAB_SIZE)
        alone = processors.apply_repetition_penalty(logits[row : row + 1], alone_ids, torch.tensor([penalty]))[0]
        assert_rows_equal(alone, ours[row], row, "alone vs batch")
    assert_rows_equal(ours[0], logits[0], 0, "penalty 1 leaves the row untouched")
    # The reference really penalized something: the test can tell a no-op from a penalty.
    assert not torch.equal(ours[1], logits[1])


def test_presence_frequency_penalties_match_openai_formula():
    presence = [0.0, 0.5, -1.0, 2.0, 0.0]
    frequency = [0.0, 0.0, 0.3, -2.0, 1.5]
    generated = [[1, 1, 2], [4, 4, 4, 10], [7, 8, 9, 7], [3, 3, 5], [0, 0, 0, 0, 9]]
    logits = random_logits(len(presence), VOCAB_SIZE, seed=1)
    ours = processors.apply_presence_frequency_penalties(
        logits, processors.pad_token_ids(generated, VOCAB_SIZE), torch.tensor(presence), torch.tensor(frequency)
    )
    for row in range(len(presence)):
        expected = logits[row].double().clone()
        for token_id, count in Counter(generated[row]).items():
            # OpenAI: mu[j] -= c[j] * alpha_frequency + float(c[j] > 0) * alpha_presence
            expected[token_id] -= count * frequency[row] + (1.0 if count > 0 else 0.0) * presence[row]
        torch.testing.assert_close(ours[row].double(), expected, rtol=1e-6, atol=1e-5)
    assert_rows_equal(ours[0], logits[0], 0, "both penalties 0 leave the row untouched")


def test_logit_bias_adds_to_the_given_tokens_only():
    biases = [{}, {3: 5.0, 999: -100.0}, {0: 0.5}]
    logits = random_logits(len(biases), VOCAB_SIZE, seed=2)
    token_ids = processors.pad_token_ids([list(b) for b in biases], VOCAB_SIZE)
    width = token_ids.shape[1]
    values = torch.tensor([list(b.values()) + [0.0] * (width - len(b)) for b in biases])
    ours = processors.apply_logit_bias(logits, token_ids, values)
    for row, bias in enumerate(biases):
        expected = logits[row].clone()
        for token_id, value in bias.items():
            expected[token_id] += value
        assert_rows_equal(ours[row], expected, row, f"logit_bias={bias}")


def test_min_tokens_blocks_stop_ids_only_while_too_short():
    blocked = [[2], [2, 17], [2, 17], []]
    num_output = torch.tensor([0, 3, 5, 0])
    min_tokens = torch.tensor([1, 5, 5, 3])
    logits = random_logits(len(blocked), VOCAB_SIZE, seed=3)
    ours = processors.apply_min_tokens(logits, processors.pad_token_ids(blocked, VOCAB_SIZE), num_output, min_tokens)
    for row in range(len(blocked)):
        expected = logits[row].clone()
        if num_output[row] < min_tokens[row]:
            expected[blocked[row]] = float("-inf")
        assert_rows_equal(ours[row], expected, row, "min_tokens")
    assert torch.isinf(ours[1, 17]) and torch.isinf(ours[1, 2])
    assert_rows_equal(ours[2], logits[2], 2, "min_tokens reached")


def test_temperature_matches_transformers():
    temperatures = [1.0, 0.7, 1.5, 0.05, 2.0]
    logits = random_logits(len(temperatures), VOCAB_SIZE, seed=4)
    ours = processors.apply_temperature(logits, torch.tensor(temperatures))
    for row, temperature in enumerate(temperatures):
        reference = transformers.TemperatureLogitsWarper(temperature)(None, logits[row : row + 1].clone())[0]
        assert_rows_equal(ours[row], reference, row, f"temperature={temperature}")
    assert_rows_equal(ours[0], logits[0], 0, "temperature 1 leaves the row untouched")


def test_top_k_matches_transformers():
    top_ks = [0, 1, 5, 50, 999, VOCAB_SIZE, -1, 200]
    logits = random_logits(len(top_ks), VOCAB_SIZE, seed=5)
    logits[7, 10:20] = logits[7].max() - 0.5  # ties around the k-th value: transformers keeps them all
    ours = processors.apply_top_k(logits, torch.tensor(top_ks))
    for row, top_k in enumerate(top_ks):
        if top_k <= 0:
            assert_rows_equal(ours[row], logits[row], row, f"top_k={top_k} is off")
            continue
        reference = transformers.TopKLogitsWarper(top_k=top_k)(None, logits[row : row + 1].clone())[0]
        assert_rows_equal(ours[row], reference, row, f"top_k={top_k}")
        alone = processors.apply_top_k(logits[row : row + 1], torch.tensor([top_k]))[0]
        assert_rows_equal(alone, ours[row], row, "alone vs batch")
    assert int(torch.isfinite(ours[2]).sum()) == 5


@pytest.mark.parametrize(
    ("vocab_size", "scale", "top_ps", "min_kept", "max_kept"),
    [
        # Peaked rows: the cut lies within the 256 most likely tokens (first search size).
        (VOCAB_SIZE, 6.0, [1.0, 0.9, 0.5, 0.99, 0.1, 0.95], 1, 256),
        # Flatter rows over a larger vocabulary: the cut needs the second search size (4096).
        (20_000, 3.0, [0.9, 1.0, 0.8, 0.95], 257, 4096),
        # Nearly uniform rows: only a full sort of the row finds the cut.
        (20_000, 0.05, [0.9, 0.99, 1.0, 0.5], 4097, 20_000),
    ],
)
def test_top_p_matches_transformers(vocab_size, scale, top_ps, min_kept, max_kept):
    logits = random_logits(len(top_ps), vocab_size, scale=scale, seed=6)
    ours = processors.apply_top_p(logits, torch.tensor(top_ps))
    for row, top_p in enumerate(top_ps):
        if top_p == 1.0:
            assert_rows_equal(ours[row], logits[row], row, "top_p=1 is off")
            continue
        reference = transformers.TopPLogitsWarper(top_p=top_p)(None, logits[row : row + 1].clone())[0]
        assert_rows_equal(ours[row], reference, row, f"top_p={top_p}")
        alone = processors.apply_top_p(logits[row : row + 1], torch.tensor([top_p]))[0]
        assert_rows_equal(alone, ours[row], row, "alone vs batch")
    # The rows exercised the intended search size (the 0.5 / 0.1 rows of the first case may keep fewer).
    num_kept = [int(torch.isfinite(ours[row]).sum()) for row, p in enumerate(top_ps) if p >= 0.9 and p < 1]
    assert all(min_kept <= n <= max_kept for n in num_kept), num_kept


def test_top_p_after_top_k_matches_transformers():
    top_ks, top_ps = [10, 300, 5000], [0.9, 0.95, 0.5]
    logits = random_logits(len(top_ks), 20_000, scale=0.5, seed=7)
    ours = processors.apply_top_p(processors.apply_top_k(logits, torch.tensor(top_ks)), torch.tensor(top_ps))
    for row, (top_k, top_p) in enumerate(zip(top_ks, top_ps)):
        after_top_k = transformers.TopKLogitsWarper(top_k=top_k)(None, logits[row : row + 1].clone())
        reference = transformers.TopPLogitsWarper(top_p=top_p)(None, after_top_k)[0]
        assert_rows_equal(ours[row], reference, row, f"top_k={top_k}, top_p={top_p}")


def test_min_p_matches_transformers():
    min_ps = [0.0, 0.05, 0.1, 0.5, 1.0, 0.01]
    logits = random_logits(len(min_ps), VOCAB_SIZE, seed=8)
    ours = processors.apply_min_p(logits, torch.tensor(min_ps))
    for row, min_p in enumerate(min_ps):
        if min_p == 0.0:
            assert_rows_equal(ours[row], logits[row], row, "min_p=0 is off")
            continue
        reference = transformers.MinPLogitsWarper(min_p=min_p)(None, logits[row : row + 1].clone())[0]
        assert_rows_equal(ours[row], reference, row, f"min_p={min_p}")
        alone = processors.apply_min_p(logits[row : row + 1], torch.tensor([min_p]))[0]
        assert_rows_equal(alone, ours[row], row, "alone vs batch")
    assert int(torch.isfinite(ours[4]).sum()) == 1  # min_p=1 keeps only the top token


def test_processors_never_modify_their_input():
    logits = random_logits(3, VOCAB_SIZE, seed=9)
    before = logits.clone()
    ids = processors.pad_token_ids([[1, 2], [3], []], VOCAB_SIZE)
    processors.apply_repetition_penalty(logits, ids, torch.tensor([1.2, 1.2, 1.2]))
    processors.apply_presence_frequency_penalties(logits, ids, torch.ones(3), torch.ones(3))
    processors.apply_logit_bias(logits, ids, torch.ones(ids.shape))
    processors.apply_min_tokens(logits, ids, torch.zeros(3), torch.ones(3))
    processors.apply_temperature(logits, torch.full((3,), 0.5))
    processors.apply_top_k(logits, torch.tensor([1, 2, 3]))
    processors.apply_top_p(logits, torch.full((3,), 0.5))
    processors.apply_min_p(logits, torch.full((3,), 0.5))
    assert torch.equal(logits, before)
