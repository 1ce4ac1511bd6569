"""The routing rules and metric merging, without Ray: plain data in, a ranking (or text) out."""

from __future__ import annotations

from tokenriver.kv.block_manager import BlockManager
from tokenriver.serve_ray.messages import stream_error_event
from tokenriver.serve_ray.metrics import aggregate, label_replica
from tokenriver.serve_ray.replica_choice import (
    BalancePolicy,
    PrefixIndex,
    ReplicaLoad,
    prompt_block_hashes,
    rank_replicas,
)

POLICY = BalancePolicy(balance_abs_threshold=8, balance_rel_threshold=1.5, hot_spill_threshold=4)


def test_block_hashes_are_the_block_managers():
    tokens = list(range(100))
    manager = BlockManager(16, block_size=16)
    expected: list[bytes] = []
    manager.extend_block_hashes(expected, tokens)
    assert prompt_block_hashes(tokens, 16) == expected
    assert len(expected) == 6  # full blocks only


def test_longest_cached_prefix_wins():
    index = PrefixIndex()
    shared = prompt_block_hashes(list(range(64)), 16)
    index.record("a", shared[:2])
    index.record("b", shared)
    loads = {"a": ReplicaLoad(0), "b": ReplicaLoad(1)}
    assert rank_replicas(shared, loads, index, POLICY)[0] == "b"


def test_no_match_goes_to_the_least_loaded():
    index = PrefixIndex()
    loads = {"a": ReplicaLoad(3), "b": ReplicaLoad(1), "c": ReplicaLoad(2)}
    assert rank_replicas(prompt_block_hashes(list(range(32)), 16), loads, index, POLICY) == ["b", "c", "a"]


def test_a_hot_prefix_spills_once_its_replica_is_busier_by_the_threshold():
    index = PrefixIndex()
    hot = prompt_block_hashes(list(range(64)), 16)
    index.record("a", hot)
    assert rank_replicas(hot, {"a": ReplicaLoad(4), "b": ReplicaLoad(0)}, index, POLICY)[0] == "a"
    assert rank_replicas(hot, {"a": ReplicaLoad(5), "b": ReplicaLoad(0)}, index, POLICY)[0] == "b"


def test_imbalance_overrides_affinity_and_full_kv_pools_are_avoided():
    index = PrefixIndex()
    hashes = prompt_block_hashes(list(range(64)), 16)
    index.record("a", hashes)
    loose = BalancePolicy(balance_abs_threshold=2, balance_rel_threshold=1.5, hot_spill_threshold=100)
    assert rank_replicas(hashes, {"a": ReplicaLoad(10), "b": ReplicaLoad(1)}, index, loose)[0] == "b"
    assert rank_replicas(hashes, {"a": ReplicaLoad(0, kv_usage=0.99), "b": ReplicaLoad(0)}, index, POLICY)[0] == "b"


def test_index_forgets_least_recent_blocks_beyond_capacity_and_dead_replicas():
    index = PrefixIndex()
    index.set_capacity("a", 2)
    first, second = prompt_block_hashes(list(range(32)), 16), prompt_block_hashes(list(range(100, 132)), 16)
    index.record("a", first)
    index.record("a", second)
    assert index.match("a", first) == 0 and index.match("a", second) == 2
    index.forget("a")
    assert index.match("a", second) == 0


def test_metrics_sum_across_replicas_and_label_each():
    one = (
        "# HELP tokenriver_prefix_cache_hit_tokens_total x\n# TYPE tokenriver_prefix_cache_hit_tokens_total counter\n"
        "tokenriver_prefix_cache_hit_tokens_total 10\ntokenriver_prefix_cache_queried_tokens_total 40\n"
        'tokenriver_prefix_cache_hit_rate 0.25\ntokenriver_http_requests_total{endpoint="/v1",status="200"} 3\n'
        'tokenriver_http_requests_created{endpoint="/v1",status="200"} 1.7e9\n'
    )
    two = (
        "tokenriver_prefix_cache_hit_tokens_total 30\ntokenriver_prefix_cache_queried_tokens_total 40\n"
        'tokenriver_prefix_cache_hit_rate 0.75\ntokenriver_http_requests_total{endpoint="/v1",status="200"} 4\n'
    )
    merged = aggregate([one, two])
    assert "tokenriver_prefix_cache_hit_tokens_total 40\n" in merged
    assert "tokenriver_prefix_cache_hit_rate 0.5\n" in merged
    assert 'tokenriver_http_requests_total{endpoint="/v1",status="200"} 7\n' in merged
    assert "_created" not in merged
    assert merged.index("# TYPE tokenriver_prefix_cache_hit_tokens_total") < merged.index(
        "tokenriver_prefix_cache_hit_tokens_total 40"
    )
    labelled = label_replica(two, "r1")
    assert 'tokenriver_http_requests_total{replica="r1",endpoint="/v1",status="200"} 4\n' in labelled
    assert 'tokenriver_prefix_cache_hit_rate{replica="r1"} 0.75\n' in labelled


def test_stream_error_event_is_openai_shaped():
    assert stream_error_event("gone") == (
        b'data: {"error": {"message": "gone", "type": "server_error", "param": null, '
        b'"code": "replica_failed"}}\n\ndata: [DONE]\n\n'
    )
