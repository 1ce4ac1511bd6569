"""What differs between GGUF architectures: tensor names, metadata keys, stored conventions.

loader/gguf.py reads every file the same way; this module says, per `general.architecture`, how llama.cpp's
converter named and stored what the Llama family does not have:
- Gemma 2/3: four norms per block (`post_attention_norm`, `ffn_norm` is the pre-feed-forward one, `post_ffw_norm`),
  q/k norms (Gemma 3), norm weights stored as 1 + w (the converter folds Gemma's (1 + weight) in; Hugging Face
  checkpoints, and models/gemma.py, keep w), soft-capping keys (Gemma 2), sliding layers whose pattern llama.cpp
  fixes per architecture (every 2nd layer global in Gemma 2, every 6th in Gemma 3), Gemma 3's local rope base;
- Qwen3 and Qwen3-MoE: per-head q/k norms;
- Phi-3: q/k/v and gate/up stored fused (`attn_qkv`, `ffn_up` with both halves), LongRoPE factor tensors;
- mixture-of-experts (Qwen3-MoE; Mixtral, which llama.cpp writes as "llama" with an expert count): the router
  (`ffn_gate_inp`) and each layer's experts stacked in one tensor per projection (`ffn_gate_exps` [n_expert, ...]),
  split here into Hugging Face's per-expert names;
- the encoders, BERT (also XLM-RoBERTa, which llama.cpp converts as "bert" with its position table cut to the rows
  used) and nomic-bert: every tensor has a name of its own (`ENCODER_NAMES`, `ENCODER_LAYER_NAMES`), LayerNorms
  have biases, and the classification head of a reranker is `cls` (dense, then tanh) and `cls.output`. What a file
  asks to pool its tokens with is `<arch>.pooling_type`, for every architecture (`POOLING_TYPES`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

_GEMMA_NORMS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_EXPERTS = {"ffn_gate_inp": "mlp.gate"}

# llama.cpp layer tensor → Hugging Face module, where an architecture differs from the Llama table in gguf.py.
LAYER_NAMES: dict[str, dict[str, str]] = {
    "gemma2": _GEMMA_NORMS,
    "gemma3": {**_GEMMA_NORMS, **_QK_NORMS},
    "qwen3": _QK_NORMS,
    "qwen3moe": {**_QK_NORMS, **_EXPERTS},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "qwen2moe": {
        **_EXPERTS,
        "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
        "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
        "ffn_up_shexp": "mlp.shared_expert.up_proj",
        "ffn_down_shexp": "mlp.shared_expert.down_proj",
    },
    "llama": _EXPERTS,
}

# Encoders: llama.cpp tensor → Hugging Face parameter, for the tensors outside the layers...
ENCODER_NAMES: dict[str, dict[str, str]] = {
    "bert": {
        "token_embd.weight": "bert.embeddings.word_embeddings.weight",
        "position_embd.weight": "bert.embeddings.position_embeddings.weight",
        "token_types.weight": "bert.embeddings.token_type_embeddings.weight",
        "token_embd_norm.weight": "bert.embeddings.LayerNorm.weight",
        "token_embd_norm.bias": "bert.embeddings.LayerNorm.bias",
        # A reranker's head: BERT's pooler and classifier, XLM-RoBERTa's classifier.dense and out_proj (the same
        # arithmetic: out(tanh(dense(x))) of the first token).
        "cls.weight": "bert.pooler.dense.weight",
        "cls.bias": "bert.pooler.dense.bias",
        "cls.output.weight": "classifier.weight",
        "cls.output.bias": "classifier.bias",
    },
    "nomic-bert": {
        "token_embd.weight": "embeddings.word_embeddings.weight",
        "token_types.weight": "embeddings.token_type_embeddings.weight",
        "token_embd_norm.weight": "emb_ln.weight",
        "token_embd_norm.bias": "emb_ln.bias",
    },
}
# ...and inside layer i: the layer's prefix, and llama.cpp's part → the Hugging Face module under it.
ENCODER_LAYER_PREFIXES = {"bert": "bert.encoder.layer", "nomic-bert": "encoder.layers"}
ENCODER_LAYER_NAMES: dict[str, dict[str, str]] = {
    "bert": {
        "attn_q": "attention.self.query",
        "attn_k": "attention.self.key",
        "attn_v": "attention.self.value",
        "attn_qkv": "attention.self.qkv_proj",
        "attn_output": "attention.output.dense",
        "attn_output_norm": "attention.output.LayerNorm",
        "ffn_up": "intermediate.dense",
        "ffn_down": "output.dense",
        "layer_output_norm": "output.LayerNorm",
    },
    "nomic-bert": {
        "attn_qkv": "attn.Wqkv",
        "attn_output": "attn.out_proj",
        "attn_output_norm": "norm1",
        "ffn_gate": "mlp.fc12",
        "ffn_up": "mlp.fc11",
        "ffn_down": "mlp.fc2",
        "layer_output_norm": "norm2",
    },
}
# llama.cpp's pooling types (`<arch>.pooling_type`) → ModelConfig.pooling. RANK (4) is a reranker's: its score
# reads the first token, so that is what it pools.
POOLING_TYPES: dict[int, str | None] = {0: None, 1: "mean", 2: "cls", 3: "last", 4: "cls"}

# Stacked expert tensors → the per-expert Hugging Face module ("{e}": the expert index).
STACKED_EXPERTS = {
    "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj",
}

# Tensors folded into the config, not weights.
CONFIG_TENSORS = frozenset({"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"})

# GGUF architecture → the registry's key (models/registry.py), where they differ.
_ARCHITECTURE_KEYS = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe"}

# Layers of the 27B models, whose query scale llama.cpp takes from hidden_size / heads instead of head_dim.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}

_STACKED = re.compile(r"blk\.(\d+)\.(ffn_(?:gate|up|down)_exps)\.weight")
_ENCODER_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def architecture_key(gguf_arch: str, fields: dict[str, Any]) -> str:
    """The registry name of a file's architecture: Mixtral is a "llama" file with experts."""
    if gguf_arch == "llama" and fields.get("llama.expert_count"):
        return "mixtral"
    return _ARCHITECTURE_KEYS.get(gguf_arch, gguf_arch)


