"""read_gguf against gguf's own dequantization, llama.cpp's q/k permutation and transformers' GGUF loader."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from loader_gguf_writing import TINY, llamacpp_permute, stored_values, tiny_llama_tensors, write_gguf

from tokenriver.loader import gguf as gguf_module
from tokenriver.loader.gguf import SUPPORTED_TYPES, read_gguf

Q = gguf.GGMLQuantizationType
HEAD_DIM = TINY["hidden_size"] // TINY["num_heads"]


def hf_row_order(stored: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's permutation, written with explicit indices: HF row t*d/2 + i of a head
    is stored at row 2i + t."""
    rows_per_head = stored.shape[0] // num_heads
    half = rows_per_head // 2
    order = [head * rows_per_head + 2 * i + t for head in range(num_heads) for t in range(2) for i in range(half)]
    return stored[order]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # random blocks may hold nan/inf scales
def test_every_supported_type_loads_as_ggufs_dequantization(tmp_path):
    rng = np.random.default_rng(1)
    types = sorted(SUPPORTED_TYPES, key=lambda t: t.value)
    tensors = tiny_llama_tensors(types, rng)
    path = str(tmp_path / "all_types.gguf")
    num_layers = len([name for name in tensors if name.endswith("attn_q.weight")])
    written = write_gguf(path, tensors, num_layers=num_layers, rng=rng)
    checkpoint = read_gguf(path)

    seen_types = set()
    for name, (values, qtype) in tensors.items():
        seen_types.add(qtype)
        expected = stored_values(written[name], qtype).reshape(values.shape)
        if ".attn_q." in name:
            expected = hf_row_order(expected, TINY["num_heads"])
        elif ".attn_k." in name:
            expected = hf_row_order(expected, TINY["num_kv_heads"])
        hf_name = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}.get(
            name,
            name.replace("blk.", "model.layers.")
            .replace("attn_norm", "input_layernorm")
            .replace("ffn_norm", "post_attention_layernorm")
            .replace("attn_q", "self_attn.q_proj")
            .replace("attn_k", "self_attn.k_proj")
            .replace("attn_v", "self_attn.v_proj")
            .replace("attn_output", "self_attn.o_proj")
            .replace("ffn_gate", "mlp.gate_proj")
            .replace("ffn_up", "mlp.up_proj")
            .replace("ffn_down", "mlp.down_proj"),
        )
        got = checkpoint.weights[hf_name]
        assert got.dtype == torch.float32 and tuple(got.shape) == values.shape, name
        np.testing.assert_array_equal(got.numpy(), expected, err_msg=f"{name} ({qtype.name})")
    assert seen_types >= set(SUPPORTED_TYPES)
    assert len(checkpoint.weights) == len(tensors)


def test_quantized_weights_stay_close_to_the_originals(tmp_path):
    """Round trip through gguf.quants.quantize: each type's error is within its precision."""
    rng = np.random.default_rng(2)
    tolerances = {Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 1e-2, Q.Q5_0: 0.05, Q.Q5_1: 0.05, Q.Q4_0: 0.1, Q.Q4_1: 0.1}
    types = list(tolerances)
    tensors = tiny_llama_tensors(types, rng)
    path = str(tmp_path / "roundtrip.gguf")
    write_gguf(path, tensors, num_layers=1, rng=rng)
    weights = read_gguf(path).weights
    names = ["model.embed_tokens.weight"] + [
        f"model.layers.0.{part}.weight"
        for part in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
        )
    ]
    gguf_names = ["token_embd.weight"] + [
        f"blk.0.{p}.weight" for p in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up")
    ]
    for qtype, name, gguf_name in zip(types, names, gguf_names):
        original = tensors[gguf_name][0]
        if "attn_q" in gguf_name:
            original = hf_row_order(original, TINY["num_heads"])
        elif "attn_k" in gguf_name:
            original = hf_row_order(original, TINY["num_kv_heads"])
        error = np.abs(weights[name].numpy() - original).max() / np.abs(original).max()
        assert error < tolerances[qtype], f"{qtype.name}: relative error {error:.3g}"


