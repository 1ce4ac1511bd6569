"""A small Ray actor where engine replicas post who they are, their load and their metrics text.

The ingress reads it for `/metrics`, `/metrics/replicas` and `/v1/replicas`: one call instead of one request per
replica through the router (which would have to aim a request at a particular replica). Replicas post about once
a second (from `record_routing_stats`, which Ray Serve calls on that period); a replica that stopped posting for a
few seconds is gone and is left out. Named per application, created by whichever replica or ingress comes first.
"""

from __future__ import annotations

import time
from typing import Any

# A replica that has not posted for this long is considered gone.
STALE_AFTER_S = 5.0


class ReplicaBoard:
    """replica id → (time posted, its description)."""

    def __init__(self) -> None:
        self._posts: dict[str, tuple[float, dict[str, Any]]] = {}

    def post(self, replica_id: str, description: dict[str, Any]) -> None:
        self._posts[replica_id] = (time.monotonic(), description)

    def live(self, max_age_s: float = STALE_AFTER_S) -> list[dict[str, Any]]:
        """The descriptions posted within max_age_s, by replica id."""
        now = time.monotonic()
        self._posts = {k: v for k, v in self._posts.items() if now - v[0] <= max_age_s}
        return [description for _, (_, description) in sorted(self._posts.items())]


def board_handle(app_name: str) -> Any:
    """The application's board actor, created on first use (detached: it outlives whichever replica made it, and
    goes with the Ray cluster or `ray.kill`)."""
    import ray

    return (
        ray.remote(ReplicaBoard)
        .options(
            name=f"tokenriver-board-{app_name}",
            namespace="tokenriver",
            get_if_exists=True,
            lifetime="detached",
            num_cpus=0,
        )
        .remote()
    )
