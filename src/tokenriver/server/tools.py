"""Tool calling: how tools reach the prompt, which grammar enforces a call, and how output becomes tool calls.

Three envelope formats, chosen from the model's chat template:
- "hermes" (Qwen 2.5/3, Hermes): the template renders `tools`; a call is
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, several in a row when parallel.
- "llama3" (Llama 3.1+): the template renders `tools`; a call is `{"name": ..., "parameters": {...}}`,
  optionally after `<|python_tag|>`.
- "generic" (templates without tool support, such as SmolLM2's): as llama.cpp does, the tools and a JSON
  envelope are described in the system prompt, and the whole answer is one JSON object:
  `{"tool_calls": [{"name": ..., "arguments": {...}}]}` or `{"response": "..."}`.

Enforcement: "required" and a named function get a grammar in the format's own envelope. "auto" with the
generic format is a grammar too (a call or a response, in JSON); with the template formats it is left to the
model and only parsed. "none" renders no tools and parses nothing.

Streaming (`visible_content`): content is held back while it may still turn into an envelope, so a client never
sees the beginning of a tool call as text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from tokenriver.errors import InvalidParameterError
from tokenriver.params import StructuredOutput
from tokenriver.server.protocol import ChatMessage, NamedToolChoice, ToolDefinition

FORMATS: tuple[str, ...] = ("generic", "hermes", "llama3")
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
# How a generic envelope's reply begins (the grammar writes JSON with this spacing).
_RESPONSE_OPEN = '{"response": "'
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass
class ToolCall:
    """One parsed call: OpenAI's id, the function's name and its arguments as JSON text."""

    id: str
    name: str
    arguments: str


def tool_format(chat_template: str | None) -> str:
    """Which envelope the model's template speaks (see the module docstring)."""
    template = chat_template or ""
    if "tools" not in template:
        return "generic"
    if _HERMES_OPEN in template:
        return "hermes"
    if "<|start_header_id|>" in template:
        return "llama3"
    return "generic"


class ToolCalling:
    """The tools of one chat request, and what follows from them."""

    def __init__(self, tools: list[ToolDefinition], choice: str | NamedToolChoice | None,
                 parallel_tool_calls: bool | None, chat_template: str | None) -> None:
        self.tools = tools
        self.choice = choice if choice is not None else "auto"
        self.is_parallel = parallel_tool_calls is not False
        self.format = tool_format(chat_template)
        names = [tool.function.name for tool in tools]
        for index, name in enumerate(names):
            if not name:
                raise InvalidParameterError("every tool needs a function name", param=f"tools[{index}].function.name")
        if isinstance(self.choice, NamedToolChoice) and self.choice.function.name not in names:
            raise InvalidParameterError(
                f"tool_choice names {self.choice.function.name!r}, which is not among the tools "
                f"({', '.join(names)})", param="tool_choice")

    @property
    def is_active(self) -> bool:
        """Whether the model is told about the tools at all (there are none, or "none" leaves them out)."""
        return bool(self.tools) and self.choice != "none"

    @property
    def callable_tools(self) -> list[ToolDefinition]:
        """The tools the model may call (only the named one when tool_choice names one)."""
        if isinstance(self.choice, NamedToolChoice):
            return [tool for tool in self.tools if tool.function.name == self.choice.function.name]
        return self.tools

    # ----- prompt ----------------------------------------------------------------------------------------

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The `tools` variable for a template that renders tools itself (None for the generic format)."""
        if not self.is_active or self.format == "generic":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.callable_tools]

    def conversation(self, messages: list[ChatMessage]) -> list[dict[str, Any]]:
        """The messages as the chat template gets them: tool calls and tool results of the history in the
        format's own terms, and for the generic format the tools described in the system prompt."""
        entries = [self._entry(message) for message in messages]
        if self.is_active and self.format == "generic":
            prompt = self._generic_system_prompt()
            if entries and entries[0]["role"] == "system":
                entries[0] = {**entries[0], "content": entries[0]["content"] + "\n\n" + prompt}
            else:
                entries.insert(0, {"role": "system", "content": prompt})
        return entries

    def _entry(self, message: ChatMessage) -> dict[str, Any]:
        entry = conversation_entry(message)
        if message.role == "assistant" and message.tool_calls:
            calls = [{"name": call.function.name, "arguments": _arguments(call.function.arguments)}
                     for call in message.tool_calls]
            if self.format == "generic":
                entry["content"] = json.dumps({"tool_calls": calls})
            else:
                entry["tool_calls"] = [{"id": call.id, "type": "function", "function": body}
                                       for call, body in zip(message.tool_calls, calls)]
        if message.role == "tool" and self.format == "generic":
            entry["content"] = json.dumps({"tool_response": {"tool_call_id": message.tool_call_id,
                                                             "content": entry["content"]}})
        return entry

    def _generic_system_prompt(self) -> str:
        tools = [tool.function.model_dump(exclude_none=True) for tool in self.callable_tools]
        example = {"tool_calls": [{"name": tools[0]["name"], "arguments": {}}]}
        must_call = self.choice != "auto"
        return ("You can call the following tools to satisfy the user's request:\n"
                + json.dumps(tools)
                + "\n\nRespond in JSON format, "
                + ("with `tool_calls` (the tools to call)" if must_call else
                   "either with `tool_calls` (a request to call tools) or with `response` (your reply to the user)")
                + ". Example tool call:\n" + json.dumps(example)
                + ("" if must_call else '\nExample response:\n{"response": "..."}'))

    # ----- grammar ---------------------------------------------------------------------------------------

    def structured_output(self) -> StructuredOutput | None:
        """The grammar that enforces the envelope, or None when the model is left free."""
        if not self.is_active:
            return None
        call_schemas = [self._call_schema(tool) for tool in self.callable_tools]
        call = call_schemas[0] if len(call_schemas) == 1 else {"anyOf": call_schemas}
        if self.format == "generic":
            calls = {"type": "array", "items": call, "minItems": 1}
            if not self.is_parallel:
                calls["maxItems"] = 1
            envelope = {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"],
                        "additionalProperties": False}
            if self.choice == "auto":
                response = {"type": "object", "properties": {"response": {"type": "string"}},
                            "required": ["response"], "additionalProperties": False}
                envelope = {"anyOf": [envelope, response]}
            return StructuredOutput.json(envelope)
        if self.choice == "auto":
            return None
        if self.format == "hermes":
            repeat = "+" if self.is_parallel else ""
            return StructuredOutput.grammar(
                f'start: call{repeat}\ncall: "{_HERMES_OPEN}\\n" body "\\n{_HERMES_CLOSE}" "\\n"?\n'
                f"body: %json {json.dumps(call)}\n")
        return StructuredOutput.json(call)

    def _call_schema(self, tool: ToolDefinition) -> dict[str, Any]:
        parameters = tool.function.parameters or {"type": "object", "properties": {}}
        key = "parameters" if self.format == "llama3" else "arguments"
        return {"type": "object", "properties": {"name": {"const": tool.function.name}, key: parameters},
                "required": ["name", key], "additionalProperties": False}

    # ----- output ----------------------------------------------------------------------------------------

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """Finished output → (content, tool calls). Output that is not a well-formed envelope is content."""
        if not self.is_active:
            return text, []
        if self.format == "generic":
            return _parse_generic(text)
        if self.format == "hermes":
            return _parse_hermes(text)
        return _parse_llama3(text)

    def visible_content(self, text: str) -> str:
        """The part of unfinished output that is surely content and may be streamed now."""
        if not self.is_active:
            return text
        if self.format == "generic":
            return _partial_response(text) or ""
        if self.format == "hermes":
            start = text.find(_HERMES_OPEN)
            end = start if start >= 0 else len(text) - _partial_suffix(text, _HERMES_OPEN)
            return text[:end].rstrip()  # whitespace before a call is not part of the content
        stripped = text.lstrip()
        if stripped.startswith(("{", _PYTHON_TAG)) or _PYTHON_TAG.startswith(stripped):
            return ""
        return text


