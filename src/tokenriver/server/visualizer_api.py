"""Facts the visualizer needs that the OpenAI-shaped API has no field for.

Kept apart from the OpenAI routes so the page's needs never change their shapes: GET /v1/visualizer/info
names the tokens that end a generation (so the page can end a branch the user forced onto one, as the engine
would), the vocabulary's size (what the grammar stage's allowed tokens are counted against) and the KV cache's
geometry (so it can state memory in bytes rather than in blocks); GET
/v1/visualizer/passes lists the engine's recent steps with the requests each forward pass carried, so the page
can draw batching: which requests shared a pass, as prompt chunks or as decode rows; POST
/v1/visualizer/inspect returns one position's view inside the forward pass, layer by layer (engine/inspection.py:
logit lens, attention weights, residual update norms), refused with a 400 past its context limit.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from tokenriver.engine.async_engine import AsyncEngine


class InspectRequest(BaseModel):
    """One position of one context: the token ids up to (at least) it, and how many lens tokens per layer."""

    model_config = ConfigDict(extra="forbid")
    token_ids: list[int]
    position: int
    top_k: int = 5


def visualizer_info(engine: AsyncEngine) -> dict[str, Any]:
    """The end-of-sequence ids, the vocabulary's size and the KV geometry, from the engine's model info."""
    info = engine.model_info
    return {
        "eos_token_ids": list(info.eos_token_ids),
        "vocab_size": info.vocab_size,
        "block_size": info.block_size,
        "kv_bytes_per_token": info.kv_bytes_per_token,
    }


def recent_passes(engine: AsyncEngine, since: int) -> list[dict[str, Any]]:
    """The logged steps whose forward-pass counter is above `since`, oldest first."""
    return [
        {
            "pass": counter,
            "rows": [
                {
                    "request_id": row.request_id,
                    "num_tokens": row.num_tokens,
                    "is_prompt": row.is_prompt,
                    "num_draft_tokens": row.num_draft_tokens,
                }
                for row in rows
            ],
        }
        for counter, rows in engine.recent_passes(since)
    ]


def add_visualizer_routes(app: FastAPI, engine: AsyncEngine) -> None:
    """Register the visualizer's own read-only routes on `app` (inspection reads the model, changes nothing)."""

    @app.get("/v1/visualizer/info")
    async def info() -> dict[str, Any]:
        return visualizer_info(engine)

    @app.get("/v1/visualizer/passes")
    async def passes(since: int = 0) -> dict[str, Any]:
        return {"passes": recent_passes(engine, since)}

    @app.post("/v1/visualizer/inspect")
    async def inspect(body: InspectRequest) -> dict[str, Any]:
        # A refused inspection raises InvalidParameterError: the app's error table makes it a 400.
        return await engine.inspect(body.token_ids, body.position, body.top_k)
