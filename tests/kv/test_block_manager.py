"""BlockManager: allocation, reference counts, chain hashing, LRU eviction, statistics."""

import pytest

from tokenriver.errors import InvalidParameterError
from tokenriver.kv.block_manager import BlockManager, hash_block_tokens


def hashes_of(manager: BlockManager, token_ids: list[int]) -> list[bytes]:
    block_hashes: list[bytes] = []
    manager.extend_block_hashes(block_hashes, token_ids)
    return block_hashes


def test_allocate_and_free_keep_free_plus_used_equal_total():
    manager = BlockManager(num_blocks=8, block_size=4)
    first = manager.allocate(3)
    second = manager.allocate(5)
    assert sorted(first + second) == list(range(8))
    assert (manager.num_free_blocks, manager.num_used_blocks, manager.usage) == (0, 8, 1.0)
    assert not manager.can_allocate(1)
    with pytest.raises(RuntimeError):
        manager.allocate(1)
    manager.free(first)
    assert (manager.num_free_blocks, manager.num_used_blocks) == (3, 5)
    assert all(manager.ref_count(b) == 0 for b in first) and all(manager.ref_count(b) == 1 for b in second)
    manager.free(second)
    assert (manager.num_free_blocks, manager.num_used_blocks, manager.usage) == (8, 0, 0.0)
    with pytest.raises(RuntimeError):
        manager.free(second[:1])


def test_num_blocks_for_rounds_up():
    manager = BlockManager(num_blocks=4, block_size=16)
    assert [manager.num_blocks_for(n) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]


def test_chain_hash_includes_everything_before_the_block():
    manager = BlockManager(num_blocks=4, block_size=2)
    a = hashes_of(manager, [1, 2, 3, 4, 5])
    b = hashes_of(manager, [9, 9, 3, 4])
    assert len(a) == 2 and len(b) == 2  # only full blocks are hashed
    assert a[1] != b[1]  # same tokens [3, 4], different prefix
    assert a[0] == hash_block_tokens(None, [1, 2]) and a[1] == hash_block_tokens(a[0], [3, 4])
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [2, 1])


def test_cached_prefix_is_reused_with_reference_counts():
    manager = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(100, 112))  # 3 full blocks
    block_hashes = hashes_of(manager, tokens)
    first = manager.allocate(3)
    manager.cache_blocks(first, block_hashes)
    assert manager.num_cached_blocks == 3
    # A second request with the same first 8 tokens and a different third block.
    other_hashes = hashes_of(manager, tokens[:8] + [7, 7, 7, 7])
    hit = manager.find_cached_blocks(other_hashes)
    assert hit == first[:2]
    assert manager.can_allocate(1, hit)
    new = manager.allocate(1, hit)
    assert [manager.ref_count(b) for b in first] == [2, 2, 1]
    assert new[0] not in first
    manager.free(first)
    assert [manager.ref_count(b) for b in first] == [1, 1, 0]
    # The freed cached block is free but still findable.
    assert manager.find_cached_blocks(block_hashes) == first
    assert manager.num_free_blocks == 8 - 3
    manager.free(hit + new)
    assert manager.num_used_blocks == 0 and manager.num_cached_blocks == 3


def test_reusing_a_free_cached_block_takes_it_out_of_the_free_count():
    manager = BlockManager(num_blocks=3, block_size=2)
    blocks = manager.allocate(3)
    block_hashes = hashes_of(manager, [1, 2, 3, 4, 5, 6])
    manager.cache_blocks(blocks, block_hashes)
    manager.free(blocks)
    hit = manager.find_cached_blocks(block_hashes[:2])
    assert manager.can_allocate(1, hit) and not manager.can_allocate(2, hit)
    new = manager.allocate(1, hit)
    # Making room for the new block must not evict the blocks being reused.
    assert new == [blocks[2]] and manager.find_cached_blocks(block_hashes) == blocks[:2]
    assert manager.num_free_blocks == 0


def test_uncached_free_blocks_are_used_before_evicting_cached_ones():
    manager = BlockManager(num_blocks=4, block_size=2)
    cached = manager.allocate(2)
    manager.cache_blocks(cached, hashes_of(manager, [1, 2, 3, 4]))
    plain = manager.allocate(2)
    manager.free(cached)
    manager.free(plain)
    again = manager.allocate(2)
    assert sorted(again) == sorted(plain)
    assert manager.num_cached_blocks == 2


