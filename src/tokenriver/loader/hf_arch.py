"""config.json settings of the families beyond Llama → the ModelConfig fields that switch their features on.

loader/safetensors.py reads what every decoder has (sizes, rope, norms); here each family adds its own keys, as
transformers 4.x and 5.x write them: Gemma's activation, score scale, soft-capping, sliding layers and per-layer-type
rope (5.x nests it in `rope_parameters` by layer type), Qwen3's q/k norms, Phi-3's partial rotary, the expert
counts of mixture-of-experts models, and the encoders' (BERT, nomic-bert, XLM-RoBERTa) LayerNorm epsilon, token
types, classification head and position offset. nomic's own config.json spells the sizes as GPT-2 does (`n_embd`,
...): `standard_keys` renames them first.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

import torch

from tokenriver.errors import ModelLoadError
from tokenriver.loader.embedding_files import sep_token_id
from tokenriver.models.config import ModelConfig

GEMMA_ARCHITECTURES = frozenset({"gemma2", "gemma3"})
ENCODER_ARCHITECTURES = frozenset({"bert", "nomic-bert", "xlm-roberta"})
# The MLP activations each encoder runs: BERT's exact or tanh-approximated GELU, nomic-bert's SwiGLU.
ENCODER_ACTIVATIONS = {
    "bert": ("gelu", "gelu_pytorch_tanh"),
    "xlm-roberta": ("gelu", "gelu_pytorch_tanh"),
    "nomic-bert": ("silu",),
}
# The weight-name prefix of the base model in a checkpoint with a classification head.
_ENCODER_PREFIXES = {"bert": "bert.", "xlm-roberta": "roberta."}
# nomic's own config.json names (GPT-2's) → transformers' names.
_NOMIC_KEYS = {
    "n_embd": "hidden_size",
    "n_head": "num_attention_heads",
    "n_layer": "num_hidden_layers",
    "n_inner": "intermediate_size",
    "n_positions": "max_position_embeddings",
    "layer_norm_epsilon": "layer_norm_eps",
}
# nomic-bert settings tokenriver runs only with these values (what nomic-embed-text uses), as nomic's code names them.
_NOMIC_REQUIRED = {
    "prenorm": False,
    "parallel_block": False,
    "rotary_emb_fraction": 1.0,
    "rotary_emb_interleaved": False,
    "rotary_emb_scale_base": None,
    "rotary_scaling_factor": None,
    "qkv_proj_bias": False,
    "mlp_fc1_bias": False,
    "mlp_fc2_bias": False,
}


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
    if architecture in ENCODER_ARCHITECTURES:
        return _encoder(architecture, raw, config_path)
    return {}


def standard_keys(architecture: str, raw: dict[str, Any]) -> dict[str, Any]:
    """config.json with transformers' key names added where a family's own code wrote others (nomic's GPT-2
    names); keys transformers already wrote win."""
    if architecture != "nomic-bert":
        return raw
    return {**{new: raw[old] for old, new in _NOMIC_KEYS.items() if old in raw}, **raw}


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


def encoder_weights(config: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An encoder checkpoint's weights under the names of its page (models/bert.py, models/nomic_bert.py).

    A bare BertModel / XLMRobertaModel checkpoint names its weights without the base model's prefix: it is added.
    Left out: the pooler where no classification head reads it, pre-training heads (`cls.*`: masked LM, next
    sentence), and position-id buffers some checkpoints store. Old checkpoints' LayerNorm.gamma / .beta are its
    weight and bias.
    """
    if config.architecture not in ENCODER_ARCHITECTURES:
        return weights
    prefix = _ENCODER_PREFIXES.get(config.architecture, "")
    keeps_pooler = config.architecture == "bert" and config.num_labels > 0
    renamed = {}
    for name, tensor in weights.items():
        if name.endswith(".gamma"):
            name = name.removesuffix(".gamma") + ".weight"
        elif name.endswith(".beta"):
            name = name.removesuffix(".beta") + ".bias"
        if prefix and not name.startswith((prefix, "classifier.")):
            name = prefix + name
        is_pooler = name.startswith(f"{prefix}pooler.")
        if (
            name.startswith(("cls.", f"{prefix}cls."))
            or name.endswith("position_ids")
            or (is_pooler and not keeps_pooler)
        ):
            continue
        renamed[name] = tensor
    return renamed


