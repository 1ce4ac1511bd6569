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
- scales and mins [tiles, K/G, 16] float16: a group's 16 values of the tile's rows together; a centred int4
  weight, whose every min is -centre * scale (GGUF's Q4_0, centre 8, and Q5_0, 16: `centred`), keeps none, and the
  products compute them: 0.5 bits a weight less to stream, the same values;
- int5 high bits [tiles, K/32, 2, 4] int64 masks: bit 4r + i of mask [h, j] is the fifth bit of column
  16h + 4j + i of row r, the lanes a masked add needs for word j's low (h = 0) or high (h = 1) nibbles.

The bytes are those of the row-major layout, moved; `untile` gives that layout back (tensor parallelism cuts it,
the reference path dequantizes it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from tokenriver.config import default_num_threads

if TYPE_CHECKING:
    from tokenriver.models.kquant import KQuantRecords, RecordLayout

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
    # Moved as 32-bit words, a quarter of the elements of moving bytes: the same bytes land in the same places.
    words = _padded(qweight).contiguous().view(torch.int32)  # [rows, B * words]
    grid = words.reshape(-1, TILE_ROWS, blocks, block_bytes // 4)  # [tiles, 16, B, words]
    tiled = grid.permute(0, 2, 3, 1).contiguous()  # [tiles, B, words, 16]
    return tiled.view(qweight.dtype).view(*tiled.shape, 4)


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
    """int5 high bits [N, K/32] int32 → masks [tiles, K/32, 2, 4] int64 (module docstring): mask [h, j] gathers, for
    each row r of the tile, the four bits 16h + 4j .. 16h + 4j + 3 of its block's word at bits 4r .. 4r + 3."""
    words = _padded(high_bits).to(torch.int64) & 0xFFFFFFFF  # [rows, B], the 32 bits as stored
    grid = words.reshape(-1, TILE_ROWS, words.shape[1])  # [tiles, 16 r, B]
    lanes = 4 * torch.arange(TILE_ROWS, dtype=torch.int64)[:, None]  # [16, 1]: row r's bits start at 4r
    masks = [
        (((grid >> (16 * h + 4 * j)) & 0xF) << lanes).sum(dim=1)  # [tiles, B]: distinct bits, so the sum ORs
        for h in range(2)
        for j in range(4)
    ]
    return torch.stack(masks, dim=-1).view(grid.shape[0], words.shape[1], 2, 4)


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
    mins: torch.Tensor | None  # int4: float16 [tiles, K/G, 16], None where centred (module docstring)
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


class NativeTiling(Protocol):
    """The in-place rewrites in one native pass each (kernels.py, csrc/tiling.cpp), the same bytes as below."""

    def tile_rows_in_place(self, tensor: torch.Tensor, num_threads: int) -> None: ...

    def tile_fifth_bits_in_place(self, high_bits: torch.Tensor, num_threads: int) -> None: ...


def tile_in_place(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    high_bits: torch.Tensor | None,
    group_size: int,
    native: NativeTiling | None = None,
) -> Tiles | None:
    """tile's result written over the row-major buffers' own bytes, a slab of whole tiles at a time: a tile's 16
    rows take the same bytes in either layout, so no second copy of the weight is ever whole (a vocabulary's
    embedding is the largest tensor of a small model). None, changing nothing, where the rows are not whole tiles
    or a buffer is not contiguous and 64-byte aligned (tile then makes new tensors). native: rewrite through its
    passes (one over each buffer, where these take several)."""
    rows = qweight.shape[0]
    buffers = [tensor for tensor in (qweight, scales, mins, high_bits) if tensor is not None]
    if (
        rows == 0
        or rows % TILE_ROWS
        or not all(tensor.is_contiguous() and tensor.data_ptr() % 64 == 0 for tensor in buffers)
    ):
        return None
    cols = qweight.shape[1] * (2 if qweight.dtype == torch.uint8 else 1)
    if native is not None:
        return _tile_natively(native, qweight, scales, mins, high_bits, cols, group_size)
    # tile_fifth_bits works in 4 scratch bytes per stored byte (its int64 words and masks), the others in one.
    return Tiles(
        _rewrite(qweight, tile_words, qweight.dtype, 1),
        _rewrite(scales, tile_terms, scales.dtype, 1),
        None if mins is None else _rewrite(mins, tile_terms, mins.dtype, 1),
        None if high_bits is None else _rewrite(high_bits, tile_fifth_bits, torch.int64, 4),
        rows,
        cols,
        group_size,
    )


def _tile_natively(
    native: NativeTiling,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    high_bits: torch.Tensor | None,
    cols: int,
    group_size: int,
) -> Tiles:
    """tile_in_place's rewrite by `native`: the codes as 32-bit words and the terms as 16-bit ones, each a
    transpose of a tile's 16 rows, and the fifth bits into their masks."""
    rows, threads = qweight.shape[0], default_num_threads()
    tiles, blocks = rows // TILE_ROWS, cols // BLOCK
    words = qweight.view(torch.int32)  # [N, K/32 * words]
    native.tile_rows_in_place(words, threads)
    codes = words.view(qweight.dtype).view(tiles, blocks, -1, TILE_ROWS, 4)
    terms = []
    for tensor in (scales, mins):
        if tensor is not None:
            native.tile_rows_in_place(tensor, threads)
            tensor = tensor.view(tiles, -1, TILE_ROWS)
        terms.append(tensor)
    if high_bits is not None:
        native.tile_fifth_bits_in_place(high_bits, threads)
        high_bits = high_bits.reshape(-1).view(torch.int64).view(tiles, blocks, 2, 4)
    return Tiles(codes, terms[0], terms[1], high_bits, rows, cols, group_size)


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
    """(qweight, scales, mins, high_bits) row after row: tile's inverse (a centred int4 weight's mins made again)."""
    scales = untile_terms(tiles.scales, tiles.rows)
    if tiles.mins is not None:
        mins = untile_terms(tiles.mins, tiles.rows)
    else:
        mins = centred_mins(scales, tiles.fifth is not None) if tiles.is_int4 else None
    return (
        untile_words(tiles.codes, tiles.rows),
        scales,
        mins,
        None if tiles.fifth is None else untile_fifth_bits(tiles.fifth, tiles.rows),
    )


def centred_mins(scales: torch.Tensor, five_bit: bool) -> torch.Tensor:
    """A centred int4 weight's mins, -centre * scale (centre 8, 16 for 5-bit codes) float16: exact wherever the
    product fits float16."""
    return (-(16 if five_bit else 8) * scales.float()).to(torch.float16)


def centred(scales: torch.Tensor, mins: torch.Tensor, five_bit: bool) -> bool:
    """Whether every min of an int4 weight is its centred_mins, bit for bit (so the products can compute them)."""
    return torch.equal(mins.view(torch.int16), centred_mins(scales, five_bit).view(torch.int16))


# ---- K-quant weights (models/kquant.py's records; csrc/kquant.h reads these) --------------------------------------
#
# A tile record is 16 row records moved (the same bytes): per super-block, the 8 blocks' low bits as 4-byte words
# (nibbles: int4's words; crumbs: two), the high bits (for the 64-byte vector of code word k, whose byte 4r + i is
# row r's column c_k(i) = 16 (k // 4) + 4 (k % 4) + i: one high bit as a plane, bit k of byte 4r + i that of column
# c_k(i); two as two crumb vectors, h = 0 for words 0-3 and 1 for 4-7, bits 2j, 2j + 1 of byte 4r + i those of
# column c_{4h + j}(i); the crumb codes are laid out so too), then byte by byte the 16 rows' scales and mins
# (models/kquant.py's pack_terms) side by side, and their d and dmin.
# A shift brings a word's high bits under a mask above the low bits and one bitwise select merges them in.


@dataclass(frozen=True)
class KTiles:
    """A K-quant weight in tile records (csrc/kquant.h), with its rows' offsets as per-tile masks."""

    records: torch.Tensor  # uint8 [tiles, K/256, 16 * layout.size]
    offset_masks: torch.Tensor | None  # int16 [tiles]: bit r for row r's centred codes (None: no row is)
    layout: RecordLayout
    rows: int
    cols: int
    chain_ends: torch.Tensor | None = None


def _word_bits(words: torch.Tensor) -> torch.Tensor:
    """Bit words [N, B] int32 → bits [N, B, 2 (h), 4 (j), 4 (i)], column 16h + 4j + i."""
    bits = (words[:, :, None] >> torch.arange(BLOCK, dtype=torch.int32)) & 1  # [N, B, 32]
    return bits.to(torch.int32).reshape(*words.shape, 2, 4, 4)


def _tile_bytes(per_row: torch.Tensor) -> torch.Tensor:
    """[N, B, ..., 4 (i)] → [tiles, B, ..., 64] uint8, byte 4r + i of row r (N a multiple of 16)."""
    grid = per_row.reshape(-1, TILE_ROWS, *per_row.shape[1:])  # [tiles, 16, B, ..., 4]
    order = [0, *range(2, grid.dim() - 1), 1, grid.dim() - 1]  # [tiles, B, ..., 16, 4]
    return grid.permute(*order).reshape(*grid.shape[:1], *grid.shape[2:-1], TILE_ROWS * 4).to(torch.uint8)


def _untile_bytes(tiled: torch.Tensor) -> torch.Tensor:
    """_tile_bytes' inverse: [tiles, B, ..., 64] → [tiles * 16, B, ..., 4]."""
    grid = tiled.reshape(*tiled.shape[:-1], TILE_ROWS, 4)  # [tiles, B, ..., 16, 4]
    order = [0, grid.dim() - 2, *range(1, grid.dim() - 2), grid.dim() - 1]  # [tiles, 16, B, ..., 4]
    rows = grid.permute(*order)
    return rows.reshape(-1, *rows.shape[2:])


def _tile_high(words: torch.Tensor) -> torch.Tensor:
    """Bit words [N, B, num_high] int32 → [tiles, B, 64 * num_high]: the plane, or the two crumb vectors."""
    if words.shape[2] == 1:
        shifts = torch.arange(8, dtype=torch.int32).reshape(2, 4, 1)  # k = 4h + j
        return _tile_bytes((_word_bits(words[:, :, 0]) << shifts).sum(dim=(2, 3)))  # [tiles, B, 64]
    crumbs = _word_bits(words[:, :, 0]) + 2 * _word_bits(words[:, :, 1])  # [N, B, h, j, i]
    packed = (crumbs << (2 * torch.arange(4, dtype=torch.int32)).reshape(4, 1)).sum(dim=3)  # [N, B, h, i]
    return _tile_bytes(packed).reshape(-1, words.shape[1], 128)  # [tiles, B, (h, 64)]


def _untile_high(tiled: torch.Tensor, num_high: int) -> torch.Tensor:
    """_tile_high's inverse: [tiles, B, 64 * num_high] → bit words [N, B, num_high] int32."""
    weights = 1 << torch.arange(BLOCK, dtype=torch.int64)

    def words(bits: torch.Tensor) -> torch.Tensor:  # [N, B, h, j, i] → [N, B] int32
        return (bits.reshape(*bits.shape[:2], BLOCK).to(torch.int64) * weights).sum(dim=-1).to(torch.int32)

    if num_high == 1:
        plane = _untile_bytes(tiled).to(torch.int32)  # [N, B, i]
        shifts = torch.arange(8, dtype=torch.int32).reshape(2, 4, 1)
        return words((plane[:, :, None, None, :] >> shifts) & 1)[:, :, None]
    halves = _untile_bytes(tiled.reshape(*tiled.shape[:2], 2, 64)).to(torch.int32)  # [N, B, h, i]
    crumbs = (halves[:, :, :, None, :] >> (2 * torch.arange(4, dtype=torch.int32)).reshape(4, 1)) & 3
    return torch.stack([words(crumbs & 1), words(crumbs >> 1)], dim=-1)


def _record_parts(layout: RecordLayout) -> list[tuple[str, int, int, torch.dtype]]:
    """A row record's fields: (name, first byte, last byte + 1, dtype), in the tile record's order."""
    parts = [("qweight", 0, layout.high, torch.uint8)]
    if layout.num_high:
        parts.append(("high", layout.high, layout.scales, torch.int32))
    parts.append(("terms", layout.scales, layout.d, torch.uint8))
    parts.append(("d", layout.d, layout.d + 2, torch.float16))
    if layout.has_mins:
        parts.append(("dmin", layout.d + 2, layout.d + 4, torch.float16))
    return parts


def _tile_records(rows: torch.Tensor, layout: RecordLayout) -> torch.Tensor:
    """Row records [16 k, S, size] → tile records [k, S, 16 size] (csrc/kquant.h's order)."""
    num_rows, num_supers = rows.shape[:2]
    tiled = []
    for name, start, stop, dtype in _record_parts(layout):
        field = rows[:, :, start:stop].contiguous().view(dtype).reshape(num_rows, -1)  # [16 k, values]
        if name == "qweight":  # a block's low_bits words of 4 bytes per row
            grid = field.reshape(-1, TILE_ROWS, num_supers * 8, layout.low_bits, 4)  # [tiles, 16, B, words, 4]
            part = grid.permute(0, 2, 3, 1, 4)
        elif name == "high":
            part = _tile_high(field.reshape(num_rows, num_supers * 8, layout.num_high))
        else:
            part = tile_terms(field)
        tiled.append(part.contiguous().view(torch.uint8).reshape(num_rows // TILE_ROWS, num_supers, -1))
    return torch.cat(tiled, dim=2)


def _untile_records(tiled: torch.Tensor, layout: RecordLayout) -> torch.Tensor:
    """_tile_records' inverse: [k, S, 16 size] → row records [16 k, S, size]."""
    num_tiles, num_supers = tiled.shape[:2]
    num_rows = num_tiles * TILE_ROWS
    rows = torch.empty(num_rows, num_supers, layout.size, dtype=torch.uint8)
    at = 0
    for name, start, stop, dtype in _record_parts(layout):
        width = TILE_ROWS * (stop - start)
        part = tiled[:, :, at : at + width].contiguous()
        at += width
        if name == "qweight":
            field = untile_words(part.reshape(num_tiles, num_supers * 8, layout.low_bits, TILE_ROWS, 4), num_rows)
        elif name == "high":
            field = _untile_high(part.reshape(num_tiles, num_supers * 8, -1), layout.num_high)
        else:
            field = untile_terms(part.view(dtype).reshape(num_tiles, -1, TILE_ROWS), num_rows)
        # flatten, not contiguous: a [rows, 1] field (one super-block) may keep a stride torch calls contiguous
        rows[:, :, start:stop] = field.flatten().view(torch.uint8).reshape(num_rows, num_supers, -1)
    return rows


def offset_masks(offsets: torch.Tensor) -> torch.Tensor | None:
    """Per-row offsets [N] uint8 → per-tile masks [tiles] int16 (bit r: row r is offset), or None if none is."""
    if not bool(offsets.any()):
        return None
    bits = (_padded(offsets) != 0).reshape(-1, TILE_ROWS).to(torch.int32) << torch.arange(TILE_ROWS, dtype=torch.int32)
    return bits.sum(dim=1).to(torch.int16)  # distinct bits: the sum ORs; bit 15 wraps into the sign


def tiles_in_place(records: torch.Tensor) -> bool:
    """Whether row records can become tile records over their own bytes: whole tiles, one contiguous 64-byte-aligned
    buffer (tile_in_place's rule)."""
    return (
        records.shape[0] > 0
        and records.shape[0] % TILE_ROWS == 0
        and records.is_contiguous()
        and records.data_ptr() % 64 == 0
    )


def tile_record_shape(weight: KQuantRecords) -> tuple[int, int]:
    """A tile record buffer's trailing shape: (K/256, 16 * record size)."""
    return weight.records.shape[1], TILE_ROWS * weight.layout.size


def tile_kquant(weight: KQuantRecords, in_place: bool) -> KTiles:
    """Row records in tile records, a slab of whole tiles at a time (the fields take about 8 bytes of scratch per
    stored byte); in_place writes them over the row records' own bytes (whole tiles, a contiguous 64-byte-aligned
    buffer: tile_in_place's rule), else into new memory (the last tile padded with zero rows)."""
    records, layout = weight.records, weight.layout
    num_rows, num_supers, size = records.shape
    in_place = in_place and tiles_in_place(records)
    num_tiles = -(-num_rows // TILE_ROWS)
    out = (
        records.view(num_tiles, num_supers, TILE_ROWS * size)
        if in_place
        else torch.empty(num_tiles, num_supers, TILE_ROWS * size, dtype=torch.uint8)
    )
    rows_per_slab = max(TILE_ROWS, _SLAB_BYTES // (8 * num_supers * size) // TILE_ROWS * TILE_ROWS)
    for start in range(0, num_rows, rows_per_slab):
        slab = _padded(records[start : start + rows_per_slab])
        out[start // TILE_ROWS : start // TILE_ROWS + slab.shape[0] // TILE_ROWS] = _tile_records(slab, layout)
    return KTiles(out, offset_masks(weight.offsets), layout, num_rows, num_supers * 256)


def untile_kquant(tiles_: KTiles) -> torch.Tensor:
    """tile_kquant's inverse: the row records [N, K/256, size]."""
    return _untile_records(tiles_.records, tiles_.layout)[: tiles_.rows]
