"""nomic-bert (nomic-embed-text): a BERT encoder with rotary positions and a SwiGLU MLP, for embeddings.

One page, top to bottom: embeddings (word + token type, then `emb_ln`; no position embeddings) → N × post-LN layer
(x = norm1(x + out_proj(attention(x))), then x = norm2(x + fc2(silu(fc12(x)) * fc11(x)))) → the last layer's hidden
states. Attention is BERT's (models/bert.py: bidirectional within each request, nothing cached, one SDPA call per
request), with rotary embeddings on queries and keys (the rotate_half layout, base `rope_theta`, 1000 in
nomic-embed) and no biases anywhere. Parameter names are the checkpoints' own (nomic's code, which transformers'
NomicBertModel also saves): q/k/v are already one matrix, `attn.Wqkv`; the MLP's gate (`fc12`) and up (`fc11`)
projections run as one, `mlp.gate_up_proj` (`FUSED_PROJECTIONS`). Token types are derived from [SEP] as in
models/bert.py; a single text is all type 0.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenriver.kv.cache import KVCache
from tokenriver.models.attention_metadata import AttentionMetadata
from tokenriver.models.bert import bidirectional_attention, derive_token_types, no_head_error
from tokenriver.models.config import ModelConfig
from tokenriver.models.layers import RotaryEmbedding, apply_rotary_, silu_and_mul

FUSED_PROJECTIONS = {"mlp.gate_up_proj": ("mlp.fc12", "mlp.fc11")}


class NomicBertEmbeddings(nn.Module):
    """word + token type embedding of each token (the LayerNorm after them is the model's `emb_ln`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.sep_token_id = config.sep_token_id if config.type_vocab_size > 1 else None
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.token_type_embeddings = (
            nn.Embedding(config.type_vocab_size, config.hidden_size) if config.type_vocab_size else None
        )

    def forward(self, input_ids: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids [num_tokens] → [num_tokens, hidden_size]."""
        hidden = self.word_embeddings(input_ids)  # [num_tokens, hidden_size]
        if self.token_type_embeddings is None:
            return hidden
        if self.sep_token_id is None:
            token_types = torch.zeros_like(input_ids)  # [num_tokens]
        else:
            token_types = derive_token_types(input_ids, metadata, self.sep_token_id)  # [num_tokens]
        return hidden + self.token_type_embeddings(token_types)


class NomicBertAttention(nn.Module):
    """Bidirectional multi-head attention with rotary positions; fused Wqkv, no biases."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        width = config.num_heads * config.head_dim
        self.Wqkv = nn.Linear(config.hidden_size, 3 * width, bias=False)
        self.out_proj = nn.Linear(width, config.hidden_size, bias=False)

    def forward(
        self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """rope: cos, sin [T, 1, head_dim // 2]; hidden [T, hidden_size] → [T, hidden_size]."""
        num_tokens = hidden.shape[0]
        qkv = self.Wqkv(hidden).view(num_tokens, 3 * self.num_heads, self.head_dim)  # [T, 3 * heads, head_dim]
        query, key, value = qkv.split(self.num_heads, dim=1)  # [T, heads, head_dim] each, views
        apply_rotary_(query, key, *rope)  # rotates both in place
        out = bidirectional_attention(query, key, value, metadata, self.scale)  # [T, heads, head_dim]
        return self.out_proj(out.view(num_tokens, self.num_heads * self.head_dim))


class NomicBertMLP(nn.Module):
    """fc2(silu(fc12(x)) * fc11(x)): SwiGLU with fc12 the gate and fc11 the up projection, stacked as gate_up_proj."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc2(silu_and_mul(self.gate_up_proj(hidden)))  # [T, hidden_size]


class NomicBertBlock(nn.Module):
    """Post-LN layer: x = norm1(x + attn(x)), then norm2(x + mlp(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn = NomicBertAttention(config)
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = NomicBertMLP(config)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(
        self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """hidden [T, hidden_size] → [T, hidden_size]."""
        hidden = self.norm1(hidden + self.attn(rope, hidden, metadata))
        return self.norm2(hidden + self.mlp(hidden))


class NomicBertEncoder(nn.Module):
    """The layer stack (the checkpoints' `encoder.layers`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(NomicBertBlock(config) for _ in range(config.num_layers))


class NomicBertForPooling(nn.Module):
    """nomic-bert for embeddings: the engine calls `forward` and pools the rows it returns. There is no
    classification head: `score` says so."""

    fused_projections = FUSED_PROJECTIONS
    # The encoder's layers run in its own forward: no native decoder takes them (models/contract.py).
    layer_layout = None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = NomicBertEmbeddings(config)
        self.emb_ln = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, None, config.max_position_embeddings)
        self.encoder = NomicBertEncoder(config)

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache | None, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions [num_tokens] int64, whole prompts one after another → the last layer's hidden states
        [num_tokens, hidden_size]. kv_cache is ignored: an encoder keeps none."""
        hidden = self.emb_ln(self.embeddings(input_ids, metadata))  # [T, hidden_size]
        rope = self.rotary_emb(positions, hidden.dtype)  # cos, sin [T, 1, head_dim // 2]
        for layer in self.encoder.layers:
            hidden = layer(rope, hidden, metadata)
        return hidden

    def score(self, pooled: torch.Tensor) -> torch.Tensor:
        """No classification head: refuses, as models/bert.py's pages do when config.num_labels is 0."""
        raise no_head_error(self.config)
