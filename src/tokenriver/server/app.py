"""The FastAPI app: routes, the per-request middleware, and the one table that maps errors to status and meaning.

`build_app(engine, config)` wires an already-running AsyncEngine to HTTP; it
starts nothing and binds nothing (serve.py does), so tests can drive it in
process. Every error a client can see goes through `error_payload`:

    InvalidParameterError / pydantic ValidationError  400 invalid_request_error (param = the field)
    ContextLengthError                                 400 code context_length_exceeded (both token counts)
    missing or wrong API key                           401 authentication_error
    unknown model or route                             404 not_found_error
    body over max_body_size                            413
    EngineDeadError                                    503
    client gone before its request was read            499 (nginx's "client closed request"; nobody reads it)
    anything else                                      500, logged with the request id

User input never reaches the last row: what it can get wrong is checked
before the engine sees it. The table speaks OpenAI's shape; errors on
Anthropic's paths (/v1/messages…) come out in Anthropic's shape instead, the
same status with its error type (`anthropic_error_payload`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import ValidationError
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import tokenriver
from tokenriver.engine.async_engine import AsyncEngine
from tokenriver.errors import ContextLengthError, EngineDeadError, EngineOverloadedError, InvalidParameterError
from tokenriver.server.config import ServerConfig
from tokenriver.server.embeddings import PoolingServing, add_pooling_routes
from tokenriver.server.messages import add_messages_routes
from tokenriver.server.messages_protocol import AnthropicErrorInfo, AnthropicErrorResponse
from tokenriver.server.metrics import ServerMetrics
from tokenriver.server.protocol import (
    IGNORED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorInfo,
    ErrorResponse,
    TokenizeRequest,
    parse_request,
)
from tokenriver.server.responses import add_responses_routes
from tokenriver.server.serving import GenerationPlan, OpenAIServing
from tokenriver.server.visualizer_api import add_visualizer_routes

logger = logging.getLogger("tokenriver.server")

DEFAULT_STATIC_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "visualizer", "static")
# Paths that need the API key when one is set; health, version, metrics and the visualizer's files stay open.
_PROTECTED_PREFIXES = ("/v1/", "/v2/", "/rerank", "/tokenize", "/detokenize")
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
# nginx's "client closed request": the access log's status for a request whose client went away.
CLIENT_CLOSED_REQUEST = 499
# Seconds a client refused for a full waiting queue (429) is told to wait: about a few requests' decode time.
RETRY_AFTER_SECONDS = 1

T = TypeVar("T")


class ApiError(Exception):
    """An error decided by the HTTP layer itself (auth, routing, limits), with its OpenAI fields."""

    def __init__(
        self, status: int, message: str, error_type: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code


# ----- errors → OpenAI's shape: the one table -----------------------------------------------------------


def error_payload(error: BaseException, request_id: str) -> tuple[int, ErrorResponse]:
    """Status code and OpenAI error body of any exception; unexpected ones are logged with the request id."""
    if isinstance(error, ApiError):
        return error.status, _body(error.message, error.error_type, error.param, error.code)
    if isinstance(error, ContextLengthError):
        return 400, _body(error.message, "invalid_request_error", error.param, "context_length_exceeded")
    if isinstance(error, InvalidParameterError):
        return 400, _body(error.message, "invalid_request_error", error.param, "invalid_value")
    if isinstance(error, (ValidationError, RequestValidationError)):
        message, param, code = _validation_message(error.errors())
        return 400, _body(message, "invalid_request_error", param, code)
    if isinstance(error, HTTPException):
        if error.status_code == 404:
            return 404, _body(
                "no such route; see GET /v1/models, POST /v1/completions, /v1/chat/completions, /v1/responses, "
                "/v1/messages, /v1/embeddings, /v1/rerank",
                "not_found_error",
                None,
                "not_found",
            )
        if error.status_code == 405:
            return 405, _body(
                f"method not allowed here ({error.detail})", "invalid_request_error", None, "method_not_allowed"
            )
        return error.status_code, _body(str(error.detail), "invalid_request_error", None, None)
    if isinstance(error, ClientDisconnect):
        return CLIENT_CLOSED_REQUEST, _body(
            "the client disconnected before its request was read", "invalid_request_error", None, "client_disconnected"
        )
    if isinstance(error, EngineOverloadedError):
        return 429, _body(
            f"{error.message} (retry after {RETRY_AFTER_SECONDS} s)", "server_error", None, "server_overloaded"
        )
    if isinstance(error, EngineDeadError):
        logger.error("request %s: %s", request_id, error.message)
        return 503, _body(f"{error.message}; restart the server", "server_error", None, "engine_dead")
    logger.error("request %s failed with an internal error", request_id, exc_info=error)
    return 500, _body(
        f"internal server error (request id {request_id}); the server log has the details",
        "server_error",
        None,
        "internal_error",
    )


# Anthropic's error type per status (its API's own table); other 4xx are invalid requests, other 5xx api errors.
_ANTHROPIC_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_payload(error: BaseException, request_id: str) -> tuple[int, AnthropicErrorResponse]:
    """The same status and meaning as `error_payload`, in Anthropic's shape; its body has no `param`, so the
    message names the field."""
    status, body = error_payload(error, request_id)
    default = "api_error" if status >= 500 else "invalid_request_error"
    message, param = body.error.message, body.error.param
    if param is not None and not message.startswith(param):
        message = f"{param}: {message}"
    info = AnthropicErrorInfo(type=_ANTHROPIC_ERROR_TYPES.get(status, default), message=message)
    return status, AnthropicErrorResponse(error=info)


def is_anthropic_path(path: str) -> bool:
    """Whether a path belongs to Anthropic's Messages API, whose errors take Anthropic's shape."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_response(error: BaseException, request_id: str, path: str) -> JSONResponse:
    """The error as a response in the shape of the API `path` belongs to."""
    payload = anthropic_error_payload if is_anthropic_path(path) else error_payload
    status, body = payload(error, request_id)
    headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if status == 429 else None
    return JSONResponse(body.model_dump(mode="json"), status_code=status, headers=headers)


