"""Anthropic's Messages API (POST /v1/messages and /v1/messages/count_tokens) as a translation over chat completions.

A Messages request becomes a ChatCompletionRequest and is rendered, planned, run and split into thinking, text and
tool calls by the code /v1/chat/completions runs (OpenAIServing, tool_calls, chat_output): the model, engine,
prefix cache, sampler and tool grammars are shared, and a conversation generates the same tokens through either
API. This module owns the translation both ways and nothing else:

- request: blocks → chat messages (tool_use → tool_calls, tool_result → tool messages, thinking → reasoning the
  template may drop); server tools skipped; tool_choice any / tool → required / named; thinking → the template's
  `enable_thinking`; output_config.format → a JSON-schema constraint. The attribution header Claude Code puts at
  the top of its system prompt changes on every request (`cch=`), so it is removed before templating, as other
  servers with a prefix cache do: a session's long prompt then stays cached. max_tokens is an upper bound, as
  llama.cpp reads it: generation also stops where the context is full, with stop_reason "max_tokens".
- response: thinking, text and tool_use blocks in that order (one empty text block when there is nothing else);
  stop reasons; usage in Anthropic's terms (input_tokens excludes the tokens read from the prefix cache).
- stream: the same blocks as events, built from the same split of the text (chat_output.message_delta), so a
  streamed message accumulates to the non-streamed one. The first engine output is awaited before the response
  starts, so an error on admission is still an HTTP status; a later error is an `error` event.

Errors name Anthropic's fields: the shared code's OpenAI names are renamed (`_renamed_errors`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import aclosing, contextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from tokenriver.errors import ContextLengthError, InvalidParameterError
from tokenriver.outputs import CompletionOutput, FinishReason, RequestOutput
from tokenriver.server.chat_output import ChatView, chat_message, message_delta
from tokenriver.server.messages_protocol import (
    IGNORED_FIELDS,
    AnthropicErrorResponse,
    ContentBlock,
    ContentBlockDeltaEvent,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    CountTokensRequest,
    CountTokensResponse,
    InputJsonDelta,
    InputMessage,
    MessageDeltaEvent,
    MessagesRequest,
    MessagesResponse,
    MessageStartEvent,
    MessageStopEvent,
    MessagesUsage,
    OutputBlock,
    PingEvent,
    SignatureDelta,
    StopInfo,
    StreamEvent,
    TextBlock,
    TextDelta,
    TextOut,
    ThinkingDelta,
    ThinkingOut,
    Tool,
    ToolChoice,
    ToolUseOut,
)
from tokenriver.server.protocol import ChatCompletionRequest, json_object
from tokenriver.server.serving import GenerationPlan, OpenAIServing, PromptInput
from tokenriver.server.tools import request_tools
from tokenriver.tool_calls import ToolCalling

logger = logging.getLogger("tokenriver.server")

M = TypeVar("M", bound=BaseModel)
# Claude Code's first system line, such as
#   x-anthropic-billing-header: cc_version=2.1.3.abc; cc_entrypoint=cli; cch=1a2b3;
# where cch is a hash of the request, so it differs every time.
_ATTRIBUTION_HEADER = re.compile(r"^x-anthropic-billing-header:[^\n]*(?:\n|$)", re.MULTILINE)
_TOOL_PARAM = re.compile(r"tools\[(\d+)\](.*)")
# The shared code's field names → the Messages API's.
_RENAMED_PARAMS = {
    "stop": "stop_sequences",
    "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
    "chat_template_kwargs": "thinking",
    "response_format": "output_config.format",
    "response_format.json_schema": "output_config.format",
}
_RENAMED_TOOL_FIELDS = {".function.parameters": ".input_schema", ".function.name": ".name", ".function": ""}


def add_messages_routes(
    app: FastAPI,
    serving: OpenAIServing,
    check_model: Callable[[str | None], None],
    until_disconnected: Callable[[Request, Awaitable[Any]], Awaitable[Any]],
    error_payload: Callable[[BaseException, str], tuple[int, AnthropicErrorResponse]],
    client_closed_status: int,
) -> None:
    """Register the Messages routes. The app lends what it owns: the model check (404), the wait that cancels
    work when the client leaves, and its error table in Anthropic's shape (for errors inside a stream)."""

    @app.post("/v1/messages")
    async def create_message(request: Request) -> Response:
        parsed = parse_body(MessagesRequest, await request.body())
        check_model(parsed.model)
        plan = plan_messages(serving, parsed)
        if plan.is_stream:
            events = await until_disconnected(request, open_events(serving, plan))
            if events is None:
                return Response(status_code=client_closed_status)
            return _sse(events, request.state.request_id, error_payload)
        finals = await until_disconnected(request, serving.final_outputs(plan))
        if finals is None:
            return Response(status_code=client_closed_status)
        return JSONResponse(message_response(plan, serving.model_name, finals[0]).model_dump(mode="json"))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict[str, Any]:
        parsed = parse_body(CountTokensRequest, await request.body())
        check_model(parsed.model)
        prompt = render_messages(serving, parsed).prompt
        return CountTokensResponse(input_tokens=len(prompt.token_ids)).model_dump(mode="json")


