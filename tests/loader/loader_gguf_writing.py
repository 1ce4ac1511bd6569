"""Helpers for loader tests: write small llama-architecture GGUF files the way llama.cpp's converter does."""

from __future__ import annotations

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType

# Types gguf.quants can quantize; the others get random blocks (still valid input for dequantize).
QUANTIZABLE = {Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0}

TINY = dict(hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=256, vocab_size=32, context_length=128)


def llamacpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """What convert_hf_to_gguf.py does to attn_q/attn_k rows of llama models (interleave each head's halves)."""
    return (weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def encode(values: np.ndarray, qtype: gguf.GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """values [rows, cols] float32 → the bytes (or float array) a GGUF stores for that type."""
    if qtype == Q.F32:
        return values.astype(np.float32)
    if qtype == Q.F16:
        return values.astype(np.float16)
    if qtype in QUANTIZABLE:
        return gguf.quants.quantize(values, qtype)
    # No quantizer in gguf for this type: random blocks (their float16 scales may decode to inf or nan,
    # which the comparison treats as equal values).
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    return rng.integers(0, 256, size=(values.shape[0], values.shape[1] // block_size * type_size), dtype=np.uint8)


def stored_values(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """What gguf's own dequantization gives for the stored data, as float32 [rows, cols]."""
    return np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32)


def write_gguf(path: str, tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]], *,
               arch: str = "llama", num_layers: int = 1, extra: dict[str, object] | None = None,
               rng: np.random.Generator | None = None) -> dict[str, np.ndarray]:
    """Write a GGUF with TINY metadata and the given tensors (numpy [out, in] order, already llama.cpp-permuted).

    Returns each tensor's stored data as written (bytes for quantized types).
    """
    rng = rng or np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name("tiny test model")
    writer.add_block_count(num_layers)
    writer.add_context_length(TINY["context_length"])
    writer.add_embedding_length(TINY["hidden_size"])
    writer.add_feed_forward_length(TINY["intermediate_size"])
    writer.add_head_count(TINY["num_heads"])
    writer.add_head_count_kv(TINY["num_kv_heads"])
    writer.add_rope_dimension_count(TINY["hidden_size"] // TINY["num_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    for key, value in (extra or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_uint32(key, value)
    written = {}
    for name, (values, qtype) in tensors.items():
        data = encode(values, qtype, rng)
        written[name] = data
        if qtype in (Q.F32, Q.F16):
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def tiny_llama_tensors(types: list[gguf.GGMLQuantizationType], rng: np.random.Generator,
                       ) -> dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]]:
    """token_embd plus one block of 2-D weights per 7 types (and F32 norms), cycling through `types`.

    Weights are in Hugging Face row order; attn_q/attn_k get llama.cpp's permutation as the converter does.
    """
    hidden, ffn, vocab = TINY["hidden_size"], TINY["intermediate_size"], TINY["vocab_size"]
    kv = TINY["num_kv_heads"] * hidden // TINY["num_heads"]
    shapes = {"attn_q": (hidden, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden),
              "attn_output": (hidden, hidden), "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden),
              "ffn_down": (hidden, ffn)}
    types = list(types)
    tensors = {"token_embd.weight": (rng.standard_normal((vocab, hidden)).astype(np.float32), types.pop(0)),
               "output_norm.weight": (rng.standard_normal(hidden).astype(np.float32), Q.F32)}
    layer = 0
    while types:
        tensors[f"blk.{layer}.attn_norm.weight"] = (rng.standard_normal(hidden).astype(np.float32), Q.F32)
        tensors[f"blk.{layer}.ffn_norm.weight"] = (rng.standard_normal(hidden).astype(np.float32), Q.F32)
        for part, shape in shapes.items():
            qtype = types.pop(0) if types else Q.F32
            values = (rng.standard_normal(shape) * 0.1).astype(np.float32)
            if part == "attn_q":
                values = llamacpp_permute(values, TINY["num_heads"])
            elif part == "attn_k":
                values = llamacpp_permute(values, TINY["num_kv_heads"])
            tensors[f"blk.{layer}.{part}.weight"] = (values, qtype)
        layer += 1
    return tensors
