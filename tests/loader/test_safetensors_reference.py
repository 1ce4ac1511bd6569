"""Hugging Face folders (config.json + safetensors) of tiny random models: our logits vs transformers'.

Covers Llama with llama3 rope scaling and a separate lm_head, Qwen2 with its
QKV bias and tied embeddings, Mistral (sliding window caps the context), and
a checkpoint split into shards with an index file.
"""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch

from tokenriver.kv.cache import KVCache
from tokenriver.loader.assemble import build_model
from tokenriver.loader.safetensors import read_hf_folder
from tokenriver.models.attention import AttentionMetadata

transformers = pytest.importorskip("transformers")

SIZES = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def tiny_model(kind: str):
    torch.manual_seed({"llama": 0, "qwen2": 1, "mistral": 2}[kind])
    if kind == "llama":
        config = transformers.LlamaConfig(**SIZES, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(config)
    elif kind == "qwen2":
        config = transformers.Qwen2Config(**SIZES, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.MistralConfig(**SIZES, sliding_window=256)
        model = transformers.MistralForCausalLM(config)
    # Random init gives near-zero logits; widen the weights so differences would show.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0, 0.2)
            else:
                param.uniform_(0.5, 1.5)
    return model.eval()


def logits_of(folder: str, ids: list[int]) -> torch.Tensor:
    checkpoint = read_hf_folder(folder)
    model = build_model(checkpoint.config, checkpoint.weights, "cpu", folder)
    config = checkpoint.config
    num_blocks = -(-len(ids) // 16)
    cache = KVCache(config.num_layers, num_blocks, 16, config.num_kv_heads, config.head_dim, torch.float32)
    metadata = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(num_blocks))], 16)
    return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), cache, metadata))


@pytest.fixture(scope="module")
def ids() -> list[int]:
    return torch.randint(0, SIZES["vocab_size"], (80,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_logits_match_transformers(tmp_path, ids, kind):
    model = tiny_model(kind)
    model.save_pretrained(tmp_path, safe_serialization=True)
    with torch.no_grad():
        reference = model(torch.tensor([ids])).logits[0]
    got = logits_of(str(tmp_path), ids)
    relative_error = ((got - reference).norm() / reference.norm()).item()
    assert relative_error < 1e-5, f"{kind}: relative error {relative_error:.2e}"


def test_configs_map_onto_model_config(tmp_path):
    expected = {
        "llama": ("llama", False, False, 512, LLAMA3_ROPE),
        "qwen2": ("qwen2", True, True, 512, None),
        "mistral": ("mistral", False, False, 256, None),
    }
    for kind, (architecture, bias, tied, max_positions, rope) in expected.items():
        folder = tmp_path / kind
        tiny_model(kind).save_pretrained(folder, safe_serialization=True)
        checkpoint = read_hf_folder(str(folder))
        config = checkpoint.config
        assert (config.architecture, config.attention_bias, config.tie_word_embeddings) == (architecture, bias, tied)
        # Mistral's 256-token sliding window caps the context at which full attention is still exact.
        assert config.max_position_embeddings == max_positions
        assert (config.head_dim, config.num_kv_heads, config.rms_norm_eps) == (16, 2, 1e-5)
        if rope is None:
            assert config.rope_scaling is None
        else:
            assert config.rope_scaling == {k: v for k, v in rope.items() if k != "rope_theta"}
        assert ("lm_head.weight" in checkpoint.weights) == (not tied)


def test_sharded_checkpoint(tmp_path, ids):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    assert len(glob.glob(os.path.join(tmp_path, "*.safetensors"))) > 1
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    with torch.no_grad():
        reference = model(torch.tensor([ids])).logits[0]
    got = logits_of(str(tmp_path), ids)
    assert ((got - reference).norm() / reference.norm()).item() < 1e-5


def test_transformers_4_style_config(tmp_path, ids):
    """config.json with rope_theta + rope_scaling (transformers 4.x) instead of rope_parameters."""
    model = tiny_model("llama")
    model.save_pretrained(tmp_path, safe_serialization=True)
    config = json.loads((tmp_path / "config.json").read_text())
    parameters = config.pop("rope_parameters")
    config["rope_theta"] = parameters.pop("rope_theta")
    config["rope_scaling"] = {"type" if k == "rope_type" else k: v for k, v in parameters.items()}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with torch.no_grad():
        reference = model(torch.tensor([ids])).logits[0]
    got = logits_of(str(tmp_path), ids)
    assert ((got - reference).norm() / reference.norm()).item() < 1e-5
