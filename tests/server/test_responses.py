"""The Responses API's translation both ways, without a model: input items → chat messages, tools → chat tools,
chat errors → the Responses field, chat chunks → Responses events.

References: the chat request the same conversation takes (its messages, tools and tool_choice as written by
hand), and the openai SDK's own types and stream accumulator, which must accept every event and rebuild the
final response from them.
"""

from __future__ import annotations

import json
import typing

import pytest
from openai._types import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response as SdkResponse
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter, ValidationError

from tokenriver.errors import ContextLengthError, InvalidParameterError
from tokenriver.server.protocol import ChatCompletionChunk, ChatCompletionRequest
from tokenriver.server.responses_input import chat_messages, parse_input_items, parse_responses_request
from tokenriver.server.responses_output import ChatToolCall, output_items, response_object, response_usage
from tokenriver.server.responses_plan import ResponsesPlan, _check_one_constraint, _renamed, prompt_messages
from tokenriver.server.responses_protocol import SKIPPED_TOOLS_KEY, MessageItem, ResponsesRequest
from tokenriver.server.responses_store import ResponseStore, StoredResponse
from tokenriver.server.responses_stream import ResponseEvents
from tokenriver.server.responses_tools import build_tools, chat_tool_choice
from tokenriver.server.serving import GenerationPlan, PromptInput

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
FILES = {
    "type": "namespace",
    "name": "mcp__files__",
    "description": "A file server",
    "tools": [{"type": "function", "name": "read", "parameters": {"type": "object", "properties": {}}}],
}
CALC = {
    "type": "custom",
    "name": "calc",
    "description": "A calculator",
    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "ADD " /[0-9]+/'},
}
# The SDK's event class of each event type, to check an event against its own class.
EVENT_TYPES = {
    cls.model_fields["type"].annotation.__args__[0]: TypeAdapter(cls)
    for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])
}


def _error(call, *args) -> InvalidParameterError:
    with pytest.raises(InvalidParameterError) as caught:
        call(*args)
    return caught.value


# ----- input → chat messages ---------------------------------------------------------------------------------


def test_a_string_input_is_one_user_message():
    assert chat_messages(parse_input_items("Hello")).messages == [{"role": "user", "content": "Hello"}]


