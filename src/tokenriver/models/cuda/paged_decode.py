"""Decode attention over the paged KV cache on NVIDIA GPUs, in Triton kernels.

A decode token attends to every cached key of its request. Through PyTorch ops that means gathering each request's
blocks into a padded copy of its context (keys and values written once and read twice more), building a length
mask, then SDPA: several kernels, and memory traffic that grows with the batch's longest context. This kernel reads
each request's keys and values straight from its blocks, through its block table, once.

One program per (request, kv head, partition) serves the query heads of that kv head's group (grouped-query
attention) from every key it loads. A partition is PARTITION consecutive positions of the context, walked in tiles
with an online softmax in float32. A 16-bit cache goes through the tensor cores: the group's query heads, padded
to the 16 rows an MMA takes, against a tile of keys (scores accumulated in float32), then the tile's probabilities,
rounded to the cache's dtype as flash attention rounds them, against its values. Through CUDA cores the same
products are a broadcast and a reduction across threads per tile, which made a batch's decode attention the step's
heaviest kernel. A float32 cache keeps float32 sums of products on the CUDA cores, exact. Tiles past a request's
context, and before a sliding window's first position, are skipped. Soft-capping applies
softcap * tanh(score / softcap) before the softmax.

Contexts longer than one partition are split so that a long context in a small batch (one user, a long chat) still
spreads over the GPU's multiprocessors: each partition writes its running maximum, sum and weighted values, and a
second kernel merges the partitions in order. The partition size is fixed, never chosen from the batch, so a
request's result depends on its own context only: a partition with no position of the context merges as an exact
no-op, and a context of one partition gets the same bits whether its batch was split or not. The block table's
width, rounded up to a power of two, is a compile-time bound (a few widths share one compiled kernel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

# Elements of the [group, tile, head_dim] product one loop iteration holds on the CUDA cores: the tile of context
# positions is as long as keeps it in registers, between MIN_TILE and MAX_TILE positions.
TILE_ELEMENTS = 8192
MIN_TILE, MAX_TILE = 16, 64
# Rows of a tensor-core product (the group's query heads padded to it), and the elements of a [tile, head_dim] key
# or value tile a program holds there.
MMA_ROWS = 16
MMA_TILE_ELEMENTS = 8192
# Positions of a partition (module docstring): a multiple of MAX_TILE. Fixed: results must not depend on the batch.
PARTITION = 512
# The window of a layer without one: longer than any context.
NO_WINDOW = 2**31 - 1


def fits(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether the kernel takes this call: the cache in the query's dtype (not int8), whole heads, and the query's
    heads a multiple of the cache's."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    return (
        query.dim() == 3
        and query.stride(2) == 1
        and key_cache.dtype == query.dtype
        and query.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and query.shape[2] == head_dim
        and query.shape[1] % num_kv_heads == 0
        and key_cache.is_contiguous()
    )


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [B, num_heads, head_dim] (one token per request); key_cache, value_cache [num_blocks, block_size,
    num_kv_heads, head_dim]; block_tables [B, max_blocks] and seq_lens [B] int64 on the GPU (the context each
    token sees, itself included). Returns [B, num_heads, head_dim] in the query's dtype: `out` where given (a
    contiguous tensor of that shape and dtype, written in place: no copy into the caller's buffer after)."""
    batch, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    shape = _Tiles.choose(key_cache.dtype, group, head_dim)
    tile = shape.tile
    out = _output_for(query, out)
    if batch == 0:
        return out
    max_len = max(tile, triton.next_power_of_2(block_tables.shape[1] * block_size))
    span = min(PARTITION, max_len)  # positions a program walks
    partitions = max_len // span
    # One partition: the final values straight into out. Several: each partition's running maximum and sum [B,
    # heads, partitions] and weighted values [B, heads, partitions, head_dim], merged by _merge_kernel.
    split = partitions > 1
    maxima = sums = values = out  # unread with one partition
    if split:
        maxima = torch.empty((batch, num_heads, partitions), dtype=torch.float32, device=query.device)
        sums = torch.empty_like(maxima)
        values = torch.empty((batch, num_heads, partitions, head_dim), dtype=torch.float32, device=query.device)
    _decode_kernel[(batch, num_kv_heads, partitions)](
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        out,
        maxima,
        sums,
        values,
        scale,
        window if window > 0 else NO_WINDOW,
        softcap or 0.0,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        block_size,
        group,
        head_dim,
        GROUP=shape.group_pad,
        DIM=shape.dim_pad,
        TILE=tile,
        SPAN=span,
        HAS_SOFTCAP=softcap is not None,
        SPLIT=split,
        ON_TENSOR_CORES=shape.on_tensor_cores,
        num_warps=4,
    )
    if split:
        _merge_partitions(maxima, sums, values, out, shape.dim_pad)
    return out


