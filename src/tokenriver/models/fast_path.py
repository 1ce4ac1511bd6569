"""Where an op of the definitions runs fast: chosen here, and nowhere else.

The definitions (layers.py, attention.py, quant.py, moe.py) are plain PyTorch: what a forward pass computes. Each
op first asks `fast_path(x)` for the fast path of its input's device:
- CPU tensors: the native kernels (models/cpu/fast_path.py), where they build (x86-64 with AVX2 and a compiler);
- CUDA tensors: the Triton kernels (models/cuda/fast_path.py), where Triton imports;
- anything else, or autograd on (the kernels record no gradients): None, and the definition runs.
A fast path answers None (False for an in-place op) for a call its kernels do not take, a layout or a dtype they do
not read: the definition runs then too. Each one is tested against the definition it stands in for, bit for bit where
the arithmetic is the same (tests/models/cpu, tests/models/cuda). Only models/cpu and models/cuda import kernel
modules (an import contract checks it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from tokenriver.models.cpu import fast_path as cpu

if TYPE_CHECKING:
    from tokenriver.models.attention_metadata import AttentionMetadata
    from tokenriver.models.kquant import KQuantRecords, RecordLayout

# Per row of a matrix: argmax [M] int64, max [M] float32, log-sum-exp [M] float32.
Reductions = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class PackedProducts(Protocol):
    """A quantized layer's products on a fast path, its weights bound once (models/quant.py's layers hold one)."""

    def matmul(self, rows: torch.Tensor) -> torch.Tensor | None:
        """rows [M, K] @ the layer's weightᵀ, [M, N] (None: the definition computes it)."""

    def dequantize_rows(self, row_ids: torch.Tensor) -> torch.Tensor | None:
        """Float32 rows [len(row_ids), K] of the weight (a tied embedding's lookup)."""

    def row_major(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None] | torch.Tensor:
        """The packing row after row where the path keeps it in another layout (the CPU's row tiles): (qweight,
        scales, mins, high_bits) of an int4/int8 layer, the row records of a K-quant one (models/kquant.py)."""


class FastPath(Protocol):
    """The ops a device's fast path offers the definitions; each answers None where it does not take the call."""

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
    ) -> torch.Tensor | None: ...

    def rotary_(self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool: ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None: ...

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None: ...

    def paged_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
        scale: float,
        window: int,
        softcap: float | None,
    ) -> torch.Tensor | None: ...

    def row_reductions(self) -> Callable[[torch.Tensor], Reductions | None] | None:
        """A faster (argmax, max, log-sum-exp) of logits rows than PyTorch's three reductions, or None."""

    def moe_route(
        self, x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, normalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor] | None: ...

    def sigmoid_gate(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None: ...

    def bind_packed(self, layer: torch.nn.Module) -> PackedProducts | None:
        """The products of a quantized layer (models/quant.py) on this path, or None."""

    def relayout_kquant(self, part: KQuantRecords, union: RecordLayout, out: torch.Tensor) -> bool:
        """Write `part`'s values into `out` as row records of the layout `union` (models/kquant.py's
        concatenate_records); False where the definition does it."""

    def gemm_rounding(self, rounded_arithmetic: bool, in_features: int) -> str | None:
        """How this path's many-row products round their inputs (models/quant.py's module docstring)."""


def fast_path(x: torch.Tensor) -> FastPath | None:
    """The fast path for an op on x, or None: the definition runs (module docstring)."""
    if torch.is_grad_enabled():
        return None
    if x.is_cpu:
        return cpu.load()
    return fast_path_for(x.device)


def fast_path_for(device: torch.device | str) -> FastPath | None:
    """The fast path of a device whatever autograd's state: for what is bound once (a layer's products), not run."""
    kind = torch.device(device).type
    if kind == "cpu":
        return cpu.load()
    if kind == "cuda":
        # Imported on first use: a CPU run never loads Triton.
        from tokenriver.models.cuda import fast_path as cuda

        return cuda.load()
    return None


def cpu_keeps_kquant(device: torch.device | str) -> bool:
    """Whether K-quant weights on `device` run at their own size (models/kquant.py): a CPU whose native kernels have
    the instructions their products need; elsewhere the loader keeps the int4/int8 layouts."""
    if torch.device(device).type != "cpu":
        return False
    fast = cpu.load()
    return fast is not None and fast.keeps_kquant()


def release_thread_pool() -> None:
    """End the calling thread's pool of the CPU kernels' OpenMP workers (models/cpu/csrc/ops.cpp says why a pool a
    thread no longer uses slows the others); its next parallel work starts a new one."""
    cpu.release_thread_pool()
