"""Quantized linear layers: weights stay 4- or 8-bit in memory and are decoded inside the matrix product.

A decode step reads every weight once for a handful of activation rows, so its speed is the speed of streaming
the weights. Keeping them quantized cuts the bytes read 4-8x against float32; what matters next is a kernel that
reads them at memory speed (benchmarks/results/kernels.md measures the candidates on this machine).

Formats (an [out_features N, in_features K] matrix, groups of `group_size` consecutive input columns):
- `Int4Weight`: qweight [N, K / 2] uint8, scales and mins [N, K / group_size] float16,
  w = scale * q + min with q in 0..15. Within each run of 32 columns, byte j holds column j in its low nibble and
  column j + 16 in its high nibble: GGUF's Q4_0/Q4_1 order, so GGUF blocks repack without touching a nibble.
  With `high_bits` [N, K / 32] int32 it holds 5-bit codes: bit j of word b is bit 4 of column 32 b + j's code,
  w = scale * (q + 16 * bit) + min (GGUF's Q5_0, whose per-block word it is as stored: 6 bits a weight where int8
  took 8.5; the CPU's row tiles leave out a min that is -8 or -16 times its scale, Q4_0's and Q5_0's, and their
  products compute it: the file's 4.5 and 5.5 bits, models/cpu/tiles.py).
- `Int8Weight`: qweight [N, K] int8, scales [N, K / group_size] float16, w = scale * q. group_size == K is one
  scale per output channel; 32 is GGUF's Q8_0.
Float16 scales are what GGUF stores, so repacking Q4_0, Q4_1 and Q8_0 is exact: the dequantized weights equal
gguf's own dequantization bit for bit (Q4_0's min is -8 * scale, exact in float16).

Each layer computes y = x @ dequantized(W)ᵀ (+ bias) with float32 accumulation, through one of two backends:
- "native": models/cpu/csrc/gemv.cpp, AVX2 GEMV that decodes in registers (the fast path for up to
  `max_gemv_rows` activation rows); for more rows models/cpu/csrc/gemm.cpp, which decodes a few weight rows at a
  time into a small buffer and multiplies them with every activation row there (compute-bound, and no float32
  copy of the model is kept; benchmarks/results/gemm.md compares it with MKL's sgemm on such a copy).
- "triton": on a GPU, models/cuda/quant_matmul.py, which decodes the packed weights inside a tiled matrix product in
  the activations' dtype (bfloat16 there), so a 4-bit file stays 4-bit in GPU memory.
- "reference": dequantize with torch ops, then F.linear. Any device; the definition the others are tested against.
"auto" picks "native" when the weights are on a CPU the kernels build on, "triton" when they are on a CUDA GPU and
Triton imports, else "reference". The first two are the fast paths of the weights' device (models/fast_path.py),
which bind a layer's weights once (`rebind`); the layer's forward is the reference's wherever they do not apply.
Outputs have the activations' dtype (float32 or bfloat16); the sums are float32 either way.

`int8_activations=True` trades exactness for speed on decode-sized products (at most `max_gemv_rows` rows): the
activations are rounded to int8 per 32 columns (scale max|x| / 127), as llama.cpp does on CPUs, and the native
kernel multiplies integers: for int4 weights about a third of the vector operations per weight byte, so the
products keep up with memory (benchmarks/results/kernels.md); for int8 weights it saves the conversion of each
weight byte to float32, about a quarter of a large GEMV's time. The engine sets it with
`load_model(..., int8_activations=True)`. The int4 min term uses the rounded activations too: the error is then
W · (x̂ - x) with W's centred values, not a shared offset from the 0..15 codes. Larger products (prefill, batched
decode) round the same way (`gemm_rounding` "int8"), and every int8-activation product computes a row in one
arithmetic (gemv.cpp): the GEMV and the GEMM (gemm.cpp, where the CPU has AVX512-VNNI; elsewhere the GEMV takes
every row count) give a row the same bits whatever rows share the call. The reference backend rounds the
activations as the native one does; its float sums are PyTorch's, close to the kernels' but not bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tokenriver.errors import InvalidParameterError, ModelLoadError
from tokenriver.models.buffers import Allocate, heap_empty
from tokenriver.models.fast_path import PackedProducts, fast_path_for

Backend = Literal["auto", "native", "triton", "reference"]
BACKENDS = ("auto", "native", "triton", "reference")
# Above this many activation rows the native path runs the GEMM: up to here the GEMV is as fast, beyond it the GEMM
# is faster (benchmarks/kernels.py measures both; benchmarks/results/kernels.md).
DEFAULT_MAX_GEMV_ROWS = 10
# GGUF block sizes in bytes for 32 weights.
Q4_0_BLOCK_BYTES = 18  # f16 d, 16 bytes of nibbles: w = d * (q - 8)
Q4_1_BLOCK_BYTES = 20  # f16 d, f16 m, 16 bytes of nibbles: w = d * q + m
Q8_0_BLOCK_BYTES = 34  # f16 d, 32 int8: w = d * q
GGUF_BLOCK = 32
FLOAT16_MAX = 65504.0


@dataclass(frozen=True)
class Int4Weight:
    """4-bit group-wise weight, w = scale * q + min, or 5-bit with high_bits (format in the module docstring)."""

    qweight: torch.Tensor  # [N, K // 2] uint8
    scales: torch.Tensor  # [N, K // group_size] float16
    mins: torch.Tensor  # [N, K // group_size] float16
    group_size: int
    high_bits: torch.Tensor | None = None  # [N, K // 32] int32

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.qweight.shape[1] * 2

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K]."""
        return dequantize_int4(self.qweight, self.scales, self.mins, self.group_size, self.high_bits)


