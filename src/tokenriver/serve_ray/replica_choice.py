"""Which replica should take a request: the longest cached prefix, unless that would overload it. Plain Python.

The router cannot ask every replica what it has cached on every request, so it keeps its own picture, as SGLang's
cache-aware router does: the chained block hashes (kv/block_manager.py's `hash_block_tokens`, the same identity
the replicas' prefix caches use) of every prompt it sent to each replica, least recently used first out, at most
as many blocks per replica as its KV pool holds. A prompt's match on a replica is the number of its leading
blocks in that picture.

Load is the requests in flight to a replica (counted by the router as it sends and completes them, so it is
fresh) and its KV usage (reported by the replica). The decision, per request:
1. If the loads are out of balance (most - least > `balance_abs_threshold` and most > `balance_rel_threshold` x
   least), the least loaded replica, whatever it caches: queues first.
2. Else the replica with the longest match (ties: the lighter), provided it matches at least `min_match_blocks`,
   is not `hot_spill_threshold` requests busier than the lightest, and its KV pool is under `max_kv_usage`.
   A hot prefix that fills its replica thereby spills to the next one, which then caches it too.
3. Else the least loaded replica (ties: lower KV usage).
The chosen replica is recorded as caching the prompt's blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from tokenriver.kv.block_manager import hash_block_tokens

# Blocks remembered per replica when it has not reported its pool size.
DEFAULT_REPLICA_CAPACITY_BLOCKS = 8192


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The chain hashes of the prompt's full blocks, as a replica's prefix cache names them."""
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, token_ids[start : start + block_size]))
    return hashes


@dataclass(frozen=True)
class BalancePolicy:
    """Thresholds of the routing decision (module docstring)."""

    balance_abs_threshold: int = 8
    balance_rel_threshold: float = 1.5
    hot_spill_threshold: int = 4
    min_match_blocks: int = 1
    max_kv_usage: float = 0.95


@dataclass(frozen=True)
class ReplicaLoad:
    """What the router knows of one replica's load."""

    in_flight: int
    kv_usage: float = 0.0


class PrefixIndex:
    """Per replica, the block hashes the router believes it caches, least recently sent first."""

    def __init__(self) -> None:
        self._blocks: dict[Hashable, OrderedDict[bytes, None]] = {}
        self._capacity: dict[Hashable, int] = {}

    def set_capacity(self, replica: Hashable, num_blocks: int) -> None:
        """How many blocks the replica's pool holds: older entries beyond it are forgotten."""
        self._capacity[replica] = max(1, num_blocks)

    def match(self, replica: Hashable, block_hashes: Sequence[bytes]) -> int:
        """Leading blocks of block_hashes the replica caches."""
        cached = self._blocks.get(replica)
        if not cached:
            return 0
        matched = 0
        for block_hash in block_hashes:
            if block_hash not in cached:
                break
            matched += 1
        return matched

    def record(self, replica: Hashable, block_hashes: Sequence[bytes]) -> None:
        """The replica now caches these blocks (most recently used)."""
        cached = self._blocks.setdefault(replica, OrderedDict())
        for block_hash in block_hashes:
            cached[block_hash] = None
            cached.move_to_end(block_hash)
        capacity = self._capacity.get(replica, DEFAULT_REPLICA_CAPACITY_BLOCKS)
        while len(cached) > capacity:
            cached.popitem(last=False)

    def forget(self, replica: Hashable) -> None:
        """The replica is gone (or restarted with an empty cache)."""
        self._blocks.pop(replica, None)
        self._capacity.pop(replica, None)


def rank_replicas(
    block_hashes: Sequence[bytes], loads: dict[Hashable, ReplicaLoad], index: PrefixIndex, policy: BalancePolicy
) -> list[Hashable]:
    """The replicas in order of preference for a prompt with these block hashes (module docstring's rules)."""
    if not loads:
        return []
    by_load = sorted(loads, key=lambda r: (loads[r].in_flight, loads[r].kv_usage, str(r)))
    least, most = loads[by_load[0]].in_flight, loads[by_load[-1]].in_flight
    imbalanced = most - least > policy.balance_abs_threshold and most > policy.balance_rel_threshold * least
    if imbalanced or not block_hashes:
        return by_load
    matches = {replica: index.match(replica, block_hashes) for replica in loads}
    best = max(loads, key=lambda r: (matches[r], -loads[r].in_flight, -loads[r].kv_usage, str(r)))
    if (
        matches[best] >= policy.min_match_blocks
        and loads[best].in_flight - least <= policy.hot_spill_threshold
        and loads[best].kv_usage < policy.max_kv_usage
    ):
        return [best] + [replica for replica in by_load if replica != best]
    return by_load
