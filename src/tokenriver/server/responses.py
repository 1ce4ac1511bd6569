"""The OpenAI Responses API (POST /v1/responses, GET /v1/responses/{id}), translated onto chat completions.

A request becomes a `ChatCompletionRequest` and is planned by `OpenAIServing.plan_chat`, so the chat template,
tool grammars, structured output, prefix cache, scheduler and sampler are the ones /v1/chat/completions uses;
the finished chat message, or the stream of chat chunks, is read back into Responses output items. The
translation is split by job:

- responses_input: the request body and its input items, validated; input items → chat messages.
- responses_tools: tools and tool_choice → chat tools, and the way back from a chat function name.
- responses_plan: one request checked, translated and planned as a chat request.
- responses_output: a finished chat answer → output items, usage and the response object.
- responses_stream: chat chunks → the Responses events.
- responses_store: the stored responses, for previous_response_id and GET.

This module runs a plan, whole or streamed, stores the responses that ask for it, and registers the routes. None
of these modules knows the engine: OpenAIServing runs the chat request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenriver.outputs import RequestOutput
from tokenriver.server.protocol import ErrorInfo, ErrorResponse
from tokenriver.server.responses_input import parse_responses_request
from tokenriver.server.responses_output import ChatToolCall, output_items, response_object, response_usage
from tokenriver.server.responses_plan import ResponsesPlan, plan_response
from tokenriver.server.responses_protocol import ResponseObject
from tokenriver.server.responses_store import ResponseStore, StoredResponse, StoredResponseNotFoundError
from tokenriver.server.responses_stream import ResponseEvents, sse_event
from tokenriver.server.serving import OpenAIServing


def add_responses_routes(
    app: FastAPI,
    serving: OpenAIServing,
    check_model: Callable[[str | None], None],
    until_disconnected: Callable[[Request, Awaitable[Any]], Awaitable[Any]],
    error_payload: Callable[[BaseException, str], tuple[int, ErrorResponse]],
    client_closed_status: int,
    store_size: int,
) -> None:
    """Register POST /v1/responses and GET /v1/responses/{id}, with a store of `store_size` responses. The app
    lends what it owns: the model check (404), the wait that cancels work when the client leaves, and its error
    table (for an error inside a stream)."""
    store = ResponseStore(store_size)

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        parsed = parse_responses_request(await request.body())
        check_model(parsed.model)
        try:
            plan = plan_response(serving, parsed, store)
        except StoredResponseNotFoundError as error:
            return _not_found(error)
        if parsed.stream:
            chunks = await until_disconnected(request, serving.open_stream(plan.chat, "chat"))
            if chunks is None:
                return Response(status_code=client_closed_status)
            events = ResponseEvents(plan, serving.model_name, _token_counter(serving))
            stream = _event_stream(events, chunks, store, lambda error: error_payload(error, request.state.request_id))
            return StreamingResponse(
                stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            )
        finals = await until_disconnected(request, serving.final_outputs(plan.chat))
        if finals is None:
            return Response(status_code=client_closed_status)
        response = finished_response(plan, serving, finals)
        if parsed.store:
            store.put(StoredResponse(response, plan.conversation))
        return JSONResponse(response.model_dump(mode="json"))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> Response:
        stored = store.get(response_id)
        if stored is None:
            return _not_found(
                StoredResponseNotFoundError(store.not_found_message(response_id), "response_id", "not_found")
            )
        return JSONResponse(stored.response.model_dump(mode="json"))


def finished_response(plan: ResponsesPlan, serving: OpenAIServing, finals: list[RequestOutput]) -> ResponseObject:
    """A non-streamed response: the chat response of the engine's outputs, read back into output items."""
    chat = serving.chat_response(plan.chat, finals)
    (choice,) = chat.choices
    message = choice.message
    calls = [ChatToolCall(call.id, call.function.name, call.function.arguments) for call in message.tool_calls or []]
    is_cut = choice.finish_reason == "length"
    items = output_items(plan, message.reasoning_content, message.content, calls, is_cut)
    usage = response_usage(chat.usage, message.reasoning_content, _token_counter(serving))
    return response_object(plan, serving.model_name, "incomplete" if is_cut else "completed", items, usage)


async def _event_stream(
    events: ResponseEvents,
    chunks: AsyncIterator[Any],
    store: ResponseStore,
    error_payload: Callable[[BaseException], tuple[int, ErrorResponse]],
) -> AsyncIterator[str]:
    """The events of one response; closing it (the client left) closes the chunks, which aborts the request.
    An error after the start ends the stream with response.failed."""
    try:
        async with aclosing(chunks):
            for event in events.start():
                yield sse_event(event)
            async for chunk in chunks:
                for event in events.on_chunk(chunk):
                    yield sse_event(event)
        for event in events.finish():
            yield sse_event(event)
    except Exception as error:
        _, body = error_payload(error)
        yield sse_event(events.failed(body.error.message))
        return
    if events.plan.request.store and events.response is not None:
        store.put(StoredResponse(events.response, events.plan.conversation))


def _token_counter(serving: OpenAIServing) -> Callable[[str], int]:
    return lambda text: len(serving.tokenizer.encode(text, add_special_tokens=False))


def _not_found(error: StoredResponseNotFoundError) -> JSONResponse:
    info = ErrorInfo(message=error.message, type="invalid_request_error", param=error.param, code=error.code)
    body = ErrorResponse(error=info)
    return JSONResponse(body.model_dump(mode="json"), status_code=404)