def conversation_entry(message: ChatMessage) -> dict[str, Any]:
    """A message as the chat template gets it (without tool-specific rewriting)."""
    entry: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role,
                             "content": message.text()}
    if message.name is not None:
        entry["name"] = message.name
    if message.tool_call_id is not None:
        entry["tool_call_id"] = message.tool_call_id
    return entry


def _arguments(text: str) -> Any:
    """An echoed call's arguments as JSON data (templates print them with tojson)."""
    try:
        return json.loads(text)
    except ValueError:
        raise InvalidParameterError(f"tool call arguments {text[:60]!r} are not valid JSON",
                                    param="messages") from None


def _new_call(name: str, arguments: Any) -> ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", name=name, arguments=text)


def _call_from(data: Any, key: str) -> ToolCall | None:
    if isinstance(data, dict) and isinstance(data.get("name"), str) and key in data:
        return _new_call(data["name"], data[key])
    return None


def _partial_response(text: str) -> str | None:
    """The reply of a generic envelope `{"response": "...` so far (cut short by max_tokens, or still streaming);
    an escape sequence not yet complete is left out."""
    if not text.startswith(_RESPONSE_OPEN):
        return None
    body = text[len(_RESPONSE_OPEN) - 1:]  # from the string's opening quote
    for cut in range(min(7, len(body))):
        try:
            value = json.loads(body[:len(body) - cut] + '"')
        except ValueError:
            continue
        return value if isinstance(value, str) else None
    return None


def _parse_generic(text: str) -> tuple[str | None, list[ToolCall]]:
    try:
        data = json.loads(text)
    except ValueError:
        partial = _partial_response(text)
        return (partial, []) if partial is not None else (text, [])
    if isinstance(data, dict) and isinstance(data.get("response"), str):
        return data["response"], []
    raw_calls = data.get("tool_calls") if isinstance(data, dict) else None
    if isinstance(data, dict) and "tool_call" in data:
        raw_calls = [data["tool_call"]]
    calls = [_call_from(item, "arguments") for item in raw_calls] if isinstance(raw_calls, list) else []
    if not calls or None in calls:
        return text, []
    return None, calls


def _parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    calls = []
    for body in _HERMES_CALL.findall(text):
        try:
            call = _call_from(json.loads(body), "arguments")
        except ValueError:
            call = None
        if call is None:
            return text, []
        calls.append(call)
    if not calls:
        return text, []
    content = text[:text.find(_HERMES_OPEN)].rstrip()
    return content or None, calls


def _parse_llama3(text: str) -> tuple[str | None, list[ToolCall]]:
    stripped = text.strip()
    if stripped.startswith(_PYTHON_TAG):
        stripped = stripped[len(_PYTHON_TAG):].strip()
    calls = []
    try:
        parts = [json.dumps(json.loads(stripped))]
    except ValueError:
        parts = stripped.split(";")
    for part in parts:
        try:
            data = json.loads(part)
        except ValueError:
            return text, []
        call = _call_from(data, "parameters") or _call_from(data, "arguments")
        if call is None:
            return text, []
        calls.append(call)
    return (None, calls) if calls else (text, [])


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of text that begins marker (text that may still become marker)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