def test_adjacent_assistant_items_make_one_turn_and_outputs_are_tool_messages():
    items = parse_input_items(
        [
            {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
            {"type": "message", "role": "user", "content": "Weather and a sum?"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "summary only"}]},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "thinking"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "read",
                "namespace": "mcp__files__",
                "arguments": "{}",
            },
            {"type": "custom_tool_call", "call_id": "call_2", "name": "calc", "input": "ADD 2"},
            {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_text", "text": "a.txt"}]},
            {"type": "custom_tool_call_output", "call_id": "call_2", "output": "2"},
            {"role": "assistant", "content": "Done."},
        ]
    )
    chat = chat_messages(items)
    assert chat.messages == [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather and a sum?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "summary only\nthinking",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "mcp__files__.read", "arguments": "{}"}},
                {"id": "call_2", "type": "function", "function": {"name": "calc", "arguments": '{"input": "ADD 2"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"},
        {"role": "tool", "tool_call_id": "call_2", "content": "2"},
        {"role": "assistant", "content": "Done."},
    ]
    # Each message names the item it came from; the joined assistant turn names no single one.
    assert chat.sources == ["input[0]", "input[1]", "input", "input[7]", "input[8]", "input[9]"]
    # The chat side takes them as they are.
    ChatCompletionRequest.model_validate({"messages": chat.messages})


@pytest.mark.parametrize(
    "item, param, words",
    [
        ({"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}, "input[1].content", "images"),
        ({"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file"}]}, "input[1].output", ""),
        ({"type": "web_search_call", "id": "ws_1"}, "input[1].type", "web_search_call"),
        ({"content": "no role"}, "input[1].type", ""),
        ({"role": "wizard", "content": "hi"}, "input[1].role", ""),
        ({"role": "user", "content": [{"type": "input_text"}]}, "input[1].content[0].text", "required"),
        ({"type": "function_call", "call_id": "c", "name": "f", "arguments": "{nope"}, "input[1].arguments", "JSON"),
        ({"type": "function_call", "call_id": "c", "name": "f"}, "input[1].arguments", "required"),
        ({"type": "function_call", "call_id": "c", "name": "f", "arguments": "[" * 5000}, "input[1].arguments", "deep"),
        ({"role": "user", "content": "hi", "extra": 1}, "input[1].extra", ""),
        ("just text", "input[1]", ""),
        # A type that is not a string cannot be looked up in a table: a 400 naming it, never a crash.
        ({"type": "message", "role": "user", "content": [{"type": ["x"]}]}, "input[1].content[0].type", "string"),
        ({"type": "function_call_output", "call_id": "c", "output": [{"type": {}}]}, "input[1].output[0].type", ""),
        ({"type": ["message"], "role": "user", "content": "hi"}, "input[1].type", ""),
        ({"type": {"a": 1}}, "input[1].type", ""),
    ],
)
def test_bad_items_name_their_place(item, param, words):
    error = _error(parse_input_items, [{"role": "user", "content": "ok"}, item])
    assert error.param == param and words in error.message, (error.param, error.message)


# ----- tools -------------------------------------------------------------------------------------------------


def test_tools_become_chat_functions_and_hosted_ones_are_skipped():
    files = {**FILES, "tools": [{"type": "file_search"}, *FILES["tools"]]}
    tools = build_tools([{"type": "web_search"}, WEATHER, files, CALC, {"type": "mcp", "server_label": "x"}])
    # Hosted tools are skipped inside a namespace as at top level.
    assert tools.skipped == ["web_search", "file_search", "mcp"]
    assert [tool["function"]["name"] for tool in tools.chat_tools] == ["get_weather", "mcp__files__.read", "calc"]
    assert tools.chat_tools[0] == {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather of a city", "parameters": WEATHER["parameters"]},
    }
    calc = tools.chat_tools[2]["function"]
    assert calc["parameters"]["properties"] == {"input": {"type": "string"}}
    assert CALC["format"]["definition"] in calc["description"]
    assert [(t.name, t.namespace, t.path) for t in tools.targets.values()] == [
        ("get_weather", None, "tools[1]"),
        ("read", "mcp__files__", "tools[2].tools[1]"),
        ("calc", None, "tools[3]"),
    ]
    regex = build_tools([{**CALC, "format": {"type": "grammar", "syntax": "regex", "definition": "[0-9]+"}}])
    assert regex.chat_tools[0]["function"]["parameters"]["properties"]["input"]["pattern"] == "^(?:[0-9]+)$"


@pytest.mark.parametrize(
    "tools, param",
    [
        ([WEATHER, WEATHER], "tools[1].name"),
        ([{**WEATHER, "bogus": 1}], "tools[0].bogus"),
        ([{**WEATHER, "name": ""}], "tools[0].name"),
        ([{**FILES, "tools": [FILES]}], "tools[0].tools[0].type"),
        ([{**CALC, "format": {"type": "grammar", "syntax": "lark"}}], "tools[0].format"),
        (["get_weather"], "tools[0]"),
        ([{"name": "untyped"}], "tools[0].type"),
        ([{**WEATHER, "type": ["function"]}], "tools[0].type"),
        ([{**FILES, "tools": [{"type": ["x"]}]}], "tools[0].tools[0].type"),
        ([{**FILES, "tools": [{"type": {"function": 1}}]}], "tools[0].tools[0].type"),
        ([{**FILES, "tools": ["read"]}], "tools[0].tools[0]"),
    ],
)
def test_bad_tools_name_their_place(tools, param):
    assert _error(build_tools, tools).param == param


def test_tool_choice_maps_to_the_chat_name_or_forces_a_custom_tool():
    tools = build_tools([WEATHER, FILES, CALC])
    assert chat_tool_choice("required", tools) == ("required", None)
    assert chat_tool_choice({"type": "function", "name": "read"}, tools) == (
        {"type": "function", "function": {"name": "mcp__files__.read"}},
        None,
    )
    choice, forced = chat_tool_choice({"type": "custom", "name": "calc"}, tools)
    assert choice is None and forced.name == "calc" and forced.format.definition == CALC["format"]["definition"]
    for bad in ({"type": "function", "name": "calc"}, {"type": "custom", "name": "nope"}, {"type": "web_search"}):
        assert _error(chat_tool_choice, bad, tools).param == "tool_choice"


def test_chat_errors_are_renamed_to_the_responses_field():
    regex = {"type": "custom", "name": "digits", "format": {"type": "grammar", "syntax": "regex", "definition": "[0"}}
    tools = build_tools([{"type": "web_search"}, WEATHER, FILES, CALC, regex])
    forced = tools.targets["calc"]
    cases = {
        "tools[1].function.parameters": "tools[2].tools[0].parameters",
        "tools[0]": "tools[1]",
        # A custom tool's regex is the pattern of the parameters made for it.
        "tools[3].function.parameters.properties.input.pattern": "tools[4].format.definition",
        "response_format.json_schema": "text.format",
        "structured_outputs.grammar": "tools[3].format.definition",
        "messages": "input",
        "messages[1].content": "input[0]",
        "messages[9]": "input",
        "temperature": "temperature",
    }
    for chat_param, param in cases.items():
        renamed = _renamed(InvalidParameterError(f"{chat_param}: bad", param=chat_param), tools, forced, SOURCES)
        assert (renamed.param, renamed.message) == (param, f"{param}: bad")
    too_long = ContextLengthError("messages: 900 tokens do not fit", num_tokens=900, max_tokens=512, param="messages")
    renamed = _renamed(too_long, tools, None, SOURCES)
    assert isinstance(renamed, ContextLengthError) and renamed.message == "input: 900 tokens do not fit"
    assert (renamed.num_tokens, renamed.max_tokens) == (900, 512)


# The sources of the chat messages of _plan()'s request with instructions: the system message, then input[0].
SOURCES = ["instructions", "input[0]"]


def test_only_the_leading_field_name_of_an_error_message_is_rewritten():
    sources = ["instructions", "input[0]", "input[1]", "input"]
    cases = [
        # The message names a field within its param: the index is traced back to the item.
        ("messages", "messages[2] must be a dict with role and content", "input", "input[1] must be a dict"),
        # Prose that happens to hold the param's name stays as it is.
        ("messages", "the model's chat template rejected these messages: roles", "input", "these messages: roles"),
        ("messages[0].content", "messages[0].content: messages and more", "instructions", "instructions: messages"),
        ("tools[0].function", "tools[0].function.name: tools must", "tools[0]", "tools[0].name: tools must"),
    ]
    tools = build_tools([WEATHER])
    for chat_param, message, param, start in cases:
        renamed = _renamed(InvalidParameterError(message, param=chat_param), tools, None, sources)
        assert renamed.param == param and start in renamed.message, (renamed.param, renamed.message)


def test_chat_messages_trace_back_to_the_request_field():
    """Instructions shift the messages by one, a forced tool's prompt joins the system message, a string input is
    `input`, and items from previous_response_id name it."""
    request = ResponsesRequest.model_validate(
        {
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": "Add."},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": "2"},
            ],
        }
    )
    earlier = [MessageItem(role="user", content="Hi"), MessageItem(role="assistant", content="Hello")]
    conversation = [*earlier, *parse_input_items(request.input)]
    chat = prompt_messages(request, conversation, len(earlier), None)
    assert [message["role"] for message in chat.messages] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
        "tool",
    ]
    assert chat.sources == [
        "instructions",
        "previous_response_id",
        "previous_response_id",
        "input[0]",
        "input[1]",
        "input[2]",
    ]
    forced = build_tools([CALC]).targets["calc"]
    plain = ResponsesRequest.model_validate({"input": "Add."})
    chat = prompt_messages(plain, parse_input_items(plain.input), 0, forced)
    assert chat.sources == ["tool_choice", "input"] and chat.messages[0]["role"] == "system"
    renamed = _renamed(
        InvalidParameterError("bad", param="messages[1].content"), build_tools([CALC]), None, chat.sources
    )
    assert renamed.param == "input"


