"""Exact by default, through the server: the shared server runs with no flags (tests/server/conftest.py), and a
request's text and logprobs do not depend on whether it is streamed, on the prefix cache, or on the requests sent
with it."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

SYSTEM = "You are a careful assistant who answers every question in one short sentence. " * 6
TOPICS = ["rivers", "tokens", "tea", "volcanoes", "chess", "leaves", "lighthouses", "the moon", "bread", "snow"]


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def model(client):
    (card,) = client.models.list().data
    return card.id


def _text_and_logprobs(response) -> tuple[str, list[float]]:
    (choice,) = response.choices
    return choice.text, choice.logprobs.token_logprobs


def test_32_concurrent_requests_equal_the_same_requests_one_at_a_time(client, model):
    prompts = [f"{SYSTEM}\nQuestion {i}: what do you know about {TOPICS[i % len(TOPICS)]}?\nAnswer:" for i in range(32)]
    kwargs = dict(model=model, max_tokens=16, temperature=0, logprobs=1, extra_body={"ignore_eos": True})
    one_at_a_time = [_text_and_logprobs(client.completions.create(prompt=prompt, **kwargs)) for prompt in prompts]
    with ThreadPoolExecutor(max_workers=32) as pool:
        together = list(pool.map(lambda p: _text_and_logprobs(client.completions.create(prompt=p, **kwargs)), prompts))
    assert together == one_at_a_time


def test_seeded_sampling_streamed_equals_non_streamed(client, model):
    """Temperature 0.7 with a seed: the second request finds the first's prompt in the prefix cache."""
    kwargs = dict(
        model=model, prompt=SYSTEM + "\nWrite a line about rivers.", max_tokens=24, temperature=0.7, seed=5, logprobs=1
    )
    whole = _text_and_logprobs(client.completions.create(**kwargs))
    text, logprobs = "", []
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                logprobs += choice.logprobs.token_logprobs
    assert (text, logprobs) == whole
