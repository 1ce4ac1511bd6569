"""Row tiles: the layout a packed weight takes once the CPU kernels bind it (models/cpu/csrc/tiles.h reads it).

A decode step's product computes each output as one chain over the 32-column blocks of its weight row (gemv.cpp's
"one arithmetic per row"), with a vector lane per weight row. Stored row after row, each block's bytes of 16 rows
had to be moved into those lanes on every call; stored as row tiles, one load gives them:

- rows are taken 16 at a time (a tile; the last one padded with zero rows), and within a tile each 32-column block
  is stored as 32-bit words, word-major: word j of the block holds bytes 4j .. 4j + 3 of each of the 16 rows, side
  by side, so that a 64-byte load puts row r's 4 bytes in lane r;
  - int4 [tiles, K/32, 4, 16, 4] uint8: a row's block is 16 bytes in GGUF's order (byte c: column c in its low
    nibble, column c + 16 in its high one), so word j holds columns 4j .. 4j + 3 and, in the high nibbles,
    16 + 4j .. 16 + 4j + 3;
  - int8 [tiles, K/32, 8, 16, 4] int8: word j holds columns 4j .. 4j + 3;
- scales and mins [tiles, K/G, 16] float16: a group's 16 values of the tile's rows together;
- int5 high bits [tiles, K/32, 2, 4] int64 masks: bit 4r + i of mask [h, j] is the fifth bit of column
  16h + 4j + i of row r, the lanes a masked add needs for word j's low (h = 0) or high (h = 1) nibbles.

The bytes are those of the row-major layout, moved; `untile` gives that layout back (tensor parallelism cuts it,
the reference path dequantizes it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

TILE_ROWS = 16
BLOCK = 32
# Bytes of scratch a tiling in place (tile_in_place) works in at a time.
_SLAB_BYTES = 2**20


def _padded(tensor: torch.Tensor) -> torch.Tensor:
    """tensor [N, ...] with zero rows up to a multiple of TILE_ROWS."""
    extra = -tensor.shape[0] % TILE_ROWS
    if extra == 0:
        return tensor
    return torch.cat([tensor, tensor.new_zeros((extra, *tensor.shape[1:]))])


def tile_words(qweight: torch.Tensor) -> torch.Tensor:
    """Row-major codes [N, bytes per row] (int4 nibbles or int8) → [tiles, K/32, words, 16, 4]."""
    block_bytes = BLOCK // 2 if qweight.dtype == torch.uint8 else BLOCK  # int4 nibbles, or int8 codes
    blocks = qweight.shape[1] // block_bytes
    grid = _padded(qweight).reshape(-1, TILE_ROWS, blocks, block_bytes // 4, 4)  # [tiles, 16, B, words, 4]
    return grid.permute(0, 2, 3, 1, 4).contiguous()


def untile_words(tiled: torch.Tensor, num_rows: int) -> torch.Tensor:
    """tile_words' inverse: [tiles, B, words, 16, 4] → [num_rows, bytes per row]."""
    tiles, blocks, words = tiled.shape[:3]
    return tiled.permute(0, 3, 1, 2, 4).reshape(tiles * TILE_ROWS, blocks * words * 4)[:num_rows]


def tile_terms(terms: torch.Tensor) -> torch.Tensor:
    """Scales or mins [N, groups] → [tiles, groups, 16]."""
    return _padded(terms).reshape(-1, TILE_ROWS, terms.shape[1]).transpose(1, 2).contiguous()


def untile_terms(tiled: torch.Tensor, num_rows: int) -> torch.Tensor:
    """tile_terms' inverse."""
    return tiled.transpose(1, 2).reshape(-1, tiled.shape[1])[:num_rows]


def tile_fifth_bits(high_bits: torch.Tensor) -> torch.Tensor:
    """int5 high bits [N, K/32] int32 → masks [tiles, K/32, 2, 4] int64 (module docstring)."""
    shifts = torch.arange(BLOCK, dtype=torch.int32)
    bits = (_padded(high_bits)[:, :, None] >> shifts) & 1  # [rows, B, 32]: bit c of each block's word
    grid = bits.reshape(-1, TILE_ROWS, bits.shape[1], 2, 4, 4)  # [tiles, 16 r, B, h, j, i]
    lanes = grid.permute(0, 2, 3, 4, 1, 5).reshape(grid.shape[0], bits.shape[1], 2, 4, 64)  # bit 4r + i
    return (lanes.to(torch.int64) << torch.arange(64, dtype=torch.int64)).sum(dim=-1)  # distinct bits: the sum ORs


