"""A step's keys and values written into the paged KV cache on NVIDIA GPUs, both in one Triton kernel.

Through PyTorch ops that is two index_copy_ kernels a layer, one per cache, each reading its source through the
fused qkv projection's strided view. Here one program per token copies that token's key and value heads to its
slot in both caches: one launch a layer. Bytes are copied as they are: the caches hold the step's dtype (an int8
cache, whose entries carry a scale, keeps attention.write_kv's PyTorch path).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


def fits(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether the kernel takes this call: [tokens, kv heads, head dim] views with each head's values contiguous,
    the caches contiguous and in the keys' dtype, the shapes matching."""
    return (
        key.dim() == 3
        and key.shape == value.shape
        and key.stride(2) == 1
        and value.stride(2) == 1
        and key.dtype == value.dtype == key_cache.dtype
        and key_cache.is_contiguous()
        and key.shape[1:] == key_cache.shape[2:]
    )


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key, value [T, num_kv_heads, head_dim]; caches [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    and alike; slot_mapping [T] int64: token t's key and value go to slot slot_mapping[t] of the flattened caches."""
    tokens, heads, head_dim = key.shape
    if tokens == 0:
        return
    _write_kv_kernel[(tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        heads,
        head_dim,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        heads * head_dim,
        HEADS=triton.next_power_of_2(heads),
        DIM=triton.next_power_of_2(head_dim),
        num_warps=4 if heads * head_dim >= 1024 else 1,
    )


if triton is not None:

    @triton.jit
    def _write_kv_kernel(
        key_ptr,
        value_ptr,
        key_cache_ptr,
        value_cache_ptr,
        slots_ptr,
        heads,
        head_dim,
        key_stride_token,
        key_stride_head,
        value_stride_token,
        value_stride_head,
        slot_stride,
        HEADS: tl.constexpr,
        DIM: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        head = tl.arange(0, HEADS)[:, None]
        d = tl.arange(0, DIM)[None, :]
        mask = (head < heads) & (d < head_dim)
        slot = tl.load(slots_ptr + token)
        cached = slot * slot_stride + head * head_dim + d  # [HEADS, DIM] in a contiguous cache
        key = tl.load(key_ptr + token * key_stride_token + head * key_stride_head + d, mask=mask)
        tl.store(key_cache_ptr + cached, key, mask=mask)
        value = tl.load(value_ptr + token * value_stride_token + head * value_stride_head + d, mask=mask)
        tl.store(value_cache_ptr + cached, value, mask=mask)