def test_recently_freed_uncached_blocks_are_reused_before_untouched_ones():
    """A warm engine keeps writing into pool pages it has touched; untouched blocks are taken only when needed."""
    manager = BlockManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    assert manager.allocate(3) == [0, 1, 2]
    first = manager.allocate(4)
    manager.free(first)
    assert manager.allocate(4) == first  # in the same order: a request's blocks stay in ascending pool order
    manager.free(first[:2])
    assert manager.allocate(3) == [first[0], first[1], 7]


def test_lru_eviction_order_least_recently_freed_first_tail_before_head():
    manager = BlockManager(num_blocks=4, block_size=2)
    a_tokens, b_tokens = [1, 2, 3, 4], [5, 6, 7, 8]
    a_hashes, b_hashes = hashes_of(manager, a_tokens), hashes_of(manager, b_tokens)
    a_blocks, b_blocks = manager.allocate(2), manager.allocate(2)
    manager.cache_blocks(a_blocks, a_hashes)
    manager.cache_blocks(b_blocks, b_hashes)
    manager.free(a_blocks)  # freed first: evicted first, its tail block before its head
    manager.free(b_blocks)
    assert manager.allocate(1) == [a_blocks[1]]
    assert manager.find_cached_blocks(a_hashes) == [a_blocks[0]]
    assert manager.allocate(1) == [a_blocks[0]]
    assert manager.find_cached_blocks(a_hashes) == []
    assert manager.find_cached_blocks(b_hashes) == b_blocks
    # Touching B's head makes it recently used: B's tail goes next.
    manager.allocate(0, [b_blocks[0]])
    manager.free([b_blocks[0]])
    assert manager.allocate(1) == [b_blocks[1]]
    assert manager.find_cached_blocks(b_hashes) == [b_blocks[0]]
    assert manager.block_hash(b_blocks[1]) is None and manager.num_cached_blocks == 1


def test_a_hash_already_cached_stays_with_its_first_block():
    manager = BlockManager(num_blocks=4, block_size=2)
    block_hashes = hashes_of(manager, [1, 2])
    first, second = manager.allocate(1), manager.allocate(1)
    manager.cache_blocks(first, block_hashes)
    manager.cache_blocks(second, block_hashes)
    assert manager.block_hash(second[0]) is None
    assert manager.find_cached_blocks(block_hashes) == first
    manager.free(second)
    manager.free(first)
    assert manager.num_free_blocks == 4 and manager.num_cached_blocks == 1


def test_reset_prefix_cache_forgets_free_cached_blocks_and_refuses_while_blocks_are_held():
    manager = BlockManager(num_blocks=4, block_size=2)
    block_hashes = hashes_of(manager, [1, 2, 3, 4])
    blocks = manager.allocate(2)
    manager.cache_blocks(blocks, block_hashes)
    assert not manager.reset_prefix_cache()  # held: nothing changes
    assert manager.find_cached_blocks(block_hashes) == blocks
    manager.free(blocks)
    assert manager.reset_prefix_cache()
    assert manager.find_cached_blocks(block_hashes) == [] and manager.num_cached_blocks == 0
    assert [manager.block_hash(b) for b in blocks] == [None, None]
    # The forgotten blocks are plain free blocks again: all four can be handed out, none twice.
    assert manager.num_free_blocks == 4 and sorted(manager.allocate(4)) == [0, 1, 2, 3]


def test_prefix_caching_disabled_caches_nothing():
    manager = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    block_hashes = hashes_of(manager, [1, 2, 3, 4])
    blocks = manager.allocate(2)
    manager.cache_blocks(blocks, block_hashes)
    assert manager.find_cached_blocks(block_hashes) == [] and manager.num_cached_blocks == 0


def test_hit_statistics():
    manager = BlockManager(num_blocks=4, block_size=2)
    assert manager.prefix_cache_hit_rate == 0.0
    manager.record_prefix_query(10, 0)
    manager.record_prefix_query(10, 6)
    assert (manager.num_prefix_queried_tokens, manager.num_prefix_hit_tokens) == (20, 6)
    assert manager.prefix_cache_hit_rate == pytest.approx(0.3)


@pytest.mark.parametrize("kwargs", [{"num_blocks": 0, "block_size": 4}, {"num_blocks": 4, "block_size": 0}])
def test_bad_sizes_name_the_parameter(kwargs):
    with pytest.raises(InvalidParameterError) as error:
        BlockManager(**kwargs)
    assert error.value.param in kwargs