def config_fields(gguf_arch: str, get: Callable[..., Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields beyond the Llama family's, from `{arch}.*` metadata (`get(key, default)`)."""
    fields: dict[str, Any] = {}
    num_layers = get("block_count")
    if gguf_arch in ("gemma2", "gemma3"):
        hidden_size, num_heads = get("embedding_length"), get("attention.head_count")
        head_dim = get("attention.key_length", hidden_size // num_heads)
        big = num_layers == _GEMMA_27B_LAYERS[gguf_arch]
        pattern = 2 if gguf_arch == "gemma2" else 6
        fields.update(
            hidden_act="gelu_pytorch_tanh",
            query_pre_attn_scalar=float(hidden_size // num_heads if big else head_dim),
            attn_logit_softcapping=get("attn_logit_softcapping", 0.0) or None,
            final_logit_softcapping=get("final_logit_softcapping", 0.0) or None,
            sliding_window=get("attention.sliding_window", 0) or None,
            qk_norm=gguf_arch == "gemma3",
        )
        if fields["sliding_window"]:
            fields["layer_types"] = _layer_types(get("attention.sliding_window_pattern", pattern), num_layers)
        if gguf_arch == "gemma3":
            # Newer converters write the sliding layers' base; llama.cpp's default is 10000.
            fields["rope_local_base_freq"] = float(get("rope.freq_base_swa", 10000.0))
    elif gguf_arch in ("qwen3", "qwen3moe"):
        fields["qk_norm"] = True
    elif gguf_arch in ENCODER_NAMES:
        fields.update(
            is_causal=False,
            tie_word_embeddings=False,
            layer_norm_eps=get("attention.layer_norm_epsilon"),
            hidden_act="gelu" if gguf_arch == "bert" else "silu",
            type_vocab_size=int(tensors["token_types.weight"].shape[1]) if "token_types.weight" in tensors else 0,
            num_labels=int(tensors["cls.output.weight"].shape[1]) if "cls.output.weight" in tensors else 0,
        )
    if gguf_arch == "phi3":
        window = get("attention.sliding_window", 0)
        if window and window < get("context_length"):
            fields.update(sliding_window=window, layer_types=("sliding_attention",) * num_layers)
    expert_count = get("expert_count", 0)
    if expert_count:
        fields.update(
            num_experts=expert_count,
            num_experts_per_tok=get("expert_used_count"),
            moe_intermediate_size=get("expert_feed_forward_length", 0) or get("feed_forward_length"),
            # llama.cpp renormalizes the top-k weights of every MoE here but Qwen2-MoE's.
            norm_topk_prob=bool(get("expert_weights_norm", gguf_arch != "qwen2moe")),
            shared_expert_intermediate_size=get("expert_shared_feed_forward_length", 0),
        )
    return fields


def _layer_types(pattern: int | list[bool], num_layers: int) -> tuple[str, ...]:
    """llama.cpp's sliding-window pattern: a period n (every n-th layer global), or one flag per layer (true:
    sliding)."""
    if isinstance(pattern, list):
        return tuple("sliding_attention" if flag else "full_attention" for flag in pattern)
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers))


def encoder_name(gguf_arch: str, name: str) -> str | None:
    """The Hugging Face parameter of an encoder's tensor `name` (e.g. "blk.3.attn_output_norm.bias"), or None."""
    if name in ENCODER_NAMES[gguf_arch]:
        return ENCODER_NAMES[gguf_arch][name]
    match = _ENCODER_LAYER_TENSOR.fullmatch(name)
    module = None if match is None else ENCODER_LAYER_NAMES[gguf_arch].get(match.group(2))
    if match is None or module is None:
        return None
    return f"{ENCODER_LAYER_PREFIXES[gguf_arch]}.{match.group(1)}.{module}.{match.group(3)}"


def layer_name(gguf_arch: str, part: str) -> str | None:
    """The Hugging Face module of layer tensor `part` (e.g. "post_ffw_norm") in this architecture, or None."""
    return LAYER_NAMES.get(gguf_arch, {}).get(part)


def stacked_experts(name: str) -> tuple[int, str] | None:
    """(layer, per-expert module template) for a stacked expert tensor's name, else None."""
    match = _STACKED.fullmatch(name)
    if match is None:
        return None
    return int(match.group(1)), STACKED_EXPERTS[match.group(2)]


def as_hf_shape(name: str, weights: torch.Tensor) -> torch.Tensor:
    """Qwen2-MoE's shared-expert gate is stored as a vector [hidden]; Hugging Face's is a [1, hidden] matrix."""
    if name.endswith("shared_expert_gate.weight") and weights.dim() == 1:
        return weights[None, :]
    return weights


def hf_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape as_hf_shape gives a tensor of this name and (Hugging Face order) shape."""
    return (1, *shape) if name.endswith("shared_expert_gate.weight") and len(shape) == 1 else shape


def stores_norm_plus_one(gguf_arch: str, name: str) -> bool:
    """Whether this tensor is a Gemma norm weight that the converter stored as 1 + w."""
    return gguf_arch in ("gemma2", "gemma3") and name.endswith("norm.weight")


# Gemma's chat template as the instruction-tuned checkpoints ship it (tokenizer_config.json), for files converted
# without one: llama.cpp likewise falls back to a built-in Gemma template. A system message becomes the prefix of
# the first user turn; the assistant's role is "model"; every turn ends with <end_of_turn>, which ends generation.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    '    {%- set first_user_prefix = "" -%}\n'
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}\n'
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    '        {%- set role = "model" -%}\n'
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    '        {{ raise_exception("Invalid content type") }}\n'
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n"
)


def default_chat_template(gguf_arch: str) -> str | None:
    """The template to use when a file of this architecture carries none."""
    return GEMMA_CHAT_TEMPLATE if gguf_arch in ("gemma2", "gemma3") else None