def _merge_partitions(
    maxima: torch.Tensor, sums: torch.Tensor, values: torch.Tensor, out: torch.Tensor, dim_pad: int
) -> None:
    """Each head's partitions ([B, heads, partitions] maxima and sums, [B, heads, partitions, head_dim] values)
    merged in order into out [B, heads, head_dim] (_merge_kernel)."""
    batch, num_heads, partitions = maxima.shape
    _merge_kernel[(batch, num_heads)](
        maxima,
        sums,
        values,
        out,
        out.stride(0),
        out.stride(1),
        out.shape[2],
        DIM=dim_pad,
        PARTITIONS=partitions,
        num_warps=1,
    )


def _output_for(query: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """`out` where it can take the result in place (a contiguous tensor of the query's shape and dtype), else a new
    tensor; any other `out` is a caller's bug."""
    if out is None:
        return torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if out.shape != query.shape or out.dtype != query.dtype or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {query.dtype} tensor of shape {tuple(query.shape)}, got "
            f"{out.dtype} {tuple(out.shape)}"
        )
    return out


@dataclass(frozen=True)
class _Tiles:
    """How _decode_kernel walks a partition: the group's query heads and head_dim padded to powers of two, and the
    positions of one tile."""

    group_pad: int
    dim_pad: int
    tile: int
    # A 16-bit cache multiplies on the tensor cores (module docstring), a float32 one on the CUDA cores.
    on_tensor_cores: bool

    @classmethod
    def choose(cls, cache_dtype: torch.dtype, group: int, head_dim: int) -> _Tiles:
        """The tile shape for a cache of this dtype and a kv head serving `group` query heads of head_dim."""
        dim_pad = max(16, triton.next_power_of_2(head_dim))
        if cache_dtype in (torch.float16, torch.bfloat16):
            group_pad = max(MMA_ROWS, triton.next_power_of_2(group))
            return cls(group_pad, dim_pad, min(MAX_TILE, max(MIN_TILE, MMA_TILE_ELEMENTS // dim_pad)), True)
        group_pad = max(2, triton.next_power_of_2(group))
        tile = min(MAX_TILE, max(MIN_TILE, triton.next_power_of_2(TILE_ELEMENTS // (group_pad * dim_pad))))
        return cls(group_pad, dim_pad, tile, False)


if triton is not None:

    @triton.jit
    def _decode_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        tables_ptr,
        lens_ptr,
        out_ptr,
        maxima_ptr,
        sums_ptr,
        values_ptr,
        scale,
        window,
        softcap,
        q_stride_token,
        q_stride_head,
        cache_stride_block,
        cache_stride_slot,
        cache_stride_head,
        table_stride,
        out_stride_token,
        out_stride_head,
        block_size,
        group,
        head_dim,
        GROUP: tl.constexpr,
        DIM: tl.constexpr,
        TILE: tl.constexpr,
        SPAN: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
        SPLIT: tl.constexpr,
        ON_TENSOR_CORES: tl.constexpr,
    ):
        request = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1)
        partition = tl.program_id(2)
        g = tl.arange(0, GROUP)
        d = tl.arange(0, DIM)
        g_mask = g < group
        d_mask = d < head_dim
        heads = kv_head * group + g  # [GROUP] query heads served
        q_ptrs = q_ptr + request * q_stride_token + heads[:, None] * q_stride_head + d[None, :]
        q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [GROUP, DIM]
        if not ON_TENSOR_CORES:
            q = q.to(tl.float32)
        seq_len = tl.load(lens_ptr + request)
        first = tl.maximum(seq_len - window, 0)  # the window's first position
        m = tl.full((GROUP,), -1.0e30, tl.float32)  # finite: a fully masked tile leaves every sum unchanged
        total = tl.zeros((GROUP,), tl.float32)
        acc = tl.zeros((GROUP, DIM), tl.float32)
        begin = partition * SPAN
        for offset in range(0, SPAN, TILE):
            tile = begin + offset
            if (tile < seq_len) & (tile + TILE > first):  # tiles past the context or before the window: skipped
                # [TILE] cache offsets of the tile's positions for this kv head, and which of them the token sees
                position = tile + tl.arange(0, TILE)
                valid = (position < seq_len) & (position >= first)
                block = tl.load(tables_ptr + request * table_stride + position // block_size, mask=valid, other=0)
                slot = (
                    block * cache_stride_block
                    + (position % block_size) * cache_stride_slot
                    + kv_head * cache_stride_head
                )
                kv = slot[:, None] + d[None, :]  # [TILE, DIM]
                m, total, acc = _attend_tile(
                    q, m, total, acc, k_ptr, v_ptr, kv, valid, d_mask, scale, softcap, HAS_SOFTCAP, ON_TENSOR_CORES
                )
        row_mask = g_mask[:, None] & d_mask[None, :]
        if SPLIT:
            # [B, heads, partitions] rows of the partials
            partial = (request * tl.num_programs(1) * group + heads) * tl.num_programs(2) + partition  # [GROUP]
            tl.store(maxima_ptr + partial, m, mask=g_mask)
            tl.store(sums_ptr + partial, total, mask=g_mask)
            tl.store(values_ptr + partial[:, None] * head_dim + d[None, :], acc, mask=row_mask)
        else:
            out_ptrs = out_ptr + request * out_stride_token + heads[:, None] * out_stride_head + d[None, :]
            tl.store(out_ptrs, (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=row_mask)

    @triton.jit
    def _attend_tile(
        q,
        m,
        total,
        acc,
        k_ptr,
        v_ptr,
        kv,
        valid,
        d_mask,
        scale,
        softcap,
        HAS_SOFTCAP: tl.constexpr,
        ON_TENSOR_CORES: tl.constexpr,
    ):
        """One tile of the online softmax: the group's queries q [GROUP, DIM] against the tile's keys and values (kv:
        their [TILE, DIM] offsets in either cache; `valid` [TILE] the positions the token sees) update the running
        maximum m and sum total [GROUP] and the weighted values acc [GROUP, DIM], which come back."""
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + kv, mask=kv_mask, other=0.0)  # [TILE, DIM]
        if ON_TENSOR_CORES:
            scores = tl.dot(q, tl.trans(k)) * scale  # [GROUP, TILE] float32
        else:
            scores = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * scale
        if HAS_SOFTCAP:
            scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))  # softcap * tanh(s / cap)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        total = total * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv, mask=kv_mask, other=0.0)  # [TILE, DIM]
        if ON_TENSOR_CORES:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)  # [GROUP, DIM]
        else:
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        return m_new, total, acc

    @triton.jit
    def _merge_kernel(
        maxima_ptr,
        sums_ptr,
        values_ptr,
        out_ptr,
        out_stride_token,
        out_stride_head,
        head_dim,
        DIM: tl.constexpr,
        PARTITIONS: tl.constexpr,
    ):
        """One head of one request: its partitions merged in order, as the online softmax merges tiles. A partition
        with no position (maximum -1e30, sums 0) scales the others by exp(0) = 1 and adds 0: an exact no-op."""
        request = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        d = tl.arange(0, DIM)
        d_mask = d < head_dim
        row = (request * tl.num_programs(1) + head) * PARTITIONS
        m = tl.full((1,), -1.0e30, tl.float32)
        total = tl.zeros((1,), tl.float32)
        acc = tl.zeros((DIM,), tl.float32)
        for partition in range(0, PARTITIONS):
            m_part = tl.load(maxima_ptr + row + partition + tl.zeros((1,), tl.int32))
            m_new = tl.maximum(m, m_part)
            alpha, beta = tl.exp(m - m_new), tl.exp(m_part - m_new)
            total = total * alpha + tl.load(sums_ptr + row + partition + tl.zeros((1,), tl.int32)) * beta
            part = tl.load(values_ptr + (row + partition) * head_dim + d, mask=d_mask, other=0.0)
            acc = acc * alpha + part * beta
            m = m_new
        tl.store(
            out_ptr + request * out_stride_token + head * out_stride_head + d,
            (acc / total).to(out_ptr.dtype.element_ty),
            mask=d_mask,
        )
