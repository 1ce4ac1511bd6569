"""The Responses API driven by the official openai SDK (and raw HTTP where the SDK would hide the bytes).

References: the same conversation as a chat completion (greedy, so the texts must be equal), /tokenize for the
prompt a request renders, the non-streamed response for its streamed twin, and the Lark grammar a forced
custom tool's input must match.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest

QUESTION = "Name a fruit."
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
# Two numbers after ADD: the Lark grammar a forced custom tool's input must follow.
CALC = {
    "type": "custom",
    "name": "calc",
    "description": "Adds two numbers",
    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "ADD " NUM " " NUM\nNUM: /[0-9]{1,3}/\n'},
}
CALC_INPUT = re.compile(r"ADD [0-9]{1,3} [0-9]{1,3}")
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
NAMESPACE = {"type": "namespace", "name": "mcp__files__", "description": "A file server", "tools": []}
BAD_REGEX = {"type": "custom", "name": "digits", "format": {"type": "grammar", "syntax": "regex", "definition": "[0-9"}}


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def model(client):
    (card,) = client.models.list().data
    return card.id


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers(), timeout=60) as client:
        yield client


def _tokenize(http: httpx.Client, messages: list[dict]) -> int:
    response = http.post("/tokenize", json={"messages": messages})
    response.raise_for_status()
    return response.json()["count"]


def _wait_until_idle(http: httpx.Client) -> dict:
    """The engine once nothing runs or waits; it holds no block beyond the prefix cache (cached blocks are free)."""
    deadline = time.monotonic() + 30
    while True:
        engine = http.get("/v1/engine").json()
        if (engine["num_running"], engine["num_waiting"], engine["num_blocks_used"]) == (0, 0, 0):
            return engine
        assert time.monotonic() < deadline, engine
        time.sleep(0.1)


def test_a_response_is_the_chat_completion_of_the_same_conversation(http, client, model):
    response = client.responses.create(
        model=model, instructions="Answer in one word.", input=QUESTION, max_output_tokens=16, temperature=0
    )
    messages = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": QUESTION}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
    (item,) = response.output
    assert (item.type, item.role, item.id[:4]) == ("message", "assistant", "msg_")
    assert response.output_text == chat.choices[0].message.content
    assert response.id.startswith("resp_") and response.model == model
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert usage.input_tokens == _tokenize(http, messages)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0


def test_text_format_json_schema_is_the_chat_response_format(client, model):
    schema = {
        "type": "object",
        "properties": {"fruit": {"type": "string", "enum": ["apple", "pear"]}},
        "required": ["fruit"],
        "additionalProperties": False,
    }
    response = client.responses.create(
        model=model,
        input=QUESTION,
        text={"format": {"type": "json_schema", "name": "fruit", "schema": schema, "strict": True}},
        max_output_tokens=16,
        temperature=0,
    )
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": QUESTION}],
        response_format={"type": "json_schema", "json_schema": {"name": "fruit", "schema": schema}},
        max_tokens=16,
        temperature=0,
    )
    assert json.loads(response.output_text)["fruit"] in ("apple", "pear")
    assert response.output_text == chat.choices[0].message.content
    assert response.text.format.type == "json_schema" and response.text.format.name == "fruit"


def test_streamed_events_come_in_order_and_add_up_to_the_response(client, model):
    kwargs = dict(model=model, input=QUESTION, max_output_tokens=16, temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    kinds = [event.type for event in events]
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete" if whole.status == "incomplete" else "response.completed",
    ]
    final = events[-1].response
    item_id = final.output[0].id
    assert {event.item_id for event in deltas} == {item_id} == {events[2].item.id, events[-2].item.id}
    text = "".join(event.delta for event in deltas)
    assert text == events[-4].text == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    with client.responses.stream(**kwargs) as stream:
        assert stream.get_final_response().output_text == whole.output_text


def test_a_function_call_round_trip(client, model):
    tools = [WEATHER]
    question = {"role": "user", "content": "What is the weather in Paris?"}
    first = client.responses.create(
        model=model,
        input=[question],
        tools=tools,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=32,
        temperature=0,
    )
    (call,) = first.output
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert set(json.loads(call.arguments)) == {"city"}
    streamed = list(
        client.responses.create(
            model=model,
            input=[question],
            tools=tools,
            tool_choice="required",
            max_output_tokens=32,
            temperature=0,
            stream=True,
        )
    )
    arguments = [event for event in streamed if event.type == "response.function_call_arguments.done"]
    assert [event.arguments for event in arguments] == [call.arguments]
    assert arguments[0].item_id == streamed[-1].response.output[0].id

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    second = client.responses.create(
        model=model,
        input=[question, call.model_dump(exclude_none=True), result],
        tools=tools,
        tool_choice="none",
        max_output_tokens=16,
        temperature=0,
    )
    assert [item.type for item in second.output] == ["message"]
    chat = client.chat.completions.create(
        model=model,
        messages=[
            question,
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"},
        ],
        max_tokens=16,
        temperature=0,
    )
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens


def test_previous_response_id_continues_a_stored_conversation(http, client, model):
    first = client.responses.create(
        model=model, input="My name is Ann.", store=True, max_output_tokens=16, temperature=0
    )
    second = client.responses.create(
        model=model,
        input="What is my name?",
        previous_response_id=first.id,
        store=True,
        max_output_tokens=16,
        temperature=0,
    )
    conversation = [
        {"role": "user", "content": "My name is Ann."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    assert second.usage.input_tokens == _tokenize(http, conversation) > first.usage.input_tokens
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(second.id).model_dump() == second.model_dump()
    unstored = client.responses.create(model=model, input="Hi", max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_forced_custom_tool_writes_input_in_its_grammar(client, model):
    kwargs = dict(
        model=model,
        input="Add 2 and 3.",
        tools=[CALC, WEATHER],
        tool_choice={"type": "custom", "name": "calc"},
        max_output_tokens=16,
        temperature=0,
    )
    response = client.responses.create(**kwargs)
    (call,) = response.output
    assert (call.type, call.name, call.id[:4], call.call_id[:5]) == ("custom_tool_call", "calc", "ctc_", "call_")
    assert CALC_INPUT.fullmatch(call.input), call.input
    events = list(client.responses.create(stream=True, **kwargs))
    deltas = "".join(event.delta for event in events if event.type == "response.custom_tool_call_input.delta")
    assert deltas == events[-1].response.output[0].input == call.input

    # The call and its output go back as the chat history of a call of a function taking {"input": ...}.
    question = {"role": "user", "content": "Add 2 and 3."}
    result = {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "5"}
    answer = client.responses.create(
        model=model,
        input=[question, call.model_dump(exclude_none=True), result],
        tools=[CALC],
        tool_choice="none",
        max_output_tokens=8,
        temperature=0,
    )
    arguments = json.dumps({"input": call.input})
    history = {"id": call.call_id, "type": "function", "function": {"name": "calc", "arguments": arguments}}
    chat = client.chat.completions.create(
        model=model,
        messages=[
            question,
            {"role": "assistant", "tool_calls": [history]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "5"},
        ],
        max_tokens=8,
        temperature=0,
    )
    assert (answer.output_text, answer.usage.input_tokens) == (
        chat.choices[0].message.content,
        chat.usage.prompt_tokens,
    )


def test_a_codex_like_first_request_streams(http, model):
    body = {
        "model": model,
        "instructions": "You are a coding agent.",
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Work in /repo."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files."}]},
        ],
        "tools": [
            {**WEATHER, "strict": False},
            {
                "type": "namespace",
                "name": "mcp__files__",
                "description": "A file server",
                "tools": [{"type": "function", "name": "list", "strict": False, "parameters": NO_ARGUMENTS}],
            },
            {"type": "web_search", "external_web_access": False},
        ],
        "tool_choice": {"type": "function", "name": "list"},
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "thread-1",
        "client_metadata": {"x-codex-installation-id": "0"},
        "text": {"verbosity": "low"},
        "max_output_tokens": 32,
    }
    with http.stream("POST", "/v1/responses", json=body) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line]
    kinds = [line.removeprefix("event: ") for line in lines[0::2]]
    events = [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
    assert kinds == [event["type"] for event in events] and kinds[-1] == "response.completed"
    final = events[-1]["response"]
    (call,) = final["output"]
    assert (call["type"], call["name"], call["namespace"], call["arguments"]) == (
        "function_call",
        "list",
        "mcp__files__",
        "{}",
    )
    assert final["metadata"] == {"tokenriver_skipped_tools": "web_search"}
    assert final["store"] is False and final["prompt_cache_key"] == "thread-1"


def test_a_forced_custom_tool_without_a_grammar_follows_text_format(client, model):
    """No tool grammar applies when a custom tool without one is forced, so text.format constrains its input;
    a hosted tool inside a namespace is skipped as one at top level is."""
    notes = {"type": "custom", "name": "notes", "description": "Takes notes"}
    response = client.responses.create(
        model=model,
        input=QUESTION,
        tools=[notes, {**NAMESPACE, "tools": [{"type": "web_search"}]}],
        tool_choice={"type": "custom", "name": "notes"},
        text={"format": {"type": "json_object"}},
        max_output_tokens=16,
        temperature=0,
    )
    (call,) = response.output
    assert (call.type, call.name) == ("custom_tool_call", "notes")
    assert call.input.lstrip().startswith("{"), call.input
    assert response.metadata == {"tokenriver_skipped_tools": "web_search"}


def _nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.mark.parametrize(
    "body, status, param",
    [
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            400,
            "input[0].content",
        ),
        ({"input": "hi", "frobnicate": 1}, 400, "frobnicate"),
        (
            {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": _nested_schema(100)}}},
            400,
            "text.format",
        ),
        ({"input": "hi", "previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
        ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"input": "hi", "background": True}, 400, "background"),
        ({"input": "hi", "tools": [CALC], "tool_choice": {"type": "custom", "name": "nope"}}, 400, "tool_choice"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, 400, "input[0].type"),
        ({"input": "hi", "tools": [{**WEATHER, "bogus": 1}]}, 400, "tools[0].bogus"),
        ({"input": "word " * 600}, 400, "input"),
        # A type that is not a string is a 400 naming it, not a 500.
        ({"input": [{"role": "user", "content": [{"type": ["input_text"]}]}]}, 400, "input[0].content[0].type"),
        ({"input": "hi", "tools": [{**NAMESPACE, "tools": [{"type": ["function"]}]}]}, 400, "tools[0].tools[0].type"),
        # A custom tool's regex offered as a function is compiled as its input's pattern, and named as written.
        ({"input": "hi", "tools": [WEATHER, BAD_REGEX]}, 400, "tools[1].format.definition"),
    ],
)
def test_bad_requests_name_the_field_and_hold_nothing(http, model, body, status, param):
    response = http.post("/v1/responses", json={"model": model, "max_output_tokens": 4, **body})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error
    _wait_until_idle(http)


def test_max_output_tokens_past_the_context_ends_incomplete_when_the_context_is_full(http, client, model):
    words = "one two three four five six seven eight nine ten " * 45
    response = client.responses.create(model=model, input="Repeat: " + words, max_output_tokens=100_000, temperature=0)
    engine = _wait_until_idle(http)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens + response.usage.output_tokens == engine["max_model_len"]


def test_a_client_that_leaves_a_stream_aborts_its_request(http, model):
    aborted_before = _num_aborted(http)
    body = {"model": model, "input": "Count to one hundred.", "stream": True, "max_output_tokens": 400}
    with http.stream("POST", "/v1/responses", json=body) as response:
        for line in response.iter_lines():
            if "response.output_text.delta" in line:
                break
    _wait_until_idle(http)
    assert _num_aborted(http) - aborted_before == 1


def _num_aborted(http: httpx.Client) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith('tokenriver_request_finished_total{finish_reason="abort"}'):
            return float(line.split()[-1])
    return 0.0
