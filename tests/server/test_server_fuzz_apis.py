"""A Schemathesis-style fuzz of the Responses, Messages, embeddings and rerank routes, over raw HTTP.

Each example starts from a small valid body and either sets one field (a field of the request model, or a name
the server does not know) to a random JSON value, or fills the structured parts with random shapes: Responses
input items and content parts, Anthropic messages and content blocks, tool definitions, tool_choice, text.format,
thinking, output_config, rerank documents. Whatever comes in:

- the status is below 500;
- an error is in its API's own shape: OpenAI's `{"error": {message, type, param, code}}` on /v1/responses,
  /v1/embeddings and /v1/rerank, Anthropic's `{"type": "error", "error": {type, message}}` on /v1/messages…;
- a 200 is the object its API promises (a stream: events up to a clean end, no failure event);
- afterwards the engine holds nothing and /metrics counted no 500.

Generation is one token of a tiny prompt (max_output_tokens / max_tokens 1), so the file runs in well under a minute.
"""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tokenriver.server.embeddings_protocol import EmbeddingRequest, EmbeddingResponse, RerankRequest, RerankResponse
from tokenriver.server.messages_protocol import CountTokensResponse, MessagesRequest, MessagesResponse
from tokenriver.server.responses_protocol import INPUT_ITEM_MODELS, ResponseObject, ResponsesRequest

