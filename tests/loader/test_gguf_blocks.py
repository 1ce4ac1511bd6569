"""Every GGUF block type → a packed weight whose values are gguf's own dequantization (exactly where the mapping
is exact, within the stated rounding where it is not), and the native kernels on those weights match the
reference product on odd shapes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from loader_gguf_writing import ENCODERS, QUANTIZABLE, RANDOM_CODED, encode

from tokenriver.errors import ModelLoadError
from tokenriver.loader.gguf_blocks import CONVERSIONS, EXACT, REQUANTIZED, SCALES_FLOAT16, to_packed
from tokenriver.models.cpu.kernels import load_kernels
from tokenriver.models.quant import Int4Linear, Int4Weight, Int8Linear, Int8Weight, repack_q4_0, repack_q4_1

Q = gguf.GGMLQuantizationType
# The types of the popular GGUF files, each of which must stay packed.
POPULAR = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS)
ENCODABLE = sorted((set(CONVERSIONS) & (QUANTIZABLE | set(ENCODERS) | RANDOM_CODED)), key=lambda t: t.value)


def _stored(qtype: gguf.GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return encode((rng.standard_normal((rows, cols)) * 0.1).astype(np.float32), qtype, rng)


def test_every_popular_type_has_a_packed_layout():
    assert set(POPULAR) <= set(CONVERSIONS)
    assert set(POPULAR) <= set(ENCODABLE)


@pytest.mark.parametrize("qtype", ENCODABLE, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 7])
def test_packed_values_are_ggufs_dequantization(qtype, rows):
    data = _stored(qtype, rows, 512, seed=rows)
    reference = np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32)  # [rows, 512]
    weight = to_packed(data, qtype)
    assert weight.shape == (rows, 512) and weight.group_size == 32
    got = weight.dequantize().numpy()
    kind = CONVERSIONS[qtype][1]
    if kind == EXACT:
        np.testing.assert_array_equal(got, reference)
    elif kind == SCALES_FLOAT16:
        # Each value is a code (at most 127 in size) times a scale rounded once to float16 (2^-11 relative).
        scales = weight.scales.float().numpy().repeat(32, axis=1)
        bound = np.abs(scales) * 127 * 2.0**-11 + 1e-7
        if isinstance(weight, Int4Weight):
            bound += np.abs(weight.mins.float().numpy().repeat(32, axis=1)) * 2.0**-11
        assert np.all(np.abs(got - reference) <= bound), qtype.name
    else:
        assert kind == REQUANTIZED
        # Half an int8 step of each group's largest magnitude, whose scale is itself a float16.
        groups = np.abs(reference).reshape(rows, -1, 32).max(axis=-1) / 127
        bound = (groups * (0.5 + 2.0**-10)).repeat(32, axis=1) + 1e-7
        assert np.all(np.abs(got - reference) <= bound), qtype.name


@pytest.mark.parametrize("qtype, block_bytes", [(Q.Q4_K, 144), (Q.Q5_K, 176)], ids=["Q4_K", "Q5_K"])
def test_k_quants_keep_their_codes_and_are_exact_where_scales_fit_float16(qtype, block_bytes):
    """With sub-scales whose products are float16 numbers, the Q4_K and Q5_K mappings are exact: only scales can
    round."""
    rng = np.random.default_rng(3)
    data = _stored(qtype, 4, 256)
    blocks = data.reshape(4, -1, block_bytes).copy()
    blocks[:, :, 0:2] = np.array([2.0**-8], dtype=np.float16).view(np.uint8)  # d: a power of two
    blocks[:, :, 2:4] = np.array([2.0**-9], dtype=np.float16).view(np.uint8)  # dmin
    blocks[:, :, 4:16] = rng.integers(0, 256, size=(4, 1, 12), dtype=np.uint8)
    data = blocks.reshape(4, -1)
    reference = np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32)
    np.testing.assert_array_equal(to_packed(data, qtype).dequantize().numpy(), reference)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.IQ4_XS], ids=lambda t: t.name)
@pytest.mark.parametrize("num_rows", [1, 3, 11, 17])
def test_native_products_on_converted_weights_match_the_reference(qtype, num_rows):
    if load_kernels() is None:
        pytest.skip("the native kernels need an x86-64 CPU with AVX2/FMA/F16C and a C++ compiler")
    weight = to_packed(_stored(qtype, 37, 768, seed=num_rows), qtype)  # odd out_features
    layer_type = Int4Linear if isinstance(weight, Int4Weight) else Int8Linear
    native, reference = layer_type(weight, backend="native"), layer_type(weight, backend="reference")
    x = torch.randn(num_rows, 768, generator=torch.Generator().manual_seed(num_rows))
    torch.testing.assert_close(native(x), reference(x), rtol=1e-4, atol=1e-4)


NATIVE_TYPES = [Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS]


@pytest.mark.parametrize("qtype", NATIVE_TYPES, ids=lambda t: t.name)
def test_native_conversion_equals_the_numpy_rule_bit_for_bit(qtype):
    if load_kernels() is None:
        pytest.skip("the native kernels need an x86-64 CPU with AVX2/FMA/F16C and a C++ compiler")
    data = _stored(qtype, 9, 1024, seed=11)
    native, portable = to_packed(data, qtype), to_packed(data, qtype, native=False)
    assert type(native) is type(portable)
    torch.testing.assert_close(native.qweight, portable.qweight, rtol=0, atol=0)
    torch.testing.assert_close(native.scales, portable.scales, rtol=0, atol=0)
    if isinstance(native, Int4Weight):
        torch.testing.assert_close(native.mins, portable.mins, rtol=0, atol=0)
        assert (native.high_bits is None) == (portable.high_bits is None)
        if native.high_bits is not None:
            torch.testing.assert_close(native.high_bits, portable.high_bits, rtol=0, atol=0)


@pytest.mark.parametrize(
    "scale, packing",
    [(4094.0, Int4Weight), (-4094.0, Int4Weight), (4096.0, Int8Weight), (-65504.0, Int8Weight), (np.inf, None)],
)
def test_native_q5_0_decides_its_large_scales_as_the_numpy_rule_does(scale, packing):
    """-16 d must fit float16 for the 5-bit form: the native pass declines where it does not, and the numpy rule
    keeps int8 codes (or names the damage), the same on either path."""
    if load_kernels() is None:
        pytest.skip("the native kernels need an x86-64 CPU with AVX2/FMA/F16C and a C++ compiler")
    blocks = _stored(Q.Q5_0, 3, 256, seed=5).reshape(3, -1, 22).copy()
    blocks[1, 2, 0:2] = np.array([scale], dtype=np.float16).view(np.uint8)
    data = blocks.reshape(3, -1)
    if packing is None:
        for native in (True, False):
            with pytest.raises(ModelLoadError, match="Q5_0"):
                to_packed(data, Q.Q5_0, native=native)
        return
    native, portable = to_packed(data, Q.Q5_0), to_packed(data, Q.Q5_0, native=False)
    assert type(native) is type(portable) is packing
    assert torch.equal(native.dequantize(), portable.dequantize())
    np.testing.assert_array_equal(native.dequantize().numpy(), gguf.quants.dequantize(data, Q.Q5_0))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1], ids=lambda t: t.name)
def test_q4_blocks_are_copied_into_the_allocators_tensors_as_models_repack_copies_them(qtype):
    data = _stored(qtype, 24, 512)
    reference = {Q.Q4_0: repack_q4_0, Q.Q4_1: repack_q4_1}[qtype](data)
    made = []

    def empty(shape, dtype):  # rows of a larger tensor, as a fused projection's allocator hands them out
        tensor = torch.zeros((shape[0] + 8, *shape[1:]), dtype=dtype)[8:]
        made.append(tensor)
        return tensor

    got = to_packed(data, qtype, empty=empty)
    fields = (got.qweight, got.scales, got.mins)
    assert [t.data_ptr() for t in fields] == [t.data_ptr() for t in made]
    for tensor, expected in zip(fields, (reference.qweight, reference.scales, reference.mins), strict=True):
        assert tensor.dtype == expected.dtype and torch.equal(tensor.view(torch.uint8), expected.view(torch.uint8))
