"""A decoder layer's small ops on NVIDIA GPUs, one Triton kernel each: RMSNorm with its residual add, rotary
embedding, SiLU-and-multiply and GeLU(tanh)-and-multiply.

In PyTorch ops each of these is several kernels (RMSNorm alone: the add, a float copy, pow, mean, add, rsqrt, two
multiplies and a cast), and on a decode step every one of them is tiny: launching them, not computing them, is what
a GPU's step spends its time on, even replayed from a CUDA graph. Each kernel here reads its inputs once and writes
its outputs once, and rounds where the PyTorch definition rounds (models/layers.py, the `*_torch` functions): a
16-bit input's intermediate results are rounded to its dtype at the same points, so the outputs agree up to the
order of the RMSNorm sum and the exponential's last bit. A round to bfloat16 is written out on the float's bits
(`_rounded`): written as a cast to bfloat16 and back, the compiled kernel for an H100 gave rotary results up to two
units of the last place away from PyTorch's, so the rounding did not happen where it was written.

layers.py calls these for CUDA tensors whose layout they take (`fits_rows`, `fits_heads`); anything else keeps the
PyTorch definitions. Triton is optional: without it this module still imports and `available()` is False.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

# Rows wider than this keep the PyTorch RMSNorm: one program holds a whole row in registers.
MAX_NORM_COLUMNS = 1 << 15


def available(device: torch.device | str) -> bool:
    """True when these kernels can run on `device`: Triton imports and the device is a CUDA GPU."""
    return triton is not None and torch.device(device).type == "cuda"


def fits_rows(x: torch.Tensor) -> bool:
    """[rows, columns] with each row contiguous (rows may be spaced apart)."""
    return x.dim() == 2 and x.stride(1) == 1 and x.dtype in (torch.float32, torch.float16, torch.bfloat16)


def fits_heads(x: torch.Tensor) -> bool:
    """[tokens, heads, dim] with each head's values contiguous."""
    return x.dim() == 3 and x.stride(2) == 1 and x.dtype in (torch.float32, torch.float16, torch.bfloat16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """layers.rms_norm_torch in one kernel: residual += x first where given (in place), then weight * the row
    normalized in float32 and rounded to x's dtype; the result in the dtype weight * x promotes to."""
    rows, columns = x.shape
    out = torch.empty((rows, columns), dtype=torch.result_type(weight, x), device=x.device)
    if rows == 0:
        return out
    source = x if residual is None else residual
    _rms_norm_kernel[(rows,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        columns,
        x.stride(0),
        source.stride(0),
        out.stride(0),
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=triton.next_power_of_2(columns),
        num_warps=_warps(columns),
    )
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """layers.apply_rotary in place on x [T, heads, 2 * half] (a view: the heads may be rows of a wider tensor);
    cos, sin [T, 1, half] in x's dtype."""
    tokens, heads, dim = x.shape
    half = cos.shape[-1]
    if tokens == 0:
        return
    cos, sin = cos.reshape(tokens, half), sin.reshape(tokens, half)
    _rotary_kernel[(tokens,)](
        x,
        cos,
        sin,
        heads,
        half,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        sin.stride(0),
        HEADS=triton.next_power_of_2(heads),
        HALF=triton.next_power_of_2(half),
        num_warps=4 if heads * half >= 1024 else 1,
    )


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """layers.silu_and_mul_torch in one kernel: gate_up [T, 2 * I] → silu(gate) * up [T, I]."""
    return _gated(gate_up, gelu=False)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """layers.gelu_tanh_and_mul_torch in one kernel: gate_up [T, 2 * I] → gelu_tanh(gate) * up [T, I]."""
    return _gated(gate_up, gelu=True)


def _gated(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    tokens, width = gate_up.shape
    columns = width // 2
    out = torch.empty((tokens, columns), dtype=gate_up.dtype, device=gate_up.device)
    if tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(columns))
    _gated_kernel[(tokens, triton.cdiv(columns, block))](
        gate_up, out, columns, gate_up.stride(0), out.stride(0), GELU=gelu, BLOCK=block, num_warps=4
    )
    return out


def _warps(columns: int) -> int:
    return 1 if columns <= 256 else 4 if columns <= 2048 else 8 if columns <= 8192 else 16


if triton is not None:

    @triton.jit
    def _rounded(x, dtype: tl.constexpr):
        """float32 x rounded to dtype (to nearest, ties to even) and widened back to float32. bfloat16 keeps a
        float32's top 16 bits: add half of the dropped part's range (one less on an even kept bit, so that ties go
        to even), then clear it; on bits, no compiler pass can fold the rounding away."""
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True)
        else:
            return x.to(dtype).to(tl.float32)

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,
        residual_ptr,
        weight_ptr,
        out_ptr,
        columns,
        x_stride,
        residual_stride,
        out_stride,
        eps,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < columns
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            residual = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
            x = (residual.to(tl.float32) + x.to(tl.float32)).to(residual.dtype)  # residual.add_(x)
            tl.store(residual_ptr + row * residual_stride + cols, x, mask=mask)
        x32 = x.to(tl.float32)
        mean_square = tl.sum(x32 * x32, axis=0) / columns
        normed = _rounded(x32 * tl.rsqrt(mean_square + eps), x.dtype)
        weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * out_stride + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotary_kernel(
        x_ptr,
        cos_ptr,
        sin_ptr,
        heads,
        half,
        token_stride,
        head_stride,
        cos_stride,
        sin_stride,
        HEADS: tl.constexpr,
        HALF: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        head = tl.arange(0, HEADS)[:, None]
        col = tl.arange(0, HALF)[None, :]
        mask = (head < heads) & (col < half)
        first = x_ptr + token * token_stride + head * head_stride + col  # [HEADS, HALF]
        x1 = tl.load(first, mask=mask, other=0.0)
        x2 = tl.load(first + half, mask=mask, other=0.0)
        cos = tl.load(cos_ptr + token * cos_stride + col, mask=col < half, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + token * sin_stride + col, mask=col < half, other=0.0).to(tl.float32)
        dtype = x1.dtype
        a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
        # x1 * cos - x2 * sin and x2 * cos + x1 * sin, each product and each sum rounded as PyTorch's ops round them.
        out1 = (_rounded(a1 * cos, dtype) - _rounded(a2 * sin, dtype)).to(dtype)
        out2 = (_rounded(a2 * cos, dtype) + _rounded(a1 * sin, dtype)).to(dtype)
        tl.store(first, out1, mask=mask)
        tl.store(first + half, out2, mask=mask)

    @triton.jit
    def _gated_kernel(gate_up_ptr, out_ptr, columns, in_stride, out_stride, GELU: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < columns
        gate = tl.load(gate_up_ptr + row * in_stride + cols, mask=mask, other=0.0)
        up = tl.load(gate_up_ptr + row * in_stride + columns + cols, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        if GELU:
            inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2 / pi) (g + 0.044715 g³)
            # 0.5 (1 + tanh(u)) as the sigmoid of 2u: no cancellation where tanh nears -1.
            act = g / (1.0 + tl.exp(-2.0 * inner))
        else:
            act = g / (1.0 + tl.exp(-g))
        act = _rounded(act, gate.dtype)  # the activation rounds to the input dtype, as PyTorch's does
        tl.store(out_ptr + row * out_stride + cols, (act * up.to(tl.float32)).to(gate.dtype), mask=mask)
