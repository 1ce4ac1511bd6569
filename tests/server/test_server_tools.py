"""Tool-call rendering and parsing, reasoning splitting and their streaming, without a model.

References: the envelope texts each format defines, and the non-streamed message (streamed pieces, fed one
character at a time so every tag is split across chunks, must concatenate to it).
"""

from __future__ import annotations

import json

import pytest

from tokenriver.errors import InvalidParameterError
from tokenriver.server.chat_output import ChatView, chat_message, message_delta
from tokenriver.server.protocol import ChatCompletionRequest, ChatMessage
from tokenriver.server.reasoning import split
from tokenriver.server.tools import conversation_messages, request_tools
from tokenriver.tool_calls import ToolCalling, tool_format

WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
HERMES_TEMPLATE = "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}<tool_call>"
LLAMA3_TEMPLATE = "{% if tools %}{{ tools | tojson }}{% endif %}<|start_header_id|>"


def _stream(text: str, tool_calling: ToolCalling | None, starts_in_reasoning: bool | None) -> tuple[str, str, list]:
    """Feed text one character at a time; returns the concatenated reasoning, content and the final calls."""
    view, reasoning, content, calls = ChatView(), "", "", []
    for end in range(1, len(text) + 1):
        delta, calls = message_delta(view, text[:end], end == len(text), tool_calling, starts_in_reasoning)
        reasoning += delta.reasoning_content or ""
        content += delta.content or ""
    return reasoning, content, calls


def test_formats_follow_the_template():
    assert tool_format(None) == "generic"
    assert tool_format("{{ messages }}") == "generic"
    assert tool_format(HERMES_TEMPLATE) == "hermes"
    assert tool_format(LLAMA3_TEMPLATE) == "llama3"


def test_generic_envelope_parses_calls_and_responses():
    calling = ToolCalling([WEATHER], "auto", None, None)
    content, calls = calling.parse('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert calling.parse('{"response": "Hello"}') == ("Hello", [])
    assert calling.parse('{"tool_calls": [{"na') == ('{"tool_calls": [{"na', [])  # cut short: left as text
    assert calling.parse('{"response": "Hel') == ("Hel", [])  # a reply cut short keeps what it said
    text = '{"response": "Say \\"hi\\" \\u00e9t\\u00e9"}'
    assert _stream(text, calling, None)[1] == calling.parse(text)[0] == 'Say "hi" \u00e9t\u00e9'


def test_generic_grammar_allows_a_call_or_a_response_only_with_auto():
    auto = json.loads(ToolCalling([WEATHER], "auto", None, None).structured_output().text)
    assert [set(option["properties"]) for option in auto["anyOf"]] == [{"tool_calls"}, {"response"}]
    required = json.loads(ToolCalling([WEATHER], "required", False, None).structured_output().text)
    assert required["properties"]["tool_calls"]["maxItems"] == 1
    item = json.loads(ToolCalling([WEATHER], NAMED, None, None).structured_output().text)
    assert item["properties"]["tool_calls"]["items"]["properties"]["name"] == {"const": "get_weather"}
    assert ToolCalling([WEATHER], "none", None, None).structured_output() is None


def test_the_request_reaches_the_core_as_dicts():
    request = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [WEATHER],
            "tool_choice": NAMED,
            "parallel_tool_calls": False,
        }
    )
    calling = request_tools(request, HERMES_TEMPLATE, lambda text: None)
    assert (calling.tools, calling.named, calling.is_parallel, calling.format) == (
        [WEATHER],
        "get_weather",
        False,
        "hermes",
    )
    unknown = request.model_copy(
        update={
            "tool_choice": request.tool_choice.model_copy(
                update={"function": request.tool_choice.function.model_copy(update={"name": "nope"})}
            )
        }
    )
    with pytest.raises(InvalidParameterError) as error:
        request_tools(unknown, None, lambda text: None)
    assert error.value.param == "tool_choice"


def test_hermes_calls_and_streaming_hold_back_the_envelope():
    calling = ToolCalling([WEATHER], "auto", None, HERMES_TEMPLATE)
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = calling.parse(text)
    assert content == "Let me check." and calls[0].name == "get_weather"
    reasoning, streamed, streamed_calls = _stream(text, calling, None)
    assert streamed == "Let me check." and [c.arguments for c in streamed_calls] == [c.arguments for c in calls]
    assert calling.visible_content("Hi <tool_") == "Hi"
    required = ToolCalling([WEATHER], "required", None, HERMES_TEMPLATE).structured_output()
    assert required.kind == "grammar" and "<tool_call>" in required.text


def test_llama3_calls_parse():
    calling = ToolCalling([WEATHER], "auto", None, LLAMA3_TEMPLATE)
    content, calls = calling.parse('<|python_tag|>{"name": "get_weather", "parameters": {"city": "a;b"}}')
    assert content is None and json.loads(calls[0].arguments) == {"city": "a;b"}
    assert calling.parse("Just text.") == ("Just text.", [])
    assert calling.visible_content('{"na') == ""


def test_history_with_tool_calls_renders_in_the_format():
    messages = [
        ChatMessage.model_validate(m)
        for m in [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]
    ]
    messages = conversation_messages(messages)
    generic = ToolCalling([WEATHER], "auto", None, None).conversation(messages)
    assert generic[0]["role"] == "system" and "get_weather" in generic[0]["content"]
    assert json.loads(generic[2]["content"]) == {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}
    assert json.loads(generic[3]["content"])["tool_response"]["content"] == "sunny"
    hermes = ToolCalling([WEATHER], "auto", None, HERMES_TEMPLATE).conversation(messages)
    assert hermes[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Oslo"}}
    assert hermes[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


@pytest.mark.parametrize("starts_inside", [False, True])
def test_reasoning_streams_like_the_whole_message(starts_inside):
    text = ("" if starts_inside else "<think>") + "Two and two.\n</think>\n\nFour."
    whole = chat_message(text, None, starts_inside)
    assert (whole.reasoning_content, whole.reasoning, whole.content) == ("Two and two.\n", "Two and two.\n", "Four.")
    assert _stream(text, None, starts_inside)[:2] == ("Two and two.\n", "Four.")


def test_reasoning_split_without_a_block_and_unfinished():
    assert split("Plain answer", False, True) == (None, "Plain answer")
    assert split("<thi", False, False) == (None, "")
    assert split("<think>still </thi", False, False) == ("still ", "")
    assert split("never closed", True, True) == ("never closed", "")
