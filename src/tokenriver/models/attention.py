"""Paged attention: write this step's K/V into the block pool, attend over each request's blocks.

A step is ragged: request i contributes `query_lens[i]` new tokens (a prompt
chunk, or one decode token) and attends to `seq_lens[i]` tokens in all: its
cached prefix plus itself. Token t of request i sits at position
`seq_lens[i] - query_lens[i] + t` and may see positions 0..that position.

Kernel choice (CPU), with a float32, float16 or int8 cache (models/cpu/csrc/attention.cpp; measured against the torch
path in benchmarks/results/attention.md):
- Requests with at most `MAX_KERNEL_QUERY_LEN` new tokens (decode, short speculative
  verification): the native paged kernel one query token at a time, reading the request's keys
  and values straight from its blocks, with online softmax in float32; a long context is split
  across threads and merged. No gathered copy of the context is made.
- Longer ones (prompt chunks, longer verification): the same kernel's chunk path, a
  flash-attention loop over the blocks that serves a block of query tokens (and the query heads
  of each kv head) from every tile of keys it reads, with the causal mask applied per token.
  Both paths visit context tiles from position 0 in fixed steps, so a token's result depends only
  on which of the two computes it, not on the rest of its chunk or what it was batched with.
- Without the native kernels (bfloat16 cache, other devices, no compiler, autograd
  on), decode tokens of all requests go through one batched SDPA call over their block tables
  gathered into a padded [B, max_len] view with a length mask; on an NVIDIA GPU with Triton, through
  one kernel that reads their blocks in place instead (models/cuda/paged_decode.py), after one that
  writes the step's keys and values (models/cuda/kv_write.py). Prompt chunks
  with nothing cached before them (fresh prompts) take one causal SDPA call together, right-padded
  to the longest, with their keys and values taken from the step itself; every other request goes
  through `scaled_dot_product_attention` over its gathered blocks.

Two variants some architectures need (Gemma 2 and 3, Mistral): a sliding window (`window` > 0: a token sees only
the last `window` positions up to its own), applied as a mask on every path, native and torch, over the same blocks
(the cache keeps every block; a prefix-cache hit is the same whatever the window), and attention-logit
soft-capping (`softcap`: scores become softcap * tanh(scores / softcap) before the softmax), on every path too.

The cache may be stored in a narrower dtype than the model computes in (a float16 or int8 pool under a float32
model, `kv_cache_dtype`; kv/cache.py has the int8 format): keys and values are rounded once, when stored, and widened
back to the compute dtype when read, so every path computes in the query's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from tokenriver.kv.cache import decode_entries, encode_int8, head_dim_of
from tokenriver.models.cpu.kernels import NativeKernels, is_f32_rows, is_native_kv_pool, kernels_for

# Requests with at most this many new tokens attend token by token in the native kernel, longer ones through its
# chunk path: at one token the former is faster, at two they are even (benchmarks/results/attention.md).
MAX_KERNEL_QUERY_LEN = 2


def to_device(values: list, device: torch.device | str) -> torch.Tensor:
    """An int64 tensor of `values` (a list, or a list of equal-length lists) on `device`. To a GPU it goes through
    pinned memory without waiting: a plain copy would first wait for every kernel queued on the device, so the host
    could never prepare a step while the GPU runs the one before."""
    tensor = torch.tensor(values, dtype=torch.long)
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


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
    # One row per token of the requests with at most MAX_KERNEL_QUERY_LEN new tokens, for the native kernel:
    # (its flat token row, its request's index, the context length it sees) [num_kernel_tokens, 3] int64; None if
    # there are no such requests, or off the CPU.
    kernel_queries: torch.Tensor | None
    # One row per request with more new tokens than that (a prompt chunk), for the native kernel's chunk path:
    # (its first flat token row, its index, its number of new tokens, its context length after them)
    # [num_chunks, 4] int64; None if there are none, or off the CPU.
    kernel_chunks: torch.Tensor | None

    @cached_property
    def query_start_loc(self) -> list[int]:
        """Flat row of each request's first token, plus num_tokens at the end."""
        starts = [0]
        for length in self.query_lens:
            starts.append(starts[-1] + length)
        return starts

    @cached_property
    def decode_block_tables(self) -> torch.Tensor:
        """[len(decode_indices), max_decode_blocks] block ids of the decode requests (torch path only)."""
        max_len = max(self.seq_lens[i] for i in self.decode_indices)
        num_blocks = (max_len + self.block_size - 1) // self.block_size
        rows = to_device(self.decode_indices, self.block_tables.device)
        return self.block_tables.index_select(0, rows)[:, :num_blocks]

    @cached_property
    def decode_lengths(self) -> torch.Tensor:
        """[len(decode_indices)] int64 context length of each decode request (torch path only)."""
        return to_device([self.seq_lens[i] for i in self.decode_indices], self.block_tables.device)

    @cached_property
    def decode_mask(self) -> torch.Tensor:
        """[len(decode_indices), max_decode_blocks * block_size] bool: which gathered slots are real tokens."""
        num_slots = self.decode_block_tables.shape[1] * self.block_size
        slots = torch.arange(num_slots, device=self.block_tables.device)
        return slots[None, :] < self.decode_lengths[:, None]

    @cached_property
    def fresh_prompts(self) -> "FreshPrompts":
        """The prompt chunks with nothing cached before them, for one padded attention call (torch path only)."""
        indices = [i for i in self.prefill_indices if self.query_lens[i] == self.seq_lens[i]]
        max_len = max((self.query_lens[i] for i in indices), default=0)
        if len(indices) < 2 or len(indices) * max_len > 2 * sum(self.query_lens[i] for i in indices):
            # One prompt, or lengths so uneven that padding would be most of the work: one call per prompt.
            return FreshPrompts(indices, frozenset(indices), max_len, None, None, None)
        starts = self.query_start_loc
        rows: list[int] = []
        padded_rows: list[int] = []
        gather: list[int] = []
        for b, i in enumerate(indices):
            length = self.query_lens[i]
            rows.extend(range(starts[i], starts[i] + length))
            padded_rows.extend(range(b * max_len, b * max_len + length))
            gather.extend(starts[i] + min(j, length - 1) for j in range(max_len))
        device = self.block_tables.device
        return FreshPrompts(indices, frozenset(indices), max_len, to_device(rows, device),
                            to_device(padded_rows, device), to_device(gather, device))

    @classmethod
    def for_decode_graph(cls, slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                         block_size: int) -> "AttentionMetadata":
        """A batch of one-token decodes described by tensors alone, for a CUDA graph (runner/cuda_graphs.py): a
        graph replays the kernels it recorded on whatever its input buffers hold, so no length may be read back to
        the host. slot_mapping, seq_lens [B] and block_tables [B, num_blocks] are those buffers; the Python lists
        hold the batch's shape, each length as its upper bound num_blocks * block_size."""
        batch, num_blocks = block_tables.shape
        metadata = cls(slot_mapping=slot_mapping, query_lens=[1] * batch, seq_lens=[num_blocks * block_size] * batch,
                       block_tables=block_tables, block_size=block_size, decode_indices=list(range(batch)),
                       prefill_indices=[], kernel_queries=None, kernel_chunks=None)
        metadata.decode_block_tables = block_tables
        metadata.decode_lengths = seq_lens
        return metadata

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int,
              device: torch.device | str = "cpu",
              max_kernel_query_len: int = MAX_KERNEL_QUERY_LEN) -> "AttentionMetadata":
        """Derive slots, padding and the per-kernel split from per-request lengths and block tables.

        max_kernel_query_len: requests with at most this many new tokens go to the native kernel token by token,
        longer ones to its chunk path (benchmarks move it; the engine keeps the default).
        """
        slots: list[int] = []
        kernel_queries: list[tuple[int, int, int]] = []
        kernel_chunks: list[tuple[int, int, int, int]] = []
        row = 0
        for i, (query_len, seq_len, blocks) in enumerate(zip(query_lens, seq_lens, block_tables)):
            for position in range(seq_len - query_len, seq_len):
                slots.append(blocks[position // block_size] * block_size + position % block_size)
            if query_len <= max_kernel_query_len:
                # The token at `position` sees positions 0..position: position + 1 tokens.
                kernel_queries.extend((row + t, i, seq_len - query_len + t + 1) for t in range(query_len))
            else:
                kernel_chunks.append((row, i, query_len, seq_len))
            row += query_len
        on_cpu = torch.device(device).type == "cpu"
        max_blocks = max((len(b) for b in block_tables), default=0)
        padded = [b + [0] * (max_blocks - len(b)) for b in block_tables]
        return cls(
            slot_mapping=to_device(slots, device),
            query_lens=list(query_lens),
            seq_lens=list(seq_lens),
            block_tables=to_device(padded, device),
            block_size=block_size,
            decode_indices=[i for i, q in enumerate(query_lens) if q == 1],
            prefill_indices=[i for i, q in enumerate(query_lens) if q != 1],
            # Only the native (CPU) kernels read these: elsewhere they would be two copies to the device per step.
            kernel_queries=torch.tensor(kernel_queries, dtype=torch.long) if kernel_queries and on_cpu else None,
            kernel_chunks=torch.tensor(kernel_chunks, dtype=torch.long) if kernel_chunks and on_cpu else None,
        )


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
             slot_mapping: torch.Tensor) -> None:
    """Store this step's keys and values in their slots."""
    key_cache, value_cache = kv_cache
    writer = _kv_writer(key, value, key_cache)
    if writer is not None:
        writer.write_kv(key, value, key_cache, value_cache, slot_mapping)
        return
    num_kv_heads, entry = key_cache.shape[2], key_cache.shape[3]
    encode = encode_int8 if key_cache.dtype == torch.int8 else (lambda x: x.to(key_cache.dtype))
    # [num_blocks * block_size, num_kv_heads, entry] views of the pools.
    key_cache.view(-1, num_kv_heads, entry).index_copy_(0, slot_mapping, encode(key))
    value_cache.view(-1, num_kv_heads, entry).index_copy_(0, slot_mapping, encode(value))


def _native_kernels_for(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        kv_cache: tuple[torch.Tensor, torch.Tensor]) -> NativeKernels | None:
    """The native kernels if they can run this call as laid out, else None."""
    kernels = kernels_for(query)
    key_cache, value_cache = kv_cache
    if (kernels is None or torch.is_grad_enabled() or not is_native_kv_pool(key_cache, value_cache)
            or not (is_f32_rows(query) and is_f32_rows(key) and is_f32_rows(value))):
        return None
    num_kv_heads, head_dim = key_cache.shape[2], head_dim_of(key_cache)
    if (head_dim not in kernels.attention_head_dims or query.shape[2] != head_dim
            or key.shape[1:] != (num_kv_heads, head_dim) or value.shape[1:] != (num_kv_heads, head_dim)):
        return None
    return kernels


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    kv_cache: tuple[torch.Tensor, torch.Tensor], metadata: AttentionMetadata,
                    scale: float, window: int = 0, softcap: float | None = None) -> torch.Tensor:
    """Causal attention of each request's new tokens over its whole context (its last `window` positions when
    window > 0), with the scores soft-capped at `softcap` if given.

    query [num_tokens, num_heads, head_dim]; key/value [num_tokens, num_kv_heads, head_dim] (each may be a view
    into a wider row, such as the fused qkv projection). Returns [num_tokens, num_heads, head_dim].
    """
    kernels = _native_kernels_for(query, key, value, kv_cache)
    if kernels is None:
        return paged_attention_torch(query, key, value, kv_cache, metadata, scale, window, softcap)
    key_cache, value_cache = kv_cache
    output = torch.empty(query.shape, dtype=query.dtype)  # [num_tokens, num_heads, head_dim]
    # Writes every token's K/V, then attends: the short requests token by token, the prompt chunks causally.
    kernels.paged_attention(query, key, value, metadata.slot_mapping, key_cache, value_cache, metadata.block_tables,
                            metadata.kernel_queries, metadata.kernel_chunks, scale, output, window, softcap)
    return output


