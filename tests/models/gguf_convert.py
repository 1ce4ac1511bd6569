"""Write a tiny Hugging Face model as a GGUF file the way llama.cpp's convert_hf_to_gguf.py does, for the GGUF tests
of the newer architectures: its tensor names, its metadata keys, Gemma's norms stored as 1 + w, Llama-architecture
(Mixtral) q/k rows permuted for interleaved rope, experts stacked into one tensor per projection.
"""

from __future__ import annotations

import os
import re

import gguf
import numpy as np
from safetensors.torch import load_file

Q = gguf.GGMLQuantizationType

_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}
_GEMMA_LAYER = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_EXPERT_PARTS = {
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
    "w1": "ffn_gate_exps",
    "w3": "ffn_up_exps",
    "w2": "ffn_down_exps",
}


def _permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's q/k row order for llama-architecture files (each head's halves interleaved)."""
    return (
        weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


# A SentencePiece-style ("llama") vocabulary of Gemma's shape: its specials at Gemma's ids (pad 0, eos 1, bos 2,
# unk 3), the turn markers, byte fallback tokens, a few pieces.
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
GEMMA_PIECES = ["▁", "\n", "H", "i", "▁Hi", "user", "model", "B", "e", "▁b", "r", "f", "."]


def gemma_vocabulary(writer: gguf.GGUFWriter) -> None:
    """Write GEMMA_SPECIALS, the 256 byte tokens and GEMMA_PIECES as the file's tokenizer (no chat template)."""
    tokens = GEMMA_SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + GEMMA_PIECES
    types = [3] * len(GEMMA_SPECIALS) + [6] * 256 + [1] * len(GEMMA_PIECES)  # control, byte, normal
    scores = [0.0] * (len(GEMMA_SPECIALS) + 256) + [-float(i) for i in range(len(GEMMA_PIECES))]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_pad_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_bos_token_id(2)
    writer.add_unk_token_id(3)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)


def write_gguf(
    folder: str, arch: str, path: str, expert_type: gguf.GGMLQuantizationType = Q.F32, with_vocabulary: bool = False
) -> None:
    """The saved Hugging Face folder (config.json + model.safetensors) → a GGUF file of architecture `arch`
    (with_vocabulary: Gemma's tokenizer layout, gemma_vocabulary)."""
    import json

    config = json.loads(open(os.path.join(folder, "config.json")).read())
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rope = config.get("rope_parameters") or {}
    if "full_attention" in rope:
        full, local = rope["full_attention"], rope["sliding_attention"]
    else:
        full, local = rope, None
    rotary_dim = int(head_dim * full.get("partial_rotary_factor", 1.0))
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name("tiny test model")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(rotary_dim)
    writer.add_rope_freq_base(float(full.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if full.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
    if config.get("sliding_window"):
        writer.add_sliding_window(config["sliding_window"])
    if arch.startswith("gemma"):
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in config["layer_types"]])
        if local is not None:
            writer.add_rope_freq_base_swa(float(local["rope_theta"]))
        if config.get("attn_logit_softcapping"):
            writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
            writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if config.get("num_local_experts") or config.get("num_experts"):
        writer.add_expert_count(config.get("num_local_experts") or config["num_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if config.get("moe_intermediate_size"):
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    if full.get("rope_type") == "longrope":
        writer.add_rope_scaling_orig_ctx_len(config["original_max_position_embeddings"])
        writer.add_float32(f"{arch}.rope.scaling.attn_factor", _longrope_attention_factor(config))
        writer.add_tensor("rope_factors_long.weight", np.array(full["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(full["short_factor"], dtype=np.float32))
    if with_vocabulary:
        gemma_vocabulary(writer)
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, tensor in tensors.items():
        values = tensor.float().numpy()
        match = _EXPERT.fullmatch(name)
        if match:
            layer, expert, part = match.groups()
            experts.setdefault((int(layer), _EXPERT_PARTS[part]), {})[int(expert)] = values
            continue
        gguf_name = _gguf_name(name, arch)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            values = values + 1.0
        if gguf_name.endswith("ffn_gate_inp_shexp.weight"):
            values = values.reshape(-1)  # llama.cpp stores the shared expert's gate as a vector
        if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config["num_attention_heads"] if "attn_q" in gguf_name else config["num_key_value_heads"]
            values = _permute(values, heads)
        writer.add_tensor(gguf_name, np.ascontiguousarray(values, dtype=np.float32))
    for (layer, part), by_expert in sorted(experts.items()):
        stacked = np.stack([by_expert[e] for e in sorted(by_expert)])  # [n_expert, out, in]
        if expert_type == Q.F32:
            writer.add_tensor(f"blk.{layer}.{part}.weight", np.ascontiguousarray(stacked))
        else:
            writer.add_tensor(
                f"blk.{layer}.{part}.weight", gguf.quants.quantize(stacked, expert_type), raw_dtype=expert_type
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_name(name: str, arch: str) -> str:
    globals_ = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if name in globals_:
        return globals_[name]
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
    assert match, name
    layer, module, kind = match.groups()
    table = {**_LAYER, **_GEMMA_LAYER} if arch.startswith("gemma") else _LAYER
    return f"blk.{layer}.{table[module]}.{kind}"


def _longrope_attention_factor(config: dict) -> float:
    import math

    factor = config["max_position_embeddings"] / config["original_max_position_embeddings"]
    return math.sqrt(1 + math.log(factor) / math.log(config["original_max_position_embeddings"]))