def hidden_act(architecture: str, raw: dict[str, Any]) -> str:
    """The MLP activation: Gemma's configs name it `hidden_activation` (gelu_pytorch_tanh), others `hidden_act`;
    BERT's "gelu_new" is the tanh approximation under another name; nomic's code calls SiLU's GLU "swiglu"."""
    if architecture in GEMMA_ARCHITECTURES:
        return raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if architecture == "nomic-bert" and "activation_function" in raw:
        return "silu" if raw["activation_function"] == "swiglu" else str(raw["activation_function"])
    if architecture == "nomic-bert":
        return raw.get("hidden_act", "silu")
    if architecture in ENCODER_ARCHITECTURES:
        activation = raw.get("hidden_act", "gelu")
        return "gelu_pytorch_tanh" if activation == "gelu_new" else activation
    return raw.get("hidden_act", "silu")


def supported_activations(architecture: str) -> tuple[str, ...]:
    """The MLP activations the architecture's page runs."""
    return ENCODER_ACTIVATIONS.get(architecture, ("silu", "gelu_pytorch_tanh"))


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


def _encoder(architecture: str, raw: dict[str, Any], config_path: str) -> dict[str, Any]:
    """BERT, nomic-bert, XLM-RoBERTa: bidirectional, no output projection; a head where the class has one."""
    names = raw.get("architectures") or []
    has_head = bool(names) and str(names[0]).endswith("ForSequenceClassification")
    fields: dict[str, Any] = {
        "is_causal": False,
        "tie_word_embeddings": False,
        # transformers writes one id2label entry per output; without one its default is 2 labels.
        "num_labels": (len(raw.get("id2label") or {}) or int(raw.get("num_labels", 2))) if has_head else 0,
        "type_vocab_size": int(raw.get("type_vocab_size", 2)),
        "layer_norm_eps": float(raw.get("layer_norm_eps", 1e-12)),
        # RoBERTa's tokenizer gives no token types: every token is type 0, so XLM-RoBERTa derives none.
        "sep_token_id": None if architecture == "xlm-roberta" else sep_token_id(os.path.dirname(config_path), raw),
    }
    if architecture != "nomic-bert" and raw.get("position_embedding_type", "absolute") != "absolute":
        raise ModelLoadError(
            f"{config_path}: position_embedding_type={raw['position_embedding_type']!r} is not supported "
            f"(tokenriver runs BERT's absolute position embeddings)",
            path=config_path,
        )
    if architecture == "xlm-roberta":
        # Positions count from padding_idx + 1, so the table's first rows are never used: the context is shorter.
        offset = int(raw.get("pad_token_id", 1)) + 1
        fields.update(position_offset=offset, max_position_embeddings=raw["max_position_embeddings"] - offset)
    if architecture == "nomic-bert":
        unsupported = [f"{key}={raw[key]!r}" for key, value in _NOMIC_REQUIRED.items() if raw.get(key, value) != value]
        if unsupported:
            raise ModelLoadError(
                f"{config_path}: {', '.join(unsupported)} is not supported (tokenriver runs nomic-embed-text's "
                f"nomic-bert: post-LN, whole-head non-interleaved rotary, no biases)",
                path=config_path,
            )
        rope = raw.get("rope_parameters") or {}
        fields["rope_theta"] = float(rope.get("rope_theta", raw.get("rope_theta", raw.get("rotary_emb_base", 1000.0))))
    return fields
