"""The request's tools and tool_choice → chat function tools, and the way back from a chat function name.

- function tools become chat function tools; a namespace's functions are named `namespace.name` (`chat_name`).
- a custom tool becomes a function taking `{"input": "..."}` (a regex format is the string's pattern), except
  when tool_choice forces it: then the whole output is its input, constrained by its grammar (Lark or regex)
  when it has one, and the prompt tells the model so (`with_tool_prompt`).
- hosted tools (web_search, mcp, …) are skipped, never refused, at top level and inside a namespace alike:
  logged and kept in `ToolSet.skipped`, which the response's metadata lists under SKIPPED_TOOLS_KEY.
- errors name the tool's place in the request (`tools[1].tools[0].name`), as `ToolTarget.path` keeps it; a
  `type` that is not a string is a 400 naming it, before any table is asked about it.

`ToolSet.targets` is in the order of `ToolSet.chat_tools`, so both a chat error about `tools[i]` and a chat call
to a function name lead back to the Responses tool. This module knows nothing of messages, the store or the engine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from tokenriver.errors import InvalidParameterError
from tokenriver.server.responses_input import ChatMessages, chat_name, validated
from tokenriver.server.responses_protocol import (
    TOOL_MODELS,
    CustomTool,
    CustomToolFormat,
    FunctionTool,
    NamespaceTool,
    ToolChoiceCustom,
    ToolChoiceFunction,
)

logger = logging.getLogger("tokenriver.server")


@dataclass(frozen=True)
class ToolTarget:
    """What a chat function name stands for in the Responses request."""

    # "function" or "custom".
    kind: str
    name: str
    namespace: str | None
    # Where the tool sits in the request ("tools[2]", "tools[1].tools[0]"), for error params.
    path: str
    description: str | None = None
    # Custom tools: how their input is constrained (None = free text).
    format: CustomToolFormat | None = None


@dataclass
class ToolSet:
    """The request's tools as chat function tools, and the way back from a chat function name."""

    chat_tools: list[dict[str, Any]] = field(default_factory=list)
    # Chat function name → its tool; in the order of chat_tools.
    targets: dict[str, ToolTarget] = field(default_factory=dict)
    # Types of the hosted tools skipped.
    skipped: list[str] = field(default_factory=list)

    def find(self, kind: str, name: str) -> str | None:
        """The chat name of the tool of this kind that `name` names (its chat name, or its own unique name)."""
        if name in self.targets and self.targets[name].kind == kind:
            return name
        found = [chat for chat, target in self.targets.items() if target.kind == kind and target.name == name]
        return found[0] if len(found) == 1 else None


def build_tools(raw_tools: list[Any] | None) -> ToolSet:
    """Validate the request's tools and translate them; hosted tools are skipped, never refused."""
    tools = ToolSet()
    for index, raw in enumerate(raw_tools or []):
        _add_raw_tool(tools, raw, f"tools[{index}]", None)
    if tools.skipped:
        logger.info("responses: skipped tools this server cannot run: %s", ", ".join(tools.skipped))
    return tools


def _add_raw_tool(tools: ToolSet, raw: object, where: str, namespace: str | None) -> None:
    """One tool as the client wrote it, at `where`; inside the namespace `namespace` when it is not None."""
    if not isinstance(raw, dict):
        raise InvalidParameterError(f"{where} must be a tool (an object with a type)", param=where)
    kind = raw.get("type")
    if not isinstance(kind, str):
        got = "it is missing" if kind is None else f"not {type(kind).__name__}"
        raise InvalidParameterError(
            f"{where}.type must be a string naming the tool's type ({got})", param=f"{where}.type"
        )
    if kind not in TOOL_MODELS:
        tools.skipped.append(kind)
        return
    if kind == "namespace" and namespace is not None:
        raise InvalidParameterError(
            "a namespace holds function, custom and hosted tools, not another namespace", param=f"{where}.type"
        )
    tool = validated(TOOL_MODELS[kind], raw, where)
    if isinstance(tool, NamespaceTool):
        for inner_index, inner in enumerate(tool.tools):
            _add_raw_tool(tools, inner, f"{where}.tools[{inner_index}]", tool.name)
    else:
        _add_tool(tools, tool, where, namespace)