def test_qk_rows_are_put_back_in_hugging_face_order(tmp_path):
    """Applying llama.cpp's permutation to what we load gives back exactly what the file stores."""
    rng = np.random.default_rng(3)
    tensors = tiny_llama_tensors([Q.F32] * 8, rng)
    path = str(tmp_path / "f32.gguf")
    write_gguf(path, tensors, rng=rng)
    weights = read_gguf(path).weights
    q = weights["model.layers.0.self_attn.q_proj.weight"].numpy()
    k = weights["model.layers.0.self_attn.k_proj.weight"].numpy()
    np.testing.assert_array_equal(llamacpp_permute(q, TINY["num_heads"]), tensors["blk.0.attn_q.weight"][0])
    np.testing.assert_array_equal(llamacpp_permute(k, TINY["num_kv_heads"]), tensors["blk.0.attn_k.weight"][0])
    np.testing.assert_array_equal(
        weights["model.layers.0.self_attn.v_proj.weight"].numpy(), tensors["blk.0.attn_v.weight"][0]
    )


def test_metadata_maps_onto_model_config(tmp_path):
    rng = np.random.default_rng(4)
    tensors = tiny_llama_tensors([Q.F32] * 8, rng)
    path = str(tmp_path / "config.gguf")
    write_gguf(path, tensors, rng=rng)
    config = read_gguf(path).config
    assert (config.architecture, config.vocab_size, config.hidden_size, config.intermediate_size) == (
        "llama",
        TINY["vocab_size"],
        TINY["hidden_size"],
        TINY["intermediate_size"],
    )
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        1,
        TINY["num_heads"],
        TINY["num_kv_heads"],
        HEAD_DIM,
    )
    assert config.rope_theta == 10000.0 and config.rope_scaling is None
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert config.max_position_embeddings == TINY["context_length"]
    assert config.tie_word_embeddings and not config.attention_bias
    assert config.name == "tiny test model"


def test_separate_output_and_rope_scaling(tmp_path):
    rng = np.random.default_rng(5)
    tensors = tiny_llama_tensors([Q.F32] * 8, rng)
    tensors["output.weight"] = (
        rng.standard_normal((TINY["vocab_size"], TINY["hidden_size"])).astype(np.float32),
        Q.F32,
    )
    factors = np.linspace(1.0, 8.0, HEAD_DIM // 2, dtype=np.float32)
    tensors["rope_freqs.weight"] = (factors, Q.F32)
    path = str(tmp_path / "llama3.gguf")
    write_gguf(path, tensors, rng=rng)
    checkpoint = read_gguf(path)
    assert not checkpoint.config.tie_word_embeddings
    np.testing.assert_array_equal(checkpoint.weights["lm_head.weight"].numpy(), tensors["output.weight"][0])
    assert checkpoint.config.rope_scaling == {"rope_type": "freq_factors", "factors": factors.tolist()}
    assert not any("rope" in name for name in checkpoint.weights)

    linear_path = str(tmp_path / "linear.gguf")
    write_gguf(
        linear_path,
        tiny_llama_tensors([Q.F32] * 8, rng),
        rng=rng,
        extra={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0},
    )
    assert read_gguf(linear_path).config.rope_scaling == {"rope_type": "linear", "factor": 4.0}


def test_qwen2_keeps_row_order_and_reads_qkv_bias(tmp_path):
    rng = np.random.default_rng(6)
    tensors = tiny_llama_tensors([Q.F32] * 8, rng)
    kv = TINY["num_kv_heads"] * HEAD_DIM
    for part, size in (("attn_q", TINY["hidden_size"]), ("attn_k", kv), ("attn_v", kv)):
        tensors[f"blk.0.{part}.bias"] = (rng.standard_normal(size).astype(np.float32), Q.F32)
    path = str(tmp_path / "qwen2.gguf")
    write_gguf(path, tensors, arch="qwen2", rng=rng)
    checkpoint = read_gguf(path)
    assert checkpoint.config.architecture == "qwen2" and checkpoint.config.attention_bias
    np.testing.assert_array_equal(
        checkpoint.weights["model.layers.0.self_attn.q_proj.weight"].numpy(), tensors["blk.0.attn_q.weight"][0]
    )
    np.testing.assert_array_equal(
        checkpoint.weights["model.layers.0.self_attn.k_proj.bias"].numpy(), tensors["blk.0.attn_k.bias"][0]
    )


def test_tokenizer_fields_are_plain_python_values(tmp_path):
    rng = np.random.default_rng(7)
    path = str(tmp_path / "tokenizer.gguf")
    tokens = [f"tok{i}" for i in range(TINY["vocab_size"] - 2)] + ["<s>", "日本"]
    write_gguf(
        path,
        tiny_llama_tensors([Q.F32] * 8, rng),
        rng=rng,
        extra={
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1] * (len(tokens) - 2) + [3, 1],
            "tokenizer.ggml.scores": [float(i) / 2 for i in range(len(tokens))],
            "tokenizer.ggml.bos_token_id": 30,
            "tokenizer.ggml.add_bos_token": True,
        },
    )
    fields = read_gguf(path).tokenizer_fields
    assert all(name.startswith("tokenizer.") for name in fields)
    assert fields["tokenizer.ggml.model"] == "gpt2"
    assert fields["tokenizer.ggml.tokens"] == tokens
    assert fields["tokenizer.ggml.token_type"] == [1] * (len(tokens) - 2) + [3, 1]
    assert fields["tokenizer.ggml.scores"] == [float(i) / 2 for i in range(len(tokens))]
    assert fields["tokenizer.ggml.bos_token_id"] == 30 and type(fields["tokenizer.ggml.bos_token_id"]) is int
    assert fields["tokenizer.ggml.add_bos_token"] is True