def paged_attention_torch(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          kv_cache: tuple[torch.Tensor, torch.Tensor], metadata: AttentionMetadata,
                          scale: float, window: int = 0, softcap: float | None = None) -> torch.Tensor:
    """`paged_attention` in PyTorch ops: any dtype and device (see the module docstring)."""
    write_kv(key, value, kv_cache, metadata.slot_mapping)
    key_cache, value_cache = kv_cache
    output = torch.empty_like(query, memory_format=torch.contiguous_format)  # [num_tokens, num_heads, head_dim]
    if metadata.decode_indices:
        # Every token a decode (a decode batch, a CUDA graph's): their rows are the query's rows, no gather.
        all_decodes = len(metadata.decode_indices) == len(metadata.query_lens)
        starts = metadata.query_start_loc
        rows = None if all_decodes else to_device([starts[i] for i in metadata.decode_indices], query.device)
        q = query if rows is None else query.index_select(0, rows)  # [num_decodes, num_heads, head_dim]
        decode = _paged_decode(query, key_cache)
        if decode is not None:
            out = decode.paged_decode_attention(q, key_cache, value_cache, metadata.decode_block_tables,
                                                metadata.decode_lengths, scale, window, softcap,
                                                out=output if rows is None else None)
        else:
            out = _attend_decodes_gathered(q, kv_cache, metadata, scale, window, softcap)
        if rows is not None:
            output.index_copy_(0, rows, out)
        elif out is not output:
            output.copy_(out)
    _attend_prompts(query, key, value, kv_cache, metadata, scale, output, window, softcap)
    return output


