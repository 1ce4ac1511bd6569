"""The KV block pool: which blocks are free, how many requests hold each, which prefixes they cache.

Pure Python, no tensors: the block manager hands out block *ids* (0..num_blocks-1)
and the KV tensors in kv/cache.py are indexed by them. It knows nothing about
requests: the scheduler keeps each request's block table (`Request.block_ids`)
and the chain hashes of its full blocks (`Request.block_hashes`), and calls in
here with lists of ids.

Reference counts: a block held by k requests has ref_count k; at 0 it is free.

Forking (beam search): a request that continues another's tokens can `share`
its blocks (one more reference each) instead of recomputing them. A shared
block must not be written: before a request writes into a block it shares, the
scheduler gives it a fresh block and asks the runner to copy the old one first
(copy-on-write, SchedulerOutput.block_copies). Only a request's last, partial
block is ever written, so that is the only one that gets copied.

Prefix caching: once a FULL block's K/V is computed it is registered under the
chain hash of its tokens, hash(parent block's hash, its token ids). The parent's
hash makes a block's identity include everything before it, so two requests whose
first blocks hash the same have the same whole prefix and the second reuses the
blocks (ref_count + 1) instead of computing them. Only full blocks are shared and a
full block is never written again, so sharing needs no copy-on-write.

A registered block whose ref_count drops to 0 stays in the cache ("evictable"): it
counts as free, but it is handed out only when no never-registered free block is
left, least recently freed first (its hash is then forgotten).

Invariants: num_free_blocks + num_used_blocks == num_total_blocks; a block is free
exactly when its ref_count is 0; every hash in the cache names a block carrying
that hash.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from tokenriver.errors import InvalidParameterError


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Identity of one full block: its tokens and, through the parent's hash, every token before them.

    sha256 rather than Python's hash(): the cache is shared between users, and a
    forged collision would hand one user's K/V to another's prompt.
    """
    digest = hashlib.sha256(parent_hash or b"")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class BlockManager:
    """A pool of fixed-size KV blocks with reference counts and an LRU prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidParameterError(f"{name}={value!r} must be an integer >= 1", param=name)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        # The hash a block is registered under in the prefix cache, or None.
        self._block_hashes: list[bytes | None] = [None] * num_blocks
        # Free blocks that cache nothing, handed out first: a stack, the most recently freed on top (block 0 on top
        # at the start). A block used before has its pool pages resident; a block never written costs page
        # faults on its first write, the OS zeroing its memory. Handed out oldest first, every prefill went to
        # untouched blocks until the whole pool had been used once, and prefill paid for the zeroing.
        self._free_uncached: list[int] = list(range(num_blocks - 1, -1, -1))
        # Free blocks that still cache a prefix, least recently freed first: evicted in this order.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # The prefix cache: block hash → block id.
        self._cached: dict[bytes, int] = {}
        # Prefix cache statistics, in tokens, over every admission that looked up the cache.
        self.num_prefix_queried_tokens = 0
        self.num_prefix_hit_tokens = 0

    # ---- sizes and statistics ----

    @property
    def num_total_blocks(self) -> int:
        return len(self._ref_counts)

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds, including cached ones that may be evicted."""
        return len(self._free_uncached) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the pool held by requests (0..1)."""
        return self.num_used_blocks / self.num_total_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, held or not."""
        return len(self._cached)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of looked-up tokens that were served from the cache (0 before any lookup)."""
        if self.num_prefix_queried_tokens == 0:
            return 0.0
        return self.num_prefix_hit_tokens / self.num_prefix_queried_tokens

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> bytes | None:
        """The hash a block is cached under, or None."""
        return self._block_hashes[block_id]

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def record_prefix_query(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        """Count one admission's lookup (called once the request is admitted, so retries do not count twice)."""
        self.num_prefix_queried_tokens += num_queried_tokens
        self.num_prefix_hit_tokens += num_hit_tokens

    # ---- prefix cache ----

    def extend_block_hashes(self, block_hashes: list[bytes], token_ids: Sequence[int]) -> None:
        """Append the chain hash of every full block of token_ids not hashed yet (in place)."""
        size = self.block_size
        for index in range(len(block_hashes), len(token_ids) // size):
            parent = block_hashes[-1] if block_hashes else None
            block_hashes.append(hash_block_tokens(parent, token_ids[index * size : (index + 1) * size]))

    def find_cached_blocks(self, block_hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest cached prefix of block_hashes (a lookup: nothing changes)."""
        if not self.enable_prefix_caching:
            return []
        block_ids = []
        for block_hash in block_hashes:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def cache_blocks(self, block_ids: Sequence[int], block_hashes: Sequence[bytes]) -> None:
        """Register full, computed blocks under their hashes so later requests can reuse them.

        A block already registered keeps its entry; a hash another block already
        caches (two requests computed the same prefix at once) stays with that
        other block, and this block simply caches nothing.
        """
        if not self.enable_prefix_caching:
            return
        for block_id, block_hash in zip(block_ids, block_hashes):
            if self._block_hashes[block_id] is None and block_hash not in self._cached:
                self._block_hashes[block_id] = block_hash
                self._cached[block_hash] = block_id

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, so the next requests compute theirs afresh (vLLM's reset_prefix_cache).

        For measurements that must not reuse an earlier run's prompts, and after anything that changes what a
        block's K/V would be for the same tokens. Only when no request holds a block: a held block's hash is
        part of its request's table, so False is returned and nothing changes.
        """
        if self.num_used_blocks:
            return False
        for block_id in self._evictable:
            self._block_hashes[block_id] = None
            self._free_uncached.append(block_id)
        self._evictable.clear()
        self._cached.clear()
        return True

    # ---- allocation ----

    def can_allocate(self, num_new_blocks: int, reused_block_ids: Sequence[int] = ()) -> bool:
        """Whether num_new_blocks fresh blocks can be handed out after taking reused_block_ids from the cache."""
        num_revived = sum(1 for block_id in reused_block_ids if self._ref_counts[block_id] == 0)
        return num_new_blocks + num_revived <= self.num_free_blocks

    def allocate(self, num_new_blocks: int, reused_block_ids: Sequence[int] = ()) -> list[int]:
        """Take one reference on each reused (cached) block, then hand out num_new_blocks fresh ones.

        The reused blocks are taken first so that making room for the fresh ones
        cannot evict them. Callers check can_allocate first: running out here is a bug.
        """
        if not self.can_allocate(num_new_blocks, reused_block_ids):
            raise RuntimeError(
                f"asked for {num_new_blocks} blocks with {self.num_free_blocks} free: call can_allocate first"
            )
        for block_id in reused_block_ids:
            if self._ref_counts[block_id] == 0:
                del self._evictable[block_id]
            self._ref_counts[block_id] += 1
        new_block_ids = [self._take_free_block() for _ in range(num_new_blocks)]
        for block_id in new_block_ids:
            self._ref_counts[block_id] = 1
        return new_block_ids

    def share(self, block_ids: Sequence[int]) -> None:
        """Take one more reference on blocks someone already holds (a forked request reuses its parent's)."""
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0:
                raise RuntimeError(f"block {block_id} is shared while nobody holds it")
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block; blocks nobody holds become free (cached ones stay cached).

        Walked from the last block to the first so that a request's tail blocks are
        evicted before its head: a cached block is useless without the blocks before it.
        """
        for block_id in reversed(block_ids):
            if self._ref_counts[block_id] <= 0:
                raise RuntimeError(f"block {block_id} freed more often than it was allocated")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                if self._block_hashes[block_id] is None:
                    self._free_uncached.append(block_id)
                else:
                    self._evictable[block_id] = None

    def _take_free_block(self) -> int:
        if self._free_uncached:
            return self._free_uncached.pop()
        block_id, _ = self._evictable.popitem(last=False)
        del self._cached[self._block_hashes[block_id]]
        self._block_hashes[block_id] = None
        return block_id
