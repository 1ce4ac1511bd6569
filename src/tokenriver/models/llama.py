"""Llama-family decoder: Llama 2/3, SmolLM/SmolLM2, Mistral, Qwen2/2.5.

One page, top to bottom: embedding → N × (RMSNorm → attention → residual,
RMSNorm → SwiGLU MLP → residual) → final RMSNorm; logits on request. Each
residual add is done by the norm that follows it (`add_and_norm`: one pass, one
native call on the CPU), so a layer takes the previous block's output and the
residual stream separately and hands both on.
Parameter names are Hugging Face's, except that q/k/v and gate/up run as one
fused projection each (`qkv_proj`, `gate_up_proj`: fewer, larger matrix
products per step); `FUSED_PROJECTIONS` tells the loader which checkpoint
tensors to stack. The variants differ only in ModelConfig fields: grouped-query
attention (num_kv_heads), QKV bias (Qwen2), rope scaling (Llama 3), tied output
embedding.

A step is a ragged batch: the tokens of many requests flattened into one
[num_tokens] tensor, each with its own position; `AttentionMetadata` says which
tokens belong to which request and where their keys/values live in the paged
KV cache. No loader logic, no global context: everything comes in as arguments.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenriver.kv.cache import KVCache
from tokenriver.models.attention import AttentionMetadata, paged_attention
from tokenriver.models.config import ModelConfig
from tokenriver.models.layers import RMSNorm, RotaryEmbedding, SwiGLUMLP, apply_rotary_

# Fused module → the Hugging Face modules whose weights (and biases) it stacks, in output order.
FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


class LlamaAttention(nn.Module):
    """Multi-head (or grouped-query) self-attention with rotary positions over the paged KV cache."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        # q_proj, k_proj and v_proj stacked: one product for all three.
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=config.attention_out_bias)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """rope: cos, sin [T, 1, head_dim // 2]; hidden [T, hidden_size] → [T, hidden_size]."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden).view(num_tokens, -1, self.head_dim)  # [T, num_heads + 2 * num_kv_heads, head_dim]
        # Views into qkv, no copies: [T, num_heads, head_dim], [T, num_kv_heads, head_dim] twice.
        query, key, value = qkv.split((self.num_heads, self.num_kv_heads, self.num_kv_heads), dim=1)
        apply_rotary_(query, key, *rope)  # rotates both in place
        out = paged_attention(query, key, value, kv_cache[self.layer_idx], metadata, self.scale)
        return self.o_proj(out.view(num_tokens, self.q_size))  # [T, hidden]


class LlamaDecoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)).

    Written in the residual-stream form: `residual` is x so far and `hidden` the previous block's output not yet
    added to it; each norm first adds (residual += hidden), then normalizes the sum.
    """

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx)
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
        """hidden [T, hidden_size]; residual [T, hidden_size], or None before the first layer.

        Returns (this layer's MLP output, the residual stream before it is added).
        """
        hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Token embedding, the decoder stack and the final norm (HF's `model.` prefix)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings
        )
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_layers))
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
        """Every decoder layer in turn: (last layer's MLP output, the residual stream before it), [T, hidden] each.

        Its own method so that a runner can run the same stack another way (runner/native_stack.py)."""
        residual = None
        for layer in self.layers:
            hidden, residual = layer(rope, hidden, residual, kv_cache, metadata)
        return hidden, residual

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Adds the last layer's output to the residual stream and normalizes: [T, hidden]."""
        hidden, _ = self.norm.add_and_norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """The decoder plus its output projection; the engine calls `forward`, then `compute_logits` on chosen rows."""

    fused_projections = FUSED_PROJECTIONS
    # Every layer is a LlamaDecoderLayer: a layout the runner may run in one native call (runner/native_stack.py).
    layer_layout = "llama"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Run one step over a ragged batch; writes this step's K/V into kv_cache.

        input_ids, positions: [num_tokens] int64. Returns the final-norm hidden
        states [num_tokens, hidden_size] in the parameters' dtype.
        """
        return self.model(input_ids, positions, kv_cache, metadata)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden_size] → [num_rows, vocab_size] float32 logits.

        Separate from forward so only the rows that get sampled (usually each
        request's last token) pay for the vocabulary-sized matmul.
        """
        return self.lm_head(hidden).float()
