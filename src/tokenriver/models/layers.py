"""Building blocks shared by Llama-family decoders: RMSNorm, rotary embedding, SwiGLU MLP.

Pure torch, no file formats, no global state. Each block reproduces the
arithmetic of its Hugging Face transformers counterpart (`LlamaRMSNorm`,
`LlamaRotaryEmbedding` + `apply_rotary_pos_emb`, `LlamaMLP`) operation for
operation, so float32 results match the reference to rounding.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) * weight, computed in float32 whatever the input dtype."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    """Rotation speed of each pair of dimensions: [head_dim // 2] float32 radians per position.

    Plain RoPE: theta^(-2i/d). Scaled variants slow the low frequencies down so
    the model reaches past its training length (same formulas as transformers'
    `modeling_rope_utils`).
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope_theta ** exponents)  # [head_dim // 2]
    if rope_scaling is None:
        return inv_freq
    rope_type = rope_scaling["rope_type"]
    if rope_type == "linear":
        # Positions divided by factor, written as frequencies divided by factor.
        return inv_freq / rope_scaling["factor"]
    if rope_type == "freq_factors":
        # llama.cpp's rope_freqs tensor: one divisor per frequency.
        return inv_freq / torch.tensor(rope_scaling["factors"], dtype=torch.float32, device="cpu")
    # llama3: wavelengths longer than the original context / low_freq_factor are divided by
    # factor, shorter than original context / high_freq_factor kept, and in between interpolated.
    factor = rope_scaling["factor"]
    low_freq_factor = rope_scaling["low_freq_factor"]
    high_freq_factor = rope_scaling["high_freq_factor"]
    old_context_len = rope_scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Angles that rotate query/key pairs (i, i + head_dim/2) by position * inv_freq[i] (HF `rotate_half` layout).

    cos/sin are computed once per position into a table and gathered by the
    positions of this step's tokens, so a ragged batch costs one index, not one
    computation per token. The table is a plain attribute, not a buffer: it is
    rebuilt on the device it is needed on and grown when a longer position shows
    up, which also keeps it out of the state dict and off the meta device.
    """

    def __init__(self, head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None,
                 max_position_embeddings: int) -> None:
        super().__init__()
        self.inv_freq = rope_inv_freq(head_dim, rope_theta, rope_scaling)  # [head_dim // 2] float32, CPU
        self.num_cached_positions = min(max_position_embeddings, 4096)
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None

    def _cos_sin(self, max_position: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos is None or self._cos.device != device or self._cos.shape[0] <= max_position:
            while self.num_cached_positions <= max_position:
                self.num_cached_positions *= 2
            positions = torch.arange(self.num_cached_positions, dtype=torch.float32, device=device)
            freqs = positions[:, None] * self.inv_freq.to(device)  # [num_positions, head_dim // 2]
            self._cos, self._sin = freqs.cos(), freqs.sin()
        return self._cos, self._sin

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of each token's angles: positions [num_tokens] → two [num_tokens, 1, head_dim // 2].

        Computed once per step and shared by every layer (the `1` broadcasts over heads).
        """
        max_position = int(positions.max()) if positions.numel() else 0
        cos_table, sin_table = self._cos_sin(max_position, positions.device)
        # index_select rather than table[positions]: advanced indexing is far slower on CPU.
        cos, sin = cos_table.index_select(0, positions), sin_table.index_select(0, positions)
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with the halves written out; x [num_tokens, num_heads, head_dim]."""
    x1, x2 = x.chunk(2, dim=-1)  # [num_tokens, num_heads, head_dim // 2] each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class SwiGLUMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)), with gate_proj and up_proj stacked into one gate_up_proj."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