@pytest.mark.parametrize(
    "tools, tool_choice, is_refused",
    [
        # A forced custom tool with no grammar offers no tools: no tool grammar applies.
        ([WEATHER, {"type": "custom", "name": "notes"}], {"type": "custom", "name": "notes"}, False),
        ([WEATHER, {**CALC, "format": {"type": "text"}}], {"type": "custom", "name": "calc"}, False),
        ([WEATHER, CALC], {"type": "custom", "name": "calc"}, True),
        ([WEATHER], "none", False),
        ([{"type": "web_search"}], "auto", False),
        ([WEATHER], "auto", True),
        ([WEATHER], None, True),
    ],
)
def test_text_format_is_refused_only_with_an_active_tool_grammar(tools, tool_choice, is_refused):
    request = ResponsesRequest.model_validate(
        {"input": "hi", "tools": tools, "tool_choice": tool_choice, "text": {"format": {"type": "json_object"}}}
    )
    toolset = build_tools(request.tools)
    choice, forced = chat_tool_choice(request.tool_choice, toolset)
    if not is_refused:
        _check_one_constraint(request, toolset, choice, forced)
        return
    error = _error(_check_one_constraint, request, toolset, choice, forced)
    assert error.param == "text.format"
    assert ("tools[1].format" in error.message) == (forced is not None), error.message


