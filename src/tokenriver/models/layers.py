"""Building blocks shared by the decoders: RMSNorm, rotary embedding, SwiGLU MLP, GeGLU's activation.

No file formats, no global state. Each block reproduces the arithmetic of its
Hugging Face transformers counterpart (`LlamaRMSNorm`, `LlamaRotaryEmbedding` +
`apply_rotary_pos_emb`, `LlamaMLP`) operation for operation: the `*_torch`
functions are those definitions in PyTorch ops.

On a decode step these ops see one row per request, so in PyTorch their cost is
dispatch (a dozen small ops per layer), not arithmetic. `rms_norm`, `apply_rotary_`,
`silu_and_mul` and `gelu_tanh_and_mul` first ask the fast path of their input's
device (models/fast_path.py): one native call each for float32 on the CPU, one
Triton kernel each on an NVIDIA GPU, computing the same arithmetic (on the CPU
within ~1e-6 relative: sums are added in another order and exp is a polynomial;
on the GPU rounding where the torch definitions round). Anything else takes the
torch definitions.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenriver.models.fast_path import fast_path


def rms_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """The definition of `rms_norm` in PyTorch ops (HF's LlamaRMSNorm after an optional residual add)."""
    if residual is not None:
        x = residual.add_(x)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """weight * x / sqrt(mean(x²) + eps), computed in float32 whatever the input dtype; x [num_tokens, hidden].

    With `residual`: residual += x in place first, and the norm is of that sum (the residual add that ends one
    block, fused into the norm that starts the next).
    """
    fast = fast_path(x)
    out = None if fast is None else fast.rms_norm(x, weight, eps, residual)
    if out is not None:
        return out
    return rms_norm_torch(x, weight, eps, residual)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) * weight, computed in float32 whatever the input dtype."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Add x into the residual stream, then normalize the stream: (norm(residual + x), residual + x).

        The sum is written into `residual` in place. With residual None, x starts the stream: (norm(x), x).
        """
        if residual is None:
            return rms_norm(x, self.weight, self.eps), x
        return rms_norm(x, self.weight, self.eps, residual), residual


def rope_inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    """Rotation speed of each pair of dimensions: [head_dim // 2] float32 radians per position.

    Plain RoPE: theta^(-2i/d). Scaled variants slow the low frequencies down so
    the model reaches past its training length (same formulas as transformers'
    `modeling_rope_utils`).
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope_theta**exponents)  # [head_dim // 2]
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

    def __init__(
        self, head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None, max_position_embeddings: int
    ) -> None:
        super().__init__()
        self.inv_freq = rope_inv_freq(head_dim, rope_theta, rope_scaling)  # [head_dim // 2] float32, CPU
        self.num_cached_positions = min(max_position_embeddings, 4096)
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None

    def tables(self, max_position: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos and sin tables [num_positions, head_dim // 2] on `device`, grown to cover max_position; a
        native loop that walks positions itself reads them directly (models/cpu/greedy.py)."""
        if self._cos is None or self._cos.device != device or self._cos.shape[0] <= max_position:
            while self.num_cached_positions <= max_position:
                self.num_cached_positions *= 2
            positions = torch.arange(self.num_cached_positions, dtype=torch.float32, device=device)
            freqs = positions[:, None] * self.inv_freq.to(device)  # [num_positions, head_dim // 2]
            self._cos, self._sin = freqs.cos(), freqs.sin()
        return self._cos, self._sin

    def reserve(self, num_positions: int, device: torch.device) -> None:
        """Build the table on `device` for positions 0..num_positions - 1 now (before a CUDA graph is captured)."""
        self.tables(num_positions - 1, device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of each token's angles: positions [num_tokens] → two [num_tokens, 1, head_dim // 2].

        Computed once per step and shared by every layer (the `1` broadcasts over heads).
        """
        if positions.is_cuda and torch.cuda.is_current_stream_capturing():
            # A CUDA graph cannot read the positions back; its runner reserved the table for every position first.
            cos_table, sin_table = self._cos, self._sin
        else:
            max_position = int(positions.max()) if positions.numel() else 0
            cos_table, sin_table = self.tables(max_position, positions.device)
        # index_select rather than table[positions]: advanced indexing is far slower on CPU.
        cos, sin = cos_table.index_select(0, positions), sin_table.index_select(0, positions)  # [T, head_dim // 2]
        if dtype != cos.dtype:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos[:, None, :], sin[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with the halves written out; x [num_tokens, num_heads, head_dim]."""
    x1, x2 = x.chunk(2, dim=-1)  # [num_tokens, num_heads, head_dim // 2] each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rotary_(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """`apply_rotary` on query [T, num_heads, head_dim] and key [T, num_kv_heads, head_dim], in place.

    cos, sin: [T, 1, head_dim // 2] from RotaryEmbedding. query and key may be views into one qkv tensor, and the
    first rotary_dim values of each head under partial rotary (cos, sin then [T, 1, rotary_dim // 2]).
    """
    fast = fast_path(query)
    if fast is not None and fast.rotary_(query, key, cos, sin):
        return
    both = adjacent_heads(query, key)
    if both is not None:  # one set of ops for both: half the small launches of a GPU's decode step
        both.copy_(apply_rotary(both, cos, sin))
        return
    query.copy_(apply_rotary(query, cos, sin))
    key.copy_(apply_rotary(key, cos, sin))


def adjacent_heads(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
    """query's and key's heads as one [T, num_heads + num_kv_heads, head_dim] view where key's heads follow
    query's in each row (both split from one qkv row, whole heads), else None."""
    if (
        query.dim() != 3
        or query.stride() != key.stride()
        or query.dtype != key.dtype
        or query.shape[0] != key.shape[0]
        or query.shape[2] != key.shape[2]
        or query.stride(2) != 1
        or query.stride(1) != query.shape[2]
        or query.untyped_storage().data_ptr() != key.untyped_storage().data_ptr()
        or key.storage_offset() != query.storage_offset() + query.shape[1] * query.stride(1)
    ):
        return None
    return query.as_strided((query.shape[0], query.shape[1] + key.shape[1], query.shape[2]), query.stride())


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """The definition of `silu_and_mul` in PyTorch ops."""
    gate, up = gate_up.chunk(2, dim=-1)  # [..., intermediate] each
    return F.silu(gate) * up


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, where gate_up [num_tokens, 2 * intermediate] is gate_proj's output, then up_proj's."""
    fast = fast_path(gate_up)
    out = None if fast is None else fast.silu_and_mul(gate_up)
    if out is not None:
        return out
    return silu_and_mul_torch(gate_up)


class SwiGLUMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)), with gate_proj and up_proj stacked into one gate_up_proj."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


def gelu_tanh_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """The definition of `gelu_tanh_and_mul` in PyTorch ops (HF's gelu_pytorch_tanh)."""
    gate, up = gate_up.chunk(2, dim=-1)  # [..., intermediate] each
    return F.gelu(gate, approximate="tanh") * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, tanh approximation) * up (GeGLU), gate_up [num_tokens, 2 * intermediate] as for silu_and_mul."""
    fast = fast_path(gate_up)
    out = None if fast is None else fast.gelu_tanh_and_mul(gate_up)
    if out is not None:
        return out
    return gelu_tanh_and_mul_torch(gate_up)
