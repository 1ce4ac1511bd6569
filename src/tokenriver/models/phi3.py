"""Phi-3 and Phi-4-mini decoders.

The Llama block (models/llama.py's structure: pre-norm attention and SwiGLU MLP, residual adds fused into the
following norm) with Phi's differences:
- q/k/v and gate/up are stored fused in the checkpoints (`qkv_proj`, `gate_up_proj`), which is how tokenriver runs
  them anyway, so nothing is stacked at load;
- partial rotary (Phi-4-mini: partial_rotary_factor 0.75): only the first rotary_dim dimensions of each query and
  key head turn, the rest pass through;
- LongRoPE (rope_scaling "longrope"): each rotary frequency is divided by a per-frequency factor, the short factors
  for positions inside the original training context and the long ones past it, and cos/sin are multiplied by the
  attention factor. transformers switches every token of a sequence to the long factors once the sequence outgrows
  the original context; here the choice is per position, so a token's rotation never depends on how long its
  sequence has grown or what it is batched with, and cached keys stay valid. Inside the original context both agree;
- a sliding window where the config sets one shorter than the context (Phi-3-mini-4k), on every layer.
Parameter names are Hugging Face's (Phi3ForCausalLM).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenriver.kv.cache import KVCache
from tokenriver.models.attention import AttentionMetadata, paged_attention
from tokenriver.models.config import ModelConfig
from tokenriver.models.layers import RMSNorm, RotaryEmbedding, SwiGLUMLP, apply_rotary_


class Phi3RotaryEmbedding(nn.Module):
    """cos, sin [T, 1, rotary_dim // 2] per token: plain RoPE, or LongRoPE's short/long factors by position."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        scaling = config.rope_scaling
        dim, theta, max_positions = config.rotary_dim, config.rope_theta, config.max_position_embeddings
        if scaling is None or scaling["rope_type"] != "longrope":
            self.short = RotaryEmbedding(dim, theta, scaling, max_positions)
            self.long = None
            self.original_max_positions = max_positions
            self.attention_factor = 1.0
            return
        # inv_freq / factor per frequency: what rope_inv_freq's "freq_factors" computes.
        self.short = RotaryEmbedding(
            dim, theta, {"rope_type": "freq_factors", "factors": scaling["short_factor"]}, max_positions
        )
        self.long = RotaryEmbedding(
            dim, theta, {"rope_type": "freq_factors", "factors": scaling["long_factor"]}, max_positions
        )
        self.original_max_positions = int(scaling["original_max_position_embeddings"])
        self.attention_factor = float(scaling.get("attention_factor", 1.0))

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.short(positions, dtype)  # [T, 1, rotary_dim // 2] each
        if self.long is not None:
            long_cos, long_sin = self.long(positions, dtype)
            is_long = (positions >= self.original_max_positions)[:, None, None]  # [T, 1, 1]
            cos, sin = torch.where(is_long, long_cos, cos), torch.where(is_long, long_sin, sin)
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos, sin


class Phi3Attention(nn.Module):
    """Grouped-query attention over the fused qkv_proj, rotating the first rotary_dim dimensions of each head."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.rotary_dim = config.rotary_dim
        self.scale = config.head_dim**-0.5
        self.window = config.layer_window(layer_idx)
        self.q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """rope: cos, sin [T, 1, rotary_dim // 2]; hidden [T, hidden_size] → [T, hidden_size]."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden).view(num_tokens, -1, self.head_dim)  # [T, heads + 2 * kv_heads, head_dim]
        query, key, value = qkv.split((self.num_heads, self.num_kv_heads, self.num_kv_heads), dim=1)
        # In place on the rotating part (a view when rotary_dim < head_dim).
        apply_rotary_(query[..., : self.rotary_dim], key[..., : self.rotary_dim], *rope)
        out = paged_attention(query, key, value, kv_cache[self.layer_idx], metadata, self.scale, self.window)
        return self.o_proj(out.view(num_tokens, self.q_size))


class Phi3DecoderLayer(nn.Module):
    """Pre-norm block in models/llama.py's residual-stream form: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Phi3Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(hidden), residual


class Phi3Model(nn.Module):
    """Token embedding, the decoder stack and the final norm (HF's `model.` prefix)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = Phi3RotaryEmbedding(config)
        self.layers = nn.ModuleList(Phi3DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata
    ) -> torch.Tensor:
        hidden, rope = self.embed(input_ids, positions)
        hidden, residual = self.run_layers(rope, hidden, kv_cache, metadata)
        return self.final_norm(hidden, residual)

    def embed(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """[T] token ids and positions → (embeddings [T, hidden], rope: cos, sin [T, 1, rotary_dim // 2] each)."""
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        return hidden, self.rotary_emb(positions, hidden.dtype)

    def run_layers(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every decoder layer in turn: (last layer's MLP output, the residual stream before it), [T, hidden] each."""
        residual = None
        for layer in self.layers:
            hidden, residual = layer(rope, hidden, residual, kv_cache, metadata)
        return hidden, residual

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Adds the last layer's output to the residual stream and normalizes: [T, hidden]."""
        hidden, _ = self.norm.add_and_norm(hidden, residual)
        return hidden


class Phi3ForCausalLM(nn.Module):
    """The decoder plus its output projection (tied to the embedding in Phi-4-mini)."""

    fused_projections: dict[str, tuple[str, ...]] = {}
    # Every layer is a Phi3DecoderLayer: a layout the runner may run in one native call (runner/native_stack.py).
    layer_layout = "phi3"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Phi3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions [num_tokens] int64 → final-norm hidden states [num_tokens, hidden_size]."""
        return self.model(input_ids, positions, kv_cache, metadata)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden_size] → [num_rows, vocab_size] float32 logits."""
        return self.lm_head(hidden).float()