FUZZ = settings(
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers(), timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def model(http) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


# ----- values ------------------------------------------------------------------------------------------------

_INTEGERS = st.integers(-3, 5) | st.sampled_from([2**31, 2**63, 2**64, -(2**63) - 1, 10**30])
_JSON = st.recursive(
    st.none() | st.booleans() | _INTEGERS | st.floats(allow_nan=True) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
_TEXT = st.sampled_from(["Hi", ""]) | st.text(max_size=6)
# What a field holding JSON text (a call's arguments) may hold: JSON, text that is not JSON, and JSON nested deeper
# than Python's recursion limit (json.loads raises RecursionError for it, not ValueError).
_JSON_TEXTS = st.sampled_from(["{}", '{"city": "Paris"}', "", "{", "[]", "null", "NaN", "[" * 2000 + "]" * 2000])
# Names no request model has: each must be refused naming it.
_UNKNOWN_FIELDS = ["frobnicate", "", "max_completion_tokens", "prompt", "input_schema"]


# The wrong shapes clients send most often (null, empty, a number, a list or an object where another type belongs).
_WRONG_SHAPES = st.sampled_from([None, "", 0, 1.5, True, [], {}, ["text"], {"type": "text"}])


def _or_junk(*values: Any) -> st.SearchStrategy[Any]:
    """One of the values the API knows, or a wrong shape, or any JSON value."""
    return st.sampled_from(values) | _WRONG_SHAPES | _JSON


def _is_long_run(value: object) -> bool:
    """A valid token limit past a few tokens (or none): generation would fill the context and only cost time."""
    return value is None or (type(value) is int and 8 < value < 2**63)


def _with_one_field(base: dict[str, Any], names: list[str], limit: str | None) -> st.SearchStrategy[dict[str, Any]]:
    """base with one field (of `names`) set to a random JSON value; `limit`, the token limit, never to a long run."""

    def value_for(name: str) -> st.SearchStrategy[Any]:
        return _JSON.filter(lambda value: not _is_long_run(value)) if name == limit else _JSON

    return (
        st.sampled_from(names)
        .flatmap(lambda name: st.tuples(st.just(name), value_for(name)))
        .map(lambda pair: {**base, pair[0]: pair[1]})
    )


def _with_parts(base: dict[str, Any], *parts: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    """base with the fields of one structured part (fields that go together, such as tools and tool_choice)."""
    return st.one_of(*(part.map(lambda drawn: {**base, **drawn}) for part in parts))


def _field_names(model: type) -> list[str]:
    return [field.alias or name for name, field in model.model_fields.items()]


_GOOD_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
_SCHEMAS = (
    st.sampled_from(
        [
            _GOOD_SCHEMA,
            {"type": "object", "properties": {}, "additionalProperties": False},
            {"type": "object"},
            {"type": "string"},
            {},
            {"type": "wat"},
            {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}, "required": ["a"]},
            {"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["n"]},
            {"type": "object", "properties": {"s": {"type": "string", "pattern": "("}}, "required": ["s"]},
            {"enum": []},
        ]
    )
    | _JSON
)

# ----- Responses: input items, content parts, tools, tool_choice, text.format ---------------------------------

_PART_TYPES = ("input_text", "output_text", "refusal", "input_image", "input_file", "input_audio", "summary_text")
_RESPONSES_PART = st.fixed_dictionaries(
    {"type": _or_junk(*_PART_TYPES, "reasoning_text", "text")},
    optional={"text": _or_junk("Hi"), "refusal": _or_junk("no"), "annotations": _JSON, "image_url": _TEXT},
)
_RESPONSES_CONTENT = st.lists(_RESPONSES_PART, min_size=1, max_size=2) | _TEXT | _JSON
_ITEM_KEYS = ["role", "content", "call_id", "name", "arguments", "input", "output", "summary", "id", "status"]
_INPUT_ITEM = st.one_of(
    st.fixed_dictionaries(
        {"role": _or_junk("user", "assistant", "system", "developer", "tool"), "content": _RESPONSES_CONTENT},
        optional={"type": _or_junk("message"), "id": _TEXT, "status": _TEXT, "phase": _or_junk("final_answer")},
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call"),
            "call_id": _or_junk("call_1"),
            "name": _or_junk("get_weather", ""),
            "arguments": _JSON_TEXTS | _WRONG_SHAPES | _JSON,
        },
        optional={"namespace": _or_junk("ns"), "status": _TEXT},
    ),
    # A well-formed call whose arguments are any JSON text.
    st.fixed_dictionaries(
        {"type": st.just("function_call"), "call_id": st.just("call_1"), "name": _TEXT, "arguments": _JSON_TEXTS}
    ),
    st.fixed_dictionaries(
        {"type": st.just("custom_tool_call"), "call_id": _or_junk("call_2"), "name": _or_junk("calc"), "input": _TEXT},
        optional={"namespace": _or_junk("ns")},
    ),
    st.fixed_dictionaries(
        {
            "type": st.sampled_from(["function_call_output", "custom_tool_call_output"]),
            "call_id": _or_junk("call_1"),
            "output": _RESPONSES_CONTENT,
        }
    ),
    st.fixed_dictionaries(
        {"type": st.just("reasoning"), "summary": st.lists(_RESPONSES_PART, max_size=2) | _JSON},
        optional={"content": st.lists(_RESPONSES_PART, max_size=2) | _JSON, "encrypted_content": _TEXT},
    ),
    # Any type (real ones and junk) with any of the item fields.
    st.fixed_dictionaries(
        {"type": _or_junk(*INPUT_ITEM_MODELS, "web_search_call", "item_reference")},
        optional={key: _JSON for key in _ITEM_KEYS},
    ),
    _JSON,
)
_LARK = 'start: "ADD " NUM\nNUM: /[0-9]{1,3}/\n'
_CUSTOM_FORMAT = st.fixed_dictionaries(
    {"type": _or_junk("text", "grammar")},
    optional={"syntax": _or_junk("lark", "regex"), "definition": _or_junk(_LARK, "start: (", "[0-9]+", "(", "")},
)
_FUNCTION_TOOL = st.fixed_dictionaries(
    {"type": st.just("function"), "name": _or_junk("get_weather", "")},
    optional={"parameters": _SCHEMAS, "description": _TEXT, "strict": _or_junk(True)},
)
_CUSTOM_TOOL = st.fixed_dictionaries(
    {"type": st.just("custom"), "name": _or_junk("calc", "")},
    optional={"format": _CUSTOM_FORMAT | _JSON, "description": _TEXT},
)
_RESPONSES_TOOL = st.one_of(
    _FUNCTION_TOOL,
    _CUSTOM_TOOL,
    st.fixed_dictionaries(
        {
            "type": st.just("namespace"),
            "name": _or_junk("ns"),
            "tools": st.lists(_FUNCTION_TOOL | _CUSTOM_TOOL | st.dictionaries(st.sampled_from(["type"]), _JSON)),
        }
    ),
    # Hosted tools (skipped) and junk types, with any fields.
    st.fixed_dictionaries(
        {"type": _or_junk("web_search", "mcp", "namespace")},
        optional={key: _JSON for key in ("name", "tools", "parameters", "format")},
    ),
    _JSON,
)
_RESPONSES_TOOL_CHOICE = _or_junk("none", "auto", "required", "any") | st.fixed_dictionaries(
    {"type": _or_junk("function", "custom", "allowed_tools")},
    optional={"name": _or_junk("get_weather", "calc", "nope")},
)
_TEXT_CONFIG = (
    st.fixed_dictionaries(
        {},
        optional={
            "format": st.fixed_dictionaries(
                {"type": _or_junk("text", "json_object", "json_schema", "grammar")},
                optional={
                    "name": _or_junk("answer"),
                    "schema": _SCHEMAS,
                    "strict": _or_junk(True),
                    "description": _TEXT,
                },
            )
            | _JSON,
            "verbosity": _or_junk("low"),
        },
    )
    | _JSON
)
_WEATHER = {"type": "function", "name": "get_weather", "parameters": _GOOD_SCHEMA}
_CALC = {"type": "custom", "name": "calc", "format": {"type": "grammar", "syntax": "lark", "definition": _LARK}}
_RESPONSES_BASE = {"input": "Hi", "max_output_tokens": 1}
_RESPONSES_BODIES = _with_one_field(
    _RESPONSES_BASE, _field_names(ResponsesRequest) + _UNKNOWN_FIELDS, "max_output_tokens"
) | _with_parts(
    _RESPONSES_BASE,
    st.fixed_dictionaries({"input": st.lists(_INPUT_ITEM, min_size=1, max_size=2)}),
    st.fixed_dictionaries(
        {"tools": st.lists(_RESPONSES_TOOL, min_size=1, max_size=2)},
        optional={"tool_choice": _or_junk("required", {"type": "function", "name": "get_weather"})},
    ),
    st.fixed_dictionaries({"tools": st.just([_WEATHER, _CALC]), "tool_choice": _RESPONSES_TOOL_CHOICE}),
    st.fixed_dictionaries({"text": _TEXT_CONFIG}),
)

# ----- Messages: messages, content blocks, tools, tool_choice, thinking, output_config, system -----------------

_CACHE_CONTROL = _or_junk({"type": "ephemeral"})
_TEXT_BLOCK = st.fixed_dictionaries(
    {"type": st.just("text"), "text": _or_junk("Hi")}, optional={"cache_control": _CACHE_CONTROL, "citations": _JSON}
)
_BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking", "image", "document")
_BLOCK_KEYS = ["text", "id", "name", "input", "tool_use_id", "content", "is_error", "thinking", "signature", "data"]
_BLOCK = st.one_of(
    _TEXT_BLOCK,
    st.fixed_dictionaries(
        {
            "type": st.just("tool_use"),
            "id": _or_junk("toolu_1"),
            "name": _or_junk("get_weather", ""),
            "input": _or_junk({}, {"city": "Paris"}),
        },
        optional={"caller": _JSON, "cache_control": _CACHE_CONTROL},
    ),
    st.fixed_dictionaries(
        {"type": st.just("tool_result"), "tool_use_id": _or_junk("toolu_1")},
        optional={
            "content": _TEXT | st.lists(_TEXT_BLOCK | st.fixed_dictionaries({"type": _or_junk(*_BLOCK_TYPES)})),
            "is_error": _or_junk(True, False),
        },
    ),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": _TEXT}, optional={"signature": _or_junk("sig")}),
    st.fixed_dictionaries({"type": st.just("redacted_thinking"), "data": _TEXT}),
    # Any type (real ones and junk) with any of the block fields.
    st.fixed_dictionaries(
        {"type": _or_junk(*_BLOCK_TYPES, "video", "server_tool_use")},
        optional={key: _JSON for key in _BLOCK_KEYS},
    ),
    _JSON,
)
_MESSAGE = st.fixed_dictionaries(
    {
        "role": _or_junk("user", "assistant", "system", "developer"),
        "content": _TEXT | st.lists(_BLOCK, max_size=3) | _JSON,
    }
)
# Random turns, then (most often) a user turn, since a conversation that ends with the assistant is refused.
_MESSAGES = st.tuples(st.lists(_MESSAGE, min_size=1, max_size=3), st.booleans()).map(
    lambda drawn: drawn[0] + [{"role": "user", "content": "Hi"}] * drawn[1]
)
_ANTHROPIC_TOOL = (
    st.fixed_dictionaries(
        {"name": _or_junk("get_weather", "")},
        optional={
            "type": _or_junk("custom", "web_search_20250305", "bash_20250124"),
            "input_schema": _SCHEMAS,
            "description": _TEXT,
            "strict": _or_junk(True),
            "cache_control": _CACHE_CONTROL,
            "max_uses": _JSON,
        },
    )
    | _JSON
)
_ANTHROPIC_TOOL_CHOICE = (
    st.fixed_dictionaries(
        {"type": _or_junk("auto", "any", "tool", "none")},
        optional={"name": _or_junk("get_weather", "nope"), "disable_parallel_tool_use": _or_junk(True, False)},
    )
    | _JSON
)
_THINKING = (
    st.fixed_dictionaries(
        {"type": _or_junk("enabled", "disabled", "adaptive")},
        optional={"budget_tokens": _or_junk(1024), "display": _or_junk("summarized", "omitted")},
    )
    | _JSON
)
_OUTPUT_CONFIG = (
    st.fixed_dictionaries(
        {},
        optional={
            "effort": _or_junk("low", "max"),
            "format": st.fixed_dictionaries({"type": _or_junk("json_schema")}, optional={"schema": _SCHEMAS}),
        },
    )
    | _JSON
)
_MESSAGES_PARTS = (
    st.fixed_dictionaries({"messages": _MESSAGES}),
    st.fixed_dictionaries(
        {
            "system": _TEXT
            | st.lists(_TEXT_BLOCK | st.fixed_dictionaries({"type": _or_junk("text")}), max_size=2)
            | _JSON
        }
    ),
    st.fixed_dictionaries(
        {"tools": st.lists(_ANTHROPIC_TOOL, min_size=1, max_size=2)},
        optional={"tool_choice": _or_junk({"type": "any"}, {"type": "tool", "name": "get_weather"})},
    ),
    st.fixed_dictionaries(
        {
            "tools": st.just([{"name": "get_weather", "input_schema": _GOOD_SCHEMA}]),
            "tool_choice": _ANTHROPIC_TOOL_CHOICE,
        }
    ),
    st.fixed_dictionaries({"thinking": _THINKING}),
    st.fixed_dictionaries({"output_config": _OUTPUT_CONFIG}),
)


# Stands for the served model's name, which a Messages request must give; the tests put the name in (_served).
_SERVED_MODEL = "served-model"
_MESSAGES_BASE = {"model": _SERVED_MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
_COUNT_TOKENS_BASE = {"model": _SERVED_MODEL, "messages": [{"role": "user", "content": "Hi"}]}


def _messages_bodies(base: dict[str, Any], limit: str | None) -> st.SearchStrategy[dict[str, Any]]:
    return _with_one_field(base, _field_names(MessagesRequest) + _UNKNOWN_FIELDS, limit) | _with_parts(
        base, *_MESSAGES_PARTS
    )


# ----- embeddings and rerank ----------------------------------------------------------------------------------

_TOKEN_IDS = st.lists(st.integers(-2, 50_000) | _INTEGERS, max_size=4)
_EMBEDDING_INPUT = _TEXT | st.lists(_TEXT, max_size=3) | _TOKEN_IDS | st.lists(_TOKEN_IDS | _TEXT, max_size=3)
_EMBEDDINGS_BASE = {"input": "Hi"}
_EMBEDDINGS_BODIES = _with_one_field(_EMBEDDINGS_BASE, _field_names(EmbeddingRequest) + _UNKNOWN_FIELDS, None) | (
    _with_parts(
        _EMBEDDINGS_BASE,
        st.fixed_dictionaries(
            {"input": _EMBEDDING_INPUT},
            optional={
                "dimensions": _or_junk(1, 32, 576, 577, 0, -1),
                "encoding_format": _or_junk("float", "base64"),
                "pooling": _or_junk("last", "mean", "cls"),
                "normalize": _or_junk(True, False),
            },
        ),
    )
)
_RERANK_BASE = {"query": "Hi", "documents": ["a", "b"]}
_RERANK_BODIES = _with_one_field(_RERANK_BASE, _field_names(RerankRequest) + _UNKNOWN_FIELDS, None) | _with_parts(
    _RERANK_BASE,
    st.fixed_dictionaries(
        {"documents": st.lists(_TEXT | st.fixed_dictionaries({"text": _TEXT | _JSON}) | _JSON, max_size=3)},
        optional={
            "query": _TEXT,
            "top_n": _or_junk(1, 2, 100, 0, -1),
            "return_documents": _or_junk(True, False),
            "instruction": _TEXT,
        },
    ),
)


# ----- checks -------------------------------------------------------------------------------------------------


def _post(http: httpx.Client, path: str, body: dict[str, Any]) -> httpx.Response:
    return http.post(path, content=json.dumps(body, allow_nan=True), headers={"Content-Type": "application/json"})


def _checked(response: httpx.Response, anthropic: bool = False) -> httpx.Response | None:
    """None for an error in the API's shape; the response itself for a 200."""
    assert response.status_code < 500, response.text
    assert response.headers["x-request-id"]
    if response.status_code == 200:
        return response
    assert 400 <= response.status_code < 500, response.text
    body = response.json()
    if anthropic:
        assert set(body) == {"type", "error"} and body["type"] == "error", body
        error = body["error"]
        assert set(error) == {"type", "message"} and isinstance(error["type"], str), body
    else:
        assert set(body) == {"error"}, body
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}, body
    assert isinstance(error["message"], str) and error["message"], body
    return None


def _served(body: dict[str, Any], model: str) -> dict[str, Any]:
    return {**body, "model": model} if body.get("model") == _SERVED_MODEL else body


def _events(response: httpx.Response) -> list[dict[str, Any]]:
    """The data of each server-sent event, checked against its `event:` line."""
    assert response.headers["content-type"].startswith("text/event-stream")
    lines = [line for line in response.text.splitlines() if line]
    assert all(line.startswith("event: ") for line in lines[0::2]), lines
    events = [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
    assert [line.removeprefix("event: ") for line in lines[0::2]] == [event["type"] for event in events]
    return events


@settings(FUZZ, max_examples=1000)
@given(body=_RESPONSES_BODIES)
@example(body={**_RESPONSES_BASE, "stream": True, "store": True})
def test_responses_fuzz(http, body):
    response = _checked(_post(http, "/v1/responses", body))
    if response is None:
        return
    if body.get("stream") is True:
        events = _events(response)
        assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
        final = events[-1]["response"]
    else:
        final = response.json()
    answer = ResponseObject.model_validate(final)
    assert answer.status in ("completed", "incomplete") and answer.output, final
    if body.get("store") is True:
        assert http.get(f"/v1/responses/{answer.id}").json() == final


@settings(FUZZ, max_examples=30)
@given(response_id=st.text(min_size=1, max_size=8))
def test_responses_get_fuzz(http, response_id):
    response = http.get("/v1/responses/" + quote(response_id, safe=""))
    assert _checked(response) is None and response.status_code == 404


@settings(FUZZ, max_examples=600)
@given(body=_messages_bodies(_MESSAGES_BASE, "max_tokens"))
@example(body={**_MESSAGES_BASE, "stream": True})
def test_messages_fuzz(http, model, body):
    response = _checked(_post(http, "/v1/messages", _served(body, model)), anthropic=True)
    if response is None:
        return
    if body.get("stream") is True:
        events = _events(response)
        assert events[-1]["type"] == "message_stop" and all(event["type"] != "error" for event in events), events
        return
    message = MessagesResponse.model_validate(response.json())
    assert message.type == "message" and message.content


@settings(FUZZ, max_examples=300)
@given(body=_messages_bodies(_COUNT_TOKENS_BASE, None))
def test_count_tokens_fuzz(http, model, body):
    response = _checked(_post(http, "/v1/messages/count_tokens", _served(body, model)), anthropic=True)
    if response is not None:
        assert set(response.json()) == {"input_tokens"}
        assert CountTokensResponse.model_validate(response.json()).input_tokens > 0


@settings(FUZZ, max_examples=300)
@given(body=_EMBEDDINGS_BODIES)
def test_embeddings_fuzz(http, body):
    response = _checked(_post(http, "/v1/embeddings", body))
    if response is not None:
        answer = EmbeddingResponse.model_validate(response.json())
        assert answer.object == "list" and answer.data
        assert [item.index for item in answer.data] == list(range(len(answer.data)))


@settings(FUZZ, max_examples=200)
@given(body=_RERANK_BODIES)
def test_rerank_fuzz(http, body):
    response = _checked(_post(http, "/v1/rerank", body))
    if response is not None:
        answer = RerankResponse.model_validate(response.json())
        indexes = [result.index for result in answer.results]
        assert indexes and len(set(indexes)) == len(indexes) and set(indexes) <= set(range(len(body["documents"])))


def test_the_engine_holds_nothing_and_nothing_was_a_500(http, server):
    """After the fuzz (the tests above run first): no request runs, waits or holds a block, and no 500 was sent."""
    deadline = time.monotonic() + 30
    while True:
        engine = http.get("/v1/engine").json()
        if (engine["num_running"], engine["num_waiting"], engine["num_blocks_used"]) == (0, 0, 0):
            break
        assert time.monotonic() < deadline, engine
        time.sleep(0.1)
    text = httpx.get(server.url + "/metrics", timeout=10).text
    assert 'status="400"' in text and 'status="200"' in text
    assert 'status="500"' not in text
