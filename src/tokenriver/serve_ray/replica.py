"""One engine replica: an AsyncEngine and tokenriver's OpenAI app over it, in one Ray Serve replica process.

The ingress forwards HTTP requests here (`http`); the router reads `record_routing_stats` (load, KV usage, pool
size), which Ray Serve collects every `request_routing_stats_period_s` and which also posts the replica's metrics to
the application's board (serve_ray/board.py). Every response carries the replica's id and
process id in `x-tokenriver-replica` / `x-tokenriver-replica-pid`, so a client (or a test) sees where it ran.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from typing import Any

from tokenriver.config import EngineConfig
from tokenriver.engine.async_engine import AsyncEngine
from tokenriver.serve_ray.asgi import replay
from tokenriver.serve_ray.board import board_handle
from tokenriver.serve_ray.messages import ForwardedRequest, ResponseHead, RoutingHint
from tokenriver.server.app import build_app
from tokenriver.server.config import ServerConfig

REPLICA_HEADER = b"x-tokenriver-replica"
REPLICA_PID_HEADER = b"x-tokenriver-replica-pid"


class EngineReplica:
    """A Ray Serve deployment class (serve_ray/app.py wraps it with serve.deployment)."""

    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig) -> None:
        from ray import serve

        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.board = board_handle(context.app_name)
        self.pid = os.getpid()
        self.engine = AsyncEngine(engine_config)
        self.app = build_app(self.engine, server_config)
        self.num_kv_blocks = self.engine.model_info.num_kv_blocks

    async def http(self, request: ForwardedRequest, hint: RoutingHint) -> AsyncIterator[ResponseHead | bytes]:
        """The app's response to request: a ResponseHead, then body chunks. `hint` is for the router only."""
        async for item in replay(self.app, request):
            if isinstance(item, ResponseHead):
                item = ResponseHead(
                    item.status,
                    [
                        *item.headers,
                        (REPLICA_HEADER, self.replica_id.encode()),
                        (REPLICA_PID_HEADER, str(self.pid).encode()),
                    ],
                )
            yield item

    async def record_routing_stats(self) -> dict[str, Any]:
        """Load for the routers (Ray Serve calls this every request_routing_stats_period_s); also posts this
        replica's description and Prometheus text to the board the ingress reads."""
        stats = self.engine.snapshot().scheduler
        routing = {
            "num_active_requests": stats.num_running + stats.num_waiting,
            "num_kv_blocks": self.num_kv_blocks,
            "kv_usage": stats.kv_usage,
            "reported_at": time.time(),
        }
        metrics = b""
        async for item in replay(self.app, ForwardedRequest("GET", "/metrics", b"", [], b"")):
            if isinstance(item, bytes):
                metrics += item
        self.board.post.remote(
            self.replica_id, {"replica_id": self.replica_id, "pid": self.pid, "metrics": metrics.decode(), **routing}
        )
        return routing

    def check_health(self) -> None:
        if not self.engine.is_running:
            raise RuntimeError("the engine thread stopped")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(timeout=5)
