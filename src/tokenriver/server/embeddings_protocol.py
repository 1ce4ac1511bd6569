"""The wire format of embeddings (OpenAI's `POST /v1/embeddings`) and reranking (`POST /v1/rerank`, the shape vLLM,
llama.cpp and Jina serve: `query`, `documents`, `top_n`; `results` with `index` and `relevance_score`).

Parsed like every request here (protocol.py): strict and closed, `user` accepted and ignored.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tokenriver.server.protocol import Int64, Request, Response, _omit_none


class EmbeddingRequest(Request):
    model: str | None = None
    # One text, a list of texts, one list of token ids, or a list of them.
    input: str | list[str] | list[Int64] | list[list[Int64]]
    # "float": a list of numbers; "base64": the little-endian float32 bytes, base64-encoded (smaller, exact).
    encoding_format: Literal["float", "base64"] | None = None
    # Keep the first `dimensions` values, then normalize (Matryoshka models; any model accepts it).
    dimensions: Int64 | None = None
    # tokenriver extensions (vLLM's names): unit-length vectors (default true), and the pooling to use instead of
    # the model's own ("last", "mean", "cls").
    normalize: bool | None = None
    pooling: Literal["last", "mean", "cls"] | None = None


class EmbeddingData(Response):
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str
    index: int


class EmbeddingUsage(Response):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(Response):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class RerankDocument(Request):
    text: str


class RerankRequest(Request):
    model: str | None = None
    query: str
    # Texts, or {"text": ...} objects (Cohere's and Jina's shape).
    documents: list[str | RerankDocument] = Field(min_length=1)
    # Return the best top_n documents only (default: all of them, best first).
    top_n: Int64 | None = None
    # Put each document's text in its result (default true).
    return_documents: bool | None = None
    # A causal judge's instruction: what "relevant" means (engine/rerank.py).
    instruction: str | None = None


class RerankResultDocument(Response):
    text: str


class RerankResultItem(Response):
    index: int
    relevance_score: float
    document: RerankResultDocument | None = _omit_none()


class RerankUsage(Response):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(Response):
    id: str
    model: str
    results: list[RerankResultItem]
    usage: RerankUsage
