"""What the ingress sends an engine replica: the HTTP request to replay, and the hint the router reads.

Plain data (they cross processes through Ray's object store).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ForwardedRequest:
    """An HTTP request as the ingress received it, replayed against the replica's own OpenAI app."""

    method: str
    path: str
    query_string: bytes
    # Raw header pairs, lower-case names.
    headers: list[tuple[bytes, bytes]]
    body: bytes


@dataclass(frozen=True)
class RoutingHint:
    """Read by the request router (serve_ray/router.py) before the request reaches any replica."""

    # Chain hashes of the prompt's full KV blocks; empty for requests without a prompt.
    block_hashes: list[bytes] = field(default_factory=list)


@dataclass(frozen=True)
class ResponseHead:
    """The first item a replica streams back: status and headers; the body's chunks (bytes) follow."""

    status: int
    headers: list[tuple[bytes, bytes]]


def stream_error_event(message: str) -> bytes:
    """An OpenAI-style error event that ends a stream whose replica failed, then the end-of-stream marker."""
    error = {"error": {"message": message, "type": "server_error", "param": None, "code": "replica_failed"}}
    return f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
