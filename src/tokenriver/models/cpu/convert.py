"""GGUF blocks converted in one native pass (csrc/convert.cpp): the loader's fast path for a file's K-quants and the
types it re-quantizes to int8, into the tensors its allocator hands out. The same values as the numpy rules of
loader/gguf_blocks.py, bit for bit (tests/loader/test_gguf_blocks.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tokenriver.config import default_num_threads
from tokenriver.models.buffers import Allocate
from tokenriver.models.cpu.kernels import NativeKernels, load_kernels


class NativeConverter:
    """Each conversion answers None where it cannot convert the blocks (a scale float16 cannot hold: the numpy
    rule then raises the error that names it)."""

    def __init__(self, kernels: NativeKernels) -> None:
        self.kernels = kernels

    def converts_to_int8(self, gguf_type: int) -> bool:
        """Whether `to_int8` takes this GGUF type."""
        return self.kernels.converts_to_int8(gguf_type)

    def q4_k(
        self, blocks: np.ndarray, in_features: int, empty: Allocate
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Q4_K rows → (qweight, scales, mins) of an Int4 packing in groups of 32."""
        return self.kernels.convert_q4_k(blocks, in_features, default_num_threads(), empty)

    def five_bit(
        self, blocks: np.ndarray, gguf_type: int, in_features: int, empty: Allocate
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Q5_0, Q5_1 or Q5_K rows → (qweight, scales, mins, high_bits) of a 5-bit Int4 packing in groups of 32."""
        return self.kernels.convert_five_bit(blocks, gguf_type, in_features, default_num_threads(), empty)

    def kquant(
        self, blocks: np.ndarray, gguf_type: int, in_features: int, layout: Any, empty: Allocate
    ) -> torch.Tensor | None:
        """K-quant (Q2_K to Q6_K) rows → their row records (models/kquant.py's RecordLayout `layout`), or None where the
        CPU does not run K-quants at their own size."""
        if not self.kernels.kquant:
            return None
        return self.kernels.convert_kquant(blocks, gguf_type, in_features, layout, default_num_threads(), empty)

    def to_int8(
        self, blocks: np.ndarray, gguf_type: int, in_features: int, empty: Allocate
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Rows of a type `converts_to_int8` takes → (qweight, scales) of an Int8 packing in groups of 32."""
        return self.kernels.convert_to_int8(blocks, gguf_type, in_features, default_num_threads(), empty)


def load() -> NativeConverter | None:
    """The native converter, or None where the native kernels do not build."""
    kernels = load_kernels()
    return None if kernels is None else NativeConverter(kernels)