def test_real_model_weights_equal_transformers_gguf_loader(default_model_path, hf_reference):
    """Every tensor of the embedded SmolLM2, dequantized and un-permuted, equals what transformers loads."""
    hf_model, _ = hf_reference
    ours = read_gguf(default_model_path).weights
    theirs = hf_model.state_dict()
    assert set(ours) | {"lm_head.weight"} == set(theirs)  # tied: the file has no separate output tensor
    ours["lm_head.weight"] = ours["model.embed_tokens.weight"]
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor.float()), name


def test_a_matrix_converted_in_chunks_of_rows_is_the_matrix_converted_whole(tmp_path, monkeypatch):
    """read_gguf converts large matrices a few MiB of the file at a time (so that their file pages are never all
    resident): the same bytes as one conversion, for fused parts too (q/k/v of one type are converted into their
    rows of the whole)."""
    rng = np.random.default_rng(5)
    types = [Q.Q8_0, Q.Q4_1, Q.Q4_1, Q.Q4_1, Q.Q4_0, Q.Q5_0, Q.Q4_K, Q.Q6_K]
    path = str(tmp_path / "mixed.gguf")
    write_gguf(path, tiny_llama_tensors(types, rng), rng=rng)
    whole = read_gguf(path, keep_quantized=True).weights
    monkeypatch.setattr(gguf_module, "_CHUNK_BYTES", 700)  # a few rows of each matrix per chunk
    chunked = read_gguf(path, keep_quantized=True).weights
    assert whole.keys() == chunked.keys()
    for name, weight in whole.items():
        got = chunked[name]
        assert type(got) is type(weight), name
        if isinstance(weight, torch.Tensor):
            assert torch.equal(got, weight), name
            continue
        for field in ("qweight", "scales", "mins", "high_bits"):
            expected, tensor = getattr(weight, field, None), getattr(got, field, None)
            assert (tensor is None) == (expected is None), (name, field)
            if expected is not None:
                assert torch.equal(tensor.view(torch.uint8), expected.view(torch.uint8)), (name, field)
