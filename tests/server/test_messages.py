"""Anthropic's Messages API without a model: the request's translation into chat, the errors in Anthropic's shape,
and the response and stream built from scripted engine outputs over the app in process.

References: the chat messages each Anthropic block stands for; the SDK's own pydantic models of a message and of
every stream event (anthropic.types); the non-streamed message, which the streamed events must accumulate to.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from anthropic.types import Message, RawMessageStreamEvent
from fastapi.testclient import TestClient
from pydantic import TypeAdapter

from tokenriver.engine.async_engine import EngineSnapshot
from tokenriver.engine.core import ModelInfo
from tokenriver.errors import EngineDeadError, EngineOverloadedError, InvalidParameterError
from tokenriver.outputs import CompletionOutput, FinishReason, RequestMetrics, RequestOutput
from tokenriver.sched.output import SchedulerStats
from tokenriver.server.app import build_app
from tokenriver.server.config import ServerConfig
from tokenriver.server.messages import chat_request, parse_body, render_messages, strip_attribution_header
from tokenriver.server.messages_protocol import CountTokensRequest, MessagesRequest

MAX_MODEL_LEN = 1024
KEY = "k"
HEADERS = {"x-api-key": KEY}
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
EVENTS = TypeAdapter(RawMessageStreamEvent)


class CharTokenizer:
    """One token per character; the template writes `<role>content` and, when thinking is not switched off,
    leaves nothing open (the model writes `<think>` itself, as Qwen3 does)."""

    eos_token_ids = [0]
    chat_template = "{{ messages }} <think> </think>"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(t) for t in token_ids)

    def token_text(self, token_id: int) -> str:
        return chr(token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        text = "".join(f"<{m['role']}>{m.get('content') or ''}" for m in messages)
        closed = "<think></think>" if kwargs.get("enable_thinking") is False else ""
        return text + ("<assistant>" + closed) * add_generation_prompt


class Engine(SimpleNamespace):
    """The engine's public surface; generate replays `text` one character per output."""

    def __init__(self, text: str = "Hello", **script) -> None:
        stats = SchedulerStats(0, 0, 0, 64, 0, 64, 0.0, 0, 0, 0.0, 0, 0, 0, 0, 0)
        info = ModelInfo(
            "/models/tiny.gguf", 0x110000, MAX_MODEL_LEN, 1, 4, "1", "float32", "float32", 16, 64, 1, 256, 8, 8, None, 4
        )
        super().__init__(
            model_info=info,
            tokenizer=CharTokenizer(),
            max_model_len=MAX_MODEL_LEN,
            is_running=True,
            snapshot=lambda: EngineSnapshot(stats, num_forward_passes=0),
            special_token_id=lambda text: None,
            check_structured_output=lambda spec: None,
            abort=lambda request_id: self.aborted.append(request_id),
            text=text,
            script=script,
            params=[],
            aborted=[],
        )

    async def generate(self, prompt_token_ids, params, request_id=None, prompt=None, priority=0):
        self.params.append(params)
        finish = self.script.get("finish", FinishReason.STOP)
        for end in range(1, len(self.text) + 1) or [0]:
            if end > self.script.get("fail_after", len(self.text)):
                raise EngineDeadError("the engine loop stopped")
            done = end == len(self.text)  # an empty text: one finished output, as an EOS at once gives
            yield RequestOutput(
                request_id=request_id,
                prompt=prompt,
                prompt_token_ids=list(prompt_token_ids),
                outputs=[
                    CompletionOutput(
                        index=0,
                        text=self.text[:end],
                        token_ids=[ord(c) for c in self.text[:end]],
                        finish_reason=finish if done else None,
                        stop_reason=self.script.get("stop_reason") if done else None,
                    )
                ],
                finished=done,
                metrics=RequestMetrics(arrival_time=0.0, num_cached_tokens=self.script.get("num_cached", 0)),
            )


def _client(engine: Engine | None = None, **config) -> TestClient:
    return TestClient(build_app(engine or Engine(), ServerConfig(api_key=KEY, **config)), raise_server_exceptions=False)


def _body(**fields) -> dict:
    return {"model": "tiny", "max_tokens": 32, "messages": [{"role": "user", "content": "hi"}], **fields}


