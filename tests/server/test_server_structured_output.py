"""Structured output and tool calling through the official openai SDK against a real server.

References: the constraint itself (the parsed pydantic instance, jsonschema validation, re.fullmatch, the
choice list), and a request's non-streamed twin (streamed tool-call deltas reassemble into the same call).
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from enum import Enum

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

MAX_TOKENS = 80


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def model(client):
    (card,) = client.models.list().data
    return card.id


# ----- response_format with pydantic models (client.chat.completions.parse) ------------------------------


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)


class Address(BaseModel):
    city: str = Field(max_length=20)
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Customer(BaseModel):
    name: str = Field(max_length=20)
    address: Address


class ShoppingList(BaseModel):
    items: list[str] = Field(min_length=1, max_length=4)


class Paint(BaseModel):
    color: Color


class Rating(BaseModel):
    score: float = Field(ge=0, le=5)
    stars: int = Field(ge=1, le=5)


class Contact(BaseModel):
    name: str = Field(max_length=20)
    email: str | None = Field(max_length=30)


class Code(BaseModel):
    code: str = Field(pattern=r"^[A-Z]{3}-[0-9]{2}$")


class Username(BaseModel):
    username: str = Field(min_length=3, max_length=8)


class Team(BaseModel):
    team: str = Field(max_length=15)
    members: list[Person] = Field(min_length=1, max_length=2)


class Flag(BaseModel):
    is_open: bool
    count: int = Field(ge=0, le=10)


PARSE_CASES = [
    ("Describe a person with a name and an age.", Person),
    ("Give me a customer with a name and an address.", Customer),
    ("Make a short shopping list.", ShoppingList),
    ("Pick a paint color.", Paint),
    ("Rate a movie you like.", Rating),
    ("Give me a contact with a name and maybe an email.", Contact),
    ("Make up a product code.", Code),
    ("Suggest a username.", Username),
    ("Describe a small team and its members.", Team),
    ("Is the shop open, and how many customers are inside?", Flag),
]


def _parse(client, model, prompt: str, schema: type[BaseModel]) -> str | None:
    """None when the parsed completion is an instance of the schema, else what went wrong."""
    completion = client.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        response_format=schema,
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    choice = completion.choices[0]
    if choice.finish_reason != "stop" or not isinstance(choice.message.parsed, schema):
        return f"{schema.__name__}: {choice.finish_reason} {choice.message.content!r}"
    # The SDK parsed it leniently; the schema it sent must hold too.
    jsonschema.validate(json.loads(choice.message.content), schema.model_json_schema())
    return None


def test_parse_returns_an_instance_of_the_model(client, model):
    # All ten at once: the server batches them, and the suite stays short.
    with ThreadPoolExecutor(len(PARSE_CASES)) as pool:
        problems = list(pool.map(lambda case: _parse(client, model, *case), PARSE_CASES))
    assert [problem for problem in problems if problem] == []


def test_json_object_parses_whenever_it_ends(client, model):
    """A json_object response that stops is one JSON object; one cut at max_tokens (the small model can loop on
    keys) is the start of one. Greedy, so the same prompts always take the same path: two of these stop."""
    prompts = [
        "Give me a JSON object describing a cat with two fields.",
        "Return a JSON object with a name and an age.",
        "Make a JSON object with one key, color, and one value.",
    ]

    def run(prompt: str):
        completion = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            response_format={"type": "json_object"},
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        return completion.choices[0]

    with ThreadPoolExecutor(len(prompts)) as pool:
        choices = list(pool.map(run, prompts))
    for choice in choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:
            assert choice.finish_reason == "length" and choice.message.content.startswith("{")
    assert sum(choice.finish_reason == "stop" for choice in choices) >= 2


def test_schema_with_n_3_every_choice_validates(client, model):
    schema = {**Person.model_json_schema(), "additionalProperties": False}
    completion = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Describe a person."}],
        n=3,
        temperature=1.0,
        seed=7,
        max_tokens=MAX_TOKENS,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}},
    )
    assert len(completion.choices) == 3
    for choice in completion.choices:
        jsonschema.validate(json.loads(choice.message.content), schema)


# ----- vLLM's fields: regex, choice, grammar ---------------------------------------------------------------


def _complete(client, model, prompt: str, **extra) -> str:
    completion = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0, extra_body=extra)
    return completion.choices[0].text


def test_regex_choice_and_grammar_outputs_match(client, model):
    lark = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/\n'
    gbnf = 'root ::= "color: " ("red" | "green" | "blue")'
    cases = [  # (prompt, extra body, the outputs that match)
        ("My phone number is", {"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}}, r"[0-9]{3}-[0-9]{4}"),
        ("Is the sky blue?", {"structured_outputs": {"choice": ["yes", "no"]}}, r"yes|no"),
        ("2 + 2 =", {"structured_outputs": {"grammar": lark}}, r"The answer is [0-9]{1,3}\."),
        ("Pick one.", {"guided_grammar": gbnf}, r"color: (red|green|blue)"),
        ("A word:", {"guided_regex": r"[a-z]{2,5}"}, r"[a-z]{2,5}"),
        ("Pick:", {"guided_choice": ["left", "right"]}, r"left|right"),
    ]
    with ThreadPoolExecutor(len(cases)) as pool:
        texts = list(pool.map(lambda case: _complete(client, model, case[0], **case[1]), cases))
    for (prompt, extra, pattern), text in zip(cases, texts):
        assert re.fullmatch(pattern, text), (extra, text)


def test_invalid_constraints_get_400_naming_the_field(server, model):
    chat = {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    cases = [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "foo"}}}},
            "response_format.json_schema",
            "foo",
        ),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "unclosed group"),
        ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar", None),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex", "only one"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
            "response_format.json_schema",
            None,
        ),
    ]
    for extra, param, words in cases:
        response = httpx.post(
            server.url + "/v1/chat/completions", json={**chat, **extra}, headers=server.headers(), timeout=60
        )
        assert response.status_code == 400, (extra, response.text)
        error = response.json()["error"]
        assert error["param"] == param, (extra, error)
        if words is not None:
            assert words in error["message"], error


def _nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_a_schema_past_the_grammar_recursion_limit_is_400_on_every_route(server, model):
    """llguidance refuses a schema nested 100 deep ("recursion limit exceeded"): the user's error, a 400 naming the
    field on chat completions and completions alike, and the engine holds nothing afterwards."""
    schema = {"type": "json_schema", "json_schema": {"name": "deep", "schema": _nested_schema(100)}}
    requests = {
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}], "response_format": schema},
        "/v1/completions": {"prompt": "x", "structured_outputs": {"json": _nested_schema(100)}},
    }
    for route, body in requests.items():
        response = httpx.post(
            server.url + route, json={"model": model, "max_tokens": 4, **body}, headers=server.headers(), timeout=60
        )
        assert response.status_code == 400, (route, response.text)
        error = response.json()["error"]
        assert "recursion limit" in error["message"] and error["param"].split(".")[0] in body, (route, error)
    engine = httpx.get(server.url + "/v1/engine", headers=server.headers(), timeout=60).json()
    assert (engine["num_running"], engine["num_waiting"], engine["num_blocks_used"]) == (0, 0, 0)


def test_continuation_with_prefix_ids_matches_the_whole_request(server, model):
    # A request that continues a constrained output (its tokens at the prompt's tail and in
    # structured_output_prefix_ids) generates what the whole request generated after them.
    body = {
        "model": model,
        "max_tokens": 8,
        "temperature": 0,
        "trace": True,
        "structured_outputs": {"regex": r"Colors: (red|green|blue), (red|green|blue)\."},
    }

    def token_ids(extra):
        response = httpx.post(
            server.url + "/v1/completions", json={**body, **extra}, headers=server.headers(), timeout=60
        )
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["token_ids"]

    prompt = httpx.post(
        server.url + "/tokenize", json={"prompt": "The flag has two"}, headers=server.headers(), timeout=60
    ).json()["tokens"]
    whole = token_ids({"prompt": prompt})
    assert len(whole) > 3
    continued = token_ids(
        {"prompt": prompt + whole[:3], "structured_output_prefix_ids": whole[:3], "max_tokens": 8 - 3}
    )
    assert continued == whole[3:]
    # Without the prefix the grammar starts over: the continuation writes "Colors" again.
    assert token_ids({"prompt": prompt + whole[:3], "max_tokens": 8 - 3})[:3] == whole[:3]


def test_prefix_ids_without_a_constraint_get_400(server, model):
    response = httpx.post(
        server.url + "/v1/completions",
        headers=server.headers(),
        timeout=60,
        json={"model": model, "prompt": "x", "max_tokens": 2, "structured_output_prefix_ids": [1]},
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "structured_output_prefix_ids"


# ----- tools -------------------------------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 20}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def _tool_chat(client, model, **kwargs):
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    return client.chat.completions.create(model=model, tools=[WEATHER, TIME], temperature=0, **kwargs)


def test_required_tool_call(client, model):
    choice = _tool_chat(client, model, messages=ASK_WEATHER, tool_choice="required").choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.id and call.type == "function" and call.function.name in ("get_weather", "get_time")
    assert isinstance(json.loads(call.function.arguments), dict)


def test_named_tool_call_uses_that_function(client, model):
    named = {"type": "function", "function": {"name": "get_time"}}
    choice = _tool_chat(client, model, messages=ASK_WEATHER, tool_choice=named).choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME["function"]["parameters"])


def test_auto_either_calls_a_tool_or_answers(client, model):
    choice = _tool_chat(client, model, messages=ASK_WEATHER, tool_choice="auto", max_tokens=32).choices[0]
    if choice.finish_reason == "tool_calls":
        (call,) = choice.message.tool_calls
        assert call.function.name in ("get_weather", "get_time")
    else:  # an answer comes out of the envelope as plain content
        assert choice.message.tool_calls is None and choice.message.content
        assert not choice.message.content.startswith('{"response"')


def test_tool_call_round_trip(client, model):
    (call,) = _tool_chat(client, model, messages=ASK_WEATHER, tool_choice="required").choices[0].message.tool_calls
    history = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"city": "Paris", "weather": "sunny"})},
    ]
    final = _tool_chat(client, model, messages=history, tool_choice="none", max_tokens=16).choices[0]
    assert final.finish_reason in ("stop", "length")
    assert final.message.tool_calls is None and final.message.content


def test_streamed_tool_call_deltas_reassemble_into_the_call(client, model):
    whole = _tool_chat(client, model, messages=ASK_WEATHER, tool_choice="required").choices[0]
    calls: dict[int, dict] = {}
    finish_reasons = []
    for chunk in _tool_chat(client, model, messages=ASK_WEATHER, tool_choice="required", stream=True):
        for choice in chunk.choices:
            assert not choice.delta.content, "the envelope must not leak as content"
            for piece in choice.delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = piece.id or call["id"]
                call["name"] += piece.function.name or ""
                call["arguments"] += piece.function.arguments or ""
            if choice.finish_reason:
                finish_reasons.append(choice.finish_reason)
    assert finish_reasons == ["tool_calls"]
    (call,) = calls.values()
    (expected,) = whole.message.tool_calls
    assert call["id"] and (call["name"], call["arguments"]) == (expected.function.name, expected.function.arguments)


def test_tool_choice_without_tools_or_unknown_name_is_400(server, model):
    chat = {"model": model, "messages": ASK_WEATHER, "max_tokens": 4}
    response = httpx.post(
        server.url + "/v1/chat/completions",
        json={**chat, "tool_choice": "required"},
        headers=server.headers(),
        timeout=60,
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"
    named = {"type": "function", "function": {"name": "nope"}}
    response = httpx.post(
        server.url + "/v1/chat/completions",
        json={**chat, "tools": [WEATHER], "tool_choice": named},
        headers=server.headers(),
        timeout=60,
    )
    assert response.status_code == 400 and "nope" in response.json()["error"]["message"]
