"""Helpers for loader tests: write small llama-architecture GGUF files the way llama.cpp's converter does."""

from __future__ import annotations

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType

# Types gguf.quants can quantize; ENCODERS below encode more, RANDOM_CODED get random codes with sane scales,
# and the rest random blocks (still valid input for dequantize).
QUANTIZABLE = {Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0}

TINY = dict(hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=256, vocab_size=32, context_length=128)


def llamacpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """What convert_hf_to_gguf.py does to attn_q/attn_k rows of llama models (interleave each head's halves)."""
    return (
        weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def encode(values: np.ndarray, qtype: gguf.GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """values [rows, cols] float32 → the bytes (or float array) a GGUF stores for that type."""
    if qtype == Q.F32:
        return values.astype(np.float32)
    if qtype == Q.F16:
        return values.astype(np.float16)
    if qtype in QUANTIZABLE:
        return gguf.quants.quantize(values, qtype)
    if qtype in ENCODERS:
        return ENCODERS[qtype](values)
    if qtype in RANDOM_CODED:
        return random_codes(values.shape[0], values.shape[1], qtype, rng)
    # No quantizer in gguf for this type: random blocks (their float16 scales may decode to inf or nan,
    # which the comparison treats as equal values).
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    return rng.integers(0, 256, size=(values.shape[0], values.shape[1] // block_size * type_size), dtype=np.uint8)


def stored_values(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """What gguf's own dequantization gives for the stored data, as float32 [rows, cols]."""
    return np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32)


def write_gguf(
    path: str,
    tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]],
    *,
    arch: str = "llama",
    num_layers: int = 1,
    extra: dict[str, object] | None = None,
    rng: np.random.Generator | None = None,
) -> dict[str, np.ndarray]:
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


def tiny_llama_tensors(
    types: list[gguf.GGMLQuantizationType],
    rng: np.random.Generator,
) -> dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]]:
    """token_embd plus one block of 2-D weights per 7 types (and F32 norms), cycling through `types`.

    Weights are in Hugging Face row order; attn_q/attn_k get llama.cpp's permutation as the converter does.
    """
    hidden, ffn, vocab = TINY["hidden_size"], TINY["intermediate_size"], TINY["vocab_size"]
    kv = TINY["num_kv_heads"] * hidden // TINY["num_heads"]
    shapes = {
        "attn_q": (hidden, hidden),
        "attn_k": (kv, hidden),
        "attn_v": (kv, hidden),
        "attn_output": (hidden, hidden),
        "ffn_gate": (ffn, hidden),
        "ffn_up": (ffn, hidden),
        "ffn_down": (hidden, ffn),
    }
    types = list(types)
    tensors = {
        "token_embd.weight": (rng.standard_normal((vocab, hidden)).astype(np.float32), types.pop(0)),
        "output_norm.weight": (rng.standard_normal(hidden).astype(np.float32), Q.F32),
    }
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


# --- Encoders for the types gguf.quants cannot quantize -----------------------------------------------------------
# Each returns the bytes [rows, blocks * block_bytes] a GGUF stores; tests check them against gguf's dequantizer.

IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    """float [..., 1] → its float16 bytes [..., 2]."""
    return np.ascontiguousarray(values.astype(np.float16)).view(np.uint8)


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """[..., 32] codes 0..15 → [..., 16] bytes, value j in the low nibble and j + 16 in the high one."""
    return (codes[..., :16] | (codes[..., 16:] << 4)).astype(np.uint8)


