"""A fused projection whose parts are stored in different K-quant types, each part kept at its own size.

A Q4_K_M file keeps q and k at Q4_K and, in some layers, v at Q6_K. Stacked in one record layout (models/kquant.py's
RecordLayout.union), q and k would take v's nibbles, two high bits and scales per 16: about 7 bits a weight for
their 4.5, read by every decode step, and the products of scales per 16 in every prompt. Kept as parts, each is a
KQuantLinear with its own kernels, and the fused output is theirs side by side: the union's values, each part's
own arithmetic (a row's bits still depend on that row alone).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenriver.models.kquant import KQuantLinear, KQuantRecords


@dataclass(frozen=True)
class KQuantStack:
    """The parts of one fused projection, stacked along out_features, each in its type's records (the loader's)."""

    parts: tuple[KQuantRecords, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(part.shape[0] for part in self.parts), self.parts[0].shape[1]

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K]: the parts' rows in order."""
        return torch.cat([part.dequantize() for part in self.parts])

    def to(self, device: torch.device | str) -> KQuantStack:
        return KQuantStack(tuple(part.to(device) for part in self.parts))


class StackedLinear(nn.Module):
    """y = the parts' outputs side by side, [..., out_features]; each part a KQuantLinear with its rows of the
    bias. The native decoder runs the parts as one projection (models/cpu/decoder.py)."""

    def __init__(self, stack: KQuantStack, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = stack.shape
        parts, start = [], 0
        for part in stack.parts:
            stop = start + part.shape[0]
            parts.append(KQuantLinear(part, None if bias is None else bias[start:stop]))
            start = stop
        self.parts = nn.ModuleList(parts)

    @property
    def bias(self) -> torch.Tensor | None:
        """The parts' biases in one tensor (a copy), or None."""
        biases = [part.bias for part in self.parts]
        return None if any(bias is None for bias in biases) else torch.cat(biases)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K]."""
        return torch.cat([part.dequantize() for part in self.parts])
