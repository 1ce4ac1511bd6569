"""Facts the visualizer needs that the OpenAI-shaped API has no field for.

Kept apart from the OpenAI routes so the page's needs never change their shapes: GET /v1/visualizer/info
names the tokens that end a generation (so the page can end a branch the user forced onto one, as the engine
would) and the KV cache's geometry (so it can state memory in bytes rather than in blocks); GET
/v1/visualizer/passes lists the engine's recent steps with the requests each forward pass carried, so the page
can draw batching: which requests shared a pass, as prompt chunks or as decode rows.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from tokenriver.engine.async_engine import AsyncEngine


def kv_bytes_per_token(engine: AsyncEngine) -> int:
    """Bytes of K and V one token occupies across all layers: the pool's size over its slots."""
    cache = engine.core.kv_cache
    return cache.num_bytes // (cache.num_blocks * cache.block_size)


def visualizer_info(engine: AsyncEngine) -> dict[str, Any]:
    """The end-of-sequence ids and the KV geometry, read from the running engine."""
    core = engine.core
    return {
        "eos_token_ids": list(core.tokenizer.eos_token_ids),
        "block_size": core.kv_cache.block_size,
        "kv_bytes_per_token": kv_bytes_per_token(engine),
    }


def recent_passes(engine: AsyncEngine, since: int) -> list[dict[str, Any]]:
    """The logged steps whose forward-pass counter is above `since`, oldest first."""
    log = engine.core.pass_log
    for _ in range(3):
        try:
            entries = list(log)
            break
        except RuntimeError:  # the engine thread appended while this one copied; copy again
            continue
    else:
        entries = []
    return [{"pass": counter, "rows": [{"request_id": row.request_id, "num_tokens": row.num_tokens,
                                        "is_prompt": row.is_prompt, "num_draft_tokens": row.num_draft_tokens}
                                       for row in rows]}
            for counter, rows in entries if counter > since]


def add_visualizer_routes(app: FastAPI, engine: AsyncEngine) -> None:
    """Register the visualizer's own read-only routes on `app`."""

    @app.get("/v1/visualizer/info")
    async def info() -> dict[str, Any]:
        return visualizer_info(engine)

    @app.get("/v1/visualizer/passes")
    async def passes(since: int = 0) -> dict[str, Any]:
        return {"passes": recent_passes(engine, since)}
