"""The one HTTP endpoint in front of the engine replicas: route, forward, retry, and merge what is per replica.

Every request is replayed on one replica's own OpenAI app (serve_ray/replica.py), so the API, streaming, /v1/engine,
/tokenize and the visualizer behave as with `tokenriver serve`. The ingress adds:
- routing: it tokenizes the prompt (chat template for chat requests) and hashes its full blocks into a RoutingHint
  that the request router (serve_ray/router.py) ranks replicas with;
- failure handling: when a replica dies under a request that has not started streaming (every non-streamed one),
  the request is sent again and the router picks another replica; a stream that already started ends with an
  error event in OpenAI's shape (`data: {"error": {...}}`) and `data: [DONE]`. Ray Serve restarts the replica;
- `/metrics`: the replicas' metrics summed; `/metrics/replicas`: each replica's under a `replica` label;
  `/v1/replicas`: which replicas are live, their process ids and load.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from ray.exceptions import RayError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from tokenriver.config import EngineConfig
from tokenriver.loader.tokenizer_only import load_tokenizer
from tokenriver.serve_ray.board import board_handle
from tokenriver.serve_ray.messages import ForwardedRequest, ResponseHead, RoutingHint, stream_error_event
from tokenriver.serve_ray.metrics import aggregate, label_replica
from tokenriver.serve_ray.replica_choice import prompt_block_hashes

logger = logging.getLogger("tokenriver.serve_ray")

# Hop-by-hop or recomputed headers not copied from a replica's response.
_DROPPED_HEADERS = {b"content-length", b"transfer-encoding", b"connection"}
METRICS_MEDIA_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ReplicaLost(Exception):
    """The replica serving a request died before answering it."""


class Ingress:
    """A Ray Serve deployment class (serve_ray/app.py wraps it); holds the handle to the engine replicas."""

    def __init__(self, engines: Any, engine_config: EngineConfig, max_attempts: int = 4) -> None:
        self.engines = engines
        self.block_size = engine_config.cache.block_size
        self.tokenizer = load_tokenizer(engine_config.model)
        self.max_attempts = max_attempts
        from ray import serve

        self.board = board_handle(serve.get_replica_context().app_name)

    # ----- routing -------------------------------------------------------------------------------------------
    def routing_hint(self, path: str, payload: Any) -> RoutingHint:
        """The prompt's block hashes, tokenized as the replica will (best effort: routing only)."""
        if not isinstance(payload, dict):
            return RoutingHint()
        try:
            if path.endswith("/chat/completions") and isinstance(payload.get("messages"), list):
                text = self.tokenizer.apply_chat_template(payload["messages"], add_generation_prompt=True)
                token_ids = self.tokenizer.encode(text, add_special_tokens=False)
            else:
                prompt = payload.get("prompt")
                if isinstance(prompt, list) and prompt:
                    prompt = prompt[0]
                if isinstance(prompt, str):
                    token_ids = self.tokenizer.encode(prompt)
                elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                    token_ids = prompt
                else:
                    return RoutingHint()
        except Exception:  # a malformed request is the replica's to reject, with its usual error
            return RoutingHint()
        return RoutingHint(prompt_block_hashes(token_ids, self.block_size))

    # ----- HTTP ------------------------------------------------------------------------------------------------
    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if request.method == "GET" and path == "/metrics":
            return Response(aggregate([r["metrics"] for r in await self.replicas()]), media_type=METRICS_MEDIA_TYPE)
        if request.method == "GET" and path == "/metrics/replicas":
            text = "".join(label_replica(r["metrics"], r["replica_id"]) for r in await self.replicas())
            return Response(text, media_type=METRICS_MEDIA_TYPE)
        if request.method == "GET" and path == "/v1/replicas":
            return JSONResponse(
                {"data": [{k: v for k, v in r.items() if k != "metrics"} for r in await self.replicas()]}
            )
        body = await request.body()
        payload: Any = None
        if body and request.method == "POST":
            try:
                payload = json.loads(body)
            except ValueError:
                payload = None
        forwarded = ForwardedRequest(
            request.method, path, request.url.query.encode(), [(k.lower(), v) for k, v in request.headers.raw], body
        )
        hint = self.routing_hint(path, payload)
        streaming = isinstance(payload, dict) and payload.get("stream") is True
        if streaming:
            return await self._stream(forwarded, hint)
        return await self._unary(forwarded, hint)

    async def replicas(self) -> list[dict[str, Any]]:
        """What every live replica posted last (serve_ray/board.py), at most a few seconds old."""
        return await self.board.live.remote()

    def _call(self, forwarded: ForwardedRequest, hint: RoutingHint) -> Any:
        return self.engines.options(stream=True).http.remote(forwarded, hint)

    async def _head(self, forwarded: ForwardedRequest, hint: RoutingHint) -> tuple[Any, ResponseHead]:
        """Send the request, retrying on another replica while none has answered: (stream, its head)."""
        for attempt in range(self.max_attempts):
            stream = self._call(forwarded, hint)
            try:
                head = await stream.__anext__()
                return stream, head
            except RayError as error:
                logger.warning(
                    "replica failed before answering %s (attempt %d): %r", forwarded.path, attempt + 1, error
                )
                await asyncio.sleep(0.2 * (attempt + 1))
        raise ReplicaLost(f"no replica answered {forwarded.path} in {self.max_attempts} attempts")

    async def _unary(self, forwarded: ForwardedRequest, hint: RoutingHint) -> Response:
        """Buffer the whole response: if the replica dies midway, nothing was sent, so send it all again."""
        for attempt in range(self.max_attempts):
            try:
                stream, head = await self._head(forwarded, hint)
                chunks = [chunk async for chunk in stream]
                return Response(b"".join(chunks), status_code=head.status, headers=_headers(head))
            except RayError as error:
                logger.warning("replica failed under %s (attempt %d): %r", forwarded.path, attempt + 1, error)
                await asyncio.sleep(0.2 * (attempt + 1))
            except ReplicaLost:
                break
        return JSONResponse(
            {
                "error": {
                    "message": "every replica tried failed; retry later",
                    "type": "server_error",
                    "param": None,
                    "code": "replica_failed",
                }
            },
            status_code=503,
        )

    async def _stream(self, forwarded: ForwardedRequest, hint: RoutingHint) -> Response:
        try:
            stream, head = await self._head(forwarded, hint)
        except ReplicaLost as error:
            return JSONResponse(
                {"error": {"message": str(error), "type": "server_error", "param": None, "code": "replica_failed"}},
                status_code=503,
            )

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in stream:
                    yield chunk
            except RayError as error:
                logger.warning("replica failed while streaming %s: %r", forwarded.path, error)
                yield stream_error_event("the replica serving this stream failed; send the request again")

        return StreamingResponse(body(), status_code=head.status, headers=_headers(head))


def _headers(head: ResponseHead) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in head.headers if k.lower() not in _DROPPED_HEADERS}
