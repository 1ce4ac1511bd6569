"""load_model end to end: a GGUF file or a Hugging Face folder gives a model, its config and a working tokenizer."""

from __future__ import annotations

import pytest
import torch

from tokenriver.kv.cache import KVCache
from tokenriver.loader.load import load_model
from tokenriver.models.attention import AttentionMetadata
from tokenriver.models.llama import LlamaForCausalLM

TEXTS = ["Hello, world!", "Größe, 東京, Привет 🚀", "def f(x):\n    return x * 2\n", "<|im_start|>user\nHi<|im_end|>"]


def test_embedded_model(loaded_float32, hf_reference, default_model_path):
    hf_model, _ = hf_reference
    loaded = loaded_float32
    assert isinstance(loaded.model, LlamaForCausalLM) and not loaded.model.training
    assert loaded.path == default_model_path
    config = loaded.config
    assert (config.architecture, config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
        "llama",
        30,
        576,
        9,
        3,
    )
    assert (config.intermediate_size, config.vocab_size, config.head_dim, config.rope_theta) == (
        1536,
        49152,
        64,
        100000.0,
    )
    assert config.tie_word_embeddings and config.max_position_embeddings == 8192
    num_parameters = sum(p.numel() for p in hf_model.parameters())  # transformers counts a tied weight once
    assert loaded.num_parameters == num_parameters
    assert loaded.num_bytes == 4 * num_parameters
    assert all(not p.requires_grad and p.dtype == torch.float32 for p in loaded.model.parameters())
    assert loaded.model.lm_head.weight.data_ptr() == loaded.model.model.embed_tokens.weight.data_ptr()


def test_embedded_tokenizer_matches_transformers(loaded_float32, hf_reference):
    _, hf_tokenizer = hf_reference
    tokenizer = loaded_float32.tokenizer
    for text in TEXTS:
        ids = hf_tokenizer(text)["input_ids"]
        assert tokenizer.encode(text) == ids, text
        assert tokenizer.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids)
    assert tokenizer.eos_token_ids[0] == 2 and tokenizer.vocab_size == 49152


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hugging_face_folder(tmp_path_factory, hf_reference, dtype):
    transformers = pytest.importorskip("transformers")
    _, hf_tokenizer = hf_reference
    folder = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=49152,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            tie_word_embeddings=False,
        )
    ).eval()
    reference.save_pretrained(folder, safe_serialization=True)
    hf_tokenizer.save_pretrained(folder)

    loaded = load_model(str(folder), dtype=dtype)
    assert loaded.path == str(folder)
    num_parameters = sum(p.numel() for p in reference.parameters())
    assert loaded.num_parameters == num_parameters
    assert loaded.num_bytes == num_parameters * (4 if dtype == "float32" else 2)
    assert next(loaded.model.parameters()).dtype == getattr(torch, dtype)

    ids = loaded.tokenizer.encode(TEXTS[1])
    assert ids == hf_tokenizer(TEXTS[1])["input_ids"]
    config = loaded.config
    cache = KVCache(config.num_layers, 4, 16, config.num_kv_heads, config.head_dim, getattr(torch, dtype))
    metadata = AttentionMetadata.build([len(ids)], [len(ids)], [[0, 1, 2, 3]], 16)
    logits = loaded.model.compute_logits(loaded.model(torch.tensor(ids), torch.arange(len(ids)), cache, metadata))
    with torch.no_grad():
        want = reference(torch.tensor([ids])).logits[0]
    tolerance = 1e-5 if dtype == "float32" else 3e-2
    assert ((logits - want).norm() / want.norm()).item() < tolerance