def _body(message: str, error_type: str, param: str | None, code: str | None) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=message, type=error_type, param=param, code=code))


def _validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None, str]:
    """Pydantic's errors as (message, param path like messages[0].content, code); unknown fields come first."""
    unknown = [_param_path(e["loc"]) for e in errors if e["type"] == "extra_forbidden"]
    if unknown:
        names = ", ".join(repr(name) for name in unknown)
        message = (
            f"unknown field(s) {names}: tokenriver does not implement them, and ignoring them could change "
            f"the result unnoticed; remove them (fields accepted and ignored: {', '.join(IGNORED_FIELDS)})"
        )
        return message, unknown[0], "unknown_parameter"
    first = errors[0]
    param = _param_path(first["loc"])
    if first["type"] == "missing":
        message, code = f"{param} is required", "missing_required_parameter"
    else:
        shown = repr(first.get("input"))
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        message, code = f"{param}: {first['msg']} (got {shown})", "invalid_type"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return message, param, code


def _param_path(loc: tuple[Any, ...]) -> str | None:
    """("messages", 0, "content") → "messages[0].content"."""
    parts = [part for part in loc if part != "body"]
    path = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in parts).lstrip(".")
    return path or (repr(parts[-1]) if parts else None)  # a field named "" is still named


# ----- middleware ----------------------------------------------------------------------------------------


