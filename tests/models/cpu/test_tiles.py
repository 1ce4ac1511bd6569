"""Row tiles (models/cpu/tiles.py): the packed bytes moved, not changed, and decoded as the row-major layout decodes;
a centred int4 weight's mins left out and computed by the products, to the same bits."""

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from tokenriver.loader.gguf_blocks import repack_q5_0
from tokenriver.models.cpu import tiles as tiles_module
from tokenriver.models.cpu.kernels import load_kernels
from tokenriver.models.cpu.tiles import tile, tile_in_place, untile
from tokenriver.models.quant import quantize_int4, quantize_int8, repack_q4_0

HAS_NATIVE = load_kernels() is not None


def packed(kind: str, rows: int, cols: int):
    """(qweight, scales, mins, high_bits, group_size) of a random weight in one of the packed layouts."""
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows + cols)) * 0.05
    if kind == "int4":
        group_size = 64 if cols % 64 == 0 else 32
        w = quantize_int4(weight, group_size)
        return w.qweight, w.scales, w.mins, None, group_size
    if kind == "int5":
        w = repack_q5_0(quantize(weight.numpy(), GGMLQuantizationType.Q5_0))
        return w.qweight, w.scales, w.mins, w.high_bits, 32
    w = quantize_int8(weight, 32)
    return w.qweight, w.scales, None, None, 32


@pytest.mark.parametrize("kind", ["int4", "int5", "int8"])
@pytest.mark.parametrize("rows", [1, 16, 37])
def test_untile_gives_the_row_major_bytes_back(kind: str, rows: int) -> None:
    qweight, scales, mins, high_bits, group_size = packed(kind, rows, 128)
    tiles = tile(qweight, scales, mins, high_bits, group_size)
    assert tiles.codes.shape[0] == -(-rows // 16)  # the last tile padded with zero rows
    assert (tiles.rows, tiles.cols, tiles.is_int4) == (rows, 128, kind != "int8")
    for got, expected in zip(untile(tiles), (qweight, scales, mins, high_bits), strict=True):
        assert (got is None) == (expected is None)
        if expected is not None:
            assert torch.equal(got, expected)


@pytest.mark.skipif(not HAS_NATIVE, reason="native kernels unavailable")
@pytest.mark.parametrize("kind", ["int4", "int5", "int8"])
def test_tiled_rows_decode_as_the_row_major_layout_does(kind: str) -> None:
    kernels = load_kernels()
    qweight, scales, mins, high_bits, group_size = packed(kind, 37, 192)
    if kind == "int8":
        dense = kernels.int8_dequantize(qweight, scales, group_size)
    else:
        dense = kernels.int4_dequantize(qweight, scales, mins, group_size, high_bits)
    ids = torch.tensor([36, 0, 17, 15, 16, 36], dtype=torch.int64)
    rows = kernels.dequantize_rows(tile(qweight, scales, mins, high_bits, group_size), ids)
    assert torch.equal(rows, dense[ids])


@pytest.mark.parametrize("kind", ["int4", "int5", "int8"])
@pytest.mark.parametrize("rows, cols", [(16, 128), (80, 128), (48, 448), (32, 32)])
@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_tiling_in_place_writes_tiles_bytes_over_the_buffers(
    kind: str, rows: int, cols: int, native: bool, monkeypatch
) -> None:
    """The native passes (csrc/tiling.cpp) write the same bytes as the definition's slabs."""
    if native and not HAS_NATIVE:
        pytest.skip("native kernels unavailable")
    monkeypatch.setattr(tiles_module, "_SLAB_BYTES", 1024)  # several slabs, as a vocabulary's table takes
    qweight, scales, mins, high_bits, group_size = packed(kind, rows, cols)
    expected = tile(qweight, scales, mins, high_bits, group_size)
    buffers = [None if t is None else t.clone() for t in (qweight, scales, mins, high_bits)]
    pointers = [None if t is None else t.data_ptr() for t in buffers]
    got = tile_in_place(*buffers, group_size, native=load_kernels() if native else None)
    assert got is not None and (got.rows, got.cols) == (expected.rows, expected.cols)
    fields = ("codes", "scales", "mins", "fifth")
    for field, pointer in zip(fields, pointers, strict=True):
        tiled, reference = getattr(got, field), getattr(expected, field)
        assert (tiled is None) == (reference is None)
        if reference is not None:
            assert tiled.data_ptr() == pointer  # the buffer's own bytes, no copy kept
            assert tiled.dtype == reference.dtype and torch.equal(tiled, reference)


def test_tiling_in_place_declines_rows_that_are_not_whole_tiles() -> None:
    qweight, scales, mins, high_bits, group_size = packed("int4", 37, 128)
    before = qweight.clone()
    assert tile_in_place(qweight, scales, mins, high_bits, group_size) is None
    assert torch.equal(qweight, before)


@pytest.mark.skipif(not HAS_NATIVE, reason="native kernels unavailable")
@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q5_0], ids=["q4_0", "q5_0"])
def test_a_centred_weight_computes_its_mins_to_the_stored_ones_bits(qtype) -> None:
    """GGUF's Q4_0 and Q5_0 keep no mins in their tiles: every product and row lookup gives the bits of the same
    tiles with the mins stored, and the row-major layout comes back with them."""
    kernels = load_kernels()
    weight = torch.randn(37, 256, generator=torch.Generator().manual_seed(5)) * 0.05
    repack = repack_q4_0 if qtype == GGMLQuantizationType.Q4_0 else repack_q5_0
    w = repack(quantize(weight.numpy(), qtype))
    assert tiles_module.centred(w.scales, w.mins, w.high_bits is not None)
    stored = tile(w.qweight, w.scales, w.mins, w.high_bits, 32)
    computed = tile(w.qweight, w.scales, None, w.high_bits, 32)
    assert computed.mins is None
    assert torch.equal(untile(computed)[2], w.mins)
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(6))
    for rounding in (None, "int8"):
        for many_rows in (False, True):
            with_mins = kernels.bind(stored, rounding, many_rows)
            without = kernels.bind(computed, rounding, many_rows)
            for rows in (1, 5, 64):
                assert torch.equal(without(x[:rows]), with_mins(x[:rows]))
    ids = torch.tensor([36, 0, 17], dtype=torch.int64)
    assert torch.equal(kernels.dequantize_rows(computed, ids), kernels.dequantize_rows(stored, ids))


def test_only_mins_that_are_exactly_centred_are_left_out() -> None:
    w = quantize_int4(torch.randn(16, 64) * 0.05, 32)
    assert not tiles_module.centred(w.scales, w.mins, False)
    assert tiles_module.centred(w.scales, tiles_module.centred_mins(w.scales, True), True)
    assert not tiles_module.centred(w.scales, tiles_module.centred_mins(w.scales, True), False)
