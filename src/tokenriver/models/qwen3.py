"""Qwen3 decoder: the Llama block with an RMSNorm over each query and key head before rotary.

One page, top to bottom as in models/llama.py: embedding → N × (RMSNorm → attention → residual, RMSNorm → MLP
→ residual) → final RMSNorm, each residual add done by the norm that follows it (`add_and_norm`). Qwen3 adds
`q_norm` / `k_norm` (weights [head_dim], shared by all heads): they keep attention logits in range without a QKV
bias. The MLP is passed in (`mlp_factory`) so the mixture-of-experts pages (models/moe.py: Qwen3-MoE, Mixtral) are
this page with another feed-forward block. Parameter names are Hugging Face's (Qwen3ForCausalLM), q/k/v and gate/up
stacked into one projection each (`FUSED_PROJECTIONS`). The model exposes llama.py's embed / run_layers / final_norm
steps, so that the runner can run the stack, dense or mixture of experts, in one native call
(runner/native_stack.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tokenriver.kv.cache import KVCache
from tokenriver.models.attention import AttentionMetadata, paged_attention
from tokenriver.models.config import ModelConfig
from tokenriver.models.layers import RMSNorm, RotaryEmbedding, SwiGLUMLP, apply_rotary_, rms_norm

FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


class Qwen3Attention(nn.Module):
    """Grouped-query attention with per-head q/k RMSNorm (when config.qk_norm) and the layer's sliding window."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.window = config.layer_window(layer_idx)
        self.q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """rope: cos, sin [T, 1, head_dim // 2]; hidden [T, hidden_size] → [T, hidden_size]."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden).view(num_tokens, -1, self.head_dim)  # [T, heads + 2 * kv_heads, head_dim]
        query, key, value = qkv.split((self.num_heads, self.num_kv_heads, self.num_kv_heads), dim=1)
        if self.q_norm is not None and self.k_norm is not None:
            # One norm per head: rows of head_dim values. [T, heads, head_dim], [T, kv_heads, head_dim]
            query = rms_norm(query.reshape(-1, self.head_dim), self.q_norm.weight, self.q_norm.eps).view(query.shape)
            key = rms_norm(key.reshape(-1, self.head_dim), self.k_norm.weight, self.k_norm.eps).view(key.shape)
        apply_rotary_(query, key, *rope)
        out = paged_attention(query, key, value, kv_cache[self.layer_idx], metadata, self.scale, self.window)
        return self.o_proj(out.view(num_tokens, self.q_size))


def dense_mlp(config: ModelConfig, layer_idx: int) -> nn.Module:
    """The SwiGLU MLP of a dense model."""
    return SwiGLUMLP(config.hidden_size, config.intermediate_size)


class Qwen3DecoderLayer(nn.Module):
    """Pre-norm block in the residual-stream form of models/llama.py: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(
        self, config: ModelConfig, layer_idx: int, mlp_factory: Callable[[ModelConfig, int], nn.Module]
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Qwen3Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp_factory(config, layer_idx)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it is added)."""
        hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen3Model(nn.Module):
    """Token embedding, the decoder stack and the final norm (HF's `model.` prefix)."""

    def __init__(self, config: ModelConfig, mlp_factory: Callable[[ModelConfig, int], nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings
        )
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config, i, mlp_factory) for i in range(config.num_layers))
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
        """[T] token ids and positions → (embeddings [T, hidden], rope: cos, sin [T, 1, head_dim // 2] each)."""
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


class Qwen3ForCausalLM(nn.Module):
    """The decoder plus its output projection; the engine calls `forward`, then `compute_logits` on chosen rows."""

    fused_projections = FUSED_PROJECTIONS
    # Every layer is a Qwen3DecoderLayer: a layout the runner may run in one native call (runner/native_stack.py),
    # with the dense MLP or, in the mixture-of-experts pages that inherit it, the router and its experts.
    layer_layout = "qwen3"

    def __init__(self, config: ModelConfig, mlp_factory: Callable[[ModelConfig, int], nn.Module] = dense_mlp) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen3Model(config, mlp_factory)
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