# ----- request → chat --------------------------------------------------------------------------------


def parse_body(model: type[M], body: bytes) -> M:
    """Bytes of a JSON body → a validated request; unknown fields are refused naming them and this API's
    ignored fields."""
    data = json_object(body)
    try:
        return model.model_validate(data)
    except ValidationError as error:
        unknown = [_path(e["loc"]) for e in error.errors() if e["type"] == "extra_forbidden"]
        if not unknown:
            raise
        raise _unknown_fields(unknown) from None


def _unknown_fields(names: list[str]) -> InvalidParameterError:
    return InvalidParameterError(
        f"unknown field(s) {', '.join(repr(name) for name in names)}: tokenriver does not implement them, and "
        f"ignoring them could change the result unnoticed; remove them (fields accepted and ignored: "
        f"{', '.join(IGNORED_FIELDS)})",
        param=names[0],
    )


def _path(loc: tuple[Any, ...]) -> str:
    """("messages", 0, "content") → "messages[0].content"."""
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")


def chat_request(request: CountTokensRequest) -> tuple[ChatCompletionRequest, list[int]]:
    """The chat request a Messages request stands for, and per chat tool its index in request.tools (server
    tools are left out)."""
    tools, tool_indices = _chat_tools(request.tools or [])
    body: dict[str, Any] = {
        "messages": _system_messages(request.system or []) + _conversation(request.messages),
        "tools": tools or None,
        **_chat_tool_choice(request.tool_choice, bool(tools)),
        "chat_template_kwargs": _template_kwargs(request.thinking.type if request.thinking else None),
    }
    if request.output_config is not None and request.output_config.format is not None:
        schema = request.output_config.format.schema_
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    if isinstance(request, MessagesRequest):
        body.update(
            stream=request.stream,
            stop=request.stop_sequences or None,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
        )
    return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None}), tool_indices


def strip_attribution_header(text: str) -> str:
    """A system text without Claude Code's attribution header line (its `cch=` changes on every request)."""
    return _ATTRIBUTION_HEADER.sub("", text)


def _system_messages(system: list[TextBlock]) -> list[dict[str, Any]]:
    texts = [text for block in system if (text := strip_attribution_header(block.text)).strip()]
    return [{"role": "system", "content": _parts(texts)}] if texts else []


def _parts(texts: list[str]) -> list[dict[str, str]]:
    """Text parts, which the chat path joins with newlines."""
    return [{"type": "text", "text": text} for text in texts]


def _conversation(messages: list[InputMessage]) -> list[dict[str, Any]]:
    if messages[-1].role == "assistant":
        raise InvalidParameterError(
            "the last message is from the assistant (a prefill to continue), which this server does not "
            "support; end with a user message",
            param=f"messages[{len(messages) - 1}]",
        )
    entries: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if message.role == "assistant":
            entries.append(_assistant_message(message.content, where))
        else:
            entries.extend(_user_messages(message.role, message.content, where))
    return entries


def _user_messages(role: str, blocks: list[ContentBlock], where: str) -> list[dict[str, Any]]:
    """A user turn: its tool results as tool messages and its text as a message, in block order. A system turn
    (Claude Code sends them mid-conversation) holds text only."""
    entries: list[dict[str, Any]] = []
    texts: list[str] = []
    for index, block in enumerate(blocks):
        if block.type == "text":
            texts.append(block.text or "")
        elif block.type == "tool_result" and role == "user":
            if texts:
                entries.append({"role": role, "content": _parts(texts)})
                texts = []
            entries.append(
                {"role": "tool", "tool_call_id": block.tool_use_id, "content": _tool_result_text(block, where, index)}
            )
        else:
            raise InvalidParameterError(
                f"a {role} message cannot hold a {block.type} block"
                + (" (tool_use and thinking blocks belong to assistant messages)" if role == "user" else ""),
                param=f"{where}.content[{index}]",
            )
    if texts or not entries:
        entries.append({"role": role, "content": _parts(texts) if texts else ""})
    return entries


