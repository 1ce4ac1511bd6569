"""The K-quant products (models/cpu/csrc/kquant.cpp, gemm.cpp) against the definition (models/kquant.py).

A row's bits depend on that row alone: 1 to 64 activation rows (the GEMV up to max_gemv_rows, the GEMM above),
each row equal to the row multiplied alone, for every kind, a stack of mixed kinds, and rows summed in sub-chains;
the values are the reference product's within float rounding; the row tiles hold the weight's values exactly, with
the scales and mins packed at the file's width or a byte each; a
tiling whose buffers do not hold the weight is refused before any kernel reads it; a fused projection's parts of
different kinds, re-laid natively in the union of their layouts, are the definition's records byte for byte."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/models: kquant_weights
from kquant_weights import KINDS, random_kquant  # noqa: E402

from tokenriver.models.cpu import tiles  # noqa: E402
from tokenriver.models.cpu.kernels import load_kernels  # noqa: E402
from tokenriver.models.kquant import (  # noqa: E402
    KQuantLinear,
    KQuantRecords,
    concatenate_kquant,
    concatenate_records,
    pack_records,
)
from tokenriver.models.quant import round_activations_int8  # noqa: E402

kernels = load_kernels()
pytestmark = pytest.mark.skipif(
    kernels is None or not kernels.kquant, reason="the K-quant kernels need x86-64 AVX512-VNNI and a C++ compiler"
)
ROW_COUNTS = [1, 2, 3, 5, 10, 11, 16, 17, 33, 64]


# Fused projections of parts of different kinds (49 rows): nibbles with two high bits and mins per 32; crumbs with
# a high bit and mins per 16; nibbles with one high bit and mins per 16.
MIXES = {
    "mixed": ("Q4_K", "Q6_K", "Q5_K"),
    "mixed-crumbs": ("Q3_K", "Q2_K", "Q3_K"),
    "mixed-low": ("Q2_K", "Q3_K", "Q5_K"),
}


# Kinds whose records keep their scales and mins a byte each (a union's width), not packed as the file's.
BYTE_TERMS = ("Q2_K@8", "Q3_K@8", "Q4_K@8", "Q5_K@8")


def layer_of(kind: str, rows: int = 37, cols: int = 768, seed: int = 0) -> KQuantLinear:
    if kind in BYTE_TERMS:
        weight = random_kquant(rows, cols, kind.split("@")[0], seed, term_bits=8)
    elif kind in MIXES:
        sizes = (20, 13, 16)
        weight = concatenate_kquant(
            [random_kquant(size, cols, part, seed + i) for i, (size, part) in enumerate(zip(sizes, MIXES[kind]))]
        )
    else:
        weight = random_kquant(rows, cols, kind, seed)
    layer = KQuantLinear(weight)
    layer.set_int8_activations(True)
    return layer


@pytest.mark.parametrize("kind", [*KINDS, *BYTE_TERMS, *MIXES])
def test_every_row_has_the_bits_it_has_alone(kind):
    layer = layer_of(kind)
    assert layer.layout == "tiles" and layer._gemv is not None and layer._gemm is not None
    x = torch.randn(64, layer.in_features)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(64)])
    for count in ROW_COUNTS:
        assert torch.equal(layer(x[:count]), alone[:count]), f"{count} rows"


@pytest.mark.parametrize("kind", [*KINDS, *BYTE_TERMS, *MIXES])
def test_values_are_the_reference_products(kind):
    layer = layer_of(kind, seed=5)
    weight = layer.dequantize()
    for count in (1, 7, 40):
        x = torch.randn(count, layer.in_features)
        reference = F.linear(round_activations_int8(x, layer.activation_run), weight)
        assert torch.allclose(layer(x), reference, rtol=1e-4, atol=1e-4 * reference.abs().max().item())


@pytest.mark.parametrize("kind", KINDS)
def test_sub_chains_keep_rows_independent_of_the_batch(kind):
    layer = layer_of(kind, seed=2)
    x = torch.randn(24, layer.in_features)
    whole = layer(x)
    layer.split_row_chains([5, 16, 24])
    split = layer(x)
    assert torch.equal(split, torch.cat([layer(x[i : i + 1]) for i in range(24)]))
    assert torch.allclose(split, whole, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("kind", [*KINDS, *BYTE_TERMS, *MIXES])
def test_tiles_hold_the_weights_values(kind):
    layer = layer_of(kind, seed=3)
    reference = layer.row_major_weight().dequantize()  # out of the tile records
    assert torch.equal(reference, layer.records().weight().dequantize())
    ids = torch.tensor([0, layer.out_features - 1, 17, 17])
    assert torch.equal(layer.dequantize_rows(ids), reference[ids])
    fresh = pack_records(layer.row_major_weight())
    for in_place in (False, True):
        records = KQuantRecords(fresh.records.clone(), fresh.offsets, fresh.layout)
        tiled = tiles.tile_kquant(records, in_place=in_place)
        assert torch.equal(tiles.untile_kquant(tiled), fresh.records)


def test_tiles_that_do_not_hold_the_weight_are_refused():
    tiled = layer_of("Q6_K").packed.tiles
    with pytest.raises(ValueError, match="records must be"):
        kernels.bind_kquant(replace(tiled, records=tiled.records[:1]), many_rows=False)
    with pytest.raises(ValueError, match="multiple of 256"):
        kernels.bind_kquant(replace(tiled, cols=500), many_rows=True)
    with pytest.raises(ValueError, match="2 bits with up to one"):
        kernels.bind_kquant(replace(tiled, layout=replace(tiled.layout, low_bits=2)), many_rows=False)
    with pytest.raises(ValueError, match="chain_ends"):
        kernels.bind_kquant(replace(tiled, chain_ends=torch.tensor([3, 2], dtype=torch.int64)), many_rows=False)


@pytest.mark.parametrize("kind", [*KINDS, *BYTE_TERMS, *MIXES])
def test_the_native_tiling_writes_the_definitions_tile_records(kind):
    records = pack_records(layer_of(kind, rows=48).row_major_weight()).rows(0, 48)  # whole tiles (mixed: 49 rows)
    records = KQuantRecords(records.records.clone(), records.offsets, records.layout)
    expected = tiles.tile_kquant(KQuantRecords(records.records.clone(), records.offsets, records.layout), False)
    kernels.tile_kquant_in_place(records.records, records.layout, 2)
    assert torch.equal(records.records.view(expected.records.shape), expected.records)


@pytest.mark.parametrize(
    "kinds",
    [
        ("Q4_K", "Q6_K", "Q5_K"),
        ("Q3_K", "Q2_K"),
        ("Q2_K", "Q4_K"),
        ("Q3_K", "Q3_K", "Q5_K"),
        ("Q3_K", "Q5_K", "Q4_K"),
        ("Q6_K", "Q3_K", "Q2_K"),
    ],
)
def test_the_native_union_writes_the_definitions_records(kinds):
    parts = [pack_records(random_kquant(20 - 3 * i, 512, kind, i)) for i, kind in enumerate(kinds)]
    native = concatenate_records(parts)
    definition = pack_records(concatenate_kquant([part.weight() for part in parts]))
    assert native.layout == definition.layout
    assert torch.equal(native.records, definition.records)
    assert torch.equal(native.offsets, definition.offsets)


def test_a_union_that_does_not_hold_a_part_is_refused():
    part = pack_records(random_kquant(16, 256, "Q6_K"))
    narrow = pack_records(random_kquant(16, 256, "Q4_K"))
    out = torch.empty(16, 1, narrow.layout.size, dtype=torch.uint8)
    with pytest.raises(ValueError, match="does not hold"):
        kernels.kquant_relayout(part.records, part.offsets, part.layout, narrow.layout, out, 2)
    with pytest.raises(ValueError, match="out must be"):
        kernels.kquant_relayout(part.records, part.offsets, part.layout, part.layout, out, 2)
