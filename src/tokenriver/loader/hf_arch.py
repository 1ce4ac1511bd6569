"""config.json settings of the families beyond Llama → the ModelConfig fields that switch their features on.

loader/safetensors.py reads what every decoder has (sizes, rope, norms); here each family adds its own keys, as
transformers 4.x and 5.x write them: Gemma's activation, score scale, soft-capping, sliding layers and per-layer-type
rope (5.x nests it in `rope_parameters` by layer type), Qwen3's q/k norms, Phi-3's partial rotary, and the expert
counts of mixture-of-experts models.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from tokenriver.errors import ModelLoadError

GEMMA_ARCHITECTURES = frozenset({"gemma2", "gemma3"})


def family_fields(architecture: str, raw: dict[str, Any], config_path: str) -> dict[str, Any]:
    """ModelConfig keyword arguments for `architecture` read from config.json (`raw`); {} for the Llama family."""
    if architecture in GEMMA_ARCHITECTURES:
        return _gemma(architecture, raw)
    if architecture == "qwen3":
        return {"qk_norm": True, "attention_bias": bool(raw.get("attention_bias", False))}
    if architecture == "phi3":
        return _phi3(raw, config_path)
    if architecture in ("qwen3_moe", "qwen2_moe", "mixtral"):
        return _moe(architecture, raw, config_path)
    return {}


# Mixtral's checkpoint names → the Qwen3-MoE names models/moe.py uses (transformers 5 renames them the same way).
_MIXTRAL_RENAMES = (
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),
    (re.compile(r"\.w1\.weight$"), ".gate_proj.weight"),
    (re.compile(r"\.w3\.weight$"), ".up_proj.weight"),
    (re.compile(r"\.w2\.weight$"), ".down_proj.weight"),
)


def rename_weights(architecture: str, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint parameter names → the model page's, where a family's checkpoints name them otherwise."""
    if architecture != "mixtral":
        return weights
    renamed = {}
    for name, tensor in weights.items():
        for pattern, replacement in _MIXTRAL_RENAMES:
            name = pattern.sub(replacement, name)
        renamed[name] = tensor
    return renamed


def hidden_act(architecture: str, raw: dict[str, Any]) -> str:
    """The MLP activation: Gemma's configs name it `hidden_activation` (gelu_pytorch_tanh), others `hidden_act`."""
    if architecture in GEMMA_ARCHITECTURES:
        return raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    return raw.get("hidden_act", "silu")


def _layer_types(architecture: str, raw: dict[str, Any]) -> tuple[str, ...]:
    """`layer_types` as written by transformers 5, or the pattern 4.x derived from the layer index."""
    if raw.get("layer_types"):
        return tuple(raw["layer_types"])
    num_layers = raw["num_hidden_layers"]
    # Gemma 2: even layers slide; Gemma 3: every sliding_window_pattern-th layer is global.
    pattern = 2 if architecture == "gemma2" else int(raw.get("sliding_window_pattern", 6))
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers))


def _gemma(architecture: str, raw: dict[str, Any]) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "hidden_act": hidden_act(architecture, raw),
        "query_pre_attn_scalar": float(raw.get("query_pre_attn_scalar") or raw.get("head_dim") or 256),
        "attn_logit_softcapping": raw.get("attn_logit_softcapping"),
        "final_logit_softcapping": raw.get("final_logit_softcapping"),
        "sliding_window": raw.get("sliding_window"),
        "layer_types": _layer_types(architecture, raw),
        "qk_norm": architecture == "gemma3",
        "attention_bias": bool(raw.get("attention_bias", False)),
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True)),
    }
    if fields["sliding_window"] is None:
        fields["layer_types"] = None
    rope = raw.get("rope_parameters")
    if isinstance(rope, dict) and "full_attention" in rope:
        # transformers 5: one rope_parameters dict per layer type.
        full, local = dict(rope["full_attention"]), dict(rope.get("sliding_attention") or rope["full_attention"])
        fields["rope_theta"] = float(full.pop("rope_theta", 10000.0))
        rope_type = full.pop("rope_type", full.pop("type", "default"))
        fields["rope_scaling"] = None if rope_type == "default" else {"rope_type": rope_type, **full}
        local_theta = float(local.get("rope_theta", fields["rope_theta"]))
    else:
        local_theta = float(raw.get("rope_local_base_freq", 10000.0)) if architecture == "gemma3" else None
    if architecture == "gemma3":
        fields["rope_local_base_freq"] = local_theta
    return fields


def _phi3(raw: dict[str, Any], config_path: str) -> dict[str, Any]:
    if raw.get("sliding_window") and raw["sliding_window"] < raw["max_position_embeddings"]:
        fields: dict[str, Any] = {
            "sliding_window": raw["sliding_window"],
            "layer_types": ("sliding_attention",) * raw["num_hidden_layers"],
        }
    else:
        fields = {}
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    # transformers 5 keeps partial_rotary_factor among the rope parameters, 4.x at the top level.
    fields["partial_rotary_factor"] = float(rope.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    if raw.get("attention_bias"):
        raise ModelLoadError(f"{config_path}: attention_bias=true is not supported for phi3", path=config_path)
    if rope.get("rope_type", rope.get("type")) == "longrope":
        fields["rope_scaling"] = _longrope(raw, rope)
    return fields


def _longrope(raw: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    """LongRoPE's factors, with the attention factor worked out as transformers does when the config omits it."""
    original = (
        rope.get("original_max_position_embeddings")
        or raw.get("original_max_position_embeddings")
        or raw["max_position_embeddings"]
    )
    factor = rope.get("factor") or raw["max_position_embeddings"] / original
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {
        "rope_type": "longrope",
        "short_factor": list(rope["short_factor"]),
        "long_factor": list(rope["long_factor"]),
        "original_max_position_embeddings": int(original),
        "attention_factor": float(attention_factor),
    }


def _moe(architecture: str, raw: dict[str, Any], config_path: str) -> dict[str, Any]:
    if raw.get("mlp_only_layers") or raw.get("decoder_sparse_step", 1) != 1:
        raise ModelLoadError(
            f"{config_path}: dense layers between the sparse ones (mlp_only_layers, "
            f"decoder_sparse_step) are not supported",
            path=config_path,
        )
    if architecture == "mixtral":
        return {
            "num_experts": raw["num_local_experts"],
            "num_experts_per_tok": raw["num_experts_per_tok"],
            "moe_intermediate_size": raw["intermediate_size"],
            "norm_topk_prob": True,
        }
    # transformers 5 writes num_local_experts, 4.x num_experts.
    num_experts = raw["num_experts"] if raw.get("num_experts") else raw["num_local_experts"]
    fields = {
        "num_experts": num_experts,
        "num_experts_per_tok": raw["num_experts_per_tok"],
        "moe_intermediate_size": raw["moe_intermediate_size"],
        "norm_topk_prob": bool(raw.get("norm_topk_prob", architecture == "qwen3_moe")),
    }
    if architecture == "qwen2_moe":
        # Qwen2's attention: a bias on q/k/v, no q/k norms; a gated shared expert beside the routed ones.
        return {
            **fields,
            "attention_bias": True,
            "shared_expert_intermediate_size": raw.get("shared_expert_intermediate_size") or 0,
        }
    return {**fields, "qk_norm": True, "attention_bias": bool(raw.get("attention_bias", False))}
