"""Paged attention: write this step's K/V into the block pool, attend over each request's blocks.

A step is ragged: request i contributes `query_lens[i]` new tokens (a prompt
chunk, or one decode token) and attends to `seq_lens[i]` tokens in all: its
cached prefix plus itself. Token t of request i sits at position
`seq_lens[i] - query_lens[i] + t` and may see positions 0..that position.

Kernel choice (CPU): `scaled_dot_product_attention`, which dispatches to
PyTorch's flash-attention CPU kernel. Decode tokens (query length 1) of all
requests go through one batched call over their block tables gathered into a
padded [B, max_len] view with a length mask; prompt chunks go one request at a
time (they are few per step and large, so the call overhead does not matter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each one may attend to."""

    # Flat cache slot of each new token: [num_tokens] int64.
    slot_mapping: torch.Tensor
    # Tokens of each request in this step; sums to num_tokens.
    query_lens: list[int]
    # Context length of each request after this step (cached prefix + new tokens).
    seq_lens: list[int]
    # Block ids of each request, padded with 0: [num_requests, max_num_blocks] int64.
    block_tables: torch.Tensor
    block_size: int
    # Indices (into the request list) of requests whose query length is 1.
    decode_indices: list[int]
    # Indices of the other requests (prompt chunks, speculative verification).
    prefill_indices: list[int]
    # [len(decode_indices), max_decode_len] bool: which gathered slots are real; None if no decodes.
    decode_mask: torch.Tensor | None
    # [len(decode_indices), max_decode_blocks] block ids of the decode requests; None if no decodes.
    decode_block_tables: torch.Tensor | None

    @property
    def query_start_loc(self) -> list[int]:
        starts = [0]
        for length in self.query_lens:
            starts.append(starts[-1] + length)
        return starts

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int,
              device: torch.device | str = "cpu") -> "AttentionMetadata":
        """Derive slots, padding and the decode/prefill split from per-request lengths and block tables."""
        slots: list[int] = []
        for query_len, seq_len, blocks in zip(query_lens, seq_lens, block_tables):
            for position in range(seq_len - query_len, seq_len):
                slots.append(blocks[position // block_size] * block_size + position % block_size)
        max_blocks = max((len(b) for b in block_tables), default=0)
        padded = [b + [0] * (max_blocks - len(b)) for b in block_tables]
        decode_indices = [i for i, q in enumerate(query_lens) if q == 1]
        prefill_indices = [i for i, q in enumerate(query_lens) if q != 1]
        decode_mask = decode_tables = None
        if decode_indices:
            max_len = max(seq_lens[i] for i in decode_indices)
            num_blocks = (max_len + block_size - 1) // block_size
            lengths = torch.tensor([seq_lens[i] for i in decode_indices], device=device)
            # [num_decodes, num_blocks * block_size]: True where a slot holds a real token.
            decode_mask = torch.arange(num_blocks * block_size, device=device)[None, :] < lengths[:, None]
            decode_tables = torch.tensor([padded[i][:num_blocks] for i in decode_indices], dtype=torch.long,
                                         device=device)
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            query_lens=list(query_lens),
            seq_lens=list(seq_lens),
            block_tables=torch.tensor(padded, dtype=torch.long, device=device),
            block_size=block_size,
            decode_indices=decode_indices,
            prefill_indices=prefill_indices,
            decode_mask=decode_mask,
            decode_block_tables=decode_tables,
        )


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
             slot_mapping: torch.Tensor) -> None:
    """Store this step's keys and values in their slots."""
    key_cache, value_cache = kv_cache
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    # [num_blocks * block_size, num_kv_heads, head_dim] views of the pools.
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    kv_cache: tuple[torch.Tensor, torch.Tensor], metadata: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """Causal attention of each request's new tokens over its whole context.

    query [num_tokens, num_heads, head_dim]; key/value [num_tokens, num_kv_heads, head_dim].
    Returns [num_tokens, num_heads, head_dim].
    """
    write_kv(key, value, kv_cache, metadata.slot_mapping)
    key_cache, value_cache = kv_cache
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    block_size = metadata.block_size
    output = torch.empty_like(query)
    starts = metadata.query_start_loc

    if metadata.decode_indices:
        rows = torch.tensor([starts[i] for i in metadata.decode_indices], dtype=torch.long, device=query.device)
        tables = metadata.decode_block_tables
        num_decodes, num_blocks = tables.shape
        flat_tables = tables.flatten()
        # index_select, not key_cache[tables]: advanced indexing on CPU walks the whole pool (ms instead of µs).
        # [num_decodes, num_blocks * block_size, num_kv_heads, head_dim] -> [num_decodes, num_kv_heads, S, head_dim]
        keys = key_cache.index_select(0, flat_tables).view(
            num_decodes, num_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)
        values = value_cache.index_select(0, flat_tables).view(
            num_decodes, num_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)
        # [num_decodes, num_heads, 1, head_dim]
        q = query.index_select(0, rows).unsqueeze(2).to(keys.dtype)
        mask = metadata.decode_mask[:, None, None, :]  # [num_decodes, 1, 1, S]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        output.index_copy_(0, rows, out.squeeze(2).to(output.dtype))

    for i in metadata.prefill_indices:
        query_len, seq_len = metadata.query_lens[i], metadata.seq_lens[i]
        num_blocks = (seq_len + block_size - 1) // block_size
        blocks = metadata.block_tables[i, :num_blocks]
        # [num_kv_heads, seq_len, head_dim]
        keys = key_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:seq_len].transpose(0, 1)
        values = value_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:seq_len].transpose(0, 1)
        # [1, num_heads, query_len, head_dim]: with a batch dimension SDPA takes its flash kernel (3-D inputs fall
        # back to the generic math path, ~10x slower on long prompts).
        q = query[starts[i]:starts[i] + query_len].transpose(0, 1).unsqueeze(0).to(keys.dtype)
        keys, values = keys.unsqueeze(0), values.unsqueeze(0)
        if query_len == seq_len:
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        else:
            # Query t sits at position seq_len - query_len + t and sees positions up to there.
            positions = torch.arange(seq_len - query_len, seq_len, device=query.device)
            mask = torch.arange(seq_len, device=query.device)[None, :] <= positions[:, None]
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[None, None], scale=scale,
                                                 enable_gqa=True)
        output[starts[i]:starts[i] + query_len] = out[0].transpose(0, 1).to(output.dtype)
    return output
