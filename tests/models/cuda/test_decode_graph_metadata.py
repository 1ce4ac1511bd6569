"""A CUDA graph's decode metadata (AttentionMetadata.for_decode_graph) describes its batch by tensors alone, padded
to the graph's bucket: the GPU's attention over it (models/cuda/attention.py) must equal the definition over the
step's own metadata. Checked on the CPU, where the GPU's route takes its PyTorch form."""

from __future__ import annotations

import pytest
import torch

from tokenriver.kv.cache import KVCache
from tokenriver.models.attention import paged_attention_torch
from tokenriver.models.attention_metadata import AttentionMetadata
from tokenriver.models.cuda import attention as gpu_attention

BLOCK = 4
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


@pytest.mark.parametrize("window", [0, 5])
def test_padded_graph_metadata_attends_like_the_steps_own(window):
    torch.manual_seed(0)
    lengths = [3, 9, 14]  # context after this step's one token each
    tables = [[5], [0, 2, 7], [1, 3, 4, 6]]
    cache = KVCache(1, 9, BLOCK, KV_HEADS, HEAD_DIM, torch.float32, padding_block=True)
    cache[0][0].normal_()
    cache[0][1].normal_()
    query = torch.randn(3, HEADS, HEAD_DIM)
    key, value = torch.randn(3, KV_HEADS, HEAD_DIM), torch.randn(3, KV_HEADS, HEAD_DIM)
    own = AttentionMetadata.build([1, 1, 1], lengths, tables, BLOCK)
    want = paged_attention_torch(query, key, value, cache[0], own, 0.35, window)

    # The graph's buffers: two more columns of stale block ids, masked off by the lengths.
    padded = torch.tensor([t + [8] * (6 - len(t)) for t in tables])
    graph = AttentionMetadata.for_decode_graph(own.slot_mapping.clone(), padded, torch.tensor(lengths), BLOCK)
    got = gpu_attention.paged_attention(query, key, value, cache[0], graph, 0.35, window)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_the_padding_block_lies_past_the_blocks_the_manager_hands_out():
    cache = KVCache(2, 9, BLOCK, KV_HEADS, HEAD_DIM, torch.float32, padding_block=True)
    assert cache.num_blocks == 9 and cache[0][0].shape[0] == 10
    assert cache.padding_slot == 9 * BLOCK
    assert KVCache(2, 9, BLOCK, KV_HEADS, HEAD_DIM, torch.float32).padding_slot is None
