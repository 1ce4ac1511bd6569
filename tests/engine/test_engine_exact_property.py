"""Exact by default, as a property: any batch composition (1 to 32 requests, prompts of 1 to 300 tokens cut from
one text so that some share their start, 1 to 12 new tokens each, any step budget, prefix caching on or off, some
prompts run once before so that the batch finds them cached) gives every request the tokens and logprobs it gets
alone, bit for bit. The engine runs with its defaults otherwise."""

from __future__ import annotations

import pytest
from exact_checks import Result, greedy, make_prompts, results
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenriver.engine.llm import LLM

POOL_PROMPTS = 48


@pytest.fixture(scope="module")
def texts(loaded_default) -> list[list[int]]:
    """Prompts to cut requests from: every third starts where the text does."""
    return make_prompts(loaded_default, [300] * POOL_PROMPTS, seed=11)


@pytest.fixture(scope="module")
def reference(loaded_default):
    """Each (prompt, max_tokens)'s result alone, computed once."""
    llm = LLM.from_loaded(loaded_default, max_num_seqs=1, enable_prefix_caching=False)
    memo: dict[tuple[tuple[int, ...], int], Result] = {}

    def alone(prompt: list[int], max_tokens: int) -> Result:
        key = (tuple(prompt), max_tokens)
        if key not in memo:
            memo[key] = results(llm, [prompt], greedy([max_tokens]))[0]
        return memo[key]

    return alone


requests = st.lists(
    st.tuples(st.integers(0, POOL_PROMPTS - 1), st.integers(1, 300), st.integers(1, 12)), min_size=1, max_size=32
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    requests=requests,
    budget=st.sampled_from([16, 40, 128, 512, 2048]),
    caching=st.booleans(),
    warm=st.lists(st.integers(0, 31), max_size=8),
)
def test_any_batch_gives_every_request_its_bits_alone(
    loaded_default, texts, reference, requests, budget, caching, warm
):
    prompts = [texts[text][:length] for text, length, _ in requests]
    max_tokens = [count for _, _, count in requests]
    llm = LLM.from_loaded(loaded_default, max_num_batched_tokens=budget, enable_prefix_caching=caching)
    if caching and warm:
        results(llm, [prompts[i % len(prompts)] for i in warm], greedy([1] * len(warm)))
    got = results(llm, prompts, greedy(max_tokens))
    want = [reference(prompt, count) for prompt, count in zip(prompts, max_tokens)]
    assert got == want
