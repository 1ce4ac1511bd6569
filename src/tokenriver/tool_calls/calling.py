"""ToolCalling: the tools of one chat request, and what follows from them for the prompt, the grammar and the
output. Inputs are OpenAI's JSON shapes as plain dicts (tool definitions, tool_choice, messages), so the server
(after pydantic), LLM.chat and the command line share it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from tokenriver.errors import InvalidParameterError
from tokenriver.outputs import ToolCall
from tokenriver.params import SamplingParams, StructuredOutput
from tokenriver.tool_calls import envelopes
from tokenriver.tool_calls.grammar import generic_grammar, hermes_grammar, llama3_grammar

FORMATS: tuple[str, ...] = ("generic", "hermes", "llama3")
CHOICES: tuple[str, ...] = ("none", "auto", "required")


def tool_format(chat_template: str | None) -> str:
    """Which envelope the model's template speaks (see the package docstring)."""
    template = chat_template or ""
    if "tools" not in template:
        return "generic"
    if envelopes.HERMES_OPEN in template:
        return "hermes"
    if "<|start_header_id|>" in template:
        return "llama3"
    return "generic"


def _no_special_tokens(text: str) -> int | None:
    return None


class ToolCalling:
    """The tools of one chat request, and what follows from them.

    `special_token_id(text)` says whether the vocabulary holds an envelope marker as one special token (its id,
    else None); the engine answers it (EngineCore.special_token_id), and the grammar depends on it.
    """

    def __init__(
        self,
        tools: list[dict[str, Any]] | None,
        choice: str | dict[str, Any] | None,
        parallel_tool_calls: bool | None,
        chat_template: str | None,
        special_token_id: Callable[[str], int | None] = _no_special_tokens,
    ) -> None:
        self.tools = _checked_tools(tools)
        self.choice = "auto" if choice is None else choice
        self.named = _named_function(self.choice)
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise InvalidParameterError(
                f"parallel_tool_calls={parallel_tool_calls!r} must be true or false", param="parallel_tool_calls"
            )
        self.is_parallel = parallel_tool_calls is not False
        self.format = tool_format(chat_template)
        self.special_token_id = special_token_id
        names = [tool["function"]["name"] for tool in self.tools]
        if choice not in (None, "none") and not self.tools:
            raise InvalidParameterError(
                "tool_choice needs tools: send the tools the model may call", param="tool_choice"
            )
        if self.named is not None and self.named not in names:
            raise InvalidParameterError(
                f"tool_choice names {self.named!r}, which is not among the tools ({', '.join(names)})",
                param="tool_choice",
            )

    @property
    def is_active(self) -> bool:
        """Whether the model is told about the tools at all (there are none, or "none" leaves them out)."""
        return bool(self.tools) and self.choice != "none"

    @property
    def callable_tools(self) -> list[dict[str, Any]]:
        """The tools the model may call (only the named one when tool_choice names one)."""
        if self.named is not None:
            return [tool for tool in self.tools if tool["function"]["name"] == self.named]
        return self.tools

    # ----- prompt ----------------------------------------------------------------------------------------

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The `tools` variable for a template that renders tools itself (None for the generic format)."""
        if not self.is_active or self.format == "generic":
            return None
        return self.callable_tools

    def conversation(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages as the chat template gets them: developer messages as system ones, tool calls and tool
        results of the history in the format's own terms, and for the generic format the tools described in
        the system prompt. Other keys pass through untouched."""
        entries = [self._entry(message, index) for index, message in enumerate(messages)]
        if self.is_active and self.format == "generic":
            prompt = self._generic_system_prompt()
            if entries and entries[0].get("role") == "system":
                entries[0] = {**entries[0], "content": _text(entries[0].get("content")) + "\n\n" + prompt}
            else:
                entries.insert(0, {"role": "system", "content": prompt})
        return entries

    def _entry(self, message: dict[str, Any], index: int) -> dict[str, Any]:
        if not isinstance(message, dict):
            raise InvalidParameterError(f"messages[{index}] must be a dict with role and content", param="messages")
        entry = dict(message)
        if entry.get("role") == "developer":
            entry["role"] = "system"
        if entry.get("role") == "assistant" and entry.get("tool_calls"):
            calls = [
                _echoed_call(call, f"messages[{index}].tool_calls[{i}]") for i, call in enumerate(entry["tool_calls"])
            ]
            bodies = [{"name": name, "arguments": arguments} for _, name, arguments in calls]
            if self.format == "generic":
                del entry["tool_calls"]
                entry["content"] = json.dumps({"tool_calls": bodies})
            else:
                entry["tool_calls"] = [
                    {"id": call_id, "type": "function", "function": body}
                    for (call_id, _, _), body in zip(calls, bodies)
                ]
        if entry.get("role") == "tool" and self.format == "generic":
            entry["content"] = json.dumps(
                {"tool_response": {"tool_call_id": entry.get("tool_call_id"), "content": _text(entry.get("content"))}}
            )
        return entry

    def _generic_system_prompt(self) -> str:
        tools = [tool["function"] for tool in self.callable_tools]
        example = {"tool_calls": [{"name": tools[0]["name"], "arguments": {}}]}
        must_call = self.choice != "auto"
        return (
            "You can call the following tools to satisfy the user's request:\n"
            + json.dumps(tools)
            + "\n\nRespond in JSON format, "
            + (
                "with `tool_calls` (the tools to call)"
                if must_call
                else "either with `tool_calls` (a request to call tools) or with `response` (your reply to the user)"
            )
            + ". Example tool call:\n"
            + json.dumps(example)
            + ("" if must_call else '\nExample response:\n{"response": "..."}')
        )

    # ----- grammar ---------------------------------------------------------------------------------------

    def structured_output(self) -> StructuredOutput | None:
        """The grammar that enforces the envelope (tool_calls/grammar.py), or None when no tools are active."""
        if not self.is_active:
            return None
        call_schemas = [self._call_schema(tool) for tool in self.callable_tools]
        call = call_schemas[0] if len(call_schemas) == 1 else {"anyOf": call_schemas}
        is_auto = self.choice == "auto"
        if self.format == "generic":
            return generic_grammar(call, is_auto, self.is_parallel)
        if self.format == "hermes":
            return hermes_grammar(call, is_auto, self.is_parallel, self.special_token_id)
        return llama3_grammar(call, is_auto, self.is_parallel, self.special_token_id)

    def constrain(self, params: SamplingParams, constraint_name: str) -> SamplingParams:
        """params with the tools' grammar; a request that has its own constraint (named `constraint_name` in
        the error, as its user wrote it) cannot also have enforced tools."""
        grammar = self.structured_output()
        if grammar is None:
            return params
        if params.structured_output is not None:
            raise InvalidParameterError(
                f"tools with tool_choice={self.choice!r} are enforced by a grammar, so the output cannot also "
                f"follow {constraint_name}; send one of them (or tool_choice='none')",
                param="tool_choice",
            )
        return dataclasses.replace(params, structured_output=grammar)

    def _call_schema(self, tool: dict[str, Any]) -> dict[str, Any]:
        function = tool["function"]
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        key = "parameters" if self.format == "llama3" else "arguments"
        return {
            "type": "object",
            "properties": {"name": {"const": function["name"]}, key: parameters},
            "required": ["name", key],
            "additionalProperties": False,
        }

    # ----- output ----------------------------------------------------------------------------------------

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """Finished output → (content, tool calls). Output that is not a well-formed envelope is content."""
        if not self.is_active:
            return text, []
        if self.format == "generic":
            return envelopes.parse_generic(text)
        if self.format == "hermes":
            return envelopes.parse_hermes(text)
        return envelopes.parse_llama3(text)

    def visible_content(self, text: str) -> str:
        """The part of unfinished output that is surely content and may be streamed now: content is held back
        while it may still turn into an envelope, so a client never sees the beginning of a call as text."""
        if not self.is_active:
            return text
        if self.format == "generic":
            return envelopes.partial_response(text) or ""
        if self.format == "hermes":
            return envelopes.visible_hermes(text)
        return envelopes.visible_llama3(text)