def encode_q4_k(values: np.ndarray) -> np.ndarray:
    """Q4_K: per 32, an asymmetric 4-bit grid; its scale and min as 6-bit multiples of two per-256 float16s."""
    rows = values.shape[0]
    sub = values.reshape(rows, -1, 8, 32).astype(np.float32)  # [N, B, 8, 32]
    low = np.minimum(sub.min(axis=-1), 0)  # [N, B, 8]
    step = (sub.max(axis=-1) - low) / 15
    d = (step.max(axis=-1, keepdims=True) / 63).astype(np.float16).astype(np.float32)  # [N, B, 1]
    dmin = (-low.min(axis=-1, keepdims=True) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(step / np.where(d > 0, d, 1)), 1, 63).astype(np.uint8)  # [N, B, 8]
    mn = np.clip(np.round(-low / np.where(dmin > 0, dmin, 1)), 0, 63).astype(np.uint8)
    scale = (d * sc)[..., None]
    codes = np.clip(np.round((sub + (dmin * mn)[..., None]) / scale), 0, 15).astype(np.uint8)  # [N, B, 8, 32]
    packed = np.empty(sc.shape[:-1] + (12,), dtype=np.uint8)
    packed[..., 0:4] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    packed[..., 4:8] = (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    pairs = codes.reshape(rows, -1, 4, 2, 32)  # [N, B, chunk, (low, high), 32]
    qs = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(rows, -1, 128)
    blocks = np.concatenate((_f16_bytes(d), _f16_bytes(dmin), packed, qs), axis=-1)  # [N, B, 144]
    return blocks.reshape(rows, -1)


def encode_iq4_nl(values: np.ndarray) -> np.ndarray:
    """IQ4_NL: per 32, the nearest of 16 fixed values times a float16 scale."""
    rows = values.shape[0]
    blocks = values.reshape(rows, -1, 32).astype(np.float32)
    d = (np.abs(blocks).max(axis=-1, keepdims=True) / 127).astype(np.float16).astype(np.float32)  # [N, B, 1]
    codes = np.abs(blocks[..., None] / np.where(d > 0, d, 1)[..., None] - IQ4_VALUES).argmin(axis=-1)
    return np.concatenate((_f16_bytes(d), _pack_nibbles(codes.astype(np.uint8))), axis=-1).reshape(rows, -1)


def encode_iq4_xs(values: np.ndarray) -> np.ndarray:
    """IQ4_XS: IQ4_NL's values per 32 with a 6-bit signed sub-scale of one float16 per 256."""
    rows = values.shape[0]
    sub = values.reshape(rows, -1, 8, 32).astype(np.float32)
    want = np.abs(sub).max(axis=-1) / 127  # [N, B, 8]
    d = (want.max(axis=-1, keepdims=True) / 31).astype(np.float16).astype(np.float32)  # [N, B, 1]
    ls = np.clip(np.round(want / np.where(d > 0, d, 1)), 1, 31).astype(np.int64) + 32  # [N, B, 8]
    scale = (d * (ls - 32))[..., None]  # [N, B, 8, 1]
    codes = np.abs(sub[..., None] / scale[..., None] - IQ4_VALUES).argmin(axis=-1).astype(np.uint8)
    high = ((ls >> 4) & 3).astype(np.uint16)
    scales_h = (high << (2 * np.arange(8, dtype=np.uint16))).sum(axis=-1, dtype=np.uint16)[..., None]  # [N, B, 1]
    low = (ls & 15).astype(np.uint8)
    scales_l = low[..., 0::2] | (low[..., 1::2] << 4)  # [N, B, 4]
    blocks = np.concatenate(
        (
            _f16_bytes(d),
            np.ascontiguousarray(scales_h).view(np.uint8),
            scales_l,
            _pack_nibbles(codes).reshape(rows, -1, 128),
        ),
        axis=-1,
    )  # [N, B, 136]
    return blocks.reshape(rows, -1)


# Byte offsets of the float16 factors of types encoded as random codes below, and a factor that keeps the
# weights around 0.1 (the largest code times the largest sub-scale, inverted).
_SCALE_OFFSETS = {
    Q.Q2_K: ((80, 82), 0.1 / 45),
    Q.Q3_K: ((108,), 0.1 / 128),
    Q.Q5_K: ((0, 2), 0.1 / 1953),
    Q.Q6_K: ((208,), 0.1 / 4096),
    Q.IQ2_XXS: ((0,), 0.1 / 150),
    Q.IQ2_XS: ((0,), 0.1 / 150),
    Q.IQ2_S: ((0,), 0.1 / 150),
    Q.IQ3_XXS: ((0,), 0.1 / 500),
    Q.IQ3_S: ((0,), 0.1 / 480),
    Q.IQ1_S: ((0,), 0.1 / 15),
}
RANDOM_CODED = frozenset(_SCALE_OFFSETS)


def random_codes(rows: int, cols: int, qtype: gguf.GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """Valid blocks of `qtype` with random codes and small positive float16 factors (weights of ~0.1)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)
    offsets, magnitude = _SCALE_OFFSETS[qtype]
    for offset in offsets:
        factor = rng.uniform(0.5, 1.0, size=blocks.shape[:2] + (1,)) * magnitude
        blocks[:, :, offset : offset + 2] = _f16_bytes(factor)
    return blocks.reshape(rows, -1)


ENCODERS = {Q.Q4_K: encode_q4_k, Q.IQ4_NL: encode_iq4_nl, Q.IQ4_XS: encode_iq4_xs}
