"""A finished chat answer → Responses output items, usage and the response object.

Output items come in the order thinking, text (or the forced custom tool's call), tool calls; an answer with no
thinking, text or call is one empty message. A call to a chat function is read back through the ToolSet: a
custom tool's arguments `{"input": ...}` become its free-text input. Reasoning tokens are the thinking text's
tokens. The response object echoes the request's settings.

Output cut short (max_output_tokens) makes the response incomplete, and the item that was cut with it: the
text item the model was writing when it stopped, that is its text if it wrote any, else its thinking, else the
one empty message. Tool calls are parsed from whole envelopes only, so a call is never the item cut (and a
custom tool call has no status to mark). The stream (responses_stream) follows the same rule, and builds its
call items, usage and response object with these same functions.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from tokenriver.server.protocol import Usage
from tokenriver.server.responses_plan import ResponsesPlan, new_id
from tokenriver.server.responses_protocol import (
    SKIPPED_TOOLS_KEY,
    IncompleteDetails,
    InputTokensDetails,
    OutputCustomToolCall,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTokensDetails,
    ReasoningText,
    ResponseObject,
    ResponseUsage,
)
from tokenriver.server.responses_tools import ToolSet, ToolTarget


@dataclass(frozen=True)
class ChatToolCall:
    """A tool call of the chat output, as chat completions returns it."""

    call_id: str
    # The chat function name (`namespace.name` for a namespace's function).
    function: str
    # JSON text.
    arguments: str


def call_item(call: ChatToolCall, tools: ToolSet) -> OutputItem:
    """A tool call of the chat output as its Responses item (function_call or custom_tool_call)."""
    target = tools.targets.get(call.function)
    if target is not None and target.kind == "custom":
        return custom_call_item(target, call.call_id, _custom_input(call.arguments))
    name, namespace = (target.name, target.namespace) if target is not None else (call.function, None)
    return OutputFunctionCall(
        id=new_id("fc"),
        status="completed",
        call_id=call.call_id,
        name=name,
        arguments=call.arguments,
        namespace=namespace,
    )


def custom_call_item(target: ToolTarget, call_id: str, text: str) -> OutputCustomToolCall:
    """A custom tool's call item, its free-text input as written."""
    return OutputCustomToolCall(
        id=new_id("ctc"), call_id=call_id, name=target.name, input=text, namespace=target.namespace
    )


def _custom_input(arguments: str) -> str:
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value["input"] if isinstance(value, dict) and isinstance(value.get("input"), str) else arguments


def output_items(
    plan: ResponsesPlan, thinking: str | None, content: str | None, calls: list[ChatToolCall], is_cut: bool
) -> list[OutputItem]:
    """The output items of a finished answer: its thinking, its text (or the forced custom call), its calls.
    When the output was cut short, the item cut is incomplete (the module docstring states which)."""
    cut_status = "incomplete" if is_cut else "completed"
    items: list[OutputItem] = []
    if thinking:
        status = "completed" if content else cut_status
        items.append(OutputReasoning(id=new_id("rs"), content=[ReasoningText(text=thinking)], status=status))
    if plan.forced_custom is not None:
        items.append(custom_call_item(plan.forced_custom, new_id("call"), content or ""))
    elif content or (not calls and not thinking):
        items.append(OutputMessage(id=new_id("msg"), status=cut_status, content=[OutputText(text=content or "")]))
    items.extend(call_item(call, plan.tools) for call in calls)
    return items


def response_usage(usage: Usage | None, thinking: str | None, count_tokens: Callable[[str], int]) -> ResponseUsage:
    """Chat usage in the Responses shape; reasoning tokens are the thinking text's tokens."""
    usage = usage or Usage(prompt_tokens=0, completion_tokens=0, total_tokens=0, prompt_tokens_details={})
    reasoning_tokens = min(count_tokens(thinking), usage.completion_tokens) if thinking else 0
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=usage.prompt_tokens_details.cached_tokens),
        output_tokens=usage.completion_tokens,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
        total_tokens=usage.total_tokens,
    )


def response_object(
    plan: ResponsesPlan, model: str, status: str, output: list[OutputItem], usage: ResponseUsage | None = None
) -> ResponseObject:
    """The response as the client sees it: its request's settings echoed, and its output so far."""
    request = plan.request
    metadata = dict(request.metadata or {})
    if plan.tools.skipped:
        metadata[SKIPPED_TOOLS_KEY] = ",".join(plan.tools.skipped)
    text_format = request.text.format if request.text is not None and request.text.format is not None else None
    return ResponseObject(
        id=plan.response_id,
        created_at=plan.created_at,
        status=status,
        completed_at=int(time.time()) if status in ("completed", "incomplete") else None,
        incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
        instructions=request.instructions,
        max_output_tokens=request.max_output_tokens,
        model=model,
        output=output,
        parallel_tool_calls=request.parallel_tool_calls is not False,
        previous_response_id=request.previous_response_id,
        reasoning=request.reasoning or {"effort": None, "summary": None},
        store=bool(request.store),
        temperature=request.temperature,
        text={"format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format else {"type": "text"}},
        tool_choice=request.tool_choice or "auto",
        tools=request.tools or [],
        top_p=request.top_p,
        usage=usage,
        user=request.user,
        metadata=metadata,
        service_tier=request.service_tier,
        prompt_cache_key=request.prompt_cache_key,
        safety_identifier=request.safety_identifier,
        top_logprobs=request.top_logprobs,
    )
