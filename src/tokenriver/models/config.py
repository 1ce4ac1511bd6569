"""ModelConfig: the shape of a model, whatever file it came from.

Loaders translate GGUF metadata or a Hugging Face config.json into this one
frozen dataclass; model code reads only this. Field names follow Hugging Face
where one exists, so a reader who knows `LlamaConfig` knows these. Checked once
on construction, so model code can trust it. Stdlib only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tokenriver.errors import ModelLoadError

# Rope scaling types tokenriver implements, and the keys each one needs.
ROPE_SCALING_KEYS: dict[str, tuple[str, ...]] = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "linear": ("factor",),
    "freq_factors": ("factors",),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}

# Activations of the MLP: SwiGLU's silu, GeGLU's tanh-approximated gelu (Gemma), or the exact (erf) gelu of BERT's
# ungated MLP.
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh", "gelu")
# Attention kinds of a layer (transformers' `layer_types`).
LAYER_TYPES = ("full_attention", "sliding_attention")
# How a file says to pool an embedding: the average of every token, the first token ([CLS]), or the last token.
POOLINGS = ("mean", "cls", "last")


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a decoder: the Llama family (Llama 2/3, SmolLM, Mistral, Qwen2) and the fields the other
    families add (Gemma 2/3, Qwen3, Phi-3, mixture-of-experts), each with the value that switches it off; and of the
    BERT family of encoders (BERT, nomic-bert, XLM-RoBERTa: `is_causal` False), which embed or score a text rather
    than continue it."""

    # Registry key of the model class, e.g. "llama" or "qwen2" (see models/registry.py).
    architecture: str
    # Rows of the token embedding (and of the output projection).
    vocab_size: int
    # Width of the residual stream.
    hidden_size: int
    # Width of the SwiGLU MLP's hidden layer.
    intermediate_size: int
    # Decoder layers.
    num_layers: int
    # Query heads per layer.
    num_heads: int
    # Key/value heads per layer; fewer than num_heads means grouped-query attention.
    num_kv_heads: int
    # Width of one attention head (usually hidden_size // num_heads).
    head_dim: int
    # Base of the rotary position embedding's geometric frequency series.
    rope_theta: float = 10000.0
    # Rotary frequency scaling, None for plain RoPE. Keys follow transformers' rope_parameters:
    #   {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    #   {"rope_type": "linear", "factor"}
    #   {"rope_type": "freq_factors", "factors": [...]}: per-frequency divisors, how llama.cpp stores
    #   Llama 3 scaling in a GGUF (the rope_freqs tensor).
    #   {"rope_type": "longrope", "short_factor", "long_factor", "original_max_position_embeddings"} (Phi-3), with
    #   optional "factor" and "attention_factor".
    rope_scaling: dict[str, Any] | None = None
    # Epsilon added to the mean square in RMSNorm.
    rms_norm_eps: float = 1e-6
    # Longest sequence the model is meant to see (prompt + output).
    max_position_embeddings: int = 2048
    # The output projection reuses the token embedding matrix (no separate lm_head weight).
    tie_word_embeddings: bool = False
    # q_proj, k_proj and v_proj carry a bias (Qwen2).
    attention_bias: bool = False
    # o_proj carries a bias too (Llama configs with attention_bias=true).
    attention_out_bias: bool = False
    # Human-readable model name, for logs and traces.
    name: str = ""
    # Activation of the gated MLP (see HIDDEN_ACTS).
    hidden_act: str = "silu"
    # Attention scores are scaled by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5 (Gemma).
    query_pre_attn_scalar: float | None = None
    # Scores become cap * tanh(scores / cap) before the softmax (Gemma 2); None: no capping.
    attn_logit_softcapping: float | None = None
    # The same on the output logits (Gemma 2).
    final_logit_softcapping: float | None = None
    # Tokens a sliding-window layer attends to (its own and the ones before it); None: no sliding layers.
    sliding_window: int | None = None
    # Per layer "full_attention" or "sliding_attention"; None: every layer full.
    layer_types: tuple[str, ...] | None = None
    # Rope base of the sliding layers, where it differs from rope_theta (Gemma 3: 10000 against 1e6).
    rope_local_base_freq: float | None = None
    # RMSNorm over each head of the queries and keys before rotary (Qwen3, Gemma 3).
    qk_norm: bool = False
    # Fraction of head_dim that rotates (Phi-3 / Phi-4-mini partial rotary); the rest passes through.
    partial_rotary_factor: float = 1.0
    # Routed experts per MoE layer (0: a dense MLP); each token goes to num_experts_per_tok of them.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    # Hidden width of one expert's MLP.
    moe_intermediate_size: int = 0
    # Renormalize the chosen experts' router probabilities to sum to 1 (Mixtral, Qwen3-MoE: true).
    norm_topk_prob: bool = True
    # Hidden width of the always-on shared expert, gated by a sigmoid (Qwen2-MoE); 0: none.
    shared_expert_intermediate_size: int = 0
    # Causal attention (a token sees the ones before it) and generation; False for an encoder, whose tokens all
    # see each other and which only embeds or scores its input.
    is_causal: bool = True
    # The pooling the file asks for (see POOLINGS): GGUF `<arch>.pooling_type`, or a sentence-transformers folder's
    # 1_Pooling/config.json; None when the file says nothing.
    pooling: str | None = None
    # Whether the file's sentence-transformers pipeline normalizes the pooled vector (a Normalize module); None when
    # the file says nothing.
    normalize: bool | None = None
    # Outputs of the classification head (models/bert.py's `score`); 0: no head, the model only embeds.
    num_labels: int = 0
    # Rows of an encoder's token-type (segment) embedding; 0: none.
    type_vocab_size: int = 0
    # Epsilon added to the variance in an encoder's LayerNorm.
    layer_norm_eps: float = 1e-12
    # Added to each position before the position-embedding lookup: XLM-RoBERTa counts positions from
    # padding_idx + 1 (the rows before are never used); 0 for BERT.
    position_offset: int = 0
    # The [SEP] token: an encoder gives the tokens after the first one token type 1 (the second text of a pair);
    # None: every token has type 0.
    sep_token_id: int | None = None

    def __post_init__(self) -> None:
        problems = [
            f"{name}={getattr(self, name)!r} must be a positive integer"
            for name in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_layers",
                "num_heads",
                "num_kv_heads",
                "head_dim",
                "max_position_embeddings",
            )
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0
        ]
        if not problems and self.num_heads % self.num_kv_heads:
            problems.append(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if not problems and self.head_dim % 2:
            problems.append(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type")
            missing = sorted(set(ROPE_SCALING_KEYS.get(rope_type, ())) - set(self.rope_scaling))
            if rope_type not in ROPE_SCALING_KEYS:
                problems.append(
                    f"rope scaling type {rope_type!r} is not supported (supported: "
                    f"{', '.join(ROPE_SCALING_KEYS)}, or none)"
                )
            elif missing:
                problems.append(f"{rope_type} rope scaling needs {', '.join(missing)}")
        if self.hidden_act not in HIDDEN_ACTS:
            problems.append(f"hidden_act={self.hidden_act!r} is not supported (supported: {', '.join(HIDDEN_ACTS)})")
        if self.layer_types is not None:
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if len(self.layer_types) != self.num_layers or unknown:
                problems.append(f"layer_types must name {self.num_layers} layers, each one of {', '.join(LAYER_TYPES)}")
            elif "sliding_attention" in self.layer_types and not (self.sliding_window or 0) > 0:
                problems.append("sliding_attention layers need a positive sliding_window")
        if not 0.0 < self.partial_rotary_factor <= 1.0 or round(self.head_dim * self.partial_rotary_factor) % 2:
            problems.append(
                f"partial_rotary_factor={self.partial_rotary_factor} must rotate an even part of "
                f"head_dim={self.head_dim}"
            )
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            problems.append(
                f"num_experts_per_tok={self.num_experts_per_tok} must be between 1 and num_experts={self.num_experts}"
            )
        if self.pooling is not None and self.pooling not in POOLINGS:
            problems.append(f"pooling={self.pooling!r} is not supported (supported: {', '.join(POOLINGS)}, or none)")
        if self.num_labels < 0 or self.type_vocab_size < 0 or self.position_offset < 0:
            problems.append("num_labels, type_vocab_size and position_offset must not be negative")
        if self.num_labels and self.is_causal:
            problems.append(f"num_labels={self.num_labels}: a classification head needs an encoder (is_causal false)")
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            cap = getattr(self, name)
            if cap is not None and not 0.0 < cap < math.inf:
                problems.append(f"{name}={cap} must be a positive finite number (or absent: no capping)")
        if problems:
            raise ModelLoadError("the model's configuration is inconsistent: " + "; ".join(problems))

    def layer_window(self, layer_idx: int) -> int:
        """The sliding window of layer layer_idx, 0 for a layer that sees its whole context."""
        if self.layer_types is None or self.layer_types[layer_idx] != "sliding_attention":
            return 0
        return int(self.sliding_window or 0)

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that rotary embeddings turn."""
        return round(self.head_dim * self.partial_rotary_factor)
