"""Tool calling through the offline API: LLM.chat(tools=..., tool_choice=...) on the embedded model.

Reference: the tools offered. A forced call ("required", a named function) is one of them with arguments that
validate against its parameters; "auto" through a Hermes template is prose without the envelope or calls and
nothing after them; bad requests are refused with InvalidParameterError naming the parameter.
"""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest
from tokenizers import Tokenizer as BackendTokenizer

from tokenriver.engine.llm import LLM
from tokenriver.errors import InvalidParameterError
from tokenriver.params import SamplingParams, StructuredOutput
from tokenriver.tokenizer.tokenizer import Tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = SamplingParams(max_tokens=48, temperature=0.0)
# A Qwen 2.5-like template: it renders `tools` and asks for <tool_call> envelopes (the "hermes" format).
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these tools:\n<tools>\n{% for tool in tools %}"
    "{{ tool | tojson }}\n{% endfor %}</tools>\nFor each call, return <tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n{% endif %}'
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{% if message.tool_calls %}"
    "{% for call in message.tool_calls %}<tool_call>\n{{ call.function | tojson }}\n</tool_call>{% endfor %}"
    "{% else %}{{ message.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def llm(loaded_packed) -> LLM:
    return LLM.from_loaded(loaded_packed, max_num_kv_tokens=4096)


@pytest.fixture(scope="module")
def hermes_llm(loaded_packed) -> LLM:
    tokenizer = loaded_packed.tokenizer
    hermes = Tokenizer(
        BackendTokenizer.from_str(tokenizer.to_json()),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
        chat_template=HERMES_TEMPLATE,
        special_token_strings={},
        vocab_size=tokenizer.vocab_size,
    )
    return LLM.from_loaded(dataclasses.replace(loaded_packed, tokenizer=hermes), max_num_kv_tokens=4096)


def _check_call(call, tools=TOOLS) -> None:
    (tool,) = [tool for tool in tools if tool["function"]["name"] == call.name]
    jsonschema.validate(json.loads(call.arguments), tool["function"].get("parameters", {"type": "object"}))
    assert call.id.startswith("call_")


def test_required_calls_a_tool(llm):
    (output,) = llm.chat(ASK, GREEDY, use_tqdm=False, tools=TOOLS, tool_choice="required")
    completion = output.outputs[0]
    assert completion.tool_calls and completion.content is None, completion.text
    for call in completion.tool_calls:
        _check_call(call)


def test_a_named_function_is_the_one_called(llm):
    named = {"type": "function", "function": {"name": "get_time"}}
    (output,) = llm.chat(ASK, GREEDY, use_tqdm=False, tools=TOOLS, tool_choice=named, parallel_tool_calls=False)
    (call,) = output.outputs[0].tool_calls
    assert call.name == "get_time" and json.loads(call.arguments) == {}


def test_without_tools_the_output_carries_no_calls(llm):
    (output,) = llm.chat(ASK, SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert output.outputs[0].tool_calls is None and output.outputs[0].content is None


def test_hermes_template_required_and_auto(hermes_llm):
    (required,) = hermes_llm.chat(ASK, GREEDY, use_tqdm=False, tools=TOOLS, tool_choice="required")
    assert required.outputs[0].text.startswith("<tool_call>\n")
    for call in required.outputs[0].tool_calls:
        _check_call(call)
    (auto,) = hermes_llm.chat(ASK, SamplingParams(max_tokens=64, temperature=0.0), use_tqdm=False, tools=TOOLS)
    completion = auto.outputs[0]
    if completion.tool_calls:  # calls, with nothing but whitespace after them
        assert completion.text.rstrip().endswith("</tool_call>")
        for call in completion.tool_calls:
            _check_call(call)
    else:  # prose: the grammar let no envelope start
        assert "<tool_call>" not in completion.text and completion.content == completion.text


@pytest.mark.parametrize(
    "kwargs, param, words",
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not among the tools",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", '"required"'),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name", "name"),
        (
            {
                "tools": TOOLS,
                "tool_choice": "required",
                "sampling_params": SamplingParams(structured_output=StructuredOutput.json_object()),
            },
            "tool_choice",
            "sampling_params.structured_output",
        ),
    ],
)
def test_bad_tool_requests_are_refused(llm, kwargs, param, words):
    with pytest.raises(InvalidParameterError) as error:
        llm.chat(ASK, use_tqdm=False, **kwargs)
    assert error.value.param == param and words in error.value.message
