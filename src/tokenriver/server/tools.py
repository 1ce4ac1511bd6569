"""A chat request's tools and messages as the tool-calling core takes them (tokenriver.tool_calls: OpenAI's
shapes as plain dicts). What tools do to the prompt, the grammar and the output is decided there, the same for
the server, LLM.chat and the command line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenriver.server.protocol import ChatCompletionRequest, ChatMessage
from tokenriver.tool_calls import ToolCalling


def request_tools(
    request: ChatCompletionRequest, chat_template: str | None, special_token_id: Callable[[str], int | None]
) -> ToolCalling:
    """The request's tools, tool_choice and parallel_tool_calls (validated by ToolCalling)."""
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools or []]
    choice = request.tool_choice
    return ToolCalling(
        tools,
        choice if isinstance(choice, str) or choice is None else choice.model_dump(),
        request.parallel_tool_calls,
        chat_template,
        special_token_id,
    )


def conversation_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as dicts, content as one string; the thinking a reasoning model returned is not sent back."""
    return [_message(message) for message in messages]


def _message(message: ChatMessage) -> dict[str, Any]:
    entry: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.name is not None:
        entry["name"] = message.name
    if message.tool_call_id is not None:
        entry["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        entry["tool_calls"] = [call.model_dump() for call in message.tool_calls]
    return entry
