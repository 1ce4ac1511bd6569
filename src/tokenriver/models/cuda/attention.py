"""Paged attention on a GPU: the definition (models/attention.py) regrouped into as few launches as the step allows.

The definition attends request by request. A GPU's step runs:
- the step's keys and values into their slots: one Triton kernel for both caches (kv_write.py) where the cache
  holds the keys' dtype, else the definition's index_copy_ (an int8 cache, whose entries carry a scale);
- every decode token at once: the Triton kernel that reads each request's blocks in place (paged_decode.py) where
  the cache holds the query's dtype; else (an int8 cache) one SDPA call over the decode requests' blocks gathered
  into a padded view with a length mask;
- the prompt chunks with nothing cached before them (fresh prompts) in one causal SDPA call, right-padded to the
  longest, their keys and values taken from the step itself; every other chunk (after a cached prefix, or when
  padding would outweigh the prompts) as the definition attends it, over its gathered blocks.
The Triton kernels run on CUDA tensors only; on others (the tests' CPU tensors) those parts take their PyTorch form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenriver.kv.cache import decode_entries
from tokenriver.models.attention import attend, attend_request, write_kv
from tokenriver.models.attention_metadata import AttentionMetadata, FreshPrompts, to_device
from tokenriver.models.cuda import kv_write, paged_decode


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
    """models/attention.py's paged_attention, the same contract, grouped as the module docstring says."""
    key_cache, value_cache = kv_cache
    if _takes_triton(key) and kv_write.fits(key, value, key_cache):
        kv_write.write_kv(key, value, key_cache, value_cache, metadata.slot_mapping)
    else:
        write_kv(key, value, kv_cache, metadata.slot_mapping)
    output = torch.empty_like(query, memory_format=torch.contiguous_format)  # [num_tokens, num_heads, head_dim]
    if metadata.decode_indices:
        _attend_decodes(query, kv_cache, metadata, scale, window, softcap, output)
    fresh = metadata.fresh_prompts
    batched = (
        fresh.rows is not None
        and softcap is None
        and (window <= 0 or window >= fresh.max_len)
        and key_cache.dtype == query.dtype
        and query.dim() == 3
    )
    if batched:
        _attend_fresh_prompts(query, key, value, fresh, scale, output)
    for i in metadata.prefill_indices:
        if not (batched and i in fresh.index_set):
            attend_request(query, kv_cache, metadata, i, scale, output, window, softcap)
    return output


def _takes_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and paged_decode.triton is not None


def _attend_decodes(
    query: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    metadata: AttentionMetadata,
    scale: float,
    window: int,
    softcap: float | None,
    output: torch.Tensor,
) -> None:
    """The decode tokens, all at once, into their rows of output."""
    key_cache, value_cache = kv_cache
    # Every token a decode (a decode batch, a CUDA graph's): their rows are the query's rows, no gather.
    all_decodes = len(metadata.decode_indices) == len(metadata.query_lens)
    starts = metadata.query_start_loc
    rows = None if all_decodes else to_device([starts[i] for i in metadata.decode_indices], query.device)
    q = query if rows is None else query.index_select(0, rows)  # [num_decodes, num_heads, head_dim]
    if _takes_triton(query) and paged_decode.fits(q, key_cache):
        out = paged_decode.paged_decode_attention(
            q,
            key_cache,
            value_cache,
            metadata.decode_block_tables,
            metadata.decode_lengths,
            scale,
            window,
            softcap,
            out=output if rows is None else None,
        )
    else:
        out = _attend_decodes_gathered(q, kv_cache, metadata, scale, window, softcap)
    if rows is not None:
        output.index_copy_(0, rows, out)
    elif out is not output:
        output.copy_(out)


def _attend_decodes_gathered(
    q: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    metadata: AttentionMetadata,
    scale: float,
    window: int,
    softcap: float | None,
) -> torch.Tensor:
    """The decode tokens q [num_decodes, num_heads, head_dim] over their blocks gathered into a padded view, with a
    length mask, in one SDPA call."""
    key_cache, value_cache = kv_cache
    num_kv_heads, entry = key_cache.shape[2], key_cache.shape[3]
    tables = metadata.decode_block_tables
    num_decodes, num_blocks = tables.shape
    flat_tables = tables.flatten()
    # [num_decodes, num_blocks * block_size, num_kv_heads, entry] -> [num_decodes, num_kv_heads, S, head_dim]
    keys = decode_entries(
        key_cache.index_select(0, flat_tables).view(num_decodes, num_blocks * metadata.block_size, num_kv_heads, entry),
        q.dtype,
    ).transpose(1, 2)
    values = decode_entries(
        value_cache.index_select(0, flat_tables).view(
            num_decodes, num_blocks * metadata.block_size, num_kv_heads, entry
        ),
        q.dtype,
    ).transpose(1, 2)
    mask = metadata.decode_mask  # [num_decodes, S]
    if window > 0:
        lengths = metadata.decode_lengths
        mask = mask & (torch.arange(mask.shape[1], device=q.device)[None, :] >= lengths[:, None] - window)
    if softcap is None:
        # Each kv head's group of query heads as its query rows: plain attention with a mask, which a GPU's
        # memory-efficient kernel takes (grouped heads with a mask leave SDPA only its unfused math path).
        grouped = q.reshape(num_decodes, num_kv_heads, -1, q.shape[2])  # [num_decodes, num_kv_heads, group, hd]
        return F.scaled_dot_product_attention(
            grouped, keys, values, attn_mask=mask[:, None, None, :], scale=scale
        ).reshape(q.shape)
    return attend(q.unsqueeze(2), keys, values, mask[:, None, None, :], scale, softcap).squeeze(2)


def _attend_fresh_prompts(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, fresh: FreshPrompts, scale: float, output: torch.Tensor
) -> None:
    """Causal SDPA of every fresh prompt in one call: their keys and values are this step's own (nothing before
    them is cached), so they come from `key` and `value` directly, not from the pool."""
    batch, length = len(fresh.indices), fresh.max_len

    def padded(x: torch.Tensor) -> torch.Tensor:  # [T, heads, d] -> [B, heads, L, d]
        return x.index_select(0, fresh.gather).view(batch, length, x.shape[1], x.shape[2]).transpose(1, 2)

    out = attend(padded(query), padded(key), padded(value), None, scale, None)  # [B, heads, L, d]
    out = out.transpose(1, 2).reshape(batch * length, query.shape[1], query.shape[2])
    output.index_copy_(0, fresh.rows, out.index_select(0, fresh.padded_rows))
