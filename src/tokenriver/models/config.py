"""ModelConfig: the shape of a model, whatever file it came from.

Loaders translate GGUF metadata or a Hugging Face config.json into this one
frozen dataclass; model code reads only this. Field names follow Hugging Face
where one exists, so a reader who knows `LlamaConfig` knows these. Checked once
on construction, so model code can trust it. Stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenriver.errors import ModelLoadError

# Rope scaling types tokenriver implements, and the keys each one needs.
ROPE_SCALING_KEYS: dict[str, tuple[str, ...]] = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "linear": ("factor",),
    "freq_factors": ("factors",),
}


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2)."""

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

    def __post_init__(self) -> None:
        problems = [f"{name}={getattr(self, name)!r} must be a positive integer"
                    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                                 "num_kv_heads", "head_dim", "max_position_embeddings")
                    if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0]
        if not problems and self.num_heads % self.num_kv_heads:
            problems.append(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if not problems and self.head_dim % 2:
            problems.append(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type")
            missing = sorted(set(ROPE_SCALING_KEYS.get(rope_type, ())) - set(self.rope_scaling))
            if rope_type not in ROPE_SCALING_KEYS:
                problems.append(f"rope scaling type {rope_type!r} is not supported (supported: "
                                f"{', '.join(ROPE_SCALING_KEYS)}, or none)")
            elif missing:
                problems.append(f"{rope_type} rope scaling needs {', '.join(missing)}")
        if problems:
            raise ModelLoadError("the model's configuration is inconsistent: " + "; ".join(problems))
