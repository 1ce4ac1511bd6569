"""Building blocks shared by the decoders: RMSNorm, rotary embedding, SwiGLU MLP, GeGLU's activation.

No file formats, no global state. Each block reproduces the arithmetic of its
Hugging Face transformers counterpart (`LlamaRMSNorm`, `LlamaRotaryEmbedding` +
`apply_rotary_pos_emb`, `LlamaMLP`) operation for operation: the `*_torch`
functions are those definitions in PyTorch ops.

On a decode step these ops see one row per request, so in PyTorch their cost is
dispatch (a dozen small ops per layer), not arithmetic. Where the native kernels
are built (models/cpu, x86-64 with AVX2) and the tensors are float32 on the
CPU, `rms_norm`, `apply_rotary_`, `silu_and_mul` and `gelu_tanh_and_mul` run as one native call each,
computing the same arithmetic (equal to the torch definitions within ~1e-6
relative: sums are added in another order and exp is a polynomial). On an
NVIDIA GPU with Triton, `rms_norm`, `apply_rotary_`, `silu_and_mul` and
`gelu_tanh_and_mul` run as one Triton kernel each (models/cuda/fused_ops.py), rounding where the torch
definitions round. Anything else (bfloat16 on the CPU, other devices, no
compiler) takes the torch definitions, and so does any call with autograd on
(`torch.is_grad_enabled()`): the kernels record no gradients.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenriver.models.cpu.kernels import is_contiguous_f32, kernels_for


def _fused_ops(x: torch.Tensor) -> Any:
    """The Triton kernel module for a CUDA tensor outside autograd where Triton imports, else None. Imported on
    first use: a CPU run never loads Triton."""
    if not x.is_cuda or torch.is_grad_enabled():
        return None
    from tokenriver.models.cuda import fused_ops

    return fused_ops if fused_ops.available(x.device) else None


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None) -> torch.Tensor:
    """The definition of `rms_norm` in PyTorch ops (HF's LlamaRMSNorm after an optional residual add)."""
    if residual is not None:
        x = residual.add_(x)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """weight * x / sqrt(mean(x²) + eps), computed in float32 whatever the input dtype; x [num_tokens, hidden].

    With `residual`: residual += x in place first, and the norm is of that sum (the residual add that ends one
    block, fused into the norm that starts the next).
    """
    kernels = kernels_for(x)
    if (kernels is not None and not torch.is_grad_enabled() and x.dim() == 2 and is_contiguous_f32(x)
            and is_contiguous_f32(weight) and weight.shape == x.shape[1:]
            and (residual is None or (is_contiguous_f32(residual) and residual.shape == x.shape))):
        return kernels.rms_norm(x, weight, eps, residual)
    fused = _fused_ops(x)
    if (fused is not None and fused.fits_rows(x) and weight.dim() == 1 and weight.is_contiguous()
            and weight.shape[0] == x.shape[1] <= fused.MAX_NORM_COLUMNS
            and (residual is None or (fused.fits_rows(residual) and residual.shape == x.shape
                                      and residual.dtype == x.dtype))):
        return fused.rms_norm(x, weight, eps, residual)
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


def _is_f32_heads(tensor: torch.Tensor) -> bool:
    """[T, heads, d] float32 on the CPU, each head's d values contiguous and the heads evenly spaced in each row:
    heads packed in a row, or the first d values of wider heads (a partial-rotary view)."""
    return (tensor.dtype == torch.float32 and tensor.is_cpu and tensor.dim() == 3 and tensor.stride(2) == 1
            and tensor.stride(1) >= tensor.shape[2])


def apply_rotary_(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """`apply_rotary` on query [T, num_heads, head_dim] and key [T, num_kv_heads, head_dim], in place.

    cos, sin: [T, 1, head_dim // 2] from RotaryEmbedding. query and key may be views into one qkv tensor, and the
    first rotary_dim values of each head under partial rotary (cos, sin then [T, 1, rotary_dim // 2]).
    """
    kernels = kernels_for(query)
    if (kernels is not None and not torch.is_grad_enabled() and _is_f32_heads(query) and _is_f32_heads(key)
            and is_contiguous_f32(cos) and is_contiguous_f32(sin)):
        num_tokens, _, rotary_dim = query.shape
        if (cos.shape == sin.shape and cos.shape[0] == num_tokens and 2 * cos.shape[-1] == rotary_dim
                and key.shape[0] == num_tokens and key.shape[2] == rotary_dim and key.stride(1) == query.stride(1)):
            kernels.rotary_(query, key, cos, sin)
            return
    both = _adjacent_heads(query, key)
    fused = _fused_ops(query)
    if fused is not None and cos.dtype == query.dtype == key.dtype and sin.dtype == cos.dtype:
        targets = [both] if both is not None else [query, key]
        if all(fused.fits_heads(x) and x.shape[0] == cos.shape[0] and x.shape[2] == 2 * cos.shape[-1]
               for x in targets):
            for x in targets:
                fused.rotary_(x, cos, sin)
            return
    if both is not None:  # one set of ops for both: half the small launches of a GPU's decode step
        both.copy_(apply_rotary(both, cos, sin))
        return
    query.copy_(apply_rotary(query, cos, sin))
    key.copy_(apply_rotary(key, cos, sin))


def _adjacent_heads(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
    """query's and key's heads as one [T, num_heads + num_kv_heads, head_dim] view where key's heads follow
    query's in each row (both split from one qkv row, whole heads), else None."""
    if (query.dim() != 3 or query.stride() != key.stride() or query.dtype != key.dtype or query.shape[0] != key.shape[0]
            or query.shape[2] != key.shape[2] or query.stride(2) != 1 or query.stride(1) != query.shape[2]
            or query.untyped_storage().data_ptr() != key.untyped_storage().data_ptr()
            or key.storage_offset() != query.storage_offset() + query.shape[1] * query.stride(1)):
        return None
    return query.as_strided((query.shape[0], query.shape[1] + key.shape[1], query.shape[2]), query.stride())


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """The definition of `silu_and_mul` in PyTorch ops."""
    gate, up = gate_up.chunk(2, dim=-1)  # [..., intermediate] each
    return F.silu(gate) * up


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, where gate_up [num_tokens, 2 * intermediate] is gate_proj's output, then up_proj's."""
    kernels = kernels_for(gate_up)
    if (kernels is not None and not torch.is_grad_enabled() and gate_up.dim() == 2
            and is_contiguous_f32(gate_up)):
        return kernels.silu_mul(gate_up)
    fused = _fused_ops(gate_up)
    if fused is not None and fused.fits_rows(gate_up) and gate_up.shape[1] % 2 == 0:
        return fused.silu_and_mul(gate_up)
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
    """gelu(gate, tanh approximation) * up (GeGLU), gate_up [num_tokens, 2 * intermediate] as for silu_and_mul.

    The native kernel is the one the fused decoder stack runs (models/cpu/decoder.py), so both paths give the
    same bits."""
    kernels = kernels_for(gate_up)
    if (kernels is not None and not torch.is_grad_enabled() and gate_up.dim() == 2
            and is_contiguous_f32(gate_up)):
        return kernels.gelu_tanh_mul(gate_up)
    fused = _fused_ops(gate_up)
    if fused is not None and fused.fits_rows(gate_up) and gate_up.shape[1] % 2 == 0:
        return fused.gelu_tanh_and_mul(gate_up)
    return gelu_tanh_and_mul_torch(gate_up)