# ----- request parsing ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, param",
    [
        (b'{"input": "hi", "frobnicate": 1}', "frobnicate"),
        (b'{"input": "\\ud800"}', "input"),  # the field is named, as on every API
        (b'{"input": "hi", "max_output_tokens": "5"}', "max_output_tokens"),
        (b"[1, 2]", None),
    ],
)
def test_bad_bodies_are_refused(body, param):
    with pytest.raises((InvalidParameterError, ValidationError)) as caught:
        parse_responses_request(body)
    if isinstance(caught.value, InvalidParameterError):
        assert caught.value.param == param
    else:
        assert caught.value.errors()[0]["loc"][0] == param


def test_codex_fields_are_accepted():
    body = {
        "model": "m",
        "instructions": "You are a coding agent.",
        "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
        "tools": [WEATHER, FILES, {"type": "web_search", "external_web_access": False}],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "thread",
        "client_metadata": {"x": "y"},
        "text": {"verbosity": "low"},
        "service_tier": "auto",
    }
    request = parse_responses_request(json.dumps(body).encode())
    assert request.prompt_cache_key == "thread" and request.parallel_tool_calls is False


# ----- output and events -----------------------------------------------------------------------------------


def _plan(tools: list | None = None, tool_choice: object = None, store: bool = False) -> ResponsesPlan:
    request = ResponsesRequest.model_validate(
        {"input": "hi", "tools": tools, "tool_choice": tool_choice, "store": store, "metadata": {"k": "v"}}
    )
    toolset = build_tools(request.tools)
    _, forced = chat_tool_choice(request.tool_choice, toolset)
    chat = GenerationPlan("resp_1", 7, [PromptInput([1, 2], None)], None, 0, True, True)
    return ResponsesPlan("resp_1", 7, request, chat, toolset, forced, parse_input_items(request.input))


def _chunk(content: str | None = None, reasoning: str | None = None, finish: str | None = None, **extra) -> dict:
    delta = {key: value for key, value in {"content": content, "reasoning_content": reasoning}.items() if value}
    return {"index": 0, "delta": {**delta, **extra}, "finish_reason": finish}


def _stream(plan: ResponsesPlan, choices: list[dict], usage: dict | None = None) -> list[dict]:
    """The events of a stream of chat chunks, one choice each, as JSON; checked against the SDK's types."""
    events = ResponseEvents(plan, "m", lambda text: len(text.split()))
    sent = events.start()
    for choice in choices:
        sent += events.on_chunk(ChatCompletionChunk(id="c", created=0, model="m", choices=[choice]))
    if usage is not None:
        sent += events.on_chunk(ChatCompletionChunk(id="c", created=0, model="m", choices=[], usage=usage))
    sent += events.finish()
    data = [json.loads(event.model_dump_json()) for event in sent]
    for event in data:
        EVENT_TYPES[event["type"]].validate_python(event)
    return data


def _accumulated(events: list[dict]):
    """The SDK's accumulator over the events (it checks ids, indexes and order); its final response."""
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for event in events:
        state.handle_event(EVENT_TYPES[event["type"]].validate_python(event))
    return state._completed_response


USAGE = {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14, "prompt_tokens_details": {"cached_tokens": 2}}


