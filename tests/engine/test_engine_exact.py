"""Exact by default, on the embedded model: with no flags a request gets the same tokens and logprobs, bit for bit,
alone or batched, with its prompt whole or chunked, from the prefix cache or cold, preempted or not, with
speculative decoding or without (exact_checks.py has the checks; test_engine_exact_models.py runs them on more
files). Prompt lengths cross the attention kernel's 128-token splits, and some leave one or two tokens after a
chunk budget or a cached prefix of whole 16-token blocks: the tokens the kernel once took by another path."""

from __future__ import annotations

import pytest
from exact_checks import (
    check_batched_equals_alone,
    check_chunked_prefill_equals_whole,
    check_preempted_equals_uninterrupted,
    check_prefix_hit_equals_cold,
    check_seeded_sampling_batched_equals_alone,
    check_speculation_equals_plain,
    make_prompts,
)

LENGTHS = [12, 300, 45, 140, 7, 260, 90, 33, 200, 129, 64, 17]
EDGES = [17, 33, 129, 258, 300, 64, 49]


@pytest.fixture(scope="module")
def prompts(loaded_default):
    return make_prompts(loaded_default, LENGTHS)


def test_the_fixture_runs_the_defaults(loaded_default):
    assert loaded_default.int8_activations


def test_batched_equals_alone(loaded_default, prompts):
    check_batched_equals_alone(loaded_default, prompts, [4 + 3 * (i % 7) for i in range(len(prompts))])


@pytest.mark.parametrize("budget", [16, 48, 160])
def test_chunked_prefill_equals_whole(loaded_default, budget):
    check_chunked_prefill_equals_whole(loaded_default, make_prompts(loaded_default, EDGES, seed=1), budget)


def test_prefix_cache_hit_equals_cold(loaded_default):
    check_prefix_hit_equals_cold(loaded_default, make_prompts(loaded_default, EDGES, seed=2))


def test_preempted_equals_uninterrupted(loaded_default, prompts):
    check_preempted_equals_uninterrupted(loaded_default, prompts[:8], pool_tokens=640)


@pytest.mark.parametrize("draft, count", [("ngram", 4), ("self:20", 3), ("model file", 3)])
def test_greedy_speculation_equals_plain(loaded_default, draft, count):
    # Repetitive prompts, so the n-gram drafts get accepted too.
    prompts = make_prompts(loaded_default, [40, 150, 90, 20], seed=3)
    prompts = [prompt + prompt[: len(prompt) // 2] for prompt in prompts]
    check_speculation_equals_plain(
        loaded_default, prompts, loaded_default.path if draft == "model file" else draft, count
    )


def test_seeded_sampling_batched_equals_alone(loaded_default, prompts):
    check_seeded_sampling_batched_equals_alone(loaded_default, prompts[:6])