def untile_fifth_bits(masks: torch.Tensor, num_rows: int) -> torch.Tensor:
    """tile_fifth_bits' inverse: → [num_rows, K/32] int32."""
    bits = (masks[..., None] >> torch.arange(64, dtype=torch.int64)) & 1  # [tiles, B, 2, 4, 64]
    grid = bits.reshape(*masks.shape, TILE_ROWS, 4).permute(0, 4, 1, 2, 3, 5)  # [tiles, 16 r, B, h, j, i]
    words = (grid.reshape(grid.shape[0] * TILE_ROWS, masks.shape[1], BLOCK) << torch.arange(BLOCK)).sum(dim=-1)
    return words.to(torch.int32)[:num_rows]  # bit 31 wraps into the sign, as the words were stored


@dataclass(frozen=True)
class Tiles:
    """A packed weight in row tiles, and its logical shape: what the native products bind (kernels.py)."""

    codes: torch.Tensor  # int4: uint8 [tiles, K/32, 4, 16, 4]; int8: int8 [tiles, K/32, 8, 16, 4]
    scales: torch.Tensor  # float16 [tiles, K/G, 16]
    mins: torch.Tensor | None  # int4: float16 [tiles, K/G, 16]
    fifth: torch.Tensor | None  # int5: int64 [tiles, K/32, 2, 4]
    rows: int
    cols: int
    group_size: int
    # The int8-activation products' sub-chains of a row (models/row_chains.py): int64 block indices, or None.
    chain_ends: torch.Tensor | None = None

    @property
    def is_int4(self) -> bool:
        return self.codes.dtype == torch.uint8


def tile(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    high_bits: torch.Tensor | None,
    group_size: int,
) -> Tiles:
    """A row-major packing (models/quant.py: int4 qweight [N, K/2] uint8 with mins, int5 with high_bits too, or int8
    qweight [N, K] int8) in row tiles."""
    rows = qweight.shape[0]
    cols = qweight.shape[1] * (2 if qweight.dtype == torch.uint8 else 1)
    return Tiles(
        tile_words(qweight),
        tile_terms(scales),
        None if mins is None else tile_terms(mins),
        None if high_bits is None else tile_fifth_bits(high_bits),
        rows,
        cols,
        group_size,
    )


def tile_in_place(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    high_bits: torch.Tensor | None,
    group_size: int,
) -> Tiles | None:
    """tile's result written over the row-major buffers' own bytes, a slab of whole tiles at a time: a tile's 16
    rows take the same bytes in either layout, so no second copy of the weight is ever whole (a vocabulary's
    embedding is the largest tensor of a small model). None, changing nothing, where the rows are not whole tiles
    or a buffer is not contiguous and 64-byte aligned (tile then makes new tensors)."""
    rows = qweight.shape[0]
    buffers = [tensor for tensor in (qweight, scales, mins, high_bits) if tensor is not None]
    if (
        rows == 0
        or rows % TILE_ROWS
        or not all(tensor.is_contiguous() and tensor.data_ptr() % 64 == 0 for tensor in buffers)
    ):
        return None
    cols = qweight.shape[1] * (2 if qweight.dtype == torch.uint8 else 1)
    # tile_fifth_bits works in 256 scratch bytes per stored byte (its bits and lanes), the others in one.
    return Tiles(
        _rewrite(qweight, tile_words, qweight.dtype, 1),
        _rewrite(scales, tile_terms, scales.dtype, 1),
        None if mins is None else _rewrite(mins, tile_terms, mins.dtype, 1),
        None if high_bits is None else _rewrite(high_bits, tile_fifth_bits, torch.int64, 256),
        rows,
        cols,
        group_size,
    )


def _rewrite(
    tensor: torch.Tensor, tile_rows: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype, scratch_per_byte: int
) -> torch.Tensor:
    """tensor [N, ...] (N whole tiles) replaced, slab by slab, by tile_rows of it, whose output for a slab takes
    the slab's bytes; returns the result as a view of the same bytes."""
    row_bytes = tensor[0].nbytes
    rows_per_slab = max(TILE_ROWS, _SLAB_BYTES // (row_bytes * scratch_per_byte) // TILE_ROWS * TILE_ROWS)
    flat = tensor.reshape(-1).view(torch.uint8)  # [N * row bytes], the tensor's own bytes
    shape = None
    for start in range(0, tensor.shape[0], rows_per_slab):
        tiled = tile_rows(tensor[start : start + rows_per_slab])  # [slab tiles, ...]: a copy
        flat[start * row_bytes : start * row_bytes + tiled.nbytes].copy_(tiled.reshape(-1).view(torch.uint8))
        shape = tiled.shape[1:]
    return flat.view(dtype).view(tensor.shape[0] // TILE_ROWS, *shape)


def untile(tiles: Tiles) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(qweight, scales, mins, high_bits) row after row: tile's inverse."""
    return (
        untile_words(tiles.codes, tiles.rows),
        untile_terms(tiles.scales, tiles.rows),
        None if tiles.mins is None else untile_terms(tiles.mins, tiles.rows),
        None if tiles.fifth is None else untile_fifth_bits(tiles.fifth, tiles.rows),
    )