def _stream(client: TestClient, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of each event, each data checked against the SDK's event models."""
    with client.stream("POST", "/v1/messages", json={**body, "stream": True}, headers=HEADERS) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line]
    events = []
    for name, data in zip(lines[::2], lines[1::2]):
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        if event["type"] not in ("ping", "error"):
            EVENTS.validate_python(event)
        events.append((event["type"], event))
    return events


def _accumulate(events: list[tuple[str, dict]]) -> dict:
    """The message the events add up to, as the SDK's stream accumulator builds it."""
    message = dict(events[0][1]["message"])
    blocks = message["content"] = []
    for kind, event in events[1:]:
        if kind == "content_block_start":
            assert event["index"] == len(blocks)
            blocks.append(dict(event["content_block"]))
        elif kind == "content_block_delta":
            block, delta = blocks[event["index"]], event["delta"]
            field = {"text_delta": "text", "thinking_delta": "thinking", "signature_delta": "signature"}
            if delta["type"] == "input_json_delta":
                block["input"] = json.loads(delta["partial_json"])
            else:
                name = field[delta["type"]]
                block[name] = (block[name] if name != "signature" else "") + delta[name]
        elif kind == "message_delta":
            message.update(event["delta"], usage=event["usage"])
    return message


def _error(response, status: int, error_type: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == error_type, body
    return body["error"]["message"]


# ----- request → chat --------------------------------------------------------------------------------


def test_blocks_become_chat_messages():
    request = parse_body(
        MessagesRequest,
        json.dumps(
            _body(
                system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
                messages=[
                    {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "thinking", "thinking": "use the tool", "signature": "sig"},
                            {"type": "redacted_thinking", "data": "xyz"},
                            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                        ],
                    },
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "down", "is_error": True},
                            {"type": "text", "text": "And now?"},
                        ],
                    },
                    {"role": "system", "content": "Answer in French."},
                ],
                tools=[WEATHER],
                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                stop_sequences=["END"],
                temperature=0.5,
            )
        ).encode(),
    )
    chat, tool_indices = chat_request(request)
    messages = [message.model_dump(exclude_none=True) for message in chat.messages]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool", "user", "system"]
    texts = ["Be brief.", "Weather?", "", "sunny", "Error: down", "And now?", "Answer in French."]
    assert [message.text() for message in chat.messages] == texts
    assert messages[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert messages[2]["reasoning_content"] == "use the tool"
    assert (messages[4]["content"], messages[4]["tool_call_id"]) == ("Error: down", "toolu_2")
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.tools[0].function.parameters == WEATHER["input_schema"] and tool_indices == [0]
    assert (chat.stop, chat.temperature) == (["END"], 0.5)


def test_tool_choice_maps_onto_chat():
    for given, expected in (
        ({"type": "auto"}, "auto"),
        ({"type": "none"}, "none"),
        ({"type": "any"}, "required"),
    ):
        chat, _ = chat_request(MessagesRequest.model_validate(_body(tools=[WEATHER], tool_choice=given)))
        assert chat.tool_choice == expected
    chat, _ = chat_request(
        MessagesRequest.model_validate(_body(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}))
    )
    assert chat.tool_choice.function.name == "get_weather" and chat.parallel_tool_calls is None


def test_server_tools_are_skipped_and_errors_keep_the_request_index(caplog):
    tools = [{"type": "web_search_20250305", "name": "web_search", "max_uses": 5}, WEATHER]
    chat, tool_indices = chat_request(MessagesRequest.model_validate(_body(tools=tools)))
    assert [tool.function.name for tool in chat.tools] == ["get_weather"] and tool_indices == [1]
    with pytest.raises(InvalidParameterError) as error:
        chat_request(MessagesRequest.model_validate(_body(tools=[tools[0], {**WEATHER, "input_schema": {}}])))
    assert error.value.param == "tools[1].input_schema"
    with pytest.raises(InvalidParameterError) as error:
        chat_request(MessagesRequest.model_validate(_body(tools=[{**WEATHER, "input_examples": [{}]}])))
    assert error.value.param == "tools[0].input_examples"
    # Only server tools: tool_choice auto has nothing to choose from, and is dropped rather than refused.
    chat, _ = chat_request(MessagesRequest.model_validate(_body(tools=tools[:1], tool_choice={"type": "auto"})))
    assert chat.tools is None and chat.tool_choice is None


