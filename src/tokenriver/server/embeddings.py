"""HTTP ↔ engine for embeddings and reranking: inputs become pooling requests, vectors and scores come back.

Every input of a request is its own engine request, so the scheduler batches them with each other and with
everyone else's prompts; at most max_num_seqs of one HTTP request wait at a time, so a long input list never
fills the engine's waiting queue by itself. A failed or abandoned request aborts the inputs still running.
Inputs are checked here, against the context and one step's token budget (an input is pooled in one forward
pass), so the error names the field the client sent.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenriver.engine.async_engine import AsyncEngine
from tokenriver.engine.rerank import check_top_n, ranked, rerank_inputs
from tokenriver.errors import InvalidParameterError
from tokenriver.outputs import RequestOutput
from tokenriver.params import PoolingParams
from tokenriver.prompts import check_pooling_length, check_prompt
from tokenriver.server.embeddings_protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    RerankRequest,
    RerankResponse,
    RerankResultDocument,
    RerankResultItem,
    RerankUsage,
)
from tokenriver.server.protocol import parse_request

# OpenAI's limit on the inputs of one embeddings request.
MAX_INPUTS = 2048


class PoolingServing:
    """The embeddings and rerank handlers, free of HTTP details."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.tokenizer
        self.info = engine.model_info

    async def embeddings(self, request: EmbeddingRequest) -> EmbeddingResponse:
        inputs = self._embedding_inputs(request.input)
        try:
            params = PoolingParams(
                pooling=request.pooling,
                normalize=True if request.normalize is None else request.normalize,
                dimensions=request.dimensions,
            )
        except InvalidParameterError as error:
            raise InvalidParameterError(error.message, param=error.param) from None
        self._check_params(params)
        outputs = await self._pool_all(inputs, params)
        as_base64 = request.encoding_format == "base64"
        num_tokens = sum(len(ids) for ids in inputs)
        return EmbeddingResponse(
            data=[
                EmbeddingData(embedding=_base64(output.embedding) if as_base64 else output.embedding, index=index)
                for index, output in enumerate(outputs)
            ],
            model=self.model_name,
            usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )

    async def rerank(self, request: RerankRequest) -> RerankResponse:
        check_top_n(request.top_n)
        documents = [d if isinstance(d, str) else d.text for d in request.documents]
        inputs, params = rerank_inputs(
            self.tokenizer, self.info.is_causal, request.query, documents, request.instruction
        )
        self._check_params(params)
        for index, ids in enumerate(inputs):
            self._check_input(ids, f"documents[{index}]", "documents")
        outputs = await self._pool_all(inputs, params)
        keep_text = request.return_documents is not False
        num_tokens = sum(len(ids) for ids in inputs)
        return RerankResponse(
            id=f"rerank-{uuid.uuid4().hex}",
            model=self.model_name,
            results=[
                RerankResultItem(
                    index=result.index,
                    relevance_score=result.relevance_score,
                    document=RerankResultDocument(text=result.document) if keep_text else None,
                )
                for result in ranked(documents, [output.score for output in outputs], request.top_n)
            ],
            usage=RerankUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )

    def _embedding_inputs(self, given: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
        if isinstance(given, str) or (given and isinstance(given[0], int)):
            given = [given]
        if not given:
            raise InvalidParameterError("input is empty: give a text, a list of texts, or token ids", param="input")
        if len(given) > MAX_INPUTS:
            raise InvalidParameterError(
                f"input has {len(given)} items; send at most {MAX_INPUTS} per request", param="input"
            )
        inputs = []
        for index, item in enumerate(given):
            if isinstance(item, str) and not item:
                raise InvalidParameterError(f"input[{index}] is an empty string", param="input")
            ids = self.tokenizer.encode(item) if isinstance(item, str) else list(item)
            self._check_input(ids, f"input[{index}]" if len(given) > 1 else "input", "input")
            inputs.append(ids)
        return inputs

    def _check_params(self, params: PoolingParams) -> None:
        """Refuse what this model cannot do before any input is queued (PoolingParams.validate_for_model, which the
        engine runs again on admission)."""
        info = self.info
        params.validate_for_model(
            model_name=self.model_name,
            is_causal=info.is_causal,
            num_labels=info.num_labels,
            hidden_size=info.hidden_size,
        )

    def _check_input(self, ids: list[int], where: str, param: str) -> None:
        """The engine's own rules (prompts.check_prompt, the one-pass limit the scheduler applies too), worded for
        this field."""
        info = self.info
        check_prompt(ids, info.vocab_size, info.max_model_len, where=where, param=param, is_pooling=True)
        num_pool_tokens = info.num_kv_blocks * info.block_size
        check_pooling_length(len(ids), info.max_num_batched_tokens, num_pool_tokens, where=where, param=param)

    async def _pool_all(self, inputs: list[list[int]], params: PoolingParams) -> list[RequestOutput]:
        """Every input's output, in order; at most max_num_seqs of them queued at once (module docstring)."""
        room = asyncio.Semaphore(self.info.max_num_seqs)
        base_id = uuid.uuid4().hex

        async def one(index: int) -> RequestOutput:
            async with room:
                return await self.engine.pool(inputs[index], params, request_id=f"embd-{base_id}-{index}")

        tasks = [asyncio.ensure_future(one(index)) for index in range(len(inputs))]
        try:
            return list(await asyncio.gather(*tasks))
        finally:  # the first error, or the caller's cancellation, aborts the inputs still running
            for task in tasks:
                task.cancel()


def _base64(vector: list[float]) -> str:
    """OpenAI's base64 encoding: the float32 values, little-endian, base64-encoded."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def add_pooling_routes(
    app: FastAPI,
    serving: PoolingServing,
    check_model: Callable[[str | None], None],
    until_disconnected: Callable[[Request, Awaitable[Any]], Awaitable[Any]],
    client_closed_status: int,
) -> None:
    """POST /v1/embeddings and POST /v1/rerank (also at /rerank and /v2/rerank, where other servers put it)."""

    async def run(request: Request, work: Awaitable[Any]) -> Response:
        body = await until_disconnected(request, work)
        if body is None:
            return Response(status_code=client_closed_status)
        return JSONResponse(body.model_dump(mode="json"))

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        parsed = parse_request(EmbeddingRequest, await request.body())
        check_model(parsed.model)
        return await run(request, serving.embeddings(parsed))

    async def rerank(request: Request) -> Response:
        parsed = parse_request(RerankRequest, await request.body())
        check_model(parsed.model)
        return await run(request, serving.rerank(parsed))

    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        app.add_api_route(path, rerank, methods=["POST"])