def _attend_decodes_gathered(q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                             metadata: AttentionMetadata, scale: float, window: int,
                             softcap: float | None) -> torch.Tensor:
    """The decode tokens q [num_decodes, num_heads, head_dim] over their blocks gathered into a padded view, with a
    length mask, in one SDPA call."""
    key_cache, value_cache = kv_cache
    num_kv_heads, entry = key_cache.shape[2], key_cache.shape[3]
    tables = metadata.decode_block_tables
    num_decodes, num_blocks = tables.shape
    flat_tables = tables.flatten()
    # index_select, not key_cache[tables]: advanced indexing on CPU walks the whole pool (ms instead of µs).
    # [num_decodes, num_blocks * block_size, num_kv_heads, entry] -> [num_decodes, num_kv_heads, S, head_dim]
    keys = decode_entries(key_cache.index_select(0, flat_tables).view(
        num_decodes, num_blocks * metadata.block_size, num_kv_heads, entry), q.dtype).transpose(1, 2)
    values = decode_entries(value_cache.index_select(0, flat_tables).view(
        num_decodes, num_blocks * metadata.block_size, num_kv_heads, entry), q.dtype).transpose(1, 2)
    mask = metadata.decode_mask  # [num_decodes, S]
    if window > 0:
        lengths = metadata.decode_lengths
        mask = mask & (torch.arange(mask.shape[1], device=q.device)[None, :] >= lengths[:, None] - window)
    if softcap is None:
        # Each kv head's group of query heads as its query rows: plain attention with a mask, which a GPU's
        # memory-efficient kernel takes (grouped heads with a mask leave SDPA only its unfused math path).
        grouped = q.reshape(num_decodes, num_kv_heads, -1, q.shape[2])  # [num_decodes, num_kv_heads, group, hd]
        return F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask[:, None, None, :],
                                              scale=scale).reshape(q.shape)
    return _attend(q.unsqueeze(2), keys, values, mask[:, None, None, :], scale, softcap).squeeze(2)