def test_attribution_header_is_removed_so_the_prompt_repeats():
    serving = build_app(Engine(), ServerConfig()).state.serving

    def prompt(cch: str, rest: str = "You are a coding agent.") -> list[int]:
        header = f"x-anthropic-billing-header: cc_version=2.1.3.abc; cc_entrypoint=cli; cch={cch};"
        system = [{"type": "text", "text": header}, {"type": "text", "text": rest}]
        request = {"model": "tiny", "system": system, "messages": [{"role": "user", "content": "hi"}]}
        return render_messages(serving, CountTokensRequest.model_validate(request)).prompt.token_ids

    assert prompt("1a2b3") == prompt("ffe01")
    assert prompt("1a2b3") != prompt("1a2b3", "You are a poet.")
    assert "billing" not in "".join(map(chr, prompt("1a2b3")))
    assert strip_attribution_header("x-anthropic-billing-header: cch=1;\nKeep me") == "Keep me"
    assert strip_attribution_header("Keep x-anthropic-billing-header: me") == "Keep x-anthropic-billing-header: me"


def test_thinking_switches_the_template():
    assert chat_request(MessagesRequest.model_validate(_body(thinking={"type": "disabled"})))[
        0
    ].chat_template_kwargs == {"enable_thinking": False}
    enabled = _body(thinking={"type": "enabled", "budget_tokens": 1024})
    assert chat_request(MessagesRequest.model_validate(enabled))[0].chat_template_kwargs == {"enable_thinking": True}
    for thinking in ({"type": "adaptive"}, None):
        assert chat_request(MessagesRequest.model_validate(_body(thinking=thinking)))[0].chat_template_kwargs is None


# ----- errors in Anthropic's shape -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "images are not supported"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "'audio' is not supported"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "needs text"),
        ({"messages": [{"role": "assistant", "content": "Sure"}]}, "prefill"),
        (
            {"messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "x"}]}]},
            "messages[0].content[0]",
        ),
        ({"temperature": "hot"}, "temperature"),
        ({"top_k": -5}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop_sequences": [""]}, "stop_sequences"),
        ({"frobnicate": 1}, "'frobnicate'"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice"),
        ({"thinking": {"type": "enabled"}}, "budget_tokens"),
        ({"mcp_servers": [{"type": "url", "url": "http://x"}]}, "MCP"),
        ({"messages": [{"role": "user", "content": "x" * MAX_MODEL_LEN}]}, "context"),
    ],
)
def test_bad_requests_are_400_in_anthropic_shape_naming_the_field(fields, words):
    engine = Engine()
    message = _error(
        _client(engine).post("/v1/messages", json=_body(**fields), headers=HEADERS), 400, "invalid_request_error"
    )
    assert words in message
    assert engine.params == []


def test_status_errors_take_anthropic_types_on_its_paths_only():
    client = _client(max_body_size=4096)
    assert "x-api-key" in _error(client.post("/v1/messages", json=_body()), 401, "authentication_error")
    _error(client.post("/v1/messages", json=_body(), headers={"x-api-key": "wrong"}), 401, "authentication_error")
    _error(client.post("/v1/messages/batches", json={}, headers=HEADERS), 404, "not_found_error")
    _error(client.post("/v1/messages", json=_body(model="claude"), headers=HEADERS), 404, "not_found_error")
    big = _body(messages=[{"role": "user", "content": "x" * 5000}])
    _error(client.post("/v1/messages", json=big, headers=HEADERS), 413, "request_too_large")
    _error(client.post("/v1/messages/count_tokens", content=b"{", headers=HEADERS), 400, "invalid_request_error")
    openai = client.post("/v1/chat/completions", json={"messages": []}, headers=HEADERS).json()
    assert openai["error"]["type"] == "invalid_request_error" and "param" in openai["error"]
    bearer = client.post("/v1/messages", json=_body(), headers={"Authorization": f"Bearer {KEY}"})
    assert bearer.status_code == 200, bearer.text


@pytest.mark.parametrize(
    "error, status, error_type",
    [
        (EngineOverloadedError("64 requests are already waiting"), 429, "rate_limit_error"),
        (EngineDeadError("the engine loop stopped"), 503, "overloaded_error"),
        (RuntimeError("bug"), 500, "api_error"),
    ],
)
def test_engine_errors_before_the_first_output_are_statuses(error, status, error_type):
    async def refuse(*args, **kwargs):
        raise error
        yield

    engine = Engine()
    engine.generate = refuse
    for stream in (False, True):
        response = _client(engine).post("/v1/messages", json=_body(stream=stream), headers=HEADERS)
        _error(response, status, error_type)
        assert "bug" not in response.text


# ----- engine → message and events ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, script, blocks, stop",
    [
        ("Hello there", {}, [("text", "Hello there")], ("end_turn", None)),
        ("Hello", {"finish": FinishReason.LENGTH}, [("text", "Hello")], ("max_tokens", None)),
        ("Hi", {"stop_reason": "END"}, [("text", "Hi")], ("stop_sequence", "END")),
        ("Hi", {"stop_reason": 7}, [("text", "Hi")], ("end_turn", None)),
        ("<think>plan it</think>\n\nDone.", {}, [("thinking", "plan it"), ("text", "Done.")], ("end_turn", None)),
        (
            "<think>still thinking",
            {"finish": FinishReason.LENGTH},
            [("thinking", "still thinking")],
            ("max_tokens", None),
        ),
        ("", {}, [("text", "")], ("end_turn", None)),
    ],
)
def test_stream_accumulates_to_the_message(text, script, blocks, stop):
    client = _client(Engine(text, num_cached=3, **script))
    response = client.post("/v1/messages", json=_body(), headers=HEADERS)
    assert response.status_code == 200, response.text
    message = Message.model_validate(response.json()).model_dump(mode="json", exclude_none=True)
    assert [(b["type"], b.get("text", b.get("thinking"))) for b in message["content"]] == blocks
    assert (message["stop_reason"], message.get("stop_sequence")) == stop
    assert message["id"].startswith("msg_") and message["model"] == "tiny"
    num_prompt = len("<user>hi<assistant>")
    assert message["usage"] == {
        "input_tokens": num_prompt - 3,
        "cache_read_input_tokens": 3,
        "cache_creation_input_tokens": 0,
        "output_tokens": len(text),
    }
    events = _stream(client, _body())
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    streamed = Message.model_validate(_accumulate(events)).model_dump(mode="json", exclude_none=True)
    assert {**streamed, "id": message["id"]} == message
    if blocks[0][0] == "thinking":
        assert ("content_block_delta", "signature_delta") in [(n, e.get("delta", {}).get("type")) for n, e in events]