class RequestContextMiddleware:
    """Per HTTP request: its id (X-Request-Id in and out), the API key, the body limit, the access log and metrics.

    Also the last resort for errors: an exception no route handled becomes a
    500 in its API's shape (logged with the request id) instead of a bare page.
    """

    def __init__(self, app: ASGIApp, config: ServerConfig, metrics: ServerMetrics) -> None:
        self.app = app
        self.config = config
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        given_id = headers.get("x-request-id", "")
        request_id = given_id if _REQUEST_ID.fullmatch(given_id) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        started = time.monotonic()
        status = 0

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                MutableHeaders(scope=message)["X-Request-Id"] = request_id
            await send(message)

        num_body_bytes = 0

        async def receive_limited() -> Message:
            nonlocal num_body_bytes
            message = await receive()
            if message["type"] == "http.request":
                num_body_bytes += len(message.get("body", b""))
                if num_body_bytes > self.config.max_body_size:
                    raise self._too_large()
            return message

        try:
            refusal = self._refusal(scope, headers)
            if refusal is not None:
                await error_response(refusal, request_id, scope["path"])(scope, receive, send_with_id)
            else:
                await self.app(scope, receive_limited, send_with_id)
        except Exception as error:
            if status:
                logger.error("request %s failed after its response started", request_id, exc_info=error)
            else:
                await error_response(error, request_id, scope["path"])(scope, receive, send_with_id)
        finally:
            route = scope.get("route")
            self.metrics.observe_http(getattr(route, "path", "unmatched"), status)
            logger.info(
                '%s "%s %s" %d %.1f ms',
                request_id,
                scope["method"],
                scope["path"],
                status,
                (time.monotonic() - started) * 1000,
            )

    def _refusal(self, scope: Scope, headers: Headers) -> ApiError | None:
        """A request refused before it is read: too large, or without the right key."""
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.config.max_body_size:
            return self._too_large()
        key = self.config.api_key
        if key is None or scope["method"] == "OPTIONS" or not scope["path"].startswith(_PROTECTED_PREFIXES):
            return None
        # OpenAI's clients send the key as a bearer token, Anthropic's SDK as x-api-key (Claude Code either way).
        scheme, _, bearer = headers.get("authorization", "").partition(" ")
        given = [k.strip() for k in (bearer if scheme.lower() == "bearer" else "", headers.get("x-api-key", "")) if k]
        if not given:
            return ApiError(
                401,
                "missing API key: send the header 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                "authentication_error",
                None,
                "missing_api_key",
            )
        if not any(hmac.compare_digest(k.encode(), key.encode()) for k in given):
            return ApiError(401, "wrong API key", "authentication_error", None, "invalid_api_key")
        return None

    def _too_large(self) -> ApiError:
        return ApiError(
            413,
            f"the request body is larger than the server's limit of {self.config.max_body_size} "
            f"bytes; send less, or start the server with a larger --max-body-size",
            "invalid_request_error",
            None,
            "request_too_large",
        )


# ----- helpers for the routes ----------------------------------------------------------------------------