def _tool_result_text(block: ContentBlock, where: str, index: int) -> str:
    texts = []
    for inner, part in enumerate(block.content or []):
        if part.type != "text":
            raise InvalidParameterError(
                f"a tool result holds text blocks, not {part.type}", param=f"{where}.content[{index}].content[{inner}]"
            )
        texts.append(part.text or "")
    text = "\n".join(texts)
    # The chat format has no error flag: the model reads it in the text.
    return f"Error: {text}" if block.is_error else text


def _assistant_message(blocks: list[ContentBlock], where: str) -> dict[str, Any]:
    """An assistant turn: text, tool calls, and thinking (which templates drop from earlier turns)."""
    texts, thoughts, calls = [], [], []
    for index, block in enumerate(blocks):
        if block.type == "text":
            texts.append(block.text or "")
        elif block.type == "thinking":
            thoughts.append(block.thinking or "")
        elif block.type == "tool_use":
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append({"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}})
        elif block.type != "redacted_thinking":
            raise InvalidParameterError(
                f"an assistant message cannot hold a {block.type} block (tool results belong to user messages)",
                param=f"{where}.content[{index}]",
            )
    entry: dict[str, Any] = {"role": "assistant", "content": _parts(texts) if texts else None}
    if calls:
        entry["tool_calls"] = calls
    if thoughts:
        entry["reasoning_content"] = "\n".join(thoughts)
    return entry


def _chat_tools(tools: list[Tool]) -> tuple[list[dict[str, Any]], list[int]]:
    """The tools as chat tool definitions, and each one's index in the request; server tools are skipped (this
    server cannot run them), with a log line."""
    chat_tools, indices, skipped = [], [], []
    for index, tool in enumerate(tools):
        if tool.is_server_tool:
            skipped.append(f"{tool.name} ({tool.type})")
            continue
        if tool.model_extra:
            raise _unknown_fields([f"tools[{index}].{name}" for name in tool.model_extra])
        if tool.input_schema is None:
            raise InvalidParameterError("every tool needs an input_schema", param=f"tools[{index}].input_schema")
        if tool.input_schema.get("type") != "object":
            raise InvalidParameterError(
                'input_schema must be a JSON schema of type "object" (a tool takes named inputs)',
                param=f"tools[{index}].input_schema",
            )
        function = {"name": tool.name, "description": tool.description, "parameters": tool.input_schema}
        chat_tools.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
        indices.append(index)
    if skipped:
        logger.info("skipping server tools this server cannot run: %s", ", ".join(skipped))
    return chat_tools, indices


def _chat_tool_choice(choice: ToolChoice | None, has_tools: bool) -> dict[str, Any]:
    """tool_choice and parallel_tool_calls: auto / none as they are, any → required, tool → the named function;
    disable_parallel_tool_use is parallel_tool_calls turned round."""
    if choice is None:
        return {}
    if not has_tools and choice.type in ("auto", "none"):
        return {}  # only server tools were sent: nothing to choose from
    fields: dict[str, Any] = {"tool_choice": "required" if choice.type == "any" else choice.type}
    if choice.type == "tool":
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    if choice.disable_parallel_tool_use is not None:
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return fields


def _template_kwargs(thinking: str | None) -> dict[str, Any] | None:
    """enabled / disabled → the template's enable_thinking (Qwen3's switch); adaptive or absent → its default."""
    if thinking in ("enabled", "disabled"):
        return {"enable_thinking": thinking == "enabled"}
    return None


@contextmanager
def _renamed_errors(tool_indices: list[int]) -> Iterator[None]:
    """Errors of the shared chat code, renamed to the Messages fields the client sent."""
    try:
        yield
    except ContextLengthError:
        raise
    except InvalidParameterError as error:
        param = _anthropic_param(error.param, tool_indices)
        if param == error.param:
            raise
        message = error.message
        if error.param and message.startswith(error.param):
            message = param + message[len(error.param) :]
        raise InvalidParameterError(message, param=param) from None


def _anthropic_param(param: str | None, tool_indices: list[int]) -> str | None:
    if param is None:
        return None
    if param in _RENAMED_PARAMS:
        return _RENAMED_PARAMS[param]
    match = _TOOL_PARAM.fullmatch(param)
    if match is None or int(match.group(1)) >= len(tool_indices):
        return param
    rest = match.group(2)
    for old, new in _RENAMED_TOOL_FIELDS.items():
        if rest.startswith(old):
            rest = new + rest[len(old) :]
            break
    return f"tools[{tool_indices[int(match.group(1))]}]{rest}"


@dataclasses.dataclass
class RenderedMessages:
    """A Messages request as the chat path runs it."""

    chat: ChatCompletionRequest
    tool_calling: ToolCalling
    prompt: PromptInput
    # Per chat tool, its index in the request's tools (for error names).
    tool_indices: list[int]


def render_messages(serving: OpenAIServing, request: CountTokensRequest) -> RenderedMessages:
    """The chat request, its tools and the rendered prompt: what count_tokens counts and messages runs."""
    chat, tool_indices = chat_request(request)
    with _renamed_errors(tool_indices):
        tool_calling = request_tools(chat, serving.tokenizer.chat_template, serving.engine.special_token_id)
        prompt = serving.render_chat(chat.messages, True, chat.chat_template_kwargs, tool_calling)
    return RenderedMessages(chat, tool_calling, prompt, tool_indices)


def plan_messages(serving: OpenAIServing, request: MessagesRequest) -> GenerationPlan:
    """The request planned as chat, with max_tokens bounded by the room the prompt leaves."""
    rendered = render_messages(serving, request)
    with _renamed_errors(rendered.tool_indices):
        max_tokens = serving.max_tokens_within_context(rendered.prompt, request.max_tokens, "messages")
        plan = serving.plan_rendered_chat(
            rendered.chat,
            rendered.prompt,
            rendered.tool_calling,
            max_tokens,
            "max_tokens",
            constraint_name="output_config.format",
        )
    return dataclasses.replace(plan, response_id=f"msg_{uuid.uuid4().hex}")


# ----- engine → Anthropic's shape ------------------------------------------------------------------------


def message_response(plan: GenerationPlan, model_name: str, output: RequestOutput) -> MessagesResponse:
    """The whole message of a finished request."""
    candidate = output.outputs[0]
    message = chat_message(candidate.text, plan.tool_calling, plan.starts_in_reasoning)
    blocks: list[OutputBlock] = []
    if message.reasoning_content:
        blocks.append(ThinkingOut(thinking=message.reasoning_content))
    if message.content:
        blocks.append(TextOut(text=message.content))
    calls = message.tool_calls or []
    blocks += [_tool_use(call.function.name, call.function.arguments) for call in calls]
    stop_reason, stop_sequence = _stop(candidate, bool(calls))
    return MessagesResponse(
        id=plan.response_id,
        model=model_name,
        content=blocks or [TextOut(text="")],
        stop_reason=stop_reason,
        stop_sequence=stop_sequence,
        usage=_usage(output),
    )


def _tool_use(name: str, arguments: str) -> ToolUseOut:
    """A call as a tool_use block: Anthropic's id, the input as an object (the grammar wrote it to the tool's
    object schema)."""
    return ToolUseOut(id=f"toolu_{uuid.uuid4().hex[:24]}", name=name, input=json.loads(arguments))


def _stop(candidate: CompletionOutput, has_calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): a stop string that matched is a stop_sequence; EOS or a stop token id ends
    the turn; the length limit (max_tokens or a full context) is max_tokens."""
    if has_calls:
        return "tool_use", None
    if candidate.finish_reason == FinishReason.LENGTH:
        return "max_tokens", None
    if isinstance(candidate.stop_reason, str):
        return "stop_sequence", candidate.stop_reason
    return "end_turn", None


def _usage(output: RequestOutput, num_output_tokens: int | None = None) -> MessagesUsage:
    num_cached = output.metrics.num_cached_tokens
    return MessagesUsage(
        input_tokens=len(output.prompt_token_ids) - num_cached,
        cache_read_input_tokens=num_cached,
        output_tokens=len(output.outputs[0].token_ids) if num_output_tokens is None else num_output_tokens,
    )


async def open_events(serving: OpenAIServing, plan: GenerationPlan) -> AsyncIterator[StreamEvent]:
    """Start a streaming request and wait for its first output, so an error on admission is still an HTTP
    status; returns the event stream (closing it aborts the request)."""
    outputs = serving.outputs(plan)
    try:
        _, first = await anext(outputs)
    except BaseException:
        await outputs.aclose()
        raise
    return _events(plan, serving.model_name, first, outputs)


async def _events(
    plan: GenerationPlan, model_name: str, first: RequestOutput, rest: AsyncIterator[tuple[int, RequestOutput]]
) -> AsyncIterator[StreamEvent]:
    async with aclosing(rest):
        start = MessagesResponse(
            id=plan.response_id,
            model=model_name,
            content=[],
            stop_reason=None,
            stop_sequence=None,
            usage=_usage(first, num_output_tokens=0),
        )
        yield MessageStartEvent(message=start)
        yield PingEvent()
        writer = EventWriter(plan)
        for event in writer.on_output(first):
            yield event
        async for _, output in rest:
            for event in writer.on_output(output):
                yield event


class EventWriter:
    """The events of one streamed message, from its engine outputs: blocks open in the order thinking, text,
    tool_use, one at a time; what each output adds is found by splitting its whole text again (message_delta)."""

    def __init__(self, plan: GenerationPlan) -> None:
        self.plan = plan
        self.view = ChatView()
        self.num_blocks = 0
        # The type of the block now open ("thinking" or "text"), None between blocks.
        self.open_kind: str | None = None

    def on_output(self, output: RequestOutput) -> list[StreamEvent]:
        candidate = output.outputs[0]
        is_finished = candidate.finish_reason is not None
        delta, calls = message_delta(
            self.view, candidate.text, is_finished, self.plan.tool_calling, self.plan.starts_in_reasoning
        )
        events: list[StreamEvent] = []
        if delta.reasoning_content:
            events += self._piece("thinking", delta.reasoning_content)
        if delta.content:
            events += self._piece("text", delta.content)
        if not is_finished:
            return events
        for call in calls:
            events += self._tool_use(call.name, call.arguments)
        if self.num_blocks == 0 and self.open_kind is None:
            events += self._open("text")
        events += self._close()
        stop_reason, stop_sequence = _stop(candidate, bool(calls))
        events.append(
            MessageDeltaEvent(
                delta=StopInfo(stop_reason=stop_reason, stop_sequence=stop_sequence), usage=_usage(output)
            )
        )
        events.append(MessageStopEvent())
        return events

    def _piece(self, kind: str, text: str) -> list[StreamEvent]:
        events = [] if self.open_kind == kind else self._close() + self._open(kind)
        delta = ThinkingDelta(thinking=text) if kind == "thinking" else TextDelta(text=text)
        return [*events, ContentBlockDeltaEvent(index=self.num_blocks, delta=delta)]

    def _open(self, kind: str) -> list[StreamEvent]:
        self.open_kind = kind
        block = ThinkingOut(thinking="") if kind == "thinking" else TextOut(text="")
        return [ContentBlockStartEvent(index=self.num_blocks, content_block=block)]

    def _close(self) -> list[StreamEvent]:
        if self.open_kind is None:
            return []
        events: list[StreamEvent] = []
        if self.open_kind == "thinking":
            events.append(ContentBlockDeltaEvent(index=self.num_blocks, delta=SignatureDelta(signature="")))
        events.append(ContentBlockStopEvent(index=self.num_blocks))
        self.open_kind = None
        self.num_blocks += 1
        return events

    def _tool_use(self, name: str, arguments: str) -> list[StreamEvent]:
        """A call as three events: the block with an empty input, the input's JSON text, the stop."""
        events = self._close()
        block = _tool_use(name, arguments)
        index = self.num_blocks
        self.num_blocks += 1
        return [
            *events,
            ContentBlockStartEvent(index=index, content_block=block.model_copy(update={"input": {}})),
            ContentBlockDeltaEvent(index=index, delta=InputJsonDelta(partial_json=arguments)),
            ContentBlockStopEvent(index=index),
        ]


def _sse(
    events: AsyncIterator[StreamEvent],
    request_id: str,
    error_payload: Callable[[BaseException, str], tuple[int, AnthropicErrorResponse]],
) -> StreamingResponse:
    """Server-sent events with Anthropic's framing (`event: <type>` then `data: <json>`); an error once the
    stream has started is an `error` event."""

    async def frames() -> AsyncIterator[str]:
        try:
            async with aclosing(events):
                async for event in events:
                    yield _frame(event)
        except Exception as error:
            _, body = error_payload(error, request_id)
            yield _frame(body)

    return StreamingResponse(
        frames(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


def _frame(event: StreamEvent) -> str:
    """One event. JSON with every non-ASCII character escaped: line readers built on str.splitlines would cut
    an event at U+2028 and its kin, which JSON otherwise leaves raw."""
    data = json.dumps(event.model_dump(mode="json"), separators=(",", ":"))
    return f"event: {event.type}\ndata: {data}\n\n"
