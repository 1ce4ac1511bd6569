"""Facts the visualizer needs that the OpenAI-shaped API has no field for.

Kept apart from the OpenAI routes so the page's needs never change their shapes: GET /v1/visualizer/info
names the tokens that end a generation (so the page can end a branch the user forced onto one, as the engine
would), the vocabulary's size (what the grammar stage's allowed tokens are counted against) and the KV cache's
geometry (so it can state memory in bytes rather than in blocks); GET
/v1/visualizer/passes lists the engine's recent steps with the requests each forward pass carried, so the page
can draw batching: which requests shared a pass, as prompt chunks or as decode rows, and each pass's wall time
with what it computed and read; GET /v1/visualizer/cost gives the cost of a token (engine/token_cost.py) and the
machine's measured ceilings (engine/machine_rates.py), the roofline the page places each pass on; POST
/v1/visualizer/inspect returns one position's view inside the forward pass, layer by layer (engine/inspection.py:
logit lens, attention weights, residual update norms), refused with a 400 past its context limit.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from tokenriver.engine.async_engine import AsyncEngine
from tokenriver.engine.core import PassLogEntry
from tokenriver.engine.token_cost import TokenCost, attended_positions
from tokenriver.errors import InvalidParameterError


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
    cost = engine.model_info.token_cost
    return [
        {
            "pass": entry.num_forward_passes,
            "rows": [
                {
                    "request_id": row.request_id,
                    "num_tokens": row.num_tokens,
                    "is_prompt": row.is_prompt,
                    "num_draft_tokens": row.num_draft_tokens,
                    "num_context_tokens": row.num_context_tokens,
                    "num_logit_rows": row.num_logit_rows,
                }
                for row in entry.rows
            ],
            "seconds": entry.seconds,
            "num_passes": entry.num_passes,
            "num_tokens": sum(row.num_tokens + row.num_draft_tokens for row in entry.rows),
            **_pass_cost(cost, entry),
        }
        for entry in engine.recent_passes(since)
    ]


def _pass_cost(cost: TokenCost, entry: PassLogEntry) -> dict[str, int]:
    """What the entry's pass computed and read (a multi-step entry's first pass)."""
    rows = entry.rows
    return {
        "multiply_adds": cost.pass_multiply_adds(
            sum(row.num_tokens + row.num_draft_tokens for row in rows),
            sum(row.num_logit_rows for row in rows),
            sum(attended_positions(row.num_tokens + row.num_draft_tokens, row.num_context_tokens) for row in rows),
        ),
        "bytes_read": cost.pass_bytes(sum(row.num_context_tokens for row in rows)),
    }


async def token_cost_facts(engine: AsyncEngine, context: int) -> dict[str, Any]:
    """The cost of a token, the bytes of one pass at a context of `context` tokens, and the machine's ceilings."""
    limit = engine.model_info.max_model_len
    if not 0 <= context <= limit:
        raise InvalidParameterError(
            f"context={context} is outside 0..{limit} (the server's max_model_len)", param="context"
        )
    cost = engine.model_info.token_cost
    rates = await asyncio.wrap_future(engine.machine_rates())
    return {
        "num_parameters": cost.num_parameters,
        "multiply_adds_per_token": cost.multiply_adds_per_token,
        "output_multiply_adds": cost.output_multiply_adds,
        "attention_multiply_adds_per_position": cost.attention_multiply_adds_per_position,
        "weight_bytes_per_pass": cost.weight_bytes_per_pass,
        "kv_bytes_per_token": cost.kv_bytes_per_token,
        "context": context,
        "bytes_per_pass": cost.pass_bytes(context),
        "machine": {
            "device": rates.device,
            "num_threads": rates.num_threads,
            "read_bytes_per_second": rates.read_bytes_per_second,
            "flops_per_second": rates.flops_per_second,
            "ridge_intensity": rates.ridge_intensity,
            "seconds": rates.seconds,
        },
    }


def add_visualizer_routes(app: FastAPI, engine: AsyncEngine) -> None:
    """Register the visualizer's own read-only routes on `app` (inspection reads the model, changes nothing)."""

    @app.get("/v1/visualizer/info")
    async def info() -> dict[str, Any]:
        return visualizer_info(engine)

    @app.get("/v1/visualizer/passes")
    async def passes(since: int = 0) -> dict[str, Any]:
        return {"passes": recent_passes(engine, since)}

    @app.get("/v1/visualizer/cost")
    async def cost(context: int = 0) -> dict[str, Any]:
        # A context outside the model's raises InvalidParameterError: the app's error table makes it a 400.
        return await token_cost_facts(engine, context)

    @app.post("/v1/visualizer/inspect")
    async def inspect(body: InspectRequest) -> dict[str, Any]:
        # A refused inspection raises InvalidParameterError: the app's error table makes it a 400.
        return await engine.inspect(body.token_ids, body.position, body.top_k)
