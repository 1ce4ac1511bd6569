"""Sliding-window and soft-capped paged attention (models/attention.py, the native kernel's `window`).

A token at position p with window w sees positions p - w + 1 .. p (transformers' sliding-window mask). The native
kernel's decode path (single tokens, split long contexts) and chunk path (prompt chunks after a cached prefix,
tiles wholly outside the window skipped, straddling ones masked) must equal the torch path, and the torch path must
equal a dense masked softmax written out here, with and without soft-capping.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tokenriver.models.attention import AttentionMetadata, paged_attention, paged_attention_torch
from tokenriver.models.cpu.kernels import load_kernels

sys.path.insert(0, str(Path(__file__).resolve().parent / "cpu"))
from test_native_attention import BLOCK_SIZE, Batch, assert_close, assert_int8_close  # noqa: E402


@pytest.fixture(autouse=True)
def no_autograd():
    with torch.inference_mode():
        yield


WINDOWED = [
    (1, 37),  # decode past the window
    (1, 5),  # decode inside the window
    (2, 40),  # two tokens, token by token
    (24, 24),  # a whole prompt longer than the window
    (70, 70),  # several blocks of query tokens
    (45, 300),  # a chunk after a cached prefix: early tiles skipped
    (1, 1100),  # split decode: only the window's splits
]


def dense_reference(batch: Batch, window: int, softcap: float | None) -> torch.Tensor:
    """Each request's attention from the full (cache + new) keys with an explicit causal window mask."""
    query, key, value = batch.qkv.split(batch.split, dim=1)
    metadata = AttentionMetadata.build(batch.query_lens, batch.seq_lens, batch.tables, BLOCK_SIZE)
    keys_all = batch.key_cache.clone().view(-1, *batch.key_cache.shape[2:])
    values_all = batch.value_cache.clone().view(-1, *batch.value_cache.shape[2:])
    keys_all[metadata.slot_mapping] = key
    values_all[metadata.slot_mapping] = value
    outputs = []
    start = 0
    for (query_len, seq_len), blocks in zip(zip(batch.query_lens, batch.seq_lens), batch.tables):
        slots = torch.tensor([blocks[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE for t in range(seq_len)])
        k = keys_all[slots].double().transpose(0, 1)  # [kv_heads, S, D]
        v = values_all[slots].double().transpose(0, 1)
        q = query[start : start + query_len].double().transpose(0, 1)  # [heads, L, D]
        group = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        scores = q @ k.transpose(1, 2) * batch.scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        positions = torch.arange(seq_len - query_len, seq_len)[:, None]
        key_positions = torch.arange(seq_len)[None, :]
        mask = (key_positions <= positions) & (key_positions > positions - window)
        scores = scores.masked_fill(~mask, float("-inf"))
        outputs.append((scores.softmax(-1) @ v).transpose(0, 1))
        start += query_len
    return torch.cat(outputs).float()


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_torch_path_equals_a_dense_windowed_softmax(softcap):
    batch = Batch(WINDOWED, 8, 2, 32, seed=1)
    query, key, value = batch.qkv.split(batch.split, dim=1)
    metadata = AttentionMetadata.build(batch.query_lens, batch.seq_lens, batch.tables, BLOCK_SIZE)
    kv_cache = (batch.key_cache.clone(), batch.value_cache.clone())
    got = paged_attention_torch(query, key, value, kv_cache, metadata, batch.scale, window=19, softcap=softcap)
    assert_close(got, dense_reference(batch, 19, softcap), rtol=1e-5)
    native = paged_attention(query, key, value, kv_cache, metadata, batch.scale, window=19, softcap=softcap)
    assert_close(native, dense_reference(batch, 19, softcap), rtol=1e-5)


@pytest.mark.skipif(load_kernels() is None, reason="native kernels do not build on this machine")
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,window", [(8, 2, 32, 19), (4, 1, 256, 40), (9, 3, 64, 200)])
def test_native_window_equals_torch(num_heads, num_kv_heads, head_dim, window):
    batch = Batch(WINDOWED, num_heads, num_kv_heads, head_dim, seed=2)
    native, *_ = batch.run(paged_attention, window=window)
    torch_path, *_ = batch.run(paged_attention_torch, window=window)
    assert_close(native, torch_path)
    assert_close(native, dense_reference(batch, window, None), rtol=1e-5)


@pytest.mark.skipif(load_kernels() is None, reason="native kernels do not build on this machine")
def test_native_window_on_an_int8_cache_equals_torch():
    """Gemma 3's shape (head_dim 256, four query heads on one kv head) on the int8 pool, a window of 40 cutting
    through a tile of 32 keys: the torch path attends over the dequantized cache."""
    batch = Batch(WINDOWED, 4, 1, 256, seed=3, cache_dtype=torch.int8)
    native, *_ = batch.run(paged_attention, window=40)
    assert_int8_close(batch, native, window=40)


@pytest.mark.skipif(load_kernels() is None, reason="native kernels do not build on this machine")
def test_a_window_as_long_as_the_context_changes_nothing():
    batch = Batch(WINDOWED, 8, 2, 32, seed=3)
    whole, *_ = batch.run(paged_attention)
    windowed, *_ = batch.run(paged_attention, window=1100)
    assert torch.equal(whole, windowed)
