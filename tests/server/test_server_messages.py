"""Anthropic's Messages API driven by the official anthropic SDK over HTTP, against the real server.

References: a request's non-streamed twin (the streamed message the SDK accumulates equals it at temperature 0),
the same request's usage (count_tokens counts what it was billed), the prefix cache's own counts (a request
differing only in Claude Code's attribution header reads the whole prompt from the cache), and for thinking a
tiny Qwen3 whose weights spell out one answer (`<think>ok</think>Hi`) under a Qwen3-style template.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from pathlib import Path

import anthropic
import httpx
import pytest
from server_harness import MAX_MODEL_LEN, start_server, stop_server

WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]}},
        "required": ["city"],
    },
}
QUESTION = [{"role": "user", "content": "Name a fruit."}]
# The SDK leaves temperature out of its signature (newer Claude models fix it); the API takes it.
GREEDY = {"temperature": 0}
# Qwen3's chat template as far as thinking goes: enable_thinking=false closes an empty thinking block in the prompt.
QWEN3_STYLE_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


@pytest.fixture(scope="module")
def client(server):
    with anthropic.Anthropic(base_url=server.url, api_key=server.api_key, max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def model(server):
    return httpx.get(server.url + "/v1/models", headers=server.headers(), timeout=30).json()["data"][0]["id"]


def _engine(server) -> dict:
    return httpx.get(server.url + "/v1/engine", headers=server.headers(), timeout=30).json()


def _wait_until_idle(server) -> dict:
    deadline = time.monotonic() + 30
    while True:
        engine = _engine(server)
        if (engine["num_running"], engine["num_waiting"], engine["num_blocks_used"]) == (0, 0, 0):
            return engine
        assert time.monotonic() < deadline, engine
        time.sleep(0.2)


def test_create_and_stream_give_the_same_message(client, model):
    kwargs = dict(model=model, max_tokens=16, messages=QUESTION, extra_body=GREEDY)
    message = client.messages.create(**kwargs)
    assert (message.type, message.role, message.model) == ("message", "assistant", model)
    assert message.id.startswith("msg_") and message.stop_reason in ("end_turn", "max_tokens")
    assert [block.type for block in message.content] == ["text"] and message.content[0].text
    assert 0 < message.usage.output_tokens <= 16

    events = [event.type for event in client.messages.create(stream=True, **kwargs)]
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    assert events[1:3] == ["content_block_start", "content_block_delta"] and events[-3] == "content_block_stop"
    assert set(events[2:-3]) == {"content_block_delta"}

    with client.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].text == message.content[0].text
    assert (streamed.stop_reason, streamed.usage.output_tokens) == (message.stop_reason, message.usage.output_tokens)


def test_tool_use_then_tool_result(client, model):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    call = client.messages.create(
        model=model,
        max_tokens=48,
        extra_body=GREEDY,
        messages=question,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    assert call.stop_reason == "tool_use"
    (block,) = call.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.id.startswith("toolu_")
    assert block.input["city"] in ("Paris", "London", "Tokyo")

    answer = client.messages.create(
        model=model,
        max_tokens=24,
        extra_body=GREEDY,
        tools=[WEATHER],
        messages=[
            *question,
            {"role": "assistant", "content": call.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "Sunny, 24 C"}]},
        ],
        tool_choice={"type": "none"},
    )
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in answer.content] == ["text"] and answer.content[0].text


def test_count_tokens_is_what_the_request_is_billed(client, model):
    fields = dict(model=model, system="You are terse.", messages=QUESTION, tools=[WEATHER])
    count = client.messages.count_tokens(**fields)
    message = client.messages.create(max_tokens=8, extra_body=GREEDY, **fields)
    assert count.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens
    assert client.messages.count_tokens(model=model, messages=QUESTION).input_tokens < count.input_tokens


def test_attribution_header_does_not_break_the_prefix_cache(client, model, server):
    """Two requests differing only in the attribution header's cch= read all but the last block from the cache."""
    block_size = _engine(server)["block_size"]
    instructions = f"Session {uuid.uuid4().hex}. " + "You are a careful coding agent; explain every change. " * 8

    def ask(cch: str) -> anthropic.types.Usage:
        header = f"x-anthropic-billing-header: cc_version=2.1.3.abc; cc_entrypoint=cli; cch={cch};"
        system = [{"type": "text", "text": header}, {"type": "text", "text": instructions}]
        return client.messages.create(model=model, max_tokens=1, system=system, messages=QUESTION).usage

    first, second = ask("1a2b3"), ask("9f8e7")
    total = first.input_tokens + first.cache_read_input_tokens
    assert second.input_tokens + second.cache_read_input_tokens == total > 4 * block_size
    assert first.cache_read_input_tokens < total - 2 * block_size  # the session's text was new
    assert second.cache_read_input_tokens >= total - block_size


