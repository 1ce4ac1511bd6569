"""The Triton kernels as a GPU's fast path of the definitions (models/fast_path.py says how one is chosen).

Each op checks that its kernel takes the call as laid out (fused_ops.fits_rows / fits_heads, a cache in the query's
dtype) and answers None where it does not, so that the definition runs. The kernels round where the definitions
round (fused_ops.py), and decode attention reads each request's blocks in place (paged_decode.py).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from tokenriver.models.cuda import attention, fused_ops, quant_matmul
from tokenriver.models.layers import adjacent_heads


class CudaFastPath:
    """The FastPath of models/fast_path.py on the Triton kernels."""

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
    ) -> torch.Tensor | None:
        if (
            fused_ops.fits_rows(x)
            and weight.dim() == 1
            and weight.is_contiguous()
            and weight.shape[0] == x.shape[1] <= fused_ops.MAX_NORM_COLUMNS
            and (
                residual is None
                or (fused_ops.fits_rows(residual) and residual.shape == x.shape and residual.dtype == x.dtype)
            )
        ):
            return fused_ops.rms_norm(x, weight, eps, residual)
        return None

    def rotary_(self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """Query and key heads turned by one launch where they sit side by side in the qkv row, else one each."""
        if not (cos.dtype == query.dtype == key.dtype and sin.dtype == cos.dtype):
            return False
        both = adjacent_heads(query, key)
        targets = [both] if both is not None else [query, key]
        if not all(
            fused_ops.fits_heads(x) and x.shape[0] == cos.shape[0] and x.shape[2] == 2 * cos.shape[-1] for x in targets
        ):
            return False
        for x in targets:
            fused_ops.rotary_(x, cos, sin)
        return True

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        fits = fused_ops.fits_rows(gate_up) and gate_up.shape[1] % 2 == 0
        return fused_ops.silu_and_mul(gate_up) if fits else None

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        fits = fused_ops.fits_rows(gate_up) and gate_up.shape[1] % 2 == 0
        return fused_ops.gelu_tanh_and_mul(gate_up) if fits else None

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
        return attention.paged_attention(query, key, value, kv_cache, metadata, scale, window, softcap)

    def row_reductions(self) -> None:
        """PyTorch's reductions are the GPU's (sampling/sampler.py's torch_row_reductions)."""
        return None

    def routes_moe(self, gates: list[nn.Module], num_experts: int) -> bool:
        return False

    def moe_route(self, x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, normalize: bool) -> None:
        return None

    def sigmoid_gate(self, x: torch.Tensor, weight: torch.Tensor) -> None:
        return None

    def relayout_kquant(self, part: object, union: object, out: torch.Tensor) -> bool:
        """K-quant records stay on the CPU (the loader converts them for a GPU): the definition re-lays them out."""
        return False

    def gemm_rounding(self, rounded_arithmetic: bool, in_features: int) -> None:
        """A GPU multiplies packed weights with its compute dtype's activations: no rounded mode."""
        return None

    def bind_packed(self, layer: nn.Module) -> TritonPacked | None:
        """The weight-only Triton products, for 4- and 8-bit codes on the GPU (5-bit weights reach a GPU as int8:
        the loader converts them)."""
        if not layer.qweight.is_cuda or layer.packing == "kquant" or getattr(layer, "high_bits", None) is not None:
            return None
        return TritonPacked(layer)

    def quantize_int8_groups(self, weight: torch.Tensor) -> None:
        return None

    def dequantize(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor | None,
        group_size: int,
        high_bits: torch.Tensor | None = None,
    ) -> None:
        return None


class TritonPacked:
    """A quantized layer's products through quant_matmul.py, which decodes each weight tile in registers inside the
    product, in the activations' dtype with float32 sums: a 4-bit file stays 4-bit in GPU memory."""

    gemv = gemm = None  # the CPU's direct calls (models/cpu/fast_path.py's NativePacked)

    def __init__(self, layer: nn.Module) -> None:
        self.is_int4 = layer.qweight.dtype == torch.uint8
        self.group_size = layer.group_size
        self.tensors = (layer.qweight, layer.scales, layer.mins) if self.is_int4 else (layer.qweight, layer.scales)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor | None:
        if not rows.is_cuda:
            return None
        if self.is_int4:
            return quant_matmul.int4_matmul(rows, *self.tensors, self.group_size)
        return quant_matmul.int8_matmul(rows, *self.tensors, self.group_size)

    def dequantize_rows(self, row_ids: torch.Tensor) -> None:
        return None

    def row_major(self) -> None:
        """The layer's buffers are its packing, row after row."""
        return None


@functools.cache
def load() -> CudaFastPath | None:
    """The GPU's fast path, or None where Triton does not import."""
    return CudaFastPath() if fused_ops.triton is not None else None