async def _until_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work` unless the client disconnects first; then cancel it (aborting its engine requests)."""
    task = asyncio.ensure_future(work)

    async def wait_for_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(wait_for_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        return None
    return task.result()


def _sse(chunks: AsyncIterator[Any], request_id: str) -> StreamingResponse:
    """Server-sent events: one `data: {json}` per chunk, an error event if the stream breaks, then [DONE]."""

    async def events() -> AsyncIterator[str]:
        try:
            async with aclosing(chunks):
                async for chunk in chunks:
                    yield _sse_event(chunk)
        except Exception as error:
            _, body = error_payload(error, request_id)
            yield _sse_event(body)
        yield "data: [DONE]\n\n"

    return StreamingResponse(
        events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


# Characters that SSE leaves inside a line but that line readers built on str.splitlines (httpx's iter_lines among
# them) take for line breaks; JSON does not escape them, so a token holding one would cut an event in two.
_LINE_BREAKS_FOR_SPLITLINES = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _sse_event(body: Any) -> str:
    """One `data: {json}` event, with the characters str.splitlines breaks on escaped (the same JSON value)."""
    return f"data: {body.model_dump_json().translate(_LINE_BREAKS_FOR_SPLITLINES)}\n\n"


def served_model_name(engine: AsyncEngine, config: ServerConfig) -> str:
    """The configured name, else the model file's stem (a folder's name)."""
    if config.served_model_name:
        return config.served_model_name
    path = engine.model_info.path.rstrip(os.sep)
    name = os.path.basename(path)
    return name if os.path.isdir(path) else os.path.splitext(name)[0]


# ----- the app -------------------------------------------------------------------------------------------


def build_app(engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    """The OpenAI-compatible HTTP API over a running engine (routes in docs/serving.md's endpoint table)."""
    app = FastAPI(title="tokenriver", version=tokenriver.__version__, docs_url="/docs", redoc_url=None)
    metrics = ServerMetrics(engine)
    model_name = served_model_name(engine, config)
    serving = OpenAIServing(engine, model_name, metrics)
    app.state.engine, app.state.serving, app.state.metrics = engine, serving, metrics
    _add_error_handling(app, config, metrics)
    check_model = _model_checker(model_name)
    # Registration order is matching order: the OpenAI routes first, then the other APIs, then the open ones.
    _add_generation_routes(app, serving, check_model)
    _add_model_routes(app, engine, serving, model_name, check_model)
    add_pooling_routes(app, PoolingServing(engine, model_name), check_model, _until_disconnected, CLIENT_CLOSED_REQUEST)
    add_messages_routes(app, serving, check_model, _until_disconnected, anthropic_error_payload, CLIENT_CLOSED_REQUEST)
    add_responses_routes(
        app,
        serving,
        check_model,
        _until_disconnected,
        error_payload,
        CLIENT_CLOSED_REQUEST,
        config.responses_store_size,
    )
    add_visualizer_routes(app, engine)
    _add_service_routes(app, engine, metrics, config.static_dir or DEFAULT_STATIC_DIR)
    return app


def _add_error_handling(app: FastAPI, config: ServerConfig, metrics: ServerMetrics) -> None:
    """Route every error through the one table, and wrap each request in its id, key check and CORS."""

    async def on_handled_error(request: Request, error: Exception) -> JSONResponse:
        return error_response(error, request.state.request_id, request.url.path)

    app.add_exception_handler(HTTPException, on_handled_error)
    app.add_exception_handler(RequestValidationError, on_handled_error)
    app.add_middleware(RequestContextMiddleware, config=config, metrics=metrics)
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["X-Request-Id"],
        )


def _model_checker(model_name: str) -> Callable[[str | None], None]:
    """One check every API shares, so a request naming another model gets the same 404 on every path."""

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise ApiError(
                404,
                f"model {name!r} is not served here; this server serves {model_name!r} (GET /v1/models)",
                "not_found_error",
                "model",
                "model_not_found",
            )

    return check_model


def _add_generation_routes(app: FastAPI, serving: OpenAIServing, check_model: Callable[[str | None], None]) -> None:
    """OpenAI's two generation routes share one path from plan to response, streamed or not."""

    async def generate(request: Request, plan: GenerationPlan, kind: str) -> Response:
        """Run a planned completion ("completion") or chat ("chat") request, streaming or not."""
        if plan.is_stream:
            chunks = await _until_disconnected(request, serving.open_stream(plan, kind))
            if chunks is None:
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            return _sse(chunks, request.state.request_id)
        finals = await _until_disconnected(request, serving.final_outputs(plan))
        if finals is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        body = (
            serving.completion_response(plan, finals) if kind == "completion" else serving.chat_response(plan, finals)
        )
        return JSONResponse(body.model_dump(mode="json"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        parsed = parse_request(CompletionRequest, await request.body())
        check_model(parsed.model)
        return await generate(request, serving.plan_completion(parsed), "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        parsed = parse_request(ChatCompletionRequest, await request.body())
        check_model(parsed.model)
        return await generate(request, serving.plan_chat(parsed), "chat")


def _add_model_routes(
    app: FastAPI,
    engine: AsyncEngine,
    serving: OpenAIServing,
    model_name: str,
    check_model: Callable[[str | None], None],
) -> None:
    """The routes that describe the served model and use its tokenizer, without generating."""
    created = int(time.time())

    def model_card() -> dict[str, Any]:
        return {
            "id": model_name,
            "object": "model",
            "created": created,
            "owned_by": "tokenriver",
            "max_model_len": engine.max_model_len,
        }

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str) -> dict[str, Any]:
        check_model(name)
        return model_card()

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        parsed = parse_request(TokenizeRequest, await request.body())
        check_model(parsed.model)
        return serving.tokenize(parsed)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        parsed = parse_request(DetokenizeRequest, await request.body())
        check_model(parsed.model)
        return serving.detokenize(parsed)

    @app.get("/v1/engine")
    async def engine_info() -> dict[str, Any]:
        return serving.engine_info()


def _add_service_routes(app: FastAPI, engine: AsyncEngine, metrics: ServerMetrics, static_dir: str) -> None:
    """Health, version, metrics and the visualizer's files: the open paths an operator or browser reads."""

    @app.get("/health")
    async def health() -> dict[str, str]:
        if not engine.is_running:
            raise EngineDeadError("the engine is not running")
        return {"status": "ok"}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": tokenriver.__version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/", include_in_schema=False)
    async def visualizer() -> Response:
        index = os.path.join(static_dir, "index.html")
        if not os.path.isfile(index):
            raise ApiError(
                404,
                f"the visualizer is not installed ({index} is missing); the API is under /v1",
                "not_found_error",
                None,
                "not_found",
            )
        return FileResponse(index)

    if os.path.isdir(static_dir):
        app.mount("/static", StaticFiles(directory=static_dir), name="static")
