"""Weight-only quantized matrix products on NVIDIA GPUs: y = x @ dequantized(W)ᵀ with Triton kernels.

The formats are those of models/quant.py (its module docstring): Int4 with GGUF's nibble order (byte j of
each 32-column run holds column j low, column j + 16 high) and a float16 scale and min per group, Int8 with a
float16 scale per group. Group sizes are multiples of 32, so every run of 32 columns lies inside one group.

Two paths:
- Products of up to FUSED_MAX_ROWS rows read every weight once for a few rows, so their speed is the speed of
  reading the weights. One kernel decodes a [BLOCK_N, BLOCK_K] weight tile in registers (w = scale * q + min,
  float32) and feeds it to tl.dot against the activation tile: the weights cross memory at 4 or 8 bits and no
  dequantized copy exists. Each 32-column run is taken as two halves, columns 0-15 and 16-31: the low and high
  nibbles of the same bytes for int4, so no nibble moves between registers, and 16 contiguous activation columns
  per half, which the loads read as vectors. On an H100 this beats cuBLAS on a bfloat16 weight for int4 (it reads
  a quarter of the bytes) and about matches it for int8 (half the bytes, and a decode).
- Larger products are bound by arithmetic: cuBLAS on a weight decoded into x's dtype by a second kernel, a band of
  output features at a time to bound the temporary. The decode costs about one extra write and read of the
  16-bit weight.

Sums are float32 on both paths. Float16 and bfloat16 activations meet the decoded weight rounded to their own type
(as F.linear with a weight of that dtype would). Float32 activations always take the second path with a float32
weight, exact unless torch.backends.cuda.matmul.allow_tf32 asks for TF32: in the fused kernel the tensor cores
would round them to TF32, and its exact "ieee" product is several times slower than cuBLAS's float32 one.

Triton is optional: without it this module still imports and `available()` is False.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from tokenriver.errors import InvalidParameterError

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the quantized layers keep their CPU and reference backends
    triton = None

RUN = 32  # columns per nibble run (GGUF block); group sizes are multiples of it
# Up to this many rows the fused kernel runs; above it, decode + cuBLAS (module docstring): where the two crossed
# on an H100.
FUSED_MAX_ROWS = 64
# The decode + cuBLAS path decodes at most this many weight elements at a time (256 MiB as bfloat16).
DEQUANT_CHUNK_ELEMENTS = 1 << 27


class Blocks(NamedTuple):
    """Tile sizes and launch shape of one fused-kernel call."""

    block_m: int
    block_n: int
    block_k: int  # a multiple of RUN that divides K: the kernel has no masks along K
    num_warps: int
    num_stages: int


def available(device: torch.device | str) -> bool:
    """True when these kernels can run on `device`: Triton imports and the device is a CUDA GPU."""
    return triton is not None and torch.device(device).type == "cuda"


def int4_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int
) -> torch.Tensor:
    """x [M, K] (float16, bfloat16 or float32) @ dequantize_int4(qweight, scales, mins, group_size)ᵀ → [M, N] in
    x's dtype, float32 sums; qweight [N, K / 2] uint8, scales and mins [N, K / group_size] float16."""
    _check(x, qweight, torch.uint8, 2 * qweight.shape[1], scales, mins, group_size)
    return _matmul(x, qweight, scales, mins, group_size)


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [M, K] (float16, bfloat16 or float32) @ dequantize_int8(qweight, scales, group_size)ᵀ → [M, N] in x's
    dtype, float32 sums; qweight [N, K] int8, scales [N, K / group_size] float16 (group_size == K: per channel)."""
    _check(x, qweight, torch.int8, qweight.shape[1], scales, None, group_size)
    return _matmul(x, qweight, scales, None, group_size)


def dequantize(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    group_size: int,
    dtype: torch.dtype,
    rows: slice = slice(None),
) -> torch.Tensor:
    """The weight rows `rows` (a step-1 slice) [n, K] in `dtype`, decoded on the GPU: int4 when `mins` is given,
    else int8. The same values as models/quant.py's dequantize_int4/int8, rounded once to `dtype`."""
    _require_triton()
    start, stop, _ = rows.indices(qweight.shape[0])
    qweight, scales = qweight[start:stop].contiguous(), scales[start:stop].contiguous()
    mins = None if mins is None else mins[start:stop].contiguous()
    n = qweight.shape[0]
    k = qweight.shape[1] * (2 if mins is not None else 1)
    weight = torch.empty((n, k), dtype=dtype, device=qweight.device)
    if n:
        block_k = _block_k(k, 256)
        grid = (triton.cdiv(n, 32), k // block_k)
        _dequantize_kernel[grid](
            qweight,
            scales,
            scales if mins is None else mins,
            weight,
            n,
            K=k,
            GROUP=group_size,
            INT4=mins is not None,
            BLOCK_N=32,
            BLOCK_K=block_k,
            num_warps=4,
        )
    return weight


def choose_blocks(m: int, n: int, k: int) -> Blocks:
    """Fused-kernel tiles for an [m, k] @ [k, n] product with m <= FUSED_MAX_ROWS (swept on an H100).

    Such products read every weight once. Up to 16 rows: the smallest row tile tl.dot takes (16), and column tiles
    narrow enough (32) that n = 4096 gives 128 programs to keep the memory system busy, each reading 512 columns a
    step; from n = 8192 there are programs enough for 64-column tiles, which read each activation tile half as
    often. Above 16 rows, 32 x 64 tiles were best up to 64 rows.
    """
    if m > 16 or n >= 8192:
        return Blocks(16 if m <= 16 else 32, 64, _block_k(k, 256), 4, 3)
    return Blocks(16, 32, _block_k(k, 512), 4, 3)


def _block_k(k: int, preferred: int) -> int:
    """The largest tile depth <= preferred (a power of two times 32) that divides K, so no masks run along K."""
    block_k = preferred
    while k % block_k:
        block_k //= 2
    return block_k


def _require_triton() -> None:
    if triton is None:
        raise RuntimeError("tokenriver.models.cuda.quant_matmul needs triton; check available() first")


def _check(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qdtype: torch.dtype,
    k: int,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    group_size: int,
) -> None:
    """Shapes and dtypes, checked here: the kernels read raw pointers and would read garbage on a mismatch."""
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise InvalidParameterError(
            f"x must be float16, bfloat16 or float32 [M, {k}], got {x.dtype} {tuple(x.shape)}", param="x"
        )
    if qweight.dim() != 2 or qweight.dtype != qdtype or group_size <= 0 or group_size % RUN or k % group_size:
        raise InvalidParameterError(
            f"qweight must be 2-D {qdtype} and group_size a multiple of {RUN} dividing "
            f"K = {k}; got {qweight.dtype} and {group_size}",
            param="group_size",
        )
    for name, tensor in (("scales", scales), ("mins", mins)):
        if tensor is not None and (
            tensor.shape != (qweight.shape[0], k // group_size) or tensor.dtype != torch.float16
        ):
            raise InvalidParameterError(
                f"{name} must be float16 [{qweight.shape[0]}, {k // group_size}], got "
                f"{tensor.dtype} {tuple(tensor.shape)}",
                param=name,
            )
    devices = {t.device for t in (x, qweight, scales, mins) if t is not None}
    if len(devices) != 1:
        raise InvalidParameterError(
            f"x and the weight must be on one device, got {sorted(map(str, devices))}", param="x"
        )


def _matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    group_size: int,
    blocks: Blocks | None = None,
) -> torch.Tensor:
    """Either path (module docstring); `blocks` forces the fused kernel with those tiles on 16-bit x (tuning)."""
    _require_triton()
    x = x.contiguous()
    m, k = x.shape
    n = qweight.shape[0]
    qweight, scales = qweight.contiguous(), scales.contiguous()
    mins = None if mins is None else mins.contiguous()
    if x.dtype == torch.float32 or (m > FUSED_MAX_ROWS and blocks is None):
        band = max(1, DEQUANT_CHUNK_ELEMENTS // max(k, 1))  # weight rows decoded at a time
        if band >= n:
            return F.linear(x, dequantize(qweight, scales, mins, group_size, x.dtype))
        return torch.cat(
            [
                F.linear(x, dequantize(qweight, scales, mins, group_size, x.dtype, slice(i, i + band)))
                for i in range(0, n, band)
            ],
            dim=1,
        )
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    b = blocks or choose_blocks(m, n, k)
    # N tiles on grid axis 0 (up to 2^31 programs; axis 1 allows 65535): the vocabulary projection has the most.
    grid = (triton.cdiv(n, b.block_n), triton.cdiv(m, b.block_m))
    _quant_matmul_kernel[grid](
        x,
        qweight,
        scales,
        scales if mins is None else mins,
        y,
        m,
        n,
        K=k,
        GROUP=group_size,
        INT4=mins is not None,
        BLOCK_M=b.block_m,
        BLOCK_N=b.block_n,
        BLOCK_K=b.block_k,
        num_warps=b.num_warps,
        num_stages=b.num_stages,
    )
    return y


if triton is not None:

    @triton.jit
    def _decode_halves(
        q_ptr,
        scale_ptr,
        min_ptr,
        cols,
        col_ok,
        k0,
        K: tl.constexpr,
        GROUP: tl.constexpr,
        INT4: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """Weight rows `cols`, columns k0 .. k0 + BLOCK_K, decoded to float32 as two [BLOCK_N, BLOCK_K / 2] halves:
        columns 0-15 and 16-31 of each run of 32 (for int4 the low and high nibbles of the same bytes)."""
        RUNS: tl.constexpr = BLOCK_K // 32
        HALF: tl.constexpr = BLOCK_K // 2
        runs = tl.arange(0, RUNS)
        if GROUP == 32:
            groups = k0 // 32 + runs  # written so that the compiler sees contiguous scales (vector loads)
        else:
            groups = (k0 + runs * 32) // GROUP
        s_off = cols[:, None] * (K // GROUP) + groups[None, :]  # [BN, R]: one scale per run
        scale = tl.load(scale_ptr + s_off, mask=col_ok[:, None], other=0.0).to(tl.float32)[:, :, None]
        if INT4:
            byte = tl.arange(0, HALF)  # byte 16 r + j of the tile holds columns 32 r + j and 32 r + 16 + j
            q = tl.load(q_ptr + cols[:, None] * (K // 2) + k0 // 2 + byte[None, :], mask=col_ok[:, None], other=0)
            q = tl.reshape(q, (BLOCK_N, RUNS, 16))
            lowest = tl.load(min_ptr + s_off, mask=col_ok[:, None], other=0.0).to(tl.float32)[:, :, None]
            w_lo = (q & 15).to(tl.float32) * scale + lowest
            w_hi = (q >> 4).to(tl.float32) * scale + lowest
        else:
            row = q_ptr + cols[:, None] * K + k0 + _low_columns(BLOCK_K)[None, :]
            w_lo = tl.reshape(tl.load(row, mask=col_ok[:, None], other=0), (BLOCK_N, RUNS, 16)).to(tl.float32)
            w_hi = tl.reshape(tl.load(row + 16, mask=col_ok[:, None], other=0), (BLOCK_N, RUNS, 16)).to(tl.float32)
            w_lo = w_lo * scale
            w_hi = w_hi * scale
        return tl.reshape(w_lo, (BLOCK_N, HALF)), tl.reshape(w_hi, (BLOCK_N, HALF))

    @triton.jit
    def _low_columns(BLOCK_K: tl.constexpr):
        """Columns 0-15 of each run of 32 in a BLOCK_K tile: 32 r + j for j < 16, BLOCK_K / 2 of them. Marked as
        runs of 16 contiguous columns so that loads and stores through them are vectorized."""
        half = tl.arange(0, BLOCK_K // 2)
        return tl.max_contiguous(tl.multiple_of((half // 16) * 32 + half % 16, 16), 16)

    @triton.jit
    def _quant_matmul_kernel(
        x_ptr,
        q_ptr,
        scale_ptr,
        min_ptr,
        y_ptr,
        M,
        N,
        K: tl.constexpr,
        GROUP: tl.constexpr,
        INT4: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """One [BLOCK_M, BLOCK_N] tile of y for 16-bit x; tiles overhanging M or N are masked, BLOCK_K divides K.

        K is a compile-time constant: a model has a few distinct K (hidden and intermediate sizes), each compiled
        once, and the compiler then knows the row strides (aligned vector loads). (Triton 3.6's interpreter also
        cannot loop to a runtime bound under NumPy >= 2.4.)
        """
        rows = tl.program_id(1).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] activation rows
        cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] outputs = weight rows
        row_ok = rows < M
        col_ok = cols < N
        x_row = x_ptr + rows[:, None] * K + _low_columns(BLOCK_K)[None, :]  # int64 offsets: M * K may pass 2^31
        x_dtype = x_ptr.dtype.element_ty
        # tl.full, a builtin, rather than tl.zeros, a @jit helper: the interpreter (tests without a GPU) runs only
        # helpers decorated while TRITON_INTERPRET was set, and triton may have been imported before that.
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            w_lo, w_hi = _decode_halves(q_ptr, scale_ptr, min_ptr, cols, col_ok, k0, K, GROUP, INT4, BLOCK_N, BLOCK_K)
            x_lo = tl.load(x_row + k0, mask=row_ok[:, None], other=0.0)
            x_hi = tl.load(x_row + k0 + 16, mask=row_ok[:, None], other=0.0)
            acc = tl.dot(x_lo, tl.trans(w_lo.to(x_dtype)), acc)
            acc = tl.dot(x_hi, tl.trans(w_hi.to(x_dtype)), acc)
        y_mask = row_ok[:, None] & col_ok[None, :]
        tl.store(y_ptr + rows[:, None] * N + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=y_mask)

    @triton.jit
    def _dequantize_kernel(
        q_ptr,
        scale_ptr,
        min_ptr,
        w_ptr,
        N,
        K: tl.constexpr,
        GROUP: tl.constexpr,
        INT4: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """One [BLOCK_N, BLOCK_K] tile of the decoded weight, in w's dtype; BLOCK_K divides K."""
        cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        k0 = tl.program_id(1) * BLOCK_K
        w_lo, w_hi = _decode_halves(q_ptr, scale_ptr, min_ptr, cols, col_ok, k0, K, GROUP, INT4, BLOCK_N, BLOCK_K)
        out = w_ptr + cols[:, None] * K + k0 + _low_columns(BLOCK_K)[None, :]
        tl.store(out, w_lo.to(w_ptr.dtype.element_ty), mask=col_ok[:, None])
        tl.store(out + 16, w_hi.to(w_ptr.dtype.element_ty), mask=col_ok[:, None])
