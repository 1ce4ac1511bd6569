"""Ray Serve request routers for engine replicas (ray.serve.request_router's RequestRouter API).

`PrefixAwareRouter` ranks the live replicas with serve_ray/replica_choice.py's rules from each request's RoutingHint
(the prompt's block hashes) and each replica's load. Load is Ray's own count of the
requests ongoing at the replica where it has one, else what the replica last reported through
`record_routing_stats` (its active requests; Ray Serve collects them every request_routing_stats_period_s) plus the
requests this router sent it since that report, so a burst routed between two reports still spreads. KV usage and
pool size come from the report. `RoundRobinRouter` cycles through the replicas: the baseline the tests and
benchmarks/scale_out.py compare with.

A router lives in each process that holds a handle to the engine deployment (the ingress), and keeps its picture
of the replicas' caches there. Ray calls `on_replica_actor_died` when a replica dies: its picture is dropped, so a
restarted replica starts empty, as its cache does.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from tokenriver.serve_ray.messages import RoutingHint
from tokenriver.serve_ray.replica_choice import BalancePolicy, PrefixIndex, ReplicaLoad, rank_replicas


def routing_hint(pending_request: PendingRequest | None) -> RoutingHint | None:
    """The RoutingHint among the request's arguments, if any.

    Also asks Ray to back off before choosing again for this request: every choice ranks all replicas, so when
    none of them takes the request right now, asking again at once would only spin.
    """
    if pending_request is None:
        return None
    pending_request.routing_context.should_backoff = True
    for value in [*pending_request.args, *pending_request.kwargs.values()]:
        if isinstance(value, RoutingHint):
            return value
    return None


class _PatientProbes:
    """A replica busy with a forward pass answers Ray's queue-length probe late (the engine thread holds the GIL for
    most of a step): wait up to a second at first, instead of Ray's 0.1 s, before passing it over."""

    queue_len_response_deadline_s = 1.0
    max_queue_len_response_deadline_s = 5.0


class PrefixAwareRouter(_PatientProbes, RequestRouter):
    """Longest cached prefix first, within balance thresholds (serve_ray/replica_choice.py)."""

    def initialize_state(self, **kwargs: Any) -> None:
        """kwargs: BalancePolicy's fields (RequestRouterConfig.request_router_kwargs)."""
        self.policy = BalancePolicy(**kwargs)
        self.index = PrefixIndex()
        # Per replica: the report its counts are relative to, and requests sent since.
        self.last_report: dict[ReplicaID, float] = {}
        self.sent_since_report: Counter[ReplicaID] = Counter()

    def _load(self, replica: RunningReplica) -> ReplicaLoad:
        stats = replica.routing_stats or {}
        replica_id = replica.replica_id
        reported_at = stats.get("reported_at")
        if reported_at is not None and reported_at != self.last_report.get(replica_id):
            self.last_report[replica_id] = reported_at
            self.sent_since_report[replica_id] = 0
        if "num_kv_blocks" in stats:
            self.index.set_capacity(replica_id, int(stats["num_kv_blocks"]))
        # Ray's own count of requests ongoing at the replica (updated as requests are sent, finish, or the replica
        # answers a probe) is the freshest; the replica's last report plus what was sent since stands in for it
        # where Ray has none.
        in_flight = self.replica_queue_len_cache.get(replica_id)
        if in_flight is None:
            in_flight = int(stats.get("num_active_requests", 0)) + self.sent_since_report[replica_id]
        return ReplicaLoad(in_flight, float(stats.get("kv_usage", 0.0)))

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        hint = routing_hint(pending_request)
        by_id = {replica.replica_id: replica for replica in candidate_replicas}
        loads = {replica_id: self._load(replica) for replica_id, replica in by_id.items()}
        block_hashes = hint.block_hashes if hint is not None else []
        ranked = rank_replicas(block_hashes, loads, self.index, self.policy)
        if block_hashes and ranked:
            # Recorded now, not when the request lands: requests routed in the same burst see where it went.
            self.index.record(ranked[0], block_hashes)
        return [[by_id[replica_id]] for replica_id in ranked]

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        self.sent_since_report[replica_id] += 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.forget(replica_id)
        self.last_report.pop(replica_id, None)
        self.sent_since_report.pop(replica_id, None)


class RoundRobinRouter(_PatientProbes, RequestRouter):
    """Each request to the next replica in id order: no prefix affinity, the baseline."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._counter = itertools.count()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        routing_hint(pending_request)
        ordered = sorted(candidate_replicas, key=lambda replica: replica.replica_id.unique_id)
        if not ordered:
            return []
        start = next(self._counter) % len(ordered)
        return [[replica] for replica in ordered[start:] + ordered[:start]]
