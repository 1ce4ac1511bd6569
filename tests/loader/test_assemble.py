"""Quantized loading: GGUF Q4_1/Q8_0 weights kept packed give the dequantized model's logits; float weights
quantized at load (int8/int4) stay close to float; fused projections; bad modes are refused."""

from __future__ import annotations

import pytest
import torch

from tokenriver.errors import InvalidParameterError
from tokenriver.kv.cache import KVCache
from tokenriver.loader.load import load_model
from tokenriver.models.attention import AttentionMetadata
from tokenriver.models.quant import Int4Linear, Int8Linear, QuantizedEmbedding

PROMPT = "The three primary colors are red, yellow and blue. Mixing two of them gives"


def _logits(loaded, ids: list[int]) -> torch.Tensor:
    config = loaded.config
    num_blocks = (len(ids) + 15) // 16
    cache = KVCache(config.num_layers, num_blocks, 16, config.num_kv_heads, config.head_dim, torch.float32)
    metadata = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(num_blocks))], 16)
    hidden = loaded.model(torch.tensor(ids), torch.arange(len(ids)), cache, metadata)
    return loaded.model.compute_logits(hidden)


@pytest.fixture(scope="module")
def loaded_auto(default_model_path):
    return load_model(default_model_path, quantization="auto")


def test_gguf_weights_stay_packed_and_tied(loaded_auto, loaded_float32):
    model = loaded_auto.model
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Int4Linear) and layer.self_attn.qkv_proj.out_features == 960
    assert isinstance(layer.mlp.gate_up_proj, Int4Linear) and layer.mlp.gate_up_proj.out_features == 3072
    assert isinstance(model.lm_head, Int8Linear)  # token_embd is Q8_0 in this file
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding) and model.model.embed_tokens.table is model.lm_head
    # Q4_1 is 20 bytes per 32 weights, Q8_0 34: about a sixth of float32.
    assert loaded_auto.num_bytes < loaded_float32.num_bytes / 5


def test_packed_weights_compute_the_dequantized_models_logits(loaded_auto, loaded_float32):
    """Repacking is exact and the kernels sum in float32, so only the summation order differs."""
    ids = loaded_float32.tokenizer.encode(PROMPT)
    want = _logits(loaded_float32, ids)
    got = _logits(loaded_auto, ids[:5])  # five rows: the decode-sized kernel path
    assert ((got - want[:5]).norm() / want[:5].norm()).item() < 1e-4
    got = _logits(loaded_auto, ids)  # all rows: the dequantize-then-sgemm path
    assert ((got - want).norm() / want.norm()).item() < 1e-4


def test_embedding_rows_equal_the_dequantized_table(loaded_auto, loaded_float32):
    ids = torch.tensor([0, 7, 49151, 7])
    assert torch.equal(loaded_auto.model.model.embed_tokens(ids), loaded_float32.model.model.embed_tokens(ids))


@pytest.mark.parametrize("quantization, tolerance", [("int8", 0.06), ("int4", 0.25)])
def test_float_weights_quantized_at_load(loaded_float32, default_model_path, quantization, tolerance):
    loaded = load_model(default_model_path, quantization=quantization)
    kinds = {type(m).__name__ for m in loaded.model.modules()}
    assert ("Int4Linear" in kinds) == (quantization == "int4") and "Int8Linear" in kinds
    ids = loaded_float32.tokenizer.encode(PROMPT)
    want, got = _logits(loaded_float32, ids), _logits(loaded, ids)
    assert ((got - want).norm() / want.norm()).item() < tolerance
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.7


def test_unknown_quantization_is_refused(default_model_path):
    with pytest.raises(InvalidParameterError, match="int8"):
        load_model(default_model_path, quantization="q4")
