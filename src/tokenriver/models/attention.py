"""Paged attention, the definition: write this step's keys and values into the block pool, then let each request's
new tokens attend over its blocks.

A step is ragged (models/attention_metadata.py): request i contributes `query_lens[i]` new tokens (a prompt chunk, or
one decode token) and attends to `seq_lens[i]` tokens in all, its cached prefix plus itself. Token t of request i sits
at position `seq_lens[i] - query_lens[i] + t` and may see positions 0..that position. Here each request gathers its
blocks from the pool and runs one SDPA call, so a request's result never depends on what it is batched with.

Two variants some architectures need (Gemma 2 and 3, Mistral): a sliding window (`window` > 0: a token sees only the
last `window` positions up to its own), applied as a mask over the same blocks (the cache keeps every block, so a
prefix-cache hit is the same whatever the window), and attention-logit soft-capping (`softcap`: the scores become
softcap * tanh(scores / softcap) before the softmax).

The cache may be stored in a narrower dtype than the model computes in (a float16 or int8 pool under a float32 model,
`kv_cache_dtype`; kv/cache.py has the int8 format): keys and values are rounded once, when stored, and widened back
to the compute dtype when read, so attention computes in the query's dtype.

The fast paths (models/fast_path.py) compute the same step in fewer calls: on the CPU one native kernel writes the
keys and values and attends every token, reading each request's blocks in place (models/cpu/fast_path.py); on a GPU,
Triton kernels for the writes and the decode tokens and one SDPA call for the fresh prompts
(models/cuda/attention.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenriver.kv.cache import decode_entries, encode_int8
from tokenriver.models.attention_metadata import AttentionMetadata
from tokenriver.models.fast_path import fast_path


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    metadata: AttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its whole context (its last `window` positions when
    window > 0), with the scores soft-capped at `softcap` if given.

    query [num_tokens, num_heads, head_dim]; key/value [num_tokens, num_kv_heads, head_dim] (each may be a view
    into a wider row, such as the fused qkv projection). Returns [num_tokens, num_heads, head_dim].
    """
    fast = fast_path(query)
    output = (
        None if fast is None else fast.paged_attention(query, key, value, kv_cache, metadata, scale, window, softcap)
    )
    if output is None:
        output = paged_attention_torch(query, key, value, kv_cache, metadata, scale, window, softcap)
    return output


def paged_attention_torch(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    metadata: AttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float | None = None,
) -> torch.Tensor:
    """`paged_attention` in PyTorch ops, request by request: any dtype and device."""
    write_kv(key, value, kv_cache, metadata.slot_mapping)
    output = torch.empty_like(query, memory_format=torch.contiguous_format)  # [num_tokens, num_heads, head_dim]
    for i in range(len(metadata.query_lens)):
        attend_request(query, kv_cache, metadata, i, scale, output, window, softcap)
    return output


def write_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor
) -> None:
    """Store this step's keys and values in their slots."""
    key_cache, value_cache = kv_cache
    num_kv_heads, entry = key_cache.shape[2], key_cache.shape[3]
    encode = encode_int8 if key_cache.dtype == torch.int8 else (lambda x: x.to(key_cache.dtype))
    # [num_blocks * block_size, num_kv_heads, entry] views of the pools.
    key_cache.view(-1, num_kv_heads, entry).index_copy_(0, slot_mapping, encode(key))
    value_cache.view(-1, num_kv_heads, entry).index_copy_(0, slot_mapping, encode(value))


def attend_request(
    query: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    metadata: AttentionMetadata,
    i: int,
    scale: float,
    output: torch.Tensor,
    window: int = 0,
    softcap: float | None = None,
) -> None:
    """Request i's new tokens over its context: its blocks gathered from the pool, then SDPA (a flash kernel
    where the device has one), causal, written into its rows of output."""
    key_cache, value_cache = kv_cache
    num_kv_heads, entry = key_cache.shape[2], key_cache.shape[3]
    start = metadata.query_start_loc[i]
    query_len, seq_len = metadata.query_lens[i], metadata.seq_lens[i]
    num_blocks = (seq_len + metadata.block_size - 1) // metadata.block_size
    blocks = metadata.block_tables[i, :num_blocks]
    # [num_kv_heads, seq_len, head_dim]
    keys = decode_entries(key_cache.index_select(0, blocks).view(-1, num_kv_heads, entry)[:seq_len], query.dtype)
    values = decode_entries(value_cache.index_select(0, blocks).view(-1, num_kv_heads, entry)[:seq_len], query.dtype)
    keys, values = keys.transpose(0, 1), values.transpose(0, 1)
    # [1, num_heads, query_len, head_dim]: with a batch dimension SDPA takes its flash kernel (3-D inputs fall
    # back to the generic math path, ~10x slower on long prompts).
    q = query[start : start + query_len].transpose(0, 1).unsqueeze(0)
    keys, values = keys.unsqueeze(0), values.unsqueeze(0)
    if query_len == seq_len and (window <= 0 or window >= seq_len):
        out = attend(q, keys, values, None, scale, softcap)
    else:
        # Query t sits at position seq_len - query_len + t and sees positions up to there (the last `window`).
        positions = torch.arange(seq_len - query_len, seq_len, device=query.device)
        key_positions = torch.arange(seq_len, device=query.device)[None, :]
        mask = key_positions <= positions[:, None]
        if window > 0:
            mask = mask & (key_positions > positions[:, None] - window)
        out = attend(q, keys, values, mask[None, None], scale, softcap)
    output[start : start + query_len] = out[0].transpose(0, 1)


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """SDPA over [B, heads, L, head_dim] queries and [B, kv_heads, S, head_dim] keys/values (mask [B|1, 1, L, S]
    bool, True where a key is seen; None: causal with L == S); soft-capped scores are computed in plain ops, as
    SDPA has no soft-capping."""
    if softcap is None:
        if mask is None:
            return F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [B, heads, L, S]
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        length = scores.shape[-1]
        mask = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(values.dtype), values)
