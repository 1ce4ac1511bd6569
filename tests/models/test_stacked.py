"""A fused projection of K-quant parts of different types (models/stacked.py): each part stays at its own size, the
values are the union's, every row's bits depend on that row alone, and the loader stacks such parts instead of
re-laying them out."""

from __future__ import annotations

import pytest
import torch
from kquant_weights import random_kquant

from tokenriver.loader.assemble import _stack
from tokenriver.models.buffers import heap_empty
from tokenriver.models.cpu.kernels import load_kernels
from tokenriver.models.kquant import KQuantLinear, concatenate_records, pack_records
from tokenriver.models.stacked import KQuantStack, StackedLinear

KINDS = [("Q4_K", "Q4_K", "Q6_K"), ("Q3_K", "Q3_K", "Q5_K"), ("Q2_K", "Q3_K", "Q4_K")]


def stack_of(kinds: tuple[str, ...], cols: int = 512) -> KQuantStack:
    return KQuantStack(
        tuple(pack_records(random_kquant(48 - 16 * (i == 2), cols, kind, i)) for i, kind in enumerate(kinds))
    )


@pytest.mark.parametrize("kinds", KINDS, ids="-".join)
def test_the_parts_keep_their_own_size_and_the_unions_values(kinds):
    stack = stack_of(kinds)
    union = concatenate_records(list(stack.parts))
    assert sum(part.records.nbytes for part in stack.parts) < union.records.nbytes
    assert torch.equal(stack.dequantize(), union.dequantize())
    layer = StackedLinear(stack)  # binding the parts lays their records out in tiles, in place
    assert (layer.out_features, layer.in_features) == union.shape
    assert torch.equal(layer.dequantize(), union.dequantize())


def test_the_loader_stacks_parts_of_different_types_and_concatenates_alike_ones():
    parts = [pack_records(random_kquant(32, 256, kind, i)) for i, kind in enumerate(("Q4_K", "Q6_K"))]
    assert isinstance(_stack(parts, heap_empty), KQuantStack)
    alike = [pack_records(random_kquant(32, 256, "Q4_K", i)) for i in range(2)]
    assert not isinstance(_stack(alike, heap_empty), KQuantStack)


@pytest.mark.parametrize("kinds", KINDS, ids="-".join)
def test_outputs_are_the_parts_side_by_side_and_a_rows_bits_its_own(kinds):
    stack = stack_of(kinds)
    bias = torch.randn(stack.shape[0])
    layer = StackedLinear(stack, bias)
    for part in layer.parts:
        part.set_int8_activations(True)
    x = torch.randn(24, stack.shape[1])
    again = stack_of(kinds)
    parts = [KQuantLinear(part, bias[start : start + part.shape[0]]) for part, start in zip(again.parts, (0, 48, 96))]
    for part in parts:
        part.set_int8_activations(True)
    assert torch.equal(layer(x), torch.cat([part(x) for part in parts], dim=-1))
    assert torch.equal(layer.bias, bias)
    if load_kernels() is not None and load_kernels().kquant:
        assert torch.equal(layer(x), torch.cat([layer(x[i : i + 1]) for i in range(24)]))


def test_parts_that_do_not_make_the_layers_shape_are_refused_before_native_code():
    decoder = pytest.importorskip("tokenriver.models.cpu.decoder")
    if load_kernels() is None or not load_kernels().kquant:
        pytest.skip("the K-quant kernels need AVX512-VNNI")
    layer = StackedLinear(stack_of(KINDS[0]))
    for part in layer.parts:
        part.set_int8_activations(True)
    assert decoder.linear_spec(layer).num_parts == 3
    layer.out_features += 16
    with pytest.raises(ValueError, match="their rows must add up"):
        decoder.linear_spec(layer)