def _paged_decode(query: torch.Tensor, key_cache: torch.Tensor):
    """models/cuda/paged_decode.py where it takes this layer's decode tokens (a CUDA tensor, Triton, a cache in the
    query's dtype), else None. Imported on first use: a CPU run never loads Triton."""
    if not query.is_cuda or torch.is_grad_enabled():
        return None
    from tokenriver.models.cuda import paged_decode

    return paged_decode if paged_decode.triton is not None and paged_decode.fits(query, key_cache) else None


def _kv_writer(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor):
    """models/cuda/kv_write.py where it takes this layer's cache write (a CUDA tensor, Triton, a cache in the
    keys' dtype), else None. Imported on first use: a CPU run never loads Triton."""
    if not key.is_cuda or torch.is_grad_enabled():
        return None
    from tokenriver.models.cuda import kv_write

    return kv_write if kv_write.triton is not None and kv_write.fits(key, value, key_cache) else None


def _attend_prompts(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    kv_cache: tuple[torch.Tensor, torch.Tensor], metadata: AttentionMetadata, scale: float,
                    output: torch.Tensor, window: int, softcap: float | None) -> None:
    """The step's prompt chunks: the fresh ones (no cached prefix) in one padded SDPA call where that applies
    (`_attend_fresh_prompts`), every other one over its gathered blocks."""
    fresh = metadata.fresh_prompts
    batched = (fresh.rows is not None and softcap is None and (window <= 0 or window >= fresh.max_len)
               and kv_cache[0].dtype == query.dtype and query.dim() == 3)
    if batched:
        _attend_fresh_prompts(query, key, value, fresh, scale, output)
    for i in metadata.prefill_indices:
        if not (batched and i in fresh.index_set):
            _attend_prompt(query, kv_cache, metadata, i, scale, output, window, softcap)