# ----- input checks -----------------------------------------------------------------------------------------


def _checked_tools(tools: object) -> list[dict[str, Any]]:
    """OpenAI tool definitions, each `{"type": "function", "function": {"name": ..., "parameters": {...}}}`."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise InvalidParameterError(
            f"tools must be a list of tool definitions, not {type(tools).__name__}", param="tools"
        )
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(tool.get("function"), dict)
        ):
            raise InvalidParameterError(
                f'{where} must be {{"type": "function", "function": {{"name": ..., "parameters": {{...}}}}}}',
                param=where,
            )
        function = tool["function"]
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise InvalidParameterError("every tool needs a function name", param=f"{where}.function.name")
        if not isinstance(function.get("parameters") or {}, dict):
            raise InvalidParameterError(
                "a function's parameters must be a JSON schema (an object)", param=f"{where}.function.parameters"
            )
    return tools


def _named_function(choice: object) -> str | None:
    """The function tool_choice names, or None for "none", "auto" and "required"."""
    if choice in CHOICES:
        return None
    if (
        isinstance(choice, dict)
        and choice.get("type", "function") == "function"
        and isinstance(choice.get("function"), dict)
        and isinstance(choice["function"].get("name"), str)
    ):
        return choice["function"]["name"]
    raise InvalidParameterError(
        f'tool_choice={choice!r} is invalid: use "none", "auto", "required" or '
        f'{{"type": "function", "function": {{"name": ...}}}}',
        param="tool_choice",
    )


def _echoed_call(call: object, where: str) -> tuple[str | None, str, Any]:
    """(id, name, arguments as JSON data) of a call an assistant message of the history made: templates print
    the arguments with tojson, so OpenAI's JSON text is parsed."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidParameterError(
            f'{where} must be {{"id": ..., "type": "function", "function": {{"name": ..., "arguments": "..."}}}}',
            param="messages",
        )
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise InvalidParameterError(
                f"tool call arguments {arguments[:60]!r} are not valid JSON", param="messages"
            ) from None
    return call.get("id"), function["name"], arguments


def _text(content: object) -> str:
    """A message's content as one string (text parts joined by newlines, as the server does)."""
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""