def _add_tool(tools: ToolSet, tool: FunctionTool | CustomTool, where: str, namespace: str | None) -> None:
    name = chat_name(tool.name, namespace)
    if name in tools.targets:
        raise InvalidParameterError(f"two tools are named {name!r}; give each a unique name", param=f"{where}.name")
    if isinstance(tool, FunctionTool):
        target = ToolTarget("function", tool.name, namespace, where, tool.description)
        parameters = tool.parameters
    else:
        _check_custom_format(tool.format, f"{where}.format")
        target = ToolTarget("custom", tool.name, namespace, where, tool.description, tool.format)
        parameters = _custom_parameters(tool.format)
    function = {"name": name, "description": _tool_description(target), "parameters": parameters}
    tools.chat_tools.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
    tools.targets[name] = target


def _check_custom_format(format: CustomToolFormat | None, where: str) -> None:
    if format is None or format.type == "text":
        if format is not None and (format.syntax or format.definition):
            raise InvalidParameterError('a "text" format takes no syntax or definition', param=where)
        return
    if format.syntax is None or not format.definition:
        raise InvalidParameterError(
            'a "grammar" format needs syntax ("lark" or "regex") and a non-empty definition', param=where
        )


def _custom_parameters(format: CustomToolFormat | None) -> dict[str, Any]:
    """A custom tool as a function: one string argument, `input` (its pattern when the tool has a regex)."""
    input_schema: dict[str, Any] = {"type": "string"}
    if format is not None and format.syntax == "regex":
        input_schema["pattern"] = f"^(?:{format.definition})$"
    return {"type": "object", "properties": {"input": input_schema}, "required": ["input"]}


def _tool_description(target: ToolTarget) -> str | None:
    if target.kind == "function":
        return target.description
    text = (target.description or "").strip()
    if target.format is not None and target.format.type == "grammar":
        text += f"\nThe input follows this {target.format.syntax} grammar:\n{target.format.definition}"
    return text.strip() or None


def chat_tool_choice(choice: str | dict[str, Any] | None, tools: ToolSet) -> tuple[Any, ToolTarget | None]:
    """(the chat tool_choice, the custom tool the choice forces or None)."""
    if choice is None or isinstance(choice, str):
        return choice, None
    kind = choice.get("type")
    if kind not in ("function", "custom"):
        raise InvalidParameterError(
            f'tool_choice of type {kind!r} is not supported: use "none", "auto", "required", '
            f'{{"type": "function", "name": ...}} or {{"type": "custom", "name": ...}}',
            param="tool_choice",
        )
    named = validated(ToolChoiceFunction if kind == "function" else ToolChoiceCustom, choice, "tool_choice")
    found = tools.find(kind, named.name)
    if found is None:
        names = ", ".join(target.name for target in tools.targets.values() if target.kind == kind) or "none"
        raise InvalidParameterError(
            f"tool_choice names the {kind} tool {named.name!r}, which is not among the {kind} tools ({names})",
            param="tool_choice",
        )
    if kind == "custom":
        return None, tools.targets[found]
    return {"type": "function", "function": {"name": found}}, None


def with_tool_prompt(chat: ChatMessages, target: ToolTarget) -> ChatMessages:
    """Tell the model that its whole answer is the forced custom tool's input (in the leading system message)."""
    prompt = f"Call the tool `{target.name}`"
    description = _tool_description(target)
    prompt += f" ({description})" if description else ""
    prompt += ". Reply with the tool's input only, with nothing before or after it."
    messages = chat.messages
    if messages and messages[0]["role"] in ("system", "developer"):
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}
        return ChatMessages([first, *messages[1:]], chat.sources)
    return chat.with_first({"role": "system", "content": prompt}, "tool_choice")