def test_api_key_as_x_api_key_or_bearer_and_a_wrong_one_is_401(server, model):
    body = {"model": model, "max_tokens": 1, "messages": QUESTION}
    assert httpx.post(server.url + "/v1/messages", json=body, headers=server.headers(), timeout=60).status_code == 200
    with anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0) as wrong:
        with pytest.raises(anthropic.AuthenticationError) as error:
            wrong.messages.create(**body)
    assert error.value.status_code == 401
    assert error.value.body["type"] == "error" and error.value.body["error"]["type"] == "authentication_error"


def test_a_claude_code_request_runs_to_the_end_of_the_context(client, model):
    """Claude Code's shape: attribution header, a system turn after the user's, tools, adaptive thinking, context
    management, effort, a user id and max_tokens far above the context (an upper bound, never refused)."""
    system = [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.3.abc; cc_entrypoint=cli; cch=1a2b3;"},
        {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
    ]
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "List three colors.", "cache_control": {"type": "ephemeral"}}],
        },
        {"role": "system", "content": "The user is in a git repository."},
    ]
    read = {
        "name": "Read",
        "description": "Read a file.",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    }
    with client.messages.stream(
        model=model,
        max_tokens=32000,
        system=system,
        messages=messages,
        tools=[read, {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}],
        thinking={"type": "adaptive"},
        metadata={"user_id": "user_abc_account_1_session_2"},
        extra_body={"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}},
        extra_headers={"anthropic-beta": "context-management-2025-06-27"},
        output_config={"effort": "high"},
    ) as stream:
        message = stream.get_final_message()
    assert message.stop_reason in ("max_tokens", "end_turn", "tool_use")
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens + usage.output_tokens <= MAX_MODEL_LEN


def _deep_tool(depth: int) -> dict:
    """A tool whose schema nests `depth` JSON lists in a const: llguidance reads a schema nested deeper than 128
    levels as invalid ("recursion limit exceeded"), and this gets there in few tokens, fitting the context."""
    value: list = []
    for _ in range(depth):
        value = [value]
    return {**WEATHER, "input_schema": {"type": "object", "properties": {"a": {"const": value}}}}


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "images are not supported"),
        ({"messages": [{"role": "developer", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]}, "'video' is not supported"),
        ({"messages": QUESTION, "tools": [_deep_tool(100)]}, None),  # the control: a schema the grammar takes
        ({"messages": QUESTION, "tools": [_deep_tool(130)]}, "recursion limit"),
    ],
)
def test_bad_input_is_400_in_anthropic_shape_and_leaves_nothing_behind(server, model, fields, words):
    body = {"model": model, "max_tokens": 8, "stream": True, **fields}
    response = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": server.api_key}, timeout=60)
    if words is None:
        assert response.status_code == 200, response.text
        return
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert words in error["error"]["message"], error
    _wait_until_idle(server)