@dataclass
class FreshPrompts:
    """The prompt chunks of a step that start at position 0, laid out for one padded batch: B requests, each
    right-padded to the longest (L tokens). Causal attention from the top-left never lets a real token see the
    padding after it, so padded rows are computed and dropped."""

    indices: list[int]  # requests, in the step's order
    index_set: frozenset[int]
    max_len: int
    # None where they run one call each (a single prompt, or padding that would outweigh the prompts).
    rows: torch.Tensor | None  # [num_fresh_tokens] their flat rows
    padded_rows: torch.Tensor | None  # [num_fresh_tokens] each one's row in the [B * L] padded batch
    gather: torch.Tensor | None  # [B * L] the flat row each padded row copies (a padding row copies its last token)


def _attend_fresh_prompts(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, fresh: FreshPrompts,
                          scale: float, output: torch.Tensor) -> None:
    """Causal SDPA of every fresh prompt in one call: their keys and values are this step's own (nothing before
    them is cached), so they come from `key` and `value` directly, not from the pool."""
    batch, length = len(fresh.indices), fresh.max_len

    def padded(x: torch.Tensor) -> torch.Tensor:  # [T, heads, d] -> [B, heads, L, d]
        return x.index_select(0, fresh.gather).view(batch, length, x.shape[1], x.shape[2]).transpose(1, 2)

    out = _attend(padded(query), padded(key), padded(value), None, scale, None)  # [B, heads, L, d]
    out = out.transpose(1, 2).reshape(batch * length, query.shape[1], query.shape[2])
    output.index_copy_(0, fresh.rows, out.index_select(0, fresh.padded_rows))


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float,
            softcap: float | None) -> torch.Tensor:
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


def _attend_prompt(query: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], metadata: AttentionMetadata,
                   i: int, scale: float, output: torch.Tensor, window: int = 0,
                   softcap: float | None = None) -> None:
    """SDPA (flash) of request i's new tokens over its gathered blocks, written into its rows of output."""
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
    q = query[start:start + query_len].transpose(0, 1).unsqueeze(0)
    keys, values = keys.unsqueeze(0), values.unsqueeze(0)
    if query_len == seq_len and (window <= 0 or window >= seq_len):
        out = _attend(q, keys, values, None, scale, softcap)
    else:
        # Query t sits at position seq_len - query_len + t and sees positions up to there (the last `window`).
        positions = torch.arange(seq_len - query_len, seq_len, device=query.device)
        key_positions = torch.arange(seq_len, device=query.device)[None, :]
        mask = key_positions <= positions[:, None]
        if window > 0:
            mask = mask & (key_positions > positions[:, None] - window)
        out = _attend(q, keys, values, mask[None, None], scale, softcap)
    output[start:start + query_len] = out[0].transpose(0, 1)
