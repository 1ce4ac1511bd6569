"""The server driven by the official openai SDK: completions and chat, streaming and not.

References: a request's own unstopped / non-streamed / unechoed twin (stream
== non-stream for one seed, stop == the unstopped text cut before the stop
string, echo == prompt + text), /tokenize for token counts, and greedy
decoding for logprobs (the chosen token must be the most likely one).
"""

from __future__ import annotations

import math

import httpx
import openai
import pytest

PROMPT = "The three primary colors are"
MESSAGES = [{"role": "user", "content": "Name a fruit."}]


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def model(client):
    (card,) = client.models.list().data
    return card.id


def _tokenize(server, body: dict) -> list[int]:
    response = httpx.post(server.url + "/tokenize", json=body, headers=server.headers(), timeout=30)
    response.raise_for_status()
    return response.json()["tokens"]


def _stream_completion(client, **kwargs) -> tuple[list[str], list[str | None], object]:
    """Texts and finish reasons per choice index, and the usage chunk."""
    n = kwargs.get("n", 1)
    texts, reasons, usage = [""] * n, [None] * n, None
    for chunk in client.completions.create(stream=True, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    return texts, reasons, usage


def test_models_lists_the_served_model(client, model):
    assert model == "SmolLM2-135M-Instruct.Q4_1"
    assert client.models.retrieve(model).id == model


def test_completion_usage_counts_tokens(server, client, model):
    response = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    (choice,) = response.choices
    assert choice.finish_reason == "length"
    prompt_ids = _tokenize(server, {"prompt": PROMPT})
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == 6
    assert response.usage.total_tokens == len(prompt_ids) + 6
    assert response.usage.prompt_tokens_details.cached_tokens >= 0
    assert response.model == model and response.object == "text_completion"


def test_streamed_completion_equals_non_streamed_for_one_seed(client, model):
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=12, temperature=0.9, seed=1234)
    whole = client.completions.create(**kwargs)
    texts, reasons, usage = _stream_completion(client, stream_options={"include_usage": True}, **kwargs)
    assert texts == [whole.choices[0].text]
    assert reasons == [whole.choices[0].finish_reason]
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_n_choices_are_seeded_and_reproducible(client, model):
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, n=2, seed=7)
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    texts, _, _ = _stream_completion(client, **kwargs)
    assert texts == [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert 2 <= first.usage.completion_tokens <= 16


def test_stop_string_cuts_the_text_before_it(client, model):
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=16, temperature=0)
    full = client.completions.create(**kwargs).choices[0].text
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    stopped = client.completions.create(stop=[stop], **kwargs).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == full[: full.index(stop)]
    texts, reasons, _ = _stream_completion(client, stop=stop, **kwargs)
    assert texts == [stopped.text] and reasons == ["stop"]


def test_completion_logprobs_greedy_chooses_the_top_token(client, model):
    response = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert "".join(logprobs.tokens) == response.choices[0].text
    for token, token_logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert token_logprob <= 0
        assert 3 <= len(top) <= 4
        assert math.isclose(token_logprob, max(top.values()), abs_tol=1e-5)
        assert top[token] == pytest.approx(token_logprob)
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(5)]


def test_echo_prepends_the_prompt_and_its_logprobs(client, model):
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
    echoed = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=1)
    (choice,) = echoed.choices
    assert choice.text == PROMPT + plain.choices[0].text
    assert "".join(choice.logprobs.tokens) == choice.text
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs[1:])
    assert choice.logprobs.text_offset[-1] == len(choice.text) - len(choice.logprobs.tokens[-1])
    texts, _, _ = _stream_completion(client, model=model, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert texts == [choice.text]


def test_best_of_returns_the_n_most_likely(client, model):
    response = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=3, temperature=1.0, n=2, best_of=3, seed=5, logprobs=0
    )
    assert sorted(c.index for c in response.choices) == [0, 1]
    totals = [sum(c.logprobs.token_logprobs) for c in sorted(response.choices, key=lambda c: c.index)]
    assert totals[0] >= totals[1]


def test_batch_prompts_get_one_choice_each_in_order(client, model):
    prompts = ["One, two,", "Red, green,"]
    response = client.completions.create(model=model, prompt=prompts, max_tokens=3, temperature=0)
    assert [c.index for c in sorted(response.choices, key=lambda c: c.index)] == [0, 1]
    singles = [client.completions.create(model=model, prompt=p, max_tokens=3, temperature=0) for p in prompts]
    assert response.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert response.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)


def test_prompt_as_token_ids_matches_prompt_as_text(server, client, model):
    ids = _tokenize(server, {"prompt": PROMPT})
    as_text = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0)
    as_ids = client.completions.create(model=model, prompt=ids, max_tokens=5, temperature=0)
    assert as_ids.choices[0].text == as_text.choices[0].text


def test_chat_completion_and_its_stream_agree(server, client, model):
    kwargs = dict(model=model, messages=MESSAGES, max_completion_tokens=10, temperature=0.7, seed=3)
    whole = client.chat.completions.create(**kwargs)
    (choice,) = whole.choices
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    prompt_ids = _tokenize(server, {"messages": MESSAGES})
    assert whole.usage.prompt_tokens == len(prompt_ids)
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    pieces, roles, reasons, usage = [], [], [], None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            roles.append(c.delta.role)
            pieces.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    assert roles[0] == "assistant"
    assert "".join(pieces) == choice.message.content
    assert [r for r in reasons if r] == [choice.finish_reason]
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_chat_logprobs_list_exactly_top_logprobs(client, model):
    response = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token


def test_trace_extension_streams_token_ids_and_traces(client, model):
    stream = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=4, temperature=0, stream=True, extra_body={"trace": True, "trace_top": 3}
    )
    token_ids, traces, metrics = [], [], None
    for chunk in stream:
        extra = chunk.model_extra or {}
        metrics = extra.get("metrics") or metrics
        for choice in chunk.choices:
            choice_extra = choice.model_extra or {}
            token_ids += choice_extra.get("token_ids", [])
            traces += choice_extra.get("trace", [])
    assert len(token_ids) == len(traces) == 4
    for token_id, trace in zip(token_ids, traces):
        assert trace["chosen_token_id"] == token_id and trace["chosen_rank"] == 1
        assert len(trace["candidates"]) == 3
    assert metrics["num_generated_tokens"] == 4
    assert metrics["kv_blocks"] == math.ceil((metrics["num_prompt_tokens"] + 4) / 16)