@dataclass(frozen=True)
class Int8Weight:
    """8-bit group-wise weight, w = scale * q (group_size == in_features: one scale per output channel)."""

    qweight: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N, K // group_size] float16
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.qweight.shape[1]

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K]."""
        return dequantize_int8(self.qweight, self.scales, self.group_size)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """Nibbles [N, K // 2] uint8 → values [N, K] uint8 in column order (low nibbles first within each 32)."""
    num_rows = qweight.shape[0]
    runs = qweight.reshape(num_rows, -1, 16)  # [N, K // 32, 16]
    return torch.cat((runs & 0x0F, runs >> 4), dim=-1).reshape(num_rows, -1)  # [N, K]


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """Values [N, K] in 0..15 → nibbles [N, K // 2] uint8; the inverse of unpack_int4."""
    num_rows = values.shape[0]
    runs = values.to(torch.uint8).reshape(num_rows, -1, 2, 16)  # [N, K // 32, (low, high), 16]
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(num_rows, -1)  # [N, K // 2]


def unpack_high_bits(high_bits: torch.Tensor) -> torch.Tensor:
    """Words [N, K // 32] int32 → bits [N, K] uint8 in column order (bit j of word b is column 32 b + j)."""
    shifts = torch.arange(GGUF_BLOCK, dtype=torch.int32, device=high_bits.device)
    return ((high_bits[:, :, None] >> shifts) & 1).to(torch.uint8).reshape(high_bits.shape[0], -1)  # [N, K]


def dequantize_int4(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    group_size: int,
    high_bits: torch.Tensor | None = None,
) -> torch.Tensor:
    """scale * q + min (q with its fifth bit where high_bits is given) as float32 [N, K], with torch ops on any
    device."""
    num_rows = qweight.shape[0]
    codes = unpack_int4(qweight)  # [N, K]
    if high_bits is not None:
        codes = codes | (unpack_high_bits(high_bits) << 4)
    values = codes.reshape(num_rows, -1, group_size).float()  # [N, K // G, G]
    weight = values * scales.float()[:, :, None] + mins.float()[:, :, None]  # [N, K // G, G]
    return weight.reshape(num_rows, -1)


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """scale * q as float32 [N, K], with torch ops on any device."""
    num_rows = qweight.shape[0]
    values = qweight.reshape(num_rows, -1, group_size).float()  # [N, K // G, G]
    return (values * scales.float()[:, :, None]).reshape(num_rows, -1)


def round_activations_int8(x: torch.Tensor, run: int = GGUF_BLOCK) -> torch.Tensor:
    """The values the int8-activation kernels compute with: round(x / s) * s, s = max|x| / 127 per `run` columns
    (32; 256 for models/kquant.py's weights with 2-bit codes).

    x [M, K] float32, K a multiple of run → [M, K] float32. Division and round-half-to-even as in gemv.cpp.
    """
    runs = x.reshape(x.shape[0], -1, run)  # [M, K // run, run]
    scale = runs.abs().amax(dim=-1, keepdim=True) / 127  # [M, K // run, 1]
    rounded = torch.where(scale > 0, torch.round(runs / torch.where(scale > 0, scale, 1.0)), 0.0)
    return (rounded * scale).reshape(x.shape)


def concatenate(
    weights: list[Int4Weight] | list[Int8Weight],
    empty: Allocate = heap_empty,
) -> Int4Weight | Int8Weight:
    """Stack weights along out_features, e.g. q/k/v or gate/up into one layer: one kernel call instead of several.

    All must be of one kind, with the same in_features and group_size. The output of the stacked layer is the
    outputs of the parts side by side, [..., sum of out_features]. `empty` makes the stacked tensors.
    """
    first = weights[0]
    if any(
        type(w) is not type(first) or w.shape[1] != first.shape[1] or w.group_size != first.group_size for w in weights
    ):
        raise InvalidParameterError(
            "concatenate needs weights of one kind with equal in_features and group_size", param="weights"
        )
    qweight = cat_rows([w.qweight for w in weights], empty)  # [sum N, K // 2] or [sum N, K]
    scales = cat_rows([w.scales for w in weights], empty)  # [sum N, K // G]
    if isinstance(first, Int4Weight):
        mins = cat_rows([w.mins for w in weights], empty)  # [sum N, K // G]
        if all(w.high_bits is None for w in weights):
            return Int4Weight(qweight, scales, mins, first.group_size)
        # 4-bit parts among 5-bit ones: their fifth bits are zero.
        high_bits = cat_rows(
            [
                w.high_bits
                if w.high_bits is not None
                else torch.zeros(w.shape[0], w.shape[1] // GGUF_BLOCK, dtype=torch.int32)
                for w in weights
            ],
            empty,
        )  # [sum N, K // 32]
        return Int4Weight(qweight, scales, mins, first.group_size, high_bits)
    return Int8Weight(qweight, scales, first.group_size)


def exact_int8(weight: Int4Weight) -> Int8Weight | None:
    """The same weights as int8 codes under the same scales, where each group's min is -16 * scale (Q5_0's 5-bit
    codes centred: q + 16 * bit - 16); None otherwise. A fused projection whose other parts are int8 (a file that
    keeps v at Q8_0 beside Q5_0 q and k) then takes these exactly."""
    if (
        weight.high_bits is None
        or weight.group_size != GGUF_BLOCK
        or not torch.equal(weight.mins.float(), -16 * weight.scales.float())
    ):
        return None
    codes = unpack_int4(weight.qweight) | (unpack_high_bits(weight.high_bits) << 4)  # [N, K] 0..31
    return Int8Weight((codes.to(torch.int16) - 16).to(torch.int8), weight.scales, GGUF_BLOCK)


def cat_rows(tensors: list[torch.Tensor], empty: Allocate = heap_empty) -> torch.Tensor:
    """torch.cat along dim 0 into a tensor `empty` makes; or, when the tensors already lie one after the other in
    one storage (a loader converted each part straight into its rows of the whole), a view of them, no copy."""
    first = tensors[0]
    rows = sum(t.shape[0] for t in tensors)
    storage = first.untyped_storage().data_ptr()
    if all(
        t.is_contiguous()
        and t.dtype == first.dtype
        and t.shape[1:] == first.shape[1:]
        and t.untyped_storage().data_ptr() == storage
        for t in tensors
    ) and all(
        after.storage_offset() == before.storage_offset() + before.numel()
        for before, after in zip(tensors, tensors[1:])
    ):
        return first.new_empty(0).set_(
            first.untyped_storage(), first.storage_offset(), (rows, *first.shape[1:]), first.stride()
        )
    return torch.cat(tensors, out=empty((rows, *first.shape[1:]), first.dtype))


def _check_float_weight(weight: torch.Tensor, group_size: int) -> None:
    if weight.dim() != 2 or not weight.is_floating_point():
        raise InvalidParameterError(
            f"weight must be a 2-D float tensor [out_features, in_features], got {weight.dim()}-D {weight.dtype}",
            param="weight",
        )
    if group_size <= 0 or group_size % GGUF_BLOCK or weight.shape[1] % group_size:
        raise InvalidParameterError(
            f"group_size must be a positive multiple of 32 that divides in_features ({weight.shape[1]}), "
            f"got {group_size}",
            param="group_size",
        )
    # A sum is a single pass that nan and inf reach; only a sum that is not finite (or a finite weight large enough
    # to overflow it) takes the element-wise check, which allocates a mask as large as the weight.
    if not bool(torch.isfinite(weight.sum())) and not bool(torch.isfinite(weight).all()):
        raise InvalidParameterError("weight has inf or nan values; quantize a finite weight", param="weight")


def quantize_int8(weight: torch.Tensor, group_size: int | None = None) -> Int8Weight:
    """Symmetric int8 per group of input columns (default: one scale per output channel), q in -127..127.

    The scale is rounded to float16 before q is computed, so dequantize() is the best int8 fit to the weight
    under the scale that is actually stored.
    """
    group_size = weight.shape[-1] if group_size is None else group_size
    _check_float_weight(weight, group_size)
    num_rows = weight.shape[0]
    fast = fast_path_for(weight.device) if group_size == GGUF_BLOCK else None
    quantized = None if fast is None else fast.quantize_int8_groups(weight)
    if quantized is not None:
        return Int8Weight(*quantized, group_size)
    groups = weight.detach().float().reshape(num_rows, -1, group_size)  # [N, K // G, G]
    scales = (groups.abs().amax(dim=-1) / 127).to(torch.float16)  # [N, K // G]
    safe = torch.where(scales > 0, scales.float(), 1.0)[:, :, None]  # [N, K // G, 1]
    qweight = torch.round(groups / safe).clamp(-127, 127).to(torch.int8)  # [N, K // G, G]
    return Int8Weight(qweight.reshape(num_rows, -1).contiguous(), scales.contiguous(), group_size)


def dequantize_packed(weight: Int4Weight | Int8Weight) -> torch.Tensor:
    """The float32 matrix [N, K] of a packed weight: the native decoding where it runs (the same values as
    dequantize(), tested), which the loader needs when it re-packs a part to fuse it with parts of another type."""
    fast = fast_path_for(weight.qweight.device)
    is_int4 = isinstance(weight, Int4Weight)
    matrix = (
        None
        if fast is None
        else fast.dequantize(
            weight.qweight,
            weight.scales,
            weight.mins if is_int4 else None,
            weight.group_size,
            weight.high_bits if is_int4 else None,
        )
    )
    return weight.dequantize() if matrix is None else matrix


def quantize_int4(weight: torch.Tensor, group_size: int = 32) -> Int4Weight:
    """Asymmetric 4-bit per group (GGUF Q4_1's rule): min and (max - min) / 15 per group, q in 0..15."""
    _check_float_weight(weight, group_size)
    num_rows = weight.shape[0]
    groups = weight.detach().float().reshape(num_rows, -1, group_size)  # [N, K // G, G]
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # [N, K // G] each
    mins = low.to(torch.float16)
    scales = ((high - low) / 15).to(torch.float16)
    safe = torch.where(scales > 0, scales.float(), 1.0)[:, :, None]  # [N, K // G, 1]
    values = torch.round((groups - mins.float()[:, :, None]) / safe).clamp(0, 15)  # [N, K // G, G]
    qweight = pack_int4(values.reshape(num_rows, -1))  # [N, K // 2]
    return Int4Weight(qweight, scales.contiguous(), mins.contiguous(), group_size)


def _gguf_words(blocks: torch.Tensor | np.ndarray, block_bytes: int, kind: str) -> np.ndarray:
    """GGUF tensor bytes [N, num_blocks * block_bytes] (as gguf.GGUFReader gives them) → [N, num_blocks,
    block_bytes // 2] uint16.

    Every block type here is a whole number of 16-bit words (an f16 header, then the quants), so the fields are
    cut out as words: half the elements of a byte-wise copy, which shortens loading.
    """
    data = blocks.numpy() if isinstance(blocks, torch.Tensor) else np.asarray(blocks)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] % block_bytes:
        raise ModelLoadError(
            f"{kind} data must be uint8 [out_features, blocks * {block_bytes} bytes], got {data.dtype} "
            f"{tuple(data.shape)}; pass the tensor's raw bytes as gguf.GGUFReader returns them"
        )
    return np.ascontiguousarray(data).view(np.uint16).reshape(data.shape[0], -1, block_bytes // 2)


def _words_field(words: np.ndarray, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Words [start, stop) of every block, rows kept: [N, num_blocks * (stop - start)] reinterpreted as `dtype`."""
    field = np.ascontiguousarray(words[:, :, start:stop]).reshape(words.shape[0], -1)
    return torch.from_numpy(field).view(dtype)


def repack_q4_0(blocks: torch.Tensor | np.ndarray) -> Int4Weight:
    """GGUF Q4_0 (w = d * (q - 8)) → Int4Weight with scale d and min -8d; exact, nibbles copied as they are."""
    words = _gguf_words(blocks, Q4_0_BLOCK_BYTES, "Q4_0")
    scales = _words_field(words, 0, 1, torch.float16)  # [N, K // 32]
    if bool((scales.float().abs() * 8 > FLOAT16_MAX).any()):
        raise ModelLoadError("Q4_0 block scale too large: -8 * scale does not fit float16; the file is damaged")
    return Int4Weight(_words_field(words, 1, 9, torch.uint8), scales, (-8 * scales).contiguous(), GGUF_BLOCK)


def repack_q4_1(blocks: torch.Tensor | np.ndarray) -> Int4Weight:
    """GGUF Q4_1 (w = d * q + m) → Int4Weight with scale d and min m; exact, a copy of the bytes."""
    words = _gguf_words(blocks, Q4_1_BLOCK_BYTES, "Q4_1")
    return Int4Weight(
        _words_field(words, 2, 10, torch.uint8),
        _words_field(words, 0, 1, torch.float16),
        _words_field(words, 1, 2, torch.float16),
        GGUF_BLOCK,
    )


def repack_q8_0(blocks: torch.Tensor | np.ndarray) -> Int8Weight:
    """GGUF Q8_0 (w = d * q, one scale per 32) → Int8Weight with group_size 32; exact, a copy of the bytes.

    PyTorch's `_weight_int8pack_mm` takes one scale per output channel, so a per-32 scale runs on the native
    kernel or the reference path; folding it into one scale per row would add rounding error.
    """
    words = _gguf_words(blocks, Q8_0_BLOCK_BYTES, "Q8_0")
    return Int8Weight(_words_field(words, 1, 17, torch.int8), _words_field(words, 0, 1, torch.float16), GGUF_BLOCK)


def gemm_rounding(rounded_arithmetic: bool, in_features: int, device: torch.device | str = "cpu") -> str | None:
    """How many-row products on `device` round (module docstring): None unless asked for, or where the device's fast
    path has no rounded product ("int8" on a CPU the native kernels build on)."""
    fast = fast_path_for(device)
    return None if fast is None else fast.gemm_rounding(rounded_arithmetic, in_features)


class QuantizedLinear(nn.Module):
    """What Int4Linear and Int8Linear share (and models/kquant.py's KQuantLinear): backend choice, bias, reshaping,
    output dtype."""

    # Which packed format the buffers hold: "int4" (with int5), "int8" or "kquant"; a fast path binds by it.
    packing: str
    # The columns the int8 activations are rounded in (round_activations_int8).
    activation_run = GGUF_BLOCK

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: torch.Tensor | None,
        backend: Backend,
        max_gemv_rows: int,
        int8_activations: bool,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.max_gemv_rows = max_gemv_rows
        self.int8_activations = int8_activations
        self.gemm_rounding = gemm_rounding(int8_activations, in_features, device)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self.backend: Backend = _resolve_backend(backend, device)
        self.packed: PackedProducts | None = None
        # How the packed buffers are laid out: "rows" as the formats above, or "tiles", the CPU kernels' row tiles
        # (models/cpu/tiles.py), into which the CPU's fast path moves them when it binds the layer.
        self.layout = "rows"
        # Where the int8-activation products split a row's sum into sub-chains (models/row_chains.py): int64 block
        # indices, the last in_features / 32; None for one chain.
        self.chain_ends: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] → [..., out_features] in x's dtype."""
        gemv = self._gemv
        # The decode hot path, ~200 calls per step: 2-D float32 rows on the CPU go straight to the kernel.
        if (
            gemv is not None
            and x.dim() == 2
            and x.dtype == torch.float32
            and self.bias is None
            and x.shape[1] == self.in_features
            and x.is_cpu
            and x.is_contiguous()
        ):
            return gemv(x) if x.shape[0] <= self.max_gemv_rows else self._gemm(x)
        return self._forward_any(x)

    def _forward_any(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise InvalidParameterError(
                f"input has {x.shape[-1]} features, the layer expects {self.in_features}", param="x"
            )
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)  # [M, K]
        y = None if self.packed is None else self.packed.matmul(rows)  # [M, N]
        if y is None:
            is_gemv = rows.shape[0] <= self.max_gemv_rows
            rounding = ("int8" if self.int8_activations else None) if is_gemv else self.gemm_rounding
            y = self._reference(rows.float(), rounding)  # [M, N]
        if self.bias is not None:
            y = y + self.bias
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def dequantize_rows(self, row_ids: torch.Tensor) -> torch.Tensor:
        """Float32 rows [len(row_ids), K] of the weight: the lookup of a tied embedding, without the whole matrix."""
        rows = None if self.packed is None else self.packed.dequantize_rows(row_ids)
        return self._dequantize_rows(row_ids) if rows is None else rows

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K], with torch ops (any device)."""
        return self.row_major_weight().dequantize()

    def _dequantize_rows(self, row_ids: torch.Tensor) -> torch.Tensor:
        # index_select, not advanced indexing: on the CPU the latter is far slower for row gathers.
        weight = self.row_major_weight()
        fields = {"qweight": weight.qweight, "scales": weight.scales}
        if isinstance(weight, Int4Weight):
            fields |= {"mins": weight.mins, "high_bits": weight.high_bits}
        picked = {name: None if t is None else t.index_select(0, row_ids) for name, t in fields.items()}
        return type(weight)(**picked, group_size=weight.group_size).dequantize()

    def row_major_weight(self) -> Int4Weight | Int8Weight:
        """The layer's weight as the formats above lay it out, row after row (a copy where the buffers are in
        another layout): what tensor parallelism cuts and the reference path dequantizes."""
        rows = None if self.packed is None or self.layout == "rows" else self.packed.row_major()
        qweight, scales, mins, high_bits = rows or (
            self.qweight,
            self.scales,
            getattr(self, "mins", None),
            getattr(self, "high_bits", None),
        )
        if mins is None:
            return Int8Weight(qweight, scales, self.group_size)
        return Int4Weight(qweight, scales, mins, self.group_size, high_bits)

    def adopt(self, layout: str, **buffers: torch.Tensor | None) -> None:
        """Take the packed buffers in another layout (the same values, moved): each written into the storage of
        the buffer it replaces where the byte counts agree, so that the weights stay where the loader put them (its
        huge-page arena); a fast path calls this when it binds the layer."""
        for name, tensor in buffers.items():
            old = getattr(self, name)
            if tensor is not None and old is not None and old.is_contiguous() and old.nbytes == tensor.nbytes:
                storage = old.view(-1).view(torch.uint8)
                storage.copy_(tensor.reshape(-1).view(torch.uint8))
                tensor = storage.view(tensor.dtype).view(tensor.shape)
            setattr(self, name, tensor)
        self.layout = layout

    def split_row_chains(self, ends: list[int] | None) -> None:
        """Sum each row of the int8-activation products in sub-chains ending at these blocks of 32 columns, their
        results added in order (models/row_chains.py), or in one chain (None). A layer whose activations round in
        longer runs (activation_run) sums whole runs: its chains end at the run boundaries among `ends`."""
        if ends is not None and (ends != sorted(set(ends)) or ends[0] <= 0 or ends[-1] * 32 != self.in_features):
            raise InvalidParameterError(
                f"sub-chain ends must rise to in_features / 32 = {self.in_features // 32}, got {ends}", param="ends"
            )
        if ends is not None:
            ends = [end for end in ends if end % (self.activation_run // GGUF_BLOCK) == 0]
        self.chain_ends = None if ends is None or len(ends) == 1 else torch.tensor(ends, dtype=torch.int64)
        self.rebind()

    def set_int8_activations(self, enabled: bool) -> None:
        """Switch to the rounded arithmetic of the module docstring: int8 activations in decode-sized products,
        and in larger ones where the CPU has the instructions (or back to exact float32)."""
        self.int8_activations = enabled
        self.set_rounded_gemm(enabled)

    def set_rounded_gemm(self, enabled: bool) -> None:
        """Round the inputs of many-row products as this CPU does fastest (module docstring), or back to exact
        float32, whatever decode-sized products do."""
        self.gemm_rounding = gemm_rounding(enabled, self.in_features, self.qweight.device)
        self.rebind()

    def rebind(self) -> None:
        """Bind the weights to their device's fast path (models/fast_path.py): the products hold raw pointers, so
        whoever moves the buffers' data without .to() (the loader's arena) calls this again."""
        fast = fast_path_for(self.qweight.device) if self.backend != "reference" else None
        self.packed = None if fast is None else fast.bind_packed(self)
        if self.layout != "rows" and self.packed is None:
            raise InvalidParameterError(
                f"this layer's weights are laid out for the CPU kernels ({self.layout}) and cannot run on "
                f"{self.qweight.device}: load the model on the device it should run on",
                param="device",
            )
        self._gemv = None if self.packed is None else self.packed.gemv
        self._gemm = None if self.packed is None else self.packed.gemm

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        # .to(), .cpu(), .share_memory_()...: new buffer tensors, so the kernel must see the new pointers.
        module = super()._apply(fn, recurse)
        self.rebind()
        return module

    def _reference(self, rows: torch.Tensor, rounding: str | None) -> torch.Tensor:
        """Dequantize with torch ops and F.linear, rounding as the native product would: any device, and the
        definition the kernels are tested against."""
        if rounding == "int8":
            return F.linear(round_activations_int8(rows, self.activation_run), self.dequantize())
        return F.linear(rows, self.dequantize())

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
            f"backend={self.backend}, int8_activations={self.int8_activations}, "
            f"gemm_rounding={self.gemm_rounding}, "
            f"bias={self.bias is not None}"
        )


def _resolve_backend(backend: Backend, device: torch.device) -> Backend:
    """The backend a layer on `device` runs (module docstring), refusing one the device cannot run."""
    if backend not in BACKENDS:
        raise InvalidParameterError(f"backend must be one of {BACKENDS}, got {backend!r}", param="backend")
    fast = fast_path_for(device)
    has_native = device.type == "cpu" and fast is not None
    has_triton = device.type == "cuda" and fast is not None
    if backend == "native" and not has_native:
        raise InvalidParameterError(
            "backend 'native' needs the weights on an x86-64 CPU with AVX2, FMA and F16C and a C++ compiler; "
            "use backend='auto' to fall back to 'reference'",
            param="backend",
        )
    if backend == "triton" and not has_triton:
        raise InvalidParameterError(
            "backend 'triton' needs the weights on a CUDA GPU and Triton installed; "
            "use backend='auto' to fall back to 'reference'",
            param="backend",
        )
    if backend != "auto":
        return backend
    return "native" if has_native else "triton" if has_triton else "reference"


class Int4Linear(QuantizedLinear):
    """Linear layer over an Int4Weight; see the module docstring for backends."""

    packing = "int4"

    def __init__(
        self,
        weight: Int4Weight,
        bias: torch.Tensor | None = None,
        *,
        backend: Backend = "auto",
        max_gemv_rows: int = DEFAULT_MAX_GEMV_ROWS,
        int8_activations: bool = False,
    ) -> None:
        out_features, in_features = weight.shape
        super().__init__(
            in_features, out_features, bias, backend, max_gemv_rows, int8_activations, weight.qweight.device
        )
        self.group_size = weight.group_size
        self.register_buffer("qweight", weight.qweight.contiguous())  # [N, K // 2] uint8
        self.register_buffer("scales", weight.scales.contiguous())  # [N, K // G] float16
        self.register_buffer("mins", weight.mins.contiguous())  # [N, K // G] float16
        high_bits = weight.high_bits
        if high_bits is not None:
            expected = (out_features, in_features // GGUF_BLOCK)
            if (
                high_bits.dtype != torch.int32
                or tuple(high_bits.shape) != expected
                or high_bits.device != weight.qweight.device
            ):
                raise InvalidParameterError(
                    f"high_bits must be int32 {list(expected)} (a word per 32 columns) on the weight's device, got "
                    f"{high_bits.dtype} {list(high_bits.shape)} on {high_bits.device}",
                    param="high_bits",
                )
            if self.backend == "triton":
                if backend == "triton":
                    raise InvalidParameterError(
                        "the Triton kernel reads 4-bit codes only; pass 5-bit weights to "
                        "a GPU as int8 (quant.exact_int8), as the loader does",
                        param="backend",
                    )
                self.backend = "reference"
            high_bits = high_bits.contiguous()
        self.register_buffer("high_bits", high_bits)  # [N, K // 32] int32 for 5-bit codes, or None
        self.rebind()


class QuantizedEmbedding(nn.Module):
    """Token embedding looked up in a quantized matrix: only the rows of this step's tokens are dequantized.

    With a tied output embedding `table` is the output projection itself, so one copy of the matrix serves both.
    """

    def __init__(self, table: "Int4Linear | Int8Linear", dtype: torch.dtype) -> None:
        super().__init__()
        self.table = table
        self.dtype = dtype

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens] int64 → [num_tokens, embedding width] in the compute dtype."""
        return self.table.dequantize_rows(token_ids).to(self.dtype)


class Int8Linear(QuantizedLinear):
    """Linear layer over an Int8Weight; see the module docstring for backends."""

    packing = "int8"

    def __init__(
        self,
        weight: Int8Weight,
        bias: torch.Tensor | None = None,
        *,
        backend: Backend = "auto",
        max_gemv_rows: int = DEFAULT_MAX_GEMV_ROWS,
        int8_activations: bool = False,
    ) -> None:
        out_features, in_features = weight.shape
        super().__init__(
            in_features, out_features, bias, backend, max_gemv_rows, int8_activations, weight.qweight.device
        )
        self.group_size = weight.group_size
        self.register_buffer("qweight", weight.qweight.contiguous())  # [N, K] int8
        self.register_buffer("scales", weight.scales.contiguous())  # [N, K // G] float16
        self.rebind()
