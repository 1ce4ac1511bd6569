"""Chat chunks → the Responses event sequence of one response, and each event as a server-sent event.

- every event carries the next sequence_number, from 0.
- the sequence starts with response.created and response.in_progress, and ends with response.completed,
  response.incomplete (output cut short) or response.failed.
- an item's id (and a call's call_id) is chosen once, when the item is added; its deltas,
  `response.output_item.done` and the final response repeat it.
- text items (reasoning, message, or the forced custom tool's input) stream as they grow and close when the next
  item starts; tool calls are sent whole once the output finishes (as chat completions sends them), so an item's
  deltas concatenate to its done text.
- output cut short: the text item still open when the output ends is the item cut, and closes incomplete; this is
  the rule `output_items` states, so the final response equals the non-streamed one.

This module knows nothing of HTTP, the store or the engine: responses.py feeds it chunks and sends its events.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from tokenriver.server.protocol import ChatCompletionChunk, Usage
from tokenriver.server.responses_output import (
    ChatToolCall,
    call_item,
    custom_call_item,
    response_object,
    response_usage,
)
from tokenriver.server.responses_plan import ResponsesPlan, new_id
from tokenriver.server.responses_protocol import (
    CallDeltaEvent,
    CallDoneEvent,
    ContentPartEvent,
    LifecycleEvent,
    OutputCustomToolCall,
    OutputFunctionCall,
    OutputItem,
    OutputItemEvent,
    OutputMessage,
    OutputReasoning,
    OutputText,
    ReasoningText,
    ResponseError,
    ResponseObject,
    ResponseUsage,
    StreamEvent,
    TextDeltaEvent,
    TextDoneEvent,
)

# Characters that SSE leaves inside a line but that line readers built on str.splitlines take for line breaks;
# JSON does not escape them, so a token holding one would cut an event in two.
_LINE_BREAKS_FOR_SPLITLINES = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


@dataclass
class _OpenItem:
    """The text item being streamed: "reasoning", "message" or "custom" (the forced custom tool's input)."""

    kind: str
    item: OutputItem
    output_index: int
    text: str = ""


class ResponseEvents:
    """Chat chunks → Responses events, for one response (the module docstring states the invariants)."""

    def __init__(self, plan: ResponsesPlan, model: str, count_tokens: Callable[[str], int]) -> None:
        self.plan = plan
        self.model = model
        self.count_tokens = count_tokens
        self.num_events = 0
        # Finished items, in output order; the open text item comes after them.
        self.items: list[OutputItem] = []
        self.open: _OpenItem | None = None
        # Tool calls of the chat output by their index, as their pieces add up.
        self.calls: dict[int, ChatToolCall] = {}
        self.thinking = ""
        self.usage: Usage | None = None
        self.is_cut = False
        self.response: ResponseObject | None = None

    def _next(self) -> int:
        self.num_events += 1
        return self.num_events - 1

    def start(self) -> list[StreamEvent]:
        """response.created and response.in_progress: the response with no output yet."""
        return [
            self._lifecycle("response.created", "in_progress"),
            self._lifecycle("response.in_progress", "in_progress"),
        ]

    def on_chunk(self, chunk: ChatCompletionChunk) -> list[StreamEvent]:
        """The events of one chat chunk: thinking and text stream at once; tool calls wait for finish()."""
        self.usage = chunk.usage or self.usage
        events: list[StreamEvent] = []
        for choice in chunk.choices:
            delta = choice.delta
            if delta.reasoning_content:
                self.thinking += delta.reasoning_content
                events += self._text("reasoning", delta.reasoning_content)
            if delta.content:
                events += self._text("message" if self.plan.forced_custom is None else "custom", delta.content)
            for call in delta.tool_calls or []:
                known = self.calls.get(call.index, ChatToolCall("", "", ""))
                self.calls[call.index] = replace(
                    known,
                    call_id=call.id or known.call_id,
                    function=call.function.name or known.function,
                    arguments=known.arguments + (call.function.arguments or ""),
                )
            self.is_cut = self.is_cut or choice.finish_reason == "length"
        return events

    def finish(self) -> list[StreamEvent]:
        """Close the open item, send the tool calls, and end with response.completed or response.incomplete."""
        events = self._close("incomplete" if self.is_cut else "completed") if self.open is not None else []
        for call in self.calls.values():
            events += self._call(call_item(call, self.plan.tools))
        forced = self.plan.forced_custom
        if forced is not None and not any(isinstance(item, OutputCustomToolCall) for item in self.items):
            events += self._text("custom", "") + self._close("incomplete" if self.is_cut else "completed")
        elif not self.items:
            events += self._text("message", "") + self._close("incomplete" if self.is_cut else "completed")
        usage = response_usage(self.usage, self.thinking, self.count_tokens)
        status = "incomplete" if self.is_cut else "completed"
        events.append(self._lifecycle(f"response.{status}", status, usage))
        return events

    def failed(self, message: str) -> LifecycleEvent:
        """response.failed, with the items finished so far (an open item is dropped, being unfinished)."""
        event = self._lifecycle("response.failed", "failed")
        event.response.error = ResponseError(code="server_error", message=message)
        return event

    def _lifecycle(self, kind: str, status: str, usage: ResponseUsage | None = None) -> LifecycleEvent:
        output = list(self.items) if status != "in_progress" else []
        self.response = response_object(self.plan, self.model, status, output, usage)
        return LifecycleEvent(type=kind, sequence_number=self._next(), response=self.response)

    def _text(self, kind: str, delta: str) -> list[StreamEvent]:
        events = self._close("completed") if self.open is not None and self.open.kind != kind else []
        if self.open is None:
            events += self._open(kind)
        opened = self.open
        opened.text += delta
        if not delta:
            return events
        item_id, index = opened.item.id, opened.output_index
        if kind == "custom":
            name = "response.custom_tool_call_input.delta"
            return [
                *events,
                CallDeltaEvent(
                    type=name, sequence_number=self._next(), item_id=item_id, output_index=index, delta=delta
                ),
            ]
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        logprobs = [] if kind == "message" else None
        event = TextDeltaEvent(
            type=name,
            sequence_number=self._next(),
            item_id=item_id,
            output_index=index,
            content_index=0,
            delta=delta,
            logprobs=logprobs,
        )
        return [*events, event]

    def _open(self, kind: str) -> list[StreamEvent]:
        index = len(self.items)
        if kind == "custom":
            item: OutputItem = custom_call_item(self.plan.forced_custom, new_id("call"), "")
        elif kind == "reasoning":
            item = OutputReasoning(id=new_id("rs"), content=[], status="in_progress")
        else:
            item = OutputMessage(id=new_id("msg"), status="in_progress", content=[])
        self.open = _OpenItem(kind, item, index)
        events: list[StreamEvent] = [self._item_event("response.output_item.added", index, item)]
        if kind != "custom":
            part = ReasoningText(text="") if kind == "reasoning" else OutputText(text="")
            events.append(self._part_event("response.content_part.added", item.id, index, part))
        return events

    def _close(self, status: str) -> list[StreamEvent]:
        opened, self.open = self.open, None
        item_id, index, text = opened.item.id, opened.output_index, opened.text
        events: list[StreamEvent] = []
        if opened.kind == "custom":
            final = opened.item.model_copy(update={"input": text})
            name = "response.custom_tool_call_input.done"
            events.append(
                CallDoneEvent(type=name, sequence_number=self._next(), item_id=item_id, output_index=index, input=text)
            )
        else:
            part = ReasoningText(text=text) if opened.kind == "reasoning" else OutputText(text=text)
            name = "response.reasoning_text.done" if opened.kind == "reasoning" else "response.output_text.done"
            logprobs = [] if opened.kind == "message" else None
            events.append(
                TextDoneEvent(
                    type=name,
                    sequence_number=self._next(),
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    text=text,
                    logprobs=logprobs,
                )
            )
            events.append(self._part_event("response.content_part.done", item_id, index, part))
            final = opened.item.model_copy(update={"content": [part], "status": status})
        self.items.append(final)
        events.append(self._item_event("response.output_item.done", index, final))
        return events

    def _call(self, item: OutputItem) -> list[StreamEvent]:
        """A whole tool call: added (with empty arguments or input), one delta, done, item done."""
        index = len(self.items)
        self.items.append(item)
        is_function = isinstance(item, OutputFunctionCall)
        text = item.arguments if is_function else item.input
        empty = item.model_copy(update={"arguments": "", "status": "in_progress"} if is_function else {"input": ""})
        kind = "function_call_arguments" if is_function else "custom_tool_call_input"
        done = {"arguments": text} if is_function else {"input": text}
        return [
            self._item_event("response.output_item.added", index, empty),
            CallDeltaEvent(
                type=f"response.{kind}.delta",
                sequence_number=self._next(),
                item_id=item.id,
                output_index=index,
                delta=text,
            ),
            CallDoneEvent(
                type=f"response.{kind}.done", sequence_number=self._next(), item_id=item.id, output_index=index, **done
            ),
            self._item_event("response.output_item.done", index, item),
        ]

    def _item_event(self, kind: str, index: int, item: OutputItem) -> OutputItemEvent:
        return OutputItemEvent(type=kind, sequence_number=self._next(), output_index=index, item=item)

    def _part_event(self, kind: str, item_id: str, index: int, part: OutputText | ReasoningText) -> ContentPartEvent:
        return ContentPartEvent(
            type=kind, sequence_number=self._next(), item_id=item_id, output_index=index, content_index=0, part=part
        )


def sse_event(event: StreamEvent) -> str:
    """One server-sent event: `event: <type>` and `data: <json>` (line breaks str.splitlines sees escaped)."""
    return f"event: {event.type}\ndata: {event.model_dump_json().translate(_LINE_BREAKS_FOR_SPLITLINES)}\n\n"