def test_stream_of_thinking_and_text_matches_the_whole_response():
    plan = _plan()
    events = _stream(
        plan,
        [
            _chunk(reasoning="Let me "),
            _chunk(reasoning="think.", content="The"),
            _chunk(" answer."),
            _chunk(finish="stop"),
        ],
        USAGE,
    )
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert [event["type"] for event in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = events[-1]["response"]
    done = [event["item"] for event in events if event["type"] == "response.output_item.done"]
    assert final["output"] == done
    assert [event["item_id"] for event in events if "item_id" in event] == [done[0]["id"]] * 5 + [done[1]["id"]] * 5
    assert [item["id"][:3] for item in done] == ["rs_", "msg"]
    whole = output_items(plan, "Let me think.", "The answer.", [], is_cut=False)
    assert [_without_ids(item.model_dump(mode="json")) for item in whole] == [_without_ids(item) for item in done]
    assert final["usage"] == {
        "input_tokens": 5,
        "input_tokens_details": {"cached_tokens": 2, "cache_write_tokens": 0},
        "output_tokens": 9,
        "output_tokens_details": {"reasoning_tokens": 3},
        "total_tokens": 14,
    }
    assert final["status"] == "completed" and final["metadata"] == {"k": "v"}
    sdk = _accumulated(events)
    assert sdk.output_text == "The answer." and sdk.output[0].content[0].text == "Let me think."


def _without_ids(item: dict) -> dict:
    return {key: value for key, value in item.items() if key not in ("id", "call_id")}


def test_stream_of_tool_calls_sends_each_call_whole():
    plan = _plan([WEATHER, FILES, CALC, {"type": "web_search"}])
    calls = [
        {"index": 0, "id": "call_a", "type": "function", "function": {"name": "mcp__files__.read", "arguments": ""}},
        {"index": 0, "function": {"arguments": "{}"}},
        {"index": 1, "id": "call_b", "type": "function", "function": {"name": "calc", "arguments": ""}},
        {"index": 1, "function": {"arguments": '{"input": "ADD 2"}'}},
    ]
    events = _stream(plan, [_chunk(tool_calls=[call]) for call in calls] + [_chunk(finish="tool_calls")])
    assert [event["type"] for event in events[2:]] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done",
        "response.output_item.done",
        "response.completed",
    ]
    function, custom = events[-1]["response"]["output"]
    assert (function["type"], function["name"], function["namespace"], function["call_id"]) == (
        "function_call",
        "read",
        "mcp__files__",
        "call_a",
    )
    assert (custom["type"], custom["name"], custom["input"], custom["call_id"]) == (
        "custom_tool_call",
        "calc",
        "ADD 2",
        "call_b",
    )
    assert events[-1]["response"]["metadata"] == {"k": "v", SKIPPED_TOOLS_KEY: "web_search"}
    added = [event["item"] for event in events if event["type"] == "response.output_item.added"]
    assert (added[0]["arguments"], added[0]["status"], added[1]["input"]) == ("", "in_progress", "")
    assert _accumulated(events).output[1].input == "ADD 2"