def test_a_client_that_hangs_up_aborts_its_stream(server, model):
    body = {
        "model": model,
        "max_tokens": 400,
        "stream": True,
        "messages": [{"role": "user", "content": "Count from 1 to 500, one number per line."}],
        **GREEDY,
    }
    aborted_before = _num_aborted(server)
    with httpx.stream(
        "POST", server.url + "/v1/messages", json=body, headers={"x-api-key": server.api_key}, timeout=60
    ) as response:
        assert response.status_code == 200
        deltas = 0
        for line in response.iter_lines():
            deltas += line == "event: content_block_delta"
            if deltas == 3:
                break
    assert deltas == 3
    _wait_until_idle(server)
    assert _num_aborted(server) - aborted_before == 1


def _num_aborted(server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    found = re.search(r'^tokenriver_request_finished_total\{finish_reason="abort"\} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


# ----- thinking, on a tiny Qwen3 with a thinking template --------------------------------------------------


def _write_thinking_model(folder: Path) -> None:
    """A one-layer Qwen3 that is a bigram table: attention and MLP write nothing (o_proj, down_proj zero), so the
    next token depends on the current one only, and lm_head maps "\\n" (the end of the generation prompt) →
    `<think>` → o → k → `</think>` → H → i → `<|im_end|>`. The tokenizer is bytes plus Qwen's added tokens."""
    transformers = pytest.importorskip("transformers")
    import torch
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={piece: i for i, piece in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in ("<think>", "</think>")])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "chat_template": QWEN3_STYLE_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))

    model = transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(
            vocab_size=tokenizer.get_vocab_size(),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=1024,
            tie_word_embeddings=False,
        )
    )
    chain = tokenizer.encode("\n<think>ok</think>Hi<|im_end|>", add_special_tokens=False).ids
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            elif "o_proj" in name or "down_proj" in name:
                param.zero_()
            else:
                param.normal_(0, 1.0)
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        head.zero_()
        for current, following in zip(chain, chain[1:]):
            head[following] += 4.0 * embed[current] / embed[current].norm()  # [hidden]
    model.save_pretrained(folder, safe_serialization=True)


@pytest.fixture(scope="module")
def thinking_client(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_thinking")
    _write_thinking_model(folder)
    started = start_server(["--model", str(folder)])
    try:
        with anthropic.Anthropic(base_url=started.url, api_key=started.api_key, max_retries=0, timeout=120) as client:
            model = client.models.list().data[0].id
            yield client, model
    finally:
        stop_server(started)


def test_thinking_comes_back_as_a_thinking_block(thinking_client):
    client, model = thinking_client
    kwargs = dict(model=model, max_tokens=16, messages=QUESTION, thinking={"type": "enabled", "budget_tokens": 1024})
    message = client.messages.create(**kwargs)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == [
        ("thinking", "ok"),
        ("text", "Hi"),
    ]
    assert message.content[0].signature == "" and message.stop_reason == "end_turn"

    with client.messages.stream(**kwargs) as stream:
        deltas = [event.delta.type for event in stream if event.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert deltas == ["thinking_delta", "thinking_delta", "signature_delta", "text_delta", "text_delta"]
    blocks = [block.model_dump(exclude_none=True) for block in message.content]
    assert [block.model_dump(exclude_none=True) for block in streamed.content] == blocks
    assert streamed.stop_reason == message.stop_reason

    # The thinking goes back in the history; switching thinking off closes an empty block in the prompt.
    history = [*QUESTION, {"role": "assistant", "content": message.content}, {"role": "user", "content": "More."}]
    assert client.messages.create(model=model, max_tokens=16, messages=history).content[-1].text == "Hi"
    on = client.messages.count_tokens(model=model, messages=QUESTION, thinking={"type": "adaptive"})
    off = client.messages.count_tokens(model=model, messages=QUESTION, thinking={"type": "disabled"})
    assert off.input_tokens - on.input_tokens == len(["<think>", "\n", "\n", "</think>", "\n", "\n"])
