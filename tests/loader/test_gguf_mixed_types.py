"""Files as llama.cpp's quantizer writes them: every matrix type, and layers mixing types (a Q4_K_M file keeps q/k
at Q4_K and v at Q6_K, so fused projections meet parts of different formats). Each file loads in every mode, keeps
its matrices packed, and computes the dequantized float model's logits within the rounding its types allow."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from loader_gguf_writing import TINY, tiny_llama_tensors, write_gguf
from test_gguf_blocks import POPULAR

from tokenriver.errors import ModelLoadError
from tokenriver.kv.cache import KVCache
from tokenriver.loader.assemble import QUANTIZATIONS, build_model
from tokenriver.loader.gguf import read_gguf
from tokenriver.loader.gguf_blocks import CONVERSIONS, EXACT
from tokenriver.models.attention import AttentionMetadata
from tokenriver.models.quant import Int4Linear, Int8Linear, QuantizedEmbedding

Q = gguf.GGMLQuantizationType
IDS = [3, 17, 5, 29, 11, 0, 8, 21, 13, 2, 30, 7]
# attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down of one layer, as Q4_K_M files mix them.
Q4_K_M_LAYER = [Q.Q4_K, Q.Q4_K, Q.Q6_K, Q.Q4_K, Q.Q4_K, Q.Q5_0, Q.Q6_K]


def _build(path: str, quantization: str) -> torch.nn.Module:
    checkpoint = read_gguf(path, keep_quantized=quantization != "none")
    return build_model(checkpoint.config, checkpoint.weights, "cpu", path, quantization)


def _logits(model: torch.nn.Module) -> torch.Tensor:
    config = model.config
    num_blocks = (len(IDS) + 15) // 16
    cache = KVCache(config.num_layers, num_blocks, 16, config.num_kv_heads, config.head_dim, torch.float32)
    metadata = AttentionMetadata.build([len(IDS)], [len(IDS)], [list(range(num_blocks))], 16)
    hidden = model(torch.tensor(IDS), torch.arange(len(IDS)), cache, metadata)  # [T, hidden]
    return model.compute_logits(hidden)  # [T, vocab]


def _write(
    tmp_path,
    name: str,
    embedding: gguf.GGMLQuantizationType,
    layers: list[gguf.GGMLQuantizationType],
    output: gguf.GGMLQuantizationType | None = None,
) -> str:
    rng = np.random.default_rng(len(name))
    tensors = tiny_llama_tensors([embedding, *layers], rng)
    if output is not None:
        values = (rng.standard_normal((TINY["vocab_size"], TINY["hidden_size"])) * 0.1).astype(np.float32)
        tensors["output.weight"] = (values, output)
    path = str(tmp_path / f"{name}.gguf")
    num_layers = len([n for n in tensors if n.endswith("attn_q.weight")])
    write_gguf(path, tensors, num_layers=num_layers, rng=rng)
    return path


def _linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, (torch.nn.Linear, Int4Linear, Int8Linear))]


def _relative_error(got: torch.Tensor, reference: torch.Tensor) -> float:
    return ((got - reference).abs().max() / reference.abs().max()).item()


@pytest.fixture(scope="module")
def q4_k_m_file(tmp_path_factory) -> str:
    """Two Q4_K_M-style layers, a Q6_K tied embedding, float16 norms replaced in by the writer's F32."""
    return _write(tmp_path_factory.mktemp("mixed"), "q4_k_m", Q.Q6_K, Q4_K_M_LAYER * 2)


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_mixed_file_loads_in_every_mode(q4_k_m_file, quantization):
    model = _build(q4_k_m_file, quantization)
    logits = _logits(model)
    assert torch.isfinite(logits).all()
    if quantization != "none":
        assert all(isinstance(m, (Int4Linear, Int8Linear)) for m in _linears(model)), "a matrix became float"
        assert isinstance(model.model.embed_tokens, QuantizedEmbedding)


def test_fused_parts_of_different_types_stay_packed(q4_k_m_file):
    attention = _build(q4_k_m_file, "auto").model.layers[0].self_attn
    # q and k are Q4_K, v is Q6_K: the fused projection meets them as int8 per 32.
    assert isinstance(attention.qkv_proj, Int8Linear) and attention.qkv_proj.group_size == 32
    assert isinstance(attention.o_proj, Int4Linear)


# Largest logit error relative to the largest logit, for re-encodings that round (the random tiny model amplifies
# weight errors more than a trained one; real files' perplexities are in benchmarks/results/gguf_types.md).
ROUNDED_TOLERANCE = 0.05


def test_mixed_file_computes_the_dequantized_models_logits(q4_k_m_file):
    reference = _logits(_build(q4_k_m_file, "none"))
    assert _relative_error(_logits(_build(q4_k_m_file, "auto")), reference) < ROUNDED_TOLERANCE
    assert _relative_error(_logits(_build(q4_k_m_file, "int8")), reference) < ROUNDED_TOLERANCE
    assert _relative_error(_logits(_build(q4_k_m_file, "int4")), reference) < 0.3


@pytest.mark.parametrize("qtype", POPULAR, ids=lambda t: t.name)
def test_each_type_computes_the_dequantized_models_logits(tmp_path, qtype):
    path = _write(tmp_path, qtype.name, qtype, [qtype] * 7, output=qtype)
    reference = _logits(_build(path, "none"))
    model = _build(path, "auto")
    assert all(isinstance(m, (Int4Linear, Int8Linear)) for m in _linears(model))
    error = _relative_error(_logits(model), reference)
    if CONVERSIONS[qtype][1] == EXACT:
        assert error < 1e-5, qtype.name
    else:
        assert error < ROUNDED_TOLERANCE, qtype.name
    for quantization in ("int8", "int4"):
        assert torch.isfinite(_logits(_build(path, quantization))).all()


def test_norms_and_embeddings_in_any_type(tmp_path):
    rng = np.random.default_rng(5)
    tensors = tiny_llama_tensors([Q.Q8_0, *Q4_K_M_LAYER], rng)
    for name, (values, _) in list(tensors.items()):
        if name.endswith("norm.weight"):
            tensors[name] = (values, Q.F16)
    path = str(tmp_path / "f16_norms.gguf")
    write_gguf(path, tensors, rng=rng)
    reference = _logits(_build(path, "none"))
    assert _relative_error(_logits(_build(path, "auto")), reference) < ROUNDED_TOLERANCE


def test_a_type_that_cannot_run_names_the_tensor_and_the_supported_types(tmp_path):
    rng = np.random.default_rng(6)
    tensors = tiny_llama_tensors([Q.Q8_0, *Q4_K_M_LAYER], rng)
    values, _ = tensors["blk.0.ffn_up.weight"]
    tensors["blk.0.ffn_up.weight"] = (values, Q.TQ1_0)
    path = str(tmp_path / "ternary.gguf")
    write_gguf(path, tensors, rng=rng)
    for quantization in ("auto", "none"):
        with pytest.raises(ModelLoadError) as info:
            _build(path, quantization)
        message = info.value.message
        assert "blk.0.ffn_up.weight" in message and "TQ1_0" in message and "Q4_K" in message