def test_a_forced_custom_tool_streams_its_input_and_a_cut_answer_is_incomplete():
    plan = _plan([CALC], {"type": "custom", "name": "calc"})
    events = _stream(plan, [_chunk("ADD "), _chunk("1"), _chunk(finish="length")])
    assert [event["type"] for event in events[2:]] == [
        "response.output_item.added",
        "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    final = events[-1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [item["input"] for item in final["output"]] == ["ADD 1"]
    plain = _stream(_plan(), [_chunk("Cut"), _chunk(finish="length")])
    assert plain[-1]["response"]["output"][0]["status"] == "incomplete"
    assert output_items(_plan(), None, "Cut", [], is_cut=True)[0].status == "incomplete"


WEATHER_CALL = {"index": 0, "id": "call_w", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
CALC_CALL = {
    "index": 1,
    "id": "call_c",
    "type": "function",
    "function": {"name": "calc", "arguments": '{"input": "1"}'},
}
FORCE_CALC = {"type": "custom", "name": "calc"}


@pytest.mark.parametrize(
    "tool_choice, thinking, content, chat_calls, statuses_when_cut",
    [
        # The item cut is the text item being written when the output stopped; calls are whole, never cut (and a
        # custom tool call has no status: None).
        (None, None, "Checking.", [WEATHER_CALL, CALC_CALL], ["incomplete", "completed", None]),
        (None, "Let me think.", None, [WEATHER_CALL], ["incomplete", "completed"]),
        (None, "Let me think.", "Checking.", [WEATHER_CALL], ["completed", "incomplete", "completed"]),
        (None, None, None, [WEATHER_CALL], ["completed"]),
        (None, "Let me think.", None, [], ["incomplete"]),
        (None, None, None, [], ["incomplete"]),
        (FORCE_CALC, "Let me think.", "ADD 1", [], ["completed", None]),
        (FORCE_CALC, "Let me think.", None, [], ["incomplete", None]),
    ],
)
@pytest.mark.parametrize("is_cut", [True, False])
def test_a_streamed_answer_ends_as_the_whole_one(tool_choice, thinking, content, chat_calls, statuses_when_cut, is_cut):
    """Stream == non-stream, cut short or not: the same items, each with the same status."""
    plan = _plan([WEATHER, CALC], tool_choice)
    chunks = [_chunk(reasoning=thinking), _chunk(content), *(_chunk(tool_calls=[call]) for call in chat_calls)]
    events = _stream(plan, [*chunks, _chunk(finish="length" if is_cut else "stop")])
    calls = [ChatToolCall(call["id"], call["function"]["name"], call["function"]["arguments"]) for call in chat_calls]
    whole = [item.model_dump(mode="json") for item in output_items(plan, thinking, content, calls, is_cut)]
    streamed = events[-1]["response"]["output"]
    assert [_without_ids(item) for item in streamed] == [_without_ids(item) for item in whole]
    expected = [status if is_cut or status is None else "completed" for status in statuses_when_cut]
    assert [item.get("status") for item in whole] == expected
    assert events[-1]["response"]["status"] == ("incomplete" if is_cut else "completed")


def test_an_empty_answer_is_one_empty_message():
    events = _stream(_plan(), [_chunk(finish="stop")])
    (item,) = events[-1]["response"]["output"]
    assert (item["type"], item["content"][0]["text"]) == ("message", "")
    assert [_without_ids(i.model_dump(mode="json")) for i in output_items(_plan(), None, "", [], False)] == [
        _without_ids(item)
    ]


def test_a_failed_stream_keeps_the_finished_items():
    events = ResponseEvents(_plan(), "m", len)
    events.start()
    events.on_chunk(ChatCompletionChunk(id="c", created=0, model="m", choices=[_chunk("Hi")]))
    failed = json.loads(events.failed("the engine stopped").model_dump_json())
    EVENT_TYPES[failed["type"]].validate_python(failed)
    assert failed["response"]["status"] == "failed" and failed["response"]["error"]["message"] == "the engine stopped"


def test_the_response_passes_the_sdk_types():
    plan = _plan([WEATHER])
    calls = [ChatToolCall("call_1", "get_weather", '{"city": "Oslo"}')]
    response = response_object(plan, "m", "completed", output_items(plan, None, "Hi", calls, False))
    SdkResponse.model_validate(response.model_dump(mode="json"))


# ----- storage -----------------------------------------------------------------------------------------------


def test_the_store_keeps_the_last_responses_and_continues_their_conversation():
    plan = _plan([WEATHER], store=True)
    calls = [ChatToolCall("call_1", "get_weather", '{"city": "Oslo"}')]
    store = ResponseStore(2)
    responses = [response_object(plan, "m", "completed", output_items(plan, None, "Hi", calls, False))]
    responses += [response_object(plan, "m", "completed", []) for _ in range(2)]
    for index, response in enumerate(responses):
        store.put(StoredResponse(response.model_copy(update={"id": f"resp_{index}"}), plan.conversation))
    assert store.get("resp_0") is None and store.get("resp_1") is not None
    kept = StoredResponse(responses[0], [MessageItem(role="user", content="Weather?")])
    assert chat_messages(kept.continued()).messages == [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Hi",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
    ]


def test_reasoning_tokens_never_exceed_the_output():
    usage = response_usage(None, "a b c", lambda text: 99)
    assert (usage.output_tokens, usage.output_tokens_details.reasoning_tokens) == (0, 0)
