"""The native CPU kernels as the CPU's fast path of the definitions (models/fast_path.py says how one is chosen).

Each op checks that its kernel reads the call as it is laid out (float32 on the CPU, rows contiguous where the kernel
needs them, a head size it was compiled for) and answers None where it does not, so that the definition runs. The
kernels compute the definitions' arithmetic: bit for bit where the operations are the same, within float rounding
where a sum is added in another order or exp is a polynomial (tests/models/cpu/test_native_ops.py and the others).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenriver.config import default_num_threads
from tokenriver.kv.cache import head_dim_of
from tokenriver.models.cpu import tiles
from tokenriver.models.cpu.kernels import (
    KQuantSpec,
    NativeKernels,
    Reductions,
    is_contiguous_f32,
    is_f32_rows,
    is_native_kv_pool,
    load_kernels,
)

if TYPE_CHECKING:
    from tokenriver.models.kquant import KQuantRecords, RecordLayout


def _is_f32_heads(tensor: torch.Tensor) -> bool:
    """[T, heads, d] float32 on the CPU, each head's d values contiguous and the heads evenly spaced in each row:
    heads packed in a row, or the first d values of wider heads (a partial-rotary view)."""
    return (
        tensor.dtype == torch.float32
        and tensor.is_cpu
        and tensor.dim() == 3
        and tensor.stride(2) == 1
        and tensor.stride(1) >= tensor.shape[2]
    )


def _is_gate_up(tensor: torch.Tensor) -> bool:
    """[M, 2I] float32 rows on the CPU, contiguous: a gate half and an up half."""
    return tensor.dim() == 2 and tensor.shape[1] % 2 == 0 and is_contiguous_f32(tensor)


class CpuFastPath:
    """The FastPath of models/fast_path.py on the native kernels."""

    def __init__(self, kernels: NativeKernels) -> None:
        self.kernels = kernels

    # ----- a layer's small ops (ops.cpp) -----------------------------------------------------------------------

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
    ) -> torch.Tensor | None:
        if (
            x.dim() == 2
            and is_contiguous_f32(x)
            and is_contiguous_f32(weight)
            and weight.shape == x.shape[1:]
            and (residual is None or (is_contiguous_f32(residual) and residual.shape == x.shape))
        ):
            return self.kernels.rms_norm(x, weight, eps, residual)
        return None

    def rotary_(self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        if not (_is_f32_heads(query) and _is_f32_heads(key) and is_contiguous_f32(cos) and is_contiguous_f32(sin)):
            return False
        num_tokens, _, rotary_dim = query.shape
        if (
            cos.shape == sin.shape
            and cos.shape[0] == num_tokens
            and 2 * cos.shape[-1] == rotary_dim
            and key.shape[0] == num_tokens
            and key.shape[2] == rotary_dim
            and key.stride(1) == query.stride(1)
        ):
            self.kernels.rotary_(query, key, cos, sin)
            return True
        return False

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        return self.kernels.silu_mul(gate_up) if _is_gate_up(gate_up) else None

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """The kernel the native decoder stack runs too (models/cpu/decoder.py): both paths give the same bits."""
        return self.kernels.gelu_tanh_mul(gate_up) if _is_gate_up(gate_up) else None

    # ----- attention (attention.cpp) ---------------------------------------------------------------------------

    def paged_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata,
        scale: float,
        window: int,
        softcap: float | None,
    ) -> torch.Tensor | None:
        """The whole step in one call: every token's keys and values written, then the requests with at most
        MAX_KERNEL_QUERY_LEN new tokens (decodes, short verification) attend token by token, reading their blocks in
        place with an online softmax in float32 (a long context split across threads and merged), and prompt chunks
        through the same kernel's flash loop over their blocks, causally. Both visit a context's tiles from position
        0 in fixed steps, so a token's result depends only on which of the two computes it, never on its batch."""
        key_cache, value_cache = kv_cache
        if not (
            is_native_kv_pool(key_cache, value_cache) and is_f32_rows(query) and is_f32_rows(key) and is_f32_rows(value)
        ):
            return None
        num_kv_heads, head_dim = key_cache.shape[2], head_dim_of(key_cache)
        if (
            head_dim not in self.kernels.attention_head_dims
            or query.shape[2] != head_dim
            or key.shape[1:] != (num_kv_heads, head_dim)
            or value.shape[1:] != (num_kv_heads, head_dim)
        ):
            return None
        output = torch.empty(query.shape, dtype=query.dtype)  # [num_tokens, num_heads, head_dim]
        self.kernels.paged_attention(
            query,
            key,
            value,
            metadata.slot_mapping,
            key_cache,
            value_cache,
            metadata.block_tables,
            metadata.kernel_queries,
            metadata.kernel_chunks,
            scale,
            output,
            window,
            softcap,
        )
        return output

    # ----- sampling's reductions and a mixture of experts' routing (ops.cpp) -----------------------------------

    def row_reductions(self) -> Callable[[torch.Tensor], Reductions | None]:
        return self.kernels.argmax_logsumexp

    def routes_moe(self, gates: list[nn.Module], num_experts: int) -> bool:
        """Whether a mixture of experts' gates route here (as the native decoder routes): float32 gates without bias
        (the loader keeps them float, as llama.cpp does), at most MAX_EXPERTS experts."""
        return num_experts <= self.kernels.MAX_EXPERTS and all(
            type(g) is nn.Linear and g.bias is None and is_contiguous_f32(g.weight) for g in gates
        )

    def moe_route(
        self, x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, normalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if x.dim() != 2 or not is_contiguous_f32(x):
            return None
        return self.kernels.moe_route(self.kernels.row_dots(x, gate_weight), top_k, normalize)

    def sigmoid_gate(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        return self.kernels.sigmoid_gate(x, weight) if x.dim() == 2 and is_contiguous_f32(x) else None

    # ----- packed weights (gemv.cpp, gemm.cpp, convert.cpp) -------------------------------------------------------

    def gemm_rounding(self, rounded_arithmetic: bool, in_features: int) -> str | None:
        """ "int8" where asked for (the activations of many-row products rounded as a decode row's are, so that a row
        gets the same bits in a batch and alone: gemv.cpp), on every CPU the kernels build on; else None (exact
        float32). The kernels take the columns in runs of 32."""
        return "int8" if rounded_arithmetic and in_features % 32 == 0 else None

    def bind_packed(self, layer: nn.Module) -> NativePacked | NativeKQuantPacked | None:
        if not layer.qweight.is_cpu:
            return None
        if layer.packing == "kquant":
            return NativeKQuantPacked(self.kernels, layer) if self.kernels.kquant else None
        return NativePacked(self.kernels, layer)

    def keeps_kquant(self) -> bool:
        """Whether K-quant weights run here at their own size (models/kquant.py): the CPU has the instructions."""
        return self.kernels.kquant

    def relayout_kquant(self, part: KQuantRecords, union: RecordLayout, out: torch.Tensor) -> bool:
        """`part`'s values written into `out`, row records in the layout `union` (models/kquant.py's
        concatenate_records), in one native pass."""
        self.kernels.kquant_relayout(
            part.records.contiguous(), part.offsets.contiguous(), part.layout, union, out, default_num_threads()
        )
        return True

    def quantize_int8_groups(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """quant.quantize_int8's codes and scales for groups of 32 on float32 rows, in one pass."""
        return self.kernels.quantize_int8_groups(weight.detach().float().contiguous(), default_num_threads())

    def dequantize(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor | None,
        group_size: int,
        high_bits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The float32 weight [N, K] of an Int4 (with mins) or Int8 (mins None) packing: the values of quant.py's
        dequantize_int4 / dequantize_int8, in one call."""
        if mins is None:
            return self.kernels.int8_dequantize(qweight, scales, group_size)
        return self.kernels.int4_dequantize(qweight, scales, mins, group_size, high_bits)


class NativePacked:
    """A quantized layer's weights bound to the native products (the PackedProducts of models/fast_path.py): the
    weight's pointers go to C once, not on each of a decode step's ~200 calls. `gemv` and `gemm` take contiguous
    float32 rows; the layer calls them straight from its forward (models/quant.py). The first binding moves the
    layer's packing into row tiles (models/cpu/tiles.py), in the buffers' own storage where the sizes allow. Bound
    again whenever the layer's buffers move: the functions hold raw pointers (and the tensors, alive)."""

    def __init__(self, kernels: NativeKernels, layer: nn.Module) -> None:
        self.kernels = kernels
        self.max_gemv_rows = layer.max_gemv_rows
        is_int4 = layer.qweight.dtype == torch.uint8
        mins, high_bits = (layer.mins, layer.high_bits) if is_int4 else (None, None)
        if layer.layout == "rows":
            if is_int4 and tiles.centred(layer.scales, mins, high_bits is not None):
                mins = None  # the products compute them (tiles.py): not streamed
            tiled = tiles.tile_in_place(layer.qweight, layer.scales, mins, high_bits, layer.group_size, kernels)
            if tiled is None:
                tiled = tiles.tile(layer.qweight, layer.scales, mins, high_bits, layer.group_size)
            extra = {"mins": tiled.mins, "high_bits": tiled.fifth} if is_int4 else {}
            layer.adopt("tiles", qweight=tiled.codes, scales=tiled.scales, **extra)
            mins, high_bits = (layer.mins, layer.high_bits) if is_int4 else (None, None)
        self.tiles = tiles.Tiles(
            layer.qweight,
            layer.scales,
            mins,
            high_bits,
            layer.out_features,
            layer.in_features,
            layer.group_size,
            layer.chain_ends,
        )
        self.gemv = kernels.bind(self.tiles, "int8" if layer.int8_activations else None, many_rows=False)
        self.gemm = kernels.bind(self.tiles, layer.gemm_rounding, many_rows=True)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor | None:
        """rows [M, K] on the CPU @ Wᵀ, [M, N] float32: the GEMV up to the layer's max_gemv_rows, else the GEMM."""
        if not rows.is_cpu:
            return None
        rows32 = rows if rows.dtype == torch.float32 else rows.float()
        rows32 = rows32 if rows32.is_contiguous() else rows32.contiguous()
        return self.gemv(rows32) if rows32.shape[0] <= self.max_gemv_rows else self.gemm(rows32)

    def dequantize_rows(self, row_ids: torch.Tensor) -> torch.Tensor | None:
        """One call instead of eight tensor ops per decode step; the same values (tested). The ids' range is the
        caller's (kernels.NativeKernels.dequantize_rows says where an embedding's ids are checked)."""
        if row_ids.dim() != 1 or not row_ids.is_cpu:
            return None
        return self.kernels.dequantize_rows(self.tiles, row_ids.to(torch.int64).contiguous())

    def row_major(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The packing row after row (qweight, scales, mins, high_bits), as the layer was given it."""
        return tiles.untile(self.tiles)


class NativeKQuantPacked:
    """A K-quant layer's records (models/kquant.py) bound to kquant.cpp's products: NativePacked's contract, for
    the int8-activation arithmetic only (with exact float32 activations the definition computes the product)."""

    def __init__(self, kernels: NativeKernels, layer: nn.Module) -> None:
        self.kernels = kernels
        self.max_gemv_rows = layer.max_gemv_rows
        if layer.layout == "rows":
            records = layer.records()
            if tiles.tiles_in_place(records.records):
                kernels.tile_kquant_in_place(records.records, records.layout, default_num_threads())
                layer.adopt("tiles", qweight=records.records.view(-1, *tiles.tile_record_shape(records)))
            else:
                layer.adopt("tiles", qweight=tiles.tile_kquant(records, in_place=False).records)
        self.tiles = tiles.KTiles(
            layer.qweight,
            tiles.offset_masks(layer.offsets),
            layer.record_layout,
            layer.out_features,
            layer.in_features,
            layer.chain_ends,
        )
        # What decoder.cpp's Linear points to (models/cpu/decoder.py), alive with this binding.
        self.spec = KQuantSpec.of(self.tiles)
        self.gemv = kernels.bind_kquant(self.tiles, many_rows=False) if layer.int8_activations else None
        self.gemm = kernels.bind_kquant(self.tiles, many_rows=True) if layer.gemm_rounding == "int8" else None

    def matmul(self, rows: torch.Tensor) -> torch.Tensor | None:
        """rows [M, K] on the CPU @ Wᵀ where the layer rounds this many rows to int8; None (the definition) else."""
        product = self.gemv if rows.shape[0] <= self.max_gemv_rows else self.gemm
        if product is None or not rows.is_cpu:
            return None
        rows32 = rows if rows.dtype == torch.float32 else rows.float()
        return product(rows32 if rows32.is_contiguous() else rows32.contiguous())

    def dequantize_rows(self, row_ids: torch.Tensor) -> torch.Tensor | None:
        if row_ids.dim() != 1 or not row_ids.is_cpu:
            return None
        return self.kernels.kquant_dequantize_rows(self.tiles, row_ids.to(torch.int64).contiguous())

    def row_major(self) -> torch.Tensor:
        """The row records (models/kquant.py), out of the tile records."""
        return tiles.untile_kquant(self.tiles)


def load() -> CpuFastPath | None:
    """The CPU's fast path, or None where the native kernels do not build (models/cpu/kernels.py says why)."""
    kernels = load_kernels()
    return None if kernels is None else _fast_path(kernels)


@functools.cache
def _fast_path(kernels: NativeKernels) -> CpuFastPath:
    # Keyed by the kernels: a test that turns them off and on again (load_kernels.cache_clear) gets a new path.
    return CpuFastPath(kernels)


def release_thread_pool() -> None:
    """End the calling thread's OpenMP worker pool where the native kernels run (csrc/ops.cpp says why a pool a
    thread no longer uses slows the others); its next parallel work starts a new one. Nothing where the kernels
    were never loaded: no pool of theirs exists, and a GPU run need not build them."""
    if load_kernels.cache_info().currsize == 0:
        return
    kernels = load_kernels()
    if kernels is not None:
        kernels.release_thread_pool()
