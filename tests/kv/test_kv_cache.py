"""The KV pool tensors: zero-filled at start (a never-written slot is still read, masked, by attention), of the
requested dtype and shape, independent per layer, and block copies move whole blocks."""

from __future__ import annotations

import os
import re

import pytest
import torch

from tokenriver.kv.cache import KVCache, bytes_per_block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pool_is_zeroed_typed_and_separate_per_layer(dtype: torch.dtype) -> None:
    cache = KVCache(num_layers=3, num_blocks=5, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)
    assert len(cache) == 3
    for key, value in cache.layers:
        assert key.shape == value.shape == (5, 4, 2, 8)
        assert key.dtype == value.dtype == dtype
        assert key.is_contiguous() and value.is_contiguous()
        assert not key.any() and not value.any()
    cache[0][0][1, 2] = 1.5
    assert cache[0][0][1, 2].eq(1.5).all()
    assert not cache[0][1].any() and not cache[1][0].any()
    assert cache.num_bytes == 3 * bytes_per_block(1, 4, 2, 8, dtype) * 5


def test_copy_blocks_copies_every_layer() -> None:
    cache = KVCache(num_layers=2, num_blocks=4, block_size=2, num_kv_heads=1, head_dim=4, dtype=torch.float32)
    for layer, (key, value) in enumerate(cache.layers):
        key[1] = layer + 1.0
        value[1] = -(layer + 1.0)
    cache.copy_blocks([1], [3])
    for layer, (key, value) in enumerate(cache.layers):
        assert key[3].eq(layer + 1.0).all() and value[3].eq(-(layer + 1.0)).all()
        assert not key[2].any()


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc/self/smaps")
def test_a_large_pool_does_not_ask_for_huge_pages() -> None:
    """8 MiB per layer tensor: past numpy's calloc threshold, which asks for 2 MiB pages (each layer's pool would
    then fault in 2 MiB at its first token). The pool's mapping must not carry that advice ("hg")."""
    cache = KVCache(num_layers=1, num_blocks=256, block_size=16, num_kv_heads=4, head_dim=128, dtype=torch.float32)
    middle = cache[0][0][128]  # calloc's advice starts at the page after the array's first byte
    middle[0] = 1.0
    start = middle.data_ptr()
    for header, fields in _smaps():
        low, high = (int(part, 16) for part in header.split()[0].split("-"))
        if low <= start < high:
            assert "hg" not in fields["VmFlags"].split()
            return
    pytest.fail("the pool's mapping is not in /proc/self/smaps")


def _smaps() -> list[tuple[str, dict[str, str]]]:
    """(header line, its fields) per mapping of this process."""
    mappings: list[tuple[str, dict[str, str]]] = []
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
                mappings.append((line, {}))
            elif mappings:
                name, _, rest = line.partition(":")
                mappings[-1][1][name] = rest.strip()
    return mappings
