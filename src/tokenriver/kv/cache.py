"""The KV cache tensors: one pool of fixed-size blocks per layer.

Layout per layer: key and value tensors of shape
[num_blocks, block_size, num_kv_heads, head_dim]. A token's K/V lives in one
*slot* (block_id * block_size + offset); which blocks belong to which request
is the block manager's business, not this module's. Allocated once, at start,
so a request never waits on an allocation inside the step loop.
"""

from __future__ import annotations

import numpy as np
import torch


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Memory one block takes across all layers, keys and values."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size


class KVCache:
    """Per-layer key/value block pools."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # One (key, value) pair per layer, each [num_blocks, block_size, num_kv_heads, head_dim].
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
    """A zero-filled pool tensor. On the CPU it comes from calloc (numpy), whose pages the OS hands out
    already zeroed and only when first touched: a 2 GiB pool costs nothing at start-up, where torch.zeros
    writes every byte (seconds on this machine). Zeros, not garbage: a slot never written is still read
    (masked) by attention, and NaN garbage times a zero weight would poison the sum."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    element_size = torch.empty((), dtype=dtype).element_size()
    raw = np.zeros((*shape[:-1], shape[-1] * element_size), dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype)
