"""Gemma 2 and Gemma 3 decoders.

The same skeleton as models/llama.py (embedding → N × (attention, MLP) → final norm over a ragged batch and the
paged KV cache), with Gemma's differences, each where it acts:
- RMSNorm multiplies by (1 + weight), not weight (`GemmaRMSNorm`; checkpoints store the offset from one);
- every block is normalized on the way in and on the way out: input_layernorm → attention →
  post_attention_layernorm → residual add, pre_feedforward_layernorm → MLP → post_feedforward_layernorm →
  residual add (each add done by the norm that follows it, `add_and_norm`, as in llama.py);
- the token embedding is scaled by sqrt(hidden_size);
- the MLP is GeGLU: gelu(gate, tanh approximation) * up;
- attention scores are scaled by query_pre_attn_scalar ** -0.5;
- layers alternate between sliding-window and global attention (`ModelConfig.layer_types`); Gemma 3's sliding
  layers rotate with their own rope base (rope_local_base_freq) and its queries and keys are RMS-normalized per
  head before rotary (q_norm, k_norm);
- Gemma 2 soft-caps the attention scores and the output logits: cap * tanh(x / cap).
Parameter names are Hugging Face's (Gemma2ForCausalLM, Gemma3ForCausalLM), with q/k/v and gate/up stacked into one
projection each as in llama.py (`FUSED_PROJECTIONS`). The model exposes llama.py's embed / run_layers / final_norm
steps, so that the runner can run the layers in one native call (runner/native_stack.py); Gemma's rope is a pair of
tables, (global, local).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tokenriver.kv.cache import KVCache
from tokenriver.models.attention import AttentionMetadata, paged_attention
from tokenriver.models.config import ModelConfig
from tokenriver.models.layers import RotaryEmbedding, apply_rotary_, gelu_tanh_and_mul, rms_norm

# (global, local) rotary tables: cos, sin [T, 1, head_dim // 2] each.
RopeTables = tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

# Fused module → the Hugging Face modules whose weights it stacks, in output order.
FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


class GemmaRMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) * (1 + weight), in float32 (HF's Gemma3RMSNorm); over the last dimension."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., dim]; with residual [..., dim]: residual += x first, and the sum is normalized."""
        shape = x.shape
        if x.dtype != torch.float32:
            # HF rounds once, after the weight: (x32 * rsqrt(...) * (1 + w32)).to(dtype).
            if residual is not None:
                x = residual.add_(x)
            x32 = x.float()
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        rows = x.reshape(-1, shape[-1])  # [rows, dim]
        out = rms_norm(rows, 1.0 + self.weight, self.eps, None if residual is None else residual.view(-1, shape[-1]))
        return out.view(shape)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x), the sum written into residual; with residual None, x starts the
        stream: (norm(x), x)."""
        if residual is None:
            return self(x), x
        return self(x, residual), residual


class GemmaAttention(nn.Module):
    """Grouped-query attention with Gemma's score scale, optional q/k norms, window and soft-capping."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        self.window = config.layer_window(layer_idx)
        self.softcap = config.attn_logit_softcapping
        self.q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """rope: cos, sin [T, 1, head_dim // 2] of this layer's kind; hidden [T, hidden_size] → [T, hidden_size]."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden).view(num_tokens, -1, self.head_dim)  # [T, heads + 2 * kv_heads, head_dim]
        query, key, value = qkv.split((self.num_heads, self.num_kv_heads, self.num_kv_heads), dim=1)
        if self.q_norm is not None and self.k_norm is not None:
            query, key = self.q_norm(query.contiguous()), self.k_norm(key.contiguous())
        apply_rotary_(query, key, *rope)
        out = paged_attention(
            query, key, value, kv_cache[self.layer_idx], metadata, self.scale, self.window, self.softcap
        )
        return self.o_proj(out.view(num_tokens, self.q_size))


class GemmaMLP(nn.Module):
    """GeGLU: down_proj(gelu_tanh(gate_proj(x)) * up_proj(x)), gate_proj and up_proj stacked into gate_up_proj."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    """x + post_attn_norm(attn(input_norm(x))), then x + post_ff_norm(mlp(pre_ff_norm(x))).

    In the residual-stream form of llama.py: `residual` is x so far and `hidden` the previous layer's (normalized)
    MLP output not yet added to it.
    """

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.is_sliding = config.layer_window(layer_idx) > 0
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = GemmaAttention(config, layer_idx)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GemmaMLP(config.hidden_size, config.intermediate_size)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, hidden_size]; residual [T, hidden_size] (updated in place), or None before the first layer.

        Returns (this layer's normalized MLP output, the residual stream before it is added)."""
        hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, metadata)
        # pre_feedforward_layernorm adds the normalized attention output into the stream, then normalizes the sum.
        hidden, residual = self.pre_feedforward_layernorm.add_and_norm(self.post_attention_layernorm(hidden), residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class GemmaModel(nn.Module):
    """Token embedding (scaled), the decoder stack and the final norm (HF's `model.` prefix)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_scale = math.sqrt(config.hidden_size)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings
        )
        # Sliding layers of Gemma 3 turn with their own base and no scaling; Gemma 2's share the global one.
        self.rotary_emb_local = (
            RotaryEmbedding(config.head_dim, config.rope_local_base_freq, None, config.max_position_embeddings)
            if config.rope_local_base_freq is not None
            else None
        )
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata
    ) -> torch.Tensor:
        hidden, rope = self.embed(input_ids, positions)
        hidden, residual = self.run_layers(rope, hidden, kv_cache, metadata)
        return self.final_norm(hidden, residual)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, RopeTables]:
        """[T] token ids and positions → (scaled embeddings [T, hidden], (global, local) rope: cos, sin
        [T, 1, head_dim // 2] each; the local pair is the global one where the sliding layers share it)."""
        embedded = self.embed_tokens(input_ids)  # [T, hidden]
        # HF rounds the scale to the weights' dtype before multiplying.
        hidden = embedded * torch.tensor(self.embed_scale, dtype=embedded.dtype)
        rope_global = self.rotary_emb(positions, hidden.dtype)
        rope_local = rope_global if self.rotary_emb_local is None else self.rotary_emb_local(positions, hidden.dtype)
        return hidden, (rope_global, rope_local)

    def run_layers(
        self, rope: RopeTables, hidden: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every decoder layer in turn: (last layer's normalized MLP output, the residual stream before it)."""
        rope_global, rope_local = rope
        residual = None
        for layer in self.layers:
            hidden, residual = layer(
                rope_local if layer.is_sliding else rope_global, hidden, residual, kv_cache, metadata
            )
        return hidden, residual

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Adds the last layer's output to the residual stream and normalizes: [T, hidden]."""
        return self.norm(hidden, residual)


class GemmaForCausalLM(nn.Module):
    """The decoder plus its output projection (tied to the embedding in every released Gemma)."""

    fused_projections = FUSED_PROJECTIONS
    # Every layer is a GemmaDecoderLayer: a layout the runner may run in one native call (runner/native_stack.py).
    layer_layout = "gemma"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = GemmaModel(config)
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
        """[num_rows, hidden_size] → [num_rows, vocab_size] float32 logits, soft-capped where the model says."""
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
