"""The K-quant format's definition (models/kquant.py): its dequantization is the stated formula, out of the fields
and out of records whose scales and mins are packed at their own width, stacking keeps every part's values, the
layer refuses fields that do not fit, and its reference product is F.linear on the dequantized weight with the
activations rounded as the engine's default arithmetic rounds them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kquant_weights import KINDS, random_kquant

from tokenriver.errors import InvalidParameterError
from tokenriver.models.kquant import (
    KQuantLinear,
    KQuantWeight,
    RecordLayout,
    concatenate_kquant,
    pack_records,
    pack_terms,
    unpack_crumbs,
    unpack_terms,
)
from tokenriver.models.quant import round_activations_int8, unpack_high_bits, unpack_int4


def formula(weight: KQuantWeight) -> torch.Tensor:
    """w = d * sc * (q - o) - dmin * m, element by element in float64 (every product is exact in float32)."""
    rows, cols = weight.shape
    q = (unpack_int4(weight.qweight) if weight.low_bits == 4 else unpack_crumbs(weight.qweight)).long()
    for plane, value in ((weight.high1, 2**weight.low_bits), (weight.high2, 2 ** (weight.low_bits + 1))):
        if plane is not None:
            q = q + unpack_high_bits(plane).long() * value
    columns = torch.arange(cols)
    d = weight.d.double()[:, columns // 256]
    sc = weight.scales.double()[:, columns // weight.scale_group]
    w = d * sc * (q - weight.offsets.long()[:, None]).double()
    if weight.mins is not None:
        w = w - weight.dmin.double()[:, columns // 256] * weight.mins.double()[:, columns // weight.min_group]
    return w.float()


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_is_the_formula(kind):
    weight = random_kquant(21, 512, kind, seed=1)
    assert torch.equal(weight.dequantize(), formula(weight))
    records = pack_records(weight)
    assert records.layout.term_bits == weight.term_bits
    assert torch.equal(records.dequantize(), formula(weight))


@pytest.mark.parametrize(
    ("term_bits", "count", "signed"), [(8, 16, True), (8, 32, False), (6, 16, False), (6, 16, True), (4, 32, False)]
)
def test_packed_terms_hold_every_value_of_their_width(term_bits, count, signed):
    """Every value the width holds, at every position of a super-block's terms, comes back; 6 and 4 bits take
    exactly their share of bytes."""
    low, high = (-(2 ** (term_bits - 1)), 2 ** (term_bits - 1)) if signed else (0, 2**term_bits)
    values = torch.arange(low, high).repeat(count)[: count * (high - low)].reshape(-1, count)
    values = torch.cat([values, values.roll(1, dims=1)])
    packed = pack_terms(values, term_bits)
    assert packed.dtype == torch.uint8 and packed.shape == (values.shape[0], count * term_bits // 8)
    assert torch.equal(unpack_terms(packed, term_bits, signed), values)


def test_a_layout_holds_only_the_packings_the_products_unpack():
    assert RecordLayout(num_high=0, scale_group=32, has_mins=True, term_bits=6).packs_terms()
    assert RecordLayout(num_high=0, scale_group=16, has_mins=True, low_bits=2, min_group=16, term_bits=4).packs_terms()
    assert not RecordLayout(
        num_high=0, scale_group=16, has_mins=True, low_bits=2, min_group=16, term_bits=6
    ).packs_terms()
    assert not RecordLayout(num_high=2, scale_group=16, has_mins=False, term_bits=5).packs_terms()


@pytest.mark.parametrize(
    ("kinds", "low_bits", "num_high", "min_group"),
    [
        (("Q4_K", "Q6_K", "Q5_K"), 4, 2, 32),
        (("Q3_K", "Q2_K"), 2, 1, 16),
        (("Q2_K", "Q4_K"), 4, 0, 16),
        (("Q3_K", "Q5_K", "Q4_K"), 4, 1, 32),
        (("Q6_K", "Q3_K", "Q2_K"), 4, 2, 16),
    ],
)
def test_stacking_mixed_kinds_keeps_every_rows_values(kinds, low_bits, num_high, min_group):
    parts = [random_kquant(20 - 3 * i, 512, kind, i) for i, kind in enumerate(kinds)]
    stacked = concatenate_kquant(parts)
    assert (stacked.low_bits, stacked.num_high, stacked.min_group, stacked.scale_group) == (
        low_bits,
        num_high,
        min_group,
        min(p.scale_group for p in parts),
    )
    assert torch.equal(stacked.dequantize(), torch.cat([p.dequantize() for p in parts]))
    assert torch.equal(stacked.rows(20, 37).dequantize(), parts[1].dequantize())


def test_stacking_refuses_different_in_features():
    with pytest.raises(InvalidParameterError, match="in_features"):
        concatenate_kquant([random_kquant(4, 256, "Q4_K"), random_kquant(4, 512, "Q4_K")])


def test_the_layer_refuses_fields_that_do_not_fit():
    weight = random_kquant(8, 512, "Q4_K")
    fields = weight.fields()
    with pytest.raises(InvalidParameterError, match="scales must be torch.int8"):
        KQuantLinear(KQuantWeight(**{**fields, "scales": fields["scales"].float()}, scale_group=32))
    with pytest.raises(InvalidParameterError, match="d must be"):
        KQuantLinear(KQuantWeight(**{**fields, "d": fields["d"][:, :1]}, scale_group=32))
    with pytest.raises(InvalidParameterError, match="mins and dmin"):
        KQuantLinear(KQuantWeight(**{**fields, "dmin": None}, scale_group=32))
    with pytest.raises(InvalidParameterError, match="scales and mins per 16 or 32"):
        KQuantLinear(KQuantWeight(**fields, scale_group=64))
    with pytest.raises(InvalidParameterError, match="6 for 16 of them a super-block or 4 for 32"):
        KQuantLinear(KQuantWeight(**fields, scale_group=32, term_bits=4))
    with pytest.raises(InvalidParameterError, match="must fit its term_bits"):
        KQuantLinear(KQuantWeight(**{**fields, "mins": fields["mins"] + 64}, scale_group=32, term_bits=6))
    crumbs = random_kquant(8, 512, "Q3_K")
    with pytest.raises(InvalidParameterError, match="2-bit codes with up to one"):
        KQuantLinear(KQuantWeight(**{**crumbs.fields(), "high2": crumbs.high1}, scale_group=16, low_bits=2))
    with pytest.raises(InvalidParameterError, match="offsets are 0 or its codes' centre 4"):
        KQuantLinear(KQuantWeight(**{**crumbs.fields(), "offsets": crumbs.offsets * 8}, scale_group=16, low_bits=2))
    # 2-bit codes fold their scales into a byte (models/cpu/csrc/gemm.cpp): Q3_K's and Q2_K's ranges only.
    with pytest.raises(InvalidParameterError, match="scales in -32..31"):
        KQuantLinear(KQuantWeight(**{**crumbs.fields(), "scales": crumbs.scales * 4}, scale_group=16, low_bits=2))
    with pytest.raises(InvalidParameterError, match="no high bits in its uncentred rows"):
        KQuantLinear(KQuantWeight(**{**crumbs.fields(), "offsets": crumbs.offsets * 0}, scale_group=16, low_bits=2))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("int8_activations", [False, True], ids=["exact", "int8-activations"])
def test_the_reference_product_is_f_linear_on_the_dequantized_weight(kind, int8_activations):
    weight = random_kquant(24, 512, kind, seed=4)
    layer = KQuantLinear(weight, backend="reference", int8_activations=int8_activations)
    x = torch.randn(5, 512)
    rounded = round_activations_int8(x, layer.activation_run) if int8_activations else x
    assert torch.equal(layer(x), F.linear(rounded, weight.dequantize()))
    assert layer.activation_run == (256 if kind in ("Q2_K", "Q3_K") else 32)
    assert torch.equal(layer.dequantize_rows(torch.tensor([3, 0, 23])), weight.dequantize()[[3, 0, 23]])
