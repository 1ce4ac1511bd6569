"""Prompt chunks with nothing cached before them (fresh prompts) attend in one padded SDPA call on a GPU
(models/cuda/attention.py, `_attend_fresh_prompts`): each must get what it gets attending alone, whatever else the
step holds. Checked on the CPU, where the GPU's route takes its PyTorch form."""

from __future__ import annotations

import pytest
import torch

from tokenriver.models.attention_metadata import AttentionMetadata
from tokenriver.models.cuda import attention as gpu_attention

BLOCK_SIZE = 16


def _step(
    requests: list[tuple[int, int]], num_heads: int = 6, num_kv_heads: int = 2, head_dim: int = 32, seed: int = 0
):
    """Random caches, q/k/v as views of one qkv tensor, and block tables for (query_len, seq_len) requests."""
    generator = torch.Generator().manual_seed(seed)
    tables, next_block = [], 0
    for _, seq_len in requests:
        count = -(-seq_len // BLOCK_SIZE)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    shape = (next_block + 1, BLOCK_SIZE, num_kv_heads, head_dim)
    cache = (torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
    qkv = torch.randn(sum(q for q, _ in requests), num_heads + 2 * num_kv_heads, head_dim, generator=generator)
    return tables, cache, qkv.split((num_heads, num_kv_heads, num_kv_heads), dim=1)


def _attend(requests, tables, cache, qkv, rows=None, window=0):
    query, key, value = (x if rows is None else x[rows] for x in qkv)
    metadata = AttentionMetadata.build([q for q, _ in requests], [s for _, s in requests], tables, BLOCK_SIZE)
    kv_cache = (cache[0].clone(), cache[1].clone())
    return gpu_attention.paged_attention(query, key, value, kv_cache, metadata, 0.3, window), metadata


@pytest.mark.parametrize("window", [0, 40])
def test_each_fresh_prompt_gets_what_it_gets_alone(window):
    requests = [(30, 30), (1, 40), (17, 17), (9, 25), (45, 45), (1, 1)]  # fresh, decode, fresh, after a prefix...
    tables, cache, qkv = _step(requests)
    with torch.inference_mode():
        together, metadata = _attend(requests, tables, cache, qkv, window=window)
        assert metadata.fresh_prompts.indices == [0, 2, 4] and metadata.fresh_prompts.rows is not None
        start = 0
        for request, table in zip(requests, tables):
            rows = torch.arange(start, start + request[0])
            alone, _ = _attend([request], [table], cache, qkv, rows, window)
            assert torch.allclose(together[rows], alone, rtol=1e-5, atol=1e-5)
            start += request[0]


def test_uneven_fresh_prompts_run_one_call_each():
    requests = [(3, 3), (90, 90), (2, 2)]  # padding to 90 would be most of the work
    tables, cache, qkv = _step(requests)
    with torch.inference_mode():
        _, metadata = _attend(requests, tables, cache, qkv)
    assert metadata.fresh_prompts.indices == [0, 1, 2] and metadata.fresh_prompts.rows is None