def test_tool_calls_become_tool_use_blocks():
    envelope = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}'
    client = _client(Engine(envelope))
    body = _body(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    message = client.post("/v1/messages", json=body, headers=HEADERS).json()
    assert message["stop_reason"] == "tool_use"
    (block,) = message["content"]
    assert (block["type"], block["name"], block["input"]) == ("tool_use", "get_weather", {"city": "Paris"})
    assert block["id"].startswith("toolu_")
    events = _stream(client, body)
    assert [e["delta"]["type"] for name, e in events if name == "content_block_delta"] == ["input_json_delta"]
    streamed = _accumulate(events)
    assert streamed["stop_reason"] == "tool_use" and streamed["content"][0]["input"] == {"city": "Paris"}


def test_max_tokens_is_an_upper_bound():
    engine = Engine()
    client = _client(engine)
    assert client.post("/v1/messages", json=_body(max_tokens=32000), headers=HEADERS).status_code == 200
    assert client.post("/v1/messages", json=_body(max_tokens=5), headers=HEADERS).status_code == 200
    num_prompt = len("<user>hi<assistant>")
    assert [params.max_tokens for params in engine.params] == [MAX_MODEL_LEN - num_prompt, 5]


def test_count_tokens_counts_the_rendered_prompt_with_tools_and_system():
    client = _client()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    count = client.post("/v1/messages/count_tokens", json=body, headers=HEADERS).json()
    assert count == {"input_tokens": len("<user>hi<assistant>")}
    with_tools = client.post(
        "/v1/messages/count_tokens", json={**body, "tools": [WEATHER], "system": "Be brief."}, headers=HEADERS
    ).json()
    assert with_tools["input_tokens"] > count["input_tokens"] + len("Be brief.")
    _error(
        client.post("/v1/messages/count_tokens", json={**body, "max_tokens": 5}, headers=HEADERS),
        400,
        "invalid_request_error",
    )


def test_an_error_mid_stream_is_an_error_event():
    engine = Engine("Hello", fail_after=2)
    events = _stream(_client(engine), _body())
    assert [name for name, _ in events][:2] == ["message_start", "ping"]
    assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "overloaded_error"
