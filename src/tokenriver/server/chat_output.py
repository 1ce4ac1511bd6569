"""Generated chat text → the assistant message: thinking, content and tool calls, whole or as stream deltas.

Streaming keeps one `ChatView` per choice: the reasoning and content already sent. Each new output is split
again from its whole text (reasoning.split, ToolCalling.visible_content), and a delta carries what grew, so
streamed pieces concatenate to the non-streamed message. Tool calls are sent once the choice finishes, when
the envelope is complete and parsed.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenriver.outputs import ToolCall
from tokenriver.server import reasoning
from tokenriver.server.protocol import (
    ChatMessageOut,
    DeltaMessage,
    FunctionCallDelta,
    FunctionCallOut,
    ToolCallDelta,
    ToolCallOut,
)
from tokenriver.tool_calls import ToolCalling


@dataclass
class ChatView:
    """What a stream already sent for one choice."""

    num_reasoning_chars: int = 0
    num_content_chars: int = 0


def chat_message(text: str, tool_calling: ToolCalling | None, starts_in_reasoning: bool | None) -> ChatMessageOut:
    """The whole message of a finished choice."""
    thinking, content = _split(text, starts_in_reasoning, is_finished=True)
    calls: list[ToolCall] = []
    if tool_calling is not None:
        content, calls = tool_calling.parse(content)
    return ChatMessageOut(
        content=content,
        tool_calls=[
            ToolCallOut(id=call.id, function=FunctionCallOut(name=call.name, arguments=call.arguments))
            for call in calls
        ]
        or None,
        reasoning_content=thinking,
        reasoning=thinking,
    )


def message_delta(
    view: ChatView, text: str, is_finished: bool, tool_calling: ToolCalling | None, starts_in_reasoning: bool | None
) -> tuple[DeltaMessage, list[ToolCall]]:
    """What is new in a choice's message since `view` (which it advances), and its tool calls once finished."""
    thinking, content = _split(text, starts_in_reasoning, is_finished)
    calls: list[ToolCall] = []
    if tool_calling is not None:
        if is_finished:
            content, calls = tool_calling.parse(content)
            content = content or ""
        else:
            content = tool_calling.visible_content(content)
    new_thinking = (thinking or "")[view.num_reasoning_chars :]
    new_content = content[view.num_content_chars :]
    view.num_reasoning_chars += len(new_thinking)
    view.num_content_chars += len(new_content)
    return DeltaMessage(
        content=new_content if new_content or not new_thinking else None,
        reasoning_content=new_thinking or None,
        reasoning=new_thinking or None,
    ), calls


def tool_call_deltas(calls: list[ToolCall]) -> list[DeltaMessage]:
    """OpenAI's streamed tool calls: per call, a delta with its id and name, then one with its arguments."""
    deltas = []
    for index, call in enumerate(calls):
        deltas.append(
            DeltaMessage(
                tool_calls=[
                    ToolCallDelta(
                        index=index,
                        id=call.id,
                        type="function",
                        function=FunctionCallDelta(name=call.name, arguments=""),
                    )
                ]
            )
        )
        deltas.append(
            DeltaMessage(tool_calls=[ToolCallDelta(index=index, function=FunctionCallDelta(arguments=call.arguments))])
        )
    return deltas


def _split(text: str, starts_in_reasoning: bool | None, is_finished: bool) -> tuple[str | None, str]:
    if starts_in_reasoning is None:
        return None, text
    return reasoning.split(text, starts_in_reasoning, is_finished)
