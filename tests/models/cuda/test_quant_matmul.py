"""The Triton quantized matmul kernels (models/cuda/quant_matmul.py) against their definition: the reference
dequantization of models/quant.py and F.linear in float64.

On a machine with an NVIDIA GPU they compile and run there. Without one they run in Triton's interpreter, which
executes the kernels with NumPy on CPU tensors: it checks the indexing, the nibble order, the per-group scales and
the masks of odd shapes, but not speed, and not bfloat16 (the interpreter multiplies bfloat16 tiles as raw uint16
bits), so the bfloat16 cases need the GPU; float16 stands in for the 16-bit path there. Float32 activations take
the decode + F.linear path (module docstring), 16-bit ones up to FUSED_MAX_ROWS rows the fused kernel.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

import pytest
import torch
import torch.nn.functional as F

from tokenriver.errors import InvalidParameterError
from tokenriver.models.quant import dequantize_int4, dequantize_int8

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
MODULE = "tokenriver.models.cuda.quant_matmul"
NEEDS_GPU = [
    pytest.mark.cuda,
    pytest.mark.skipif(not ON_GPU, reason="bfloat16 tiles need a CUDA GPU: the interpreter cannot multiply them"),
]
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=NEEDS_GPU)]
# Unit roundoff of each activation dtype: the 16-bit paths round the decoded weight and the output to it.
ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
# (K, group_size) and the tiles they get (BLOCK_K is the largest of 512, 256, ... 32 dividing K): one run and one
# scale per row; 32-column steps; two runs a step with a scale each; two groups a step; a group that ends mid-step.
SHAPES_K = [(32, 32), (96, 32), (192, 32), (128, 64), (192, 96)]


@pytest.fixture(scope="module")
def qm():
    """The kernel module. Without a GPU it is (re)loaded under TRITON_INTERPRET=1: Triton reads that variable when
    @triton.jit decorates a kernel, i.e. when the module is imported, so an import made earlier without it would
    have compiled-only kernels."""
    pytest.importorskip("triton", reason="triton is not installed: the CUDA quantized matmul kernels are untested")
    module = importlib.import_module(MODULE)
    if ON_GPU:
        return module
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        return importlib.reload(module)


def random_int4(n: int, k: int, group_size: int, generator: torch.Generator):
    qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=generator)
    scales = (torch.randn(n, k // group_size, generator=generator) * 0.05).half()  # signed, as Q4_0's may be
    mins = (torch.randn(n, k // group_size, generator=generator) * 0.1).half()
    return qweight, scales, mins


def random_int8(n: int, k: int, group_size: int, generator: torch.Generator):
    qweight = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=generator)
    return qweight, (torch.randn(n, k // group_size, generator=generator) * 0.01).half()


def assert_matches(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """y against x @ weightᵀ in float64. The bound: rounding the decoded weights (relative u each) moves a sum by at
    most u · |x| @ |W|ᵀ, rounding the output by u · |y|; float32 sums add K · 2^-24 · |x| @ |W|ᵀ at most."""
    assert y.dtype == x.dtype and y.shape == (x.shape[0], weight.shape[0])
    x64, w64 = x.double().cpu(), weight.double().cpu()
    expected = F.linear(x64, w64)
    magnitude = F.linear(x64.abs(), w64.abs())
    u = ROUNDOFF[x.dtype]
    tolerance = 2 * u * (magnitude + expected.abs()) + x.shape[1] * 2.0**-24 * magnitude + 1e-30
    error = (y.double().cpu() - expected).abs()
    assert bool((error <= tolerance).all()), f"max error {error.max().item():.3g}, tolerance {tolerance.min():.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("k", "group_size"), SHAPES_K)
@pytest.mark.parametrize("n", [1, 33, 100])
@pytest.mark.parametrize("m", [1, 3, 17])
def test_int4_matches_reference(qm, m, n, k, group_size, dtype):
    generator = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    qweight, scales, mins = random_int4(n, k, group_size, generator)
    x = torch.randn(m, k, generator=generator).to(dtype)
    y = qm.int4_matmul(x.to(DEVICE), qweight.to(DEVICE), scales.to(DEVICE), mins.to(DEVICE), group_size)
    assert_matches(y, x, dequantize_int4(qweight, scales, mins, group_size))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("k", "group_size"), SHAPES_K)
@pytest.mark.parametrize("n", [1, 33, 100])
@pytest.mark.parametrize("m", [1, 3, 17])
def test_int8_matches_reference(qm, m, n, k, group_size, dtype):
    generator = torch.Generator().manual_seed(m * 1000 + n * 10 + k + 1)
    qweight, scales = random_int8(n, k, group_size, generator)
    x = torch.randn(m, k, generator=generator).to(dtype)
    y = qm.int8_matmul(x.to(DEVICE), qweight.to(DEVICE), scales.to(DEVICE), group_size)
    assert_matches(y, x, dequantize_int8(qweight, scales, group_size))


@pytest.mark.parametrize("dtype", DTYPES)
def test_many_rows_and_strided_x(qm, monkeypatch, dtype):
    """Above FUSED_MAX_ROWS: the weight decoded by the second kernel, in bands of output features (made small here
    so that there are several, the last one short), then F.linear; x a view whose rows are not contiguous."""
    monkeypatch.setattr(qm, "DEQUANT_CHUNK_ELEMENTS", 64 * 192)  # bands of 64 weight rows
    generator = torch.Generator().manual_seed(7)
    m, n, k, group_size = qm.FUSED_MAX_ROWS + 66, 150, 192, 64
    x = torch.randn(m, 2 * k, generator=generator).to(dtype)[:, ::2]
    qweight, scales, mins = random_int4(n, k, group_size, generator)
    y = qm.int4_matmul(x.to(DEVICE), qweight.to(DEVICE), scales.to(DEVICE), mins.to(DEVICE), group_size)
    assert_matches(y, x, dequantize_int4(qweight, scales, mins, group_size))
    qweight8, scales8 = random_int8(n, k, group_size, generator)
    y8 = qm.int8_matmul(x.to(DEVICE), qweight8.to(DEVICE), scales8.to(DEVICE), group_size)
    assert_matches(y8, x, dequantize_int8(qweight8, scales8, group_size))


@pytest.mark.parametrize(("k", "group_size"), [(96, 32), (512, 64), (160, 160)])
def test_dequantize_is_exact(qm, k, group_size):
    """scale * q (a float16 times a small integer) is exact in float32, so the kernel's decode equals the reference
    bit for bit, whatever it contracts into a fused multiply-add; `rows` picks a band of weight rows."""
    generator = torch.Generator().manual_seed(k)
    qweight, scales, mins = random_int4(40, k, group_size, generator)
    expected = dequantize_int4(qweight, scales, mins, group_size)
    on_device = [t.to(DEVICE) for t in (qweight, scales, mins)]
    assert torch.equal(qm.dequantize(*on_device, group_size, torch.float32).cpu(), expected)
    band = qm.dequantize(*on_device, group_size, torch.float16, slice(5, 37)).cpu()
    assert torch.equal(band, expected[5:37].half())
    qweight8, scales8 = random_int8(40, k, group_size, generator)
    decoded8 = qm.dequantize(qweight8.to(DEVICE), scales8.to(DEVICE), None, group_size, torch.float32).cpu()
    assert torch.equal(decoded8, dequantize_int8(qweight8, scales8, group_size))


def test_empty_batch(qm):
    qweight, scales, mins = random_int4(8, 64, 32, torch.Generator().manual_seed(0))
    y = qm.int4_matmul(torch.zeros(0, 64, device=DEVICE), qweight.to(DEVICE), scales.to(DEVICE), mins.to(DEVICE), 32)
    assert y.shape == (0, 8)


def test_available_only_on_cuda(qm):
    assert not qm.available("cpu")
    assert qm.available("cuda")  # triton imports here (the fixture checked); the device kind decides


def test_rejects_mismatched_shapes():
    """Checked before any launch: the kernel reads raw pointers. Needs no triton."""
    quant_matmul = importlib.import_module(MODULE)
    qweight, scales, mins = random_int4(8, 64, 32, torch.Generator().manual_seed(0))
    with pytest.raises(InvalidParameterError, match="x must be"):
        quant_matmul.int4_matmul(torch.zeros(2, 32), qweight, scales, mins, 32)
    with pytest.raises(InvalidParameterError, match="group_size"):
        quant_matmul.int4_matmul(torch.zeros(2, 64), qweight, scales, mins, 48)
    with pytest.raises(InvalidParameterError, match="scales"):
        quant_matmul.int4_matmul(torch.zeros(2, 64), qweight, scales[:, :1], mins, 32)
    with pytest.raises(InvalidParameterError, match="qweight"):
        quant_matmul.int8_matmul(torch.zeros(2, 32), qweight, scales, 32)  # uint8 codes where int8 belong


def test_imports_without_triton(monkeypatch):
    """A machine without triton still imports the module (the loader may probe it); available() is then False.
    Loaded as a fresh copy under another name, with `import triton` failing, so the real module is untouched."""
    quant_matmul = importlib.import_module(MODULE)
    monkeypatch.setitem(sys.modules, "triton", None)  # None in sys.modules makes the import raise ImportError
    monkeypatch.setitem(sys.modules, "triton.language", None)
    spec = importlib.util.spec_from_file_location("quant_matmul_without_triton", quant_matmul.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.triton is None and not module.available("cuda")
    with pytest.raises(RuntimeError, match="needs triton"):
        module.int8_matmul(torch.zeros(1, 32), torch.zeros(2, 32, dtype=torch.int8), torch.ones(2, 1).half(), 32)
