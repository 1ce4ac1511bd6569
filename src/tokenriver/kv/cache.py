"""The KV cache tensors: one pool of fixed-size blocks per layer.

Layout per layer: key and value tensors of shape
[num_blocks, block_size, num_kv_heads, entry_size]. A token's K/V lives in one
*slot* (block_id * block_size + offset); which blocks belong to which request
is the block manager's business, not this module's. Allocated once, at start,
so a request never waits on an allocation inside the step loop.

An entry is one token's vector for one kv head. In a float pool it is the head_dim values (entry_size = head_dim).
In an int8 pool (llama.cpp's q8_0 KV cache, per vector instead of per 32 values) it is head_dim int8 values q and
then the float32 scale s as its 4 bytes (entry_size = head_dim + 4): the vector is s * q, s = max|x| / 127 and
q = x / s rounded to nearest (encode_int8). A vector of the embedded model's 64 values then takes 68 bytes, 53% of
float16's 128, with a rounding error of at most s / 2 per value.
"""

from __future__ import annotations

import math
import mmap

import torch

# Bytes after an int8 entry's head_dim values: its float32 scale.
INT8_SCALE_BYTES = 4


def entry_size(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one pool entry (one token, one kv head) in a pool of dtype."""
    return head_dim + INT8_SCALE_BYTES if dtype == torch.int8 else head_dim


def head_dim_of(pool: torch.Tensor) -> int:
    """The head size a pool [..., entry_size] stores."""
    return pool.shape[-1] - INT8_SCALE_BYTES if pool.dtype == torch.int8 else pool.shape[-1]


def encode_int8(vectors: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] float → int8 entries [..., head_dim + 4] (see the module docstring). Computed in float32:
    the native kernel (models/cpu/csrc/attention.cpp) stores the same bytes."""
    x = vectors.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / 127  # [..., 1]
    q = torch.round(x / torch.where(scale > 0, scale, 1.0)).to(torch.int8)  # [..., head_dim]
    return torch.cat([q, scale.contiguous().view(torch.int8)], dim=-1)


def decode_entries(entries: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Pool entries [..., entry_size] → vectors [..., head_dim] in dtype."""
    if entries.dtype != torch.int8:
        return entries.to(dtype)
    head_dim = entries.shape[-1] - INT8_SCALE_BYTES
    scale = entries[..., head_dim:].contiguous().view(torch.float32)  # [..., 1]
    return (entries[..., :head_dim].float() * scale).to(dtype)


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Memory one block takes across all layers, keys and values."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * entry_size(head_dim, dtype) * element_size


class KVCache:
    """Per-layer key/value block pools."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        padding_block: bool = False,
    ) -> None:
        """padding_block: one block more than num_blocks, which the block manager never hands out: the slot padded
        rows of a recorded CUDA graph write to (runner/cuda_graphs.py)."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Flat slot of the padding block's first token, or None without one.
        self.padding_slot: int | None = num_blocks * block_size if padding_block else None
        shape = (num_blocks + int(padding_block), block_size, num_kv_heads, entry_size(head_dim, dtype))
        # One (key, value) pair per layer, each [num_blocks, block_size, num_kv_heads, entry_size].
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (_zeros(shape, dtype, device), _zeros(shape, dtype, device)) for _ in range(num_layers)
        ]

    def __getitem__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layers[layer]

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def num_bytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.layers)

    def copy_blocks(self, src_block_ids: list[int], dst_block_ids: list[int]) -> None:
        """Copy whole blocks (copy-on-write when a shared block must diverge)."""
        if not src_block_ids:
            return
        src = torch.tensor(src_block_ids, dtype=torch.long, device=self.layers[0][0].device)
        dst = torch.tensor(dst_block_ids, dtype=torch.long, device=src.device)
        for key, value in self.layers:
            key.index_copy_(0, dst, key.index_select(0, src))
            value.index_copy_(0, dst, value.index_select(0, src))


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero-filled pool tensor. On the CPU it is an anonymous mapping, whose pages the OS hands out already
    zeroed and only when first touched: a 2 GiB pool costs nothing at start-up, where torch.zeros writes every byte
    (seconds on this machine). Zeros, not garbage: a slot never written is still read (masked) by attention, and
    NaN garbage times a zero weight would poison the sum. Not numpy's calloc: it asks for 2 MiB pages for every
    array of 4 MiB or more, so each layer's pool would fault in 2 MiB at its first token (resident memory, and a
    slow fault where the host backs fresh memory lazily); the pool is on the system's default pages."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(shape)  # keeps the mapping alive
