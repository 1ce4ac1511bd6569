"""The pooling a model file asks for, for every architecture: a sentence-transformers folder's modules.json and
1_Pooling/config.json (loader/embedding_files.py), and a GGUF file's `<arch>.pooling_type`."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from loader_gguf_writing import TINY, write_gguf

from tokenriver.errors import ModelLoadError
from tokenriver.loader.gguf import read_gguf
from tokenriver.loader.safetensors import read_hf_config

# A causal model's config.json: pooling is read whatever the architecture (Qwen3-Embedding pools the last token).
LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 32,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "max_position_embeddings": 128,
}
TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
MODES = (
    "pooling_mode_cls_token",
    "pooling_mode_mean_tokens",
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
    "pooling_mode_lasttoken",
)


def sentence_transformers_folder(folder: Path, modules: list[dict], *modes: str) -> str:
    """config.json, modules.json and a Pooling config switching `modes` on, as sentence-transformers saves them."""
    (folder / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": 64} | {mode: mode in modes for mode in MODES} | {"include_prompt": True}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return str(folder)


@pytest.mark.parametrize(
    ("mode", "pooling"),
    [("pooling_mode_mean_tokens", "mean"), ("pooling_mode_cls_token", "cls"), ("pooling_mode_lasttoken", "last")],
)
def test_the_pooling_module_sets_the_pooling(tmp_path, mode, pooling):
    config = read_hf_config(sentence_transformers_folder(tmp_path, [TRANSFORMER, POOLING, NORMALIZE], mode))
    assert (config.pooling, config.normalize) == (pooling, True)


def test_without_a_normalize_module_vectors_are_not_normalized(tmp_path):
    folder = sentence_transformers_folder(tmp_path, [TRANSFORMER, POOLING], "pooling_mode_cls_token")
    assert (read_hf_config(folder).pooling, read_hf_config(folder).normalize) == ("cls", False)


def test_a_folder_without_sentence_transformers_files_says_nothing(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    config = read_hf_config(str(tmp_path))
    assert (config.pooling, config.normalize) == (None, None)


@pytest.mark.parametrize(
    "modes", [("pooling_mode_max_tokens",), ("pooling_mode_mean_tokens", "pooling_mode_cls_token")], ids=["max", "two"]
)
def test_a_pooling_tokenriver_does_not_run_is_refused(tmp_path, modes):
    folder = sentence_transformers_folder(tmp_path, [TRANSFORMER, POOLING], *modes)
    with pytest.raises(ModelLoadError, match="is not supported; tokenriver pools with one of"):
        read_hf_config(folder)


def test_a_module_that_changes_the_vector_is_refused(tmp_path):
    dense = {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
    folder = sentence_transformers_folder(tmp_path, [TRANSFORMER, POOLING, dense], "pooling_mode_mean_tokens")
    with pytest.raises(ModelLoadError, match="Dense.*is not supported"):
        read_hf_config(folder)


@pytest.mark.parametrize(("pooling_type", "pooling"), [(0, None), (1, "mean"), (2, "cls"), (3, "last"), (4, "cls")])
def test_a_gguf_pooling_type_sets_the_pooling(tmp_path, pooling_type, pooling):
    rng = np.random.default_rng(0)
    hidden, vocab = TINY["hidden_size"], TINY["vocab_size"]
    tensors = {
        "token_embd.weight": (rng.standard_normal((vocab, hidden)).astype(np.float32), gguf.GGMLQuantizationType.F32)
    }
    path = str(tmp_path / "pooled.gguf")
    write_gguf(path, tensors, num_layers=1, extra={"llama.pooling_type": pooling_type})
    assert read_gguf(path).config.pooling == pooling


def test_an_unknown_gguf_pooling_type_is_refused(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "token_embd.weight": (
            rng.standard_normal((TINY["vocab_size"], TINY["hidden_size"])).astype(np.float32),
            gguf.GGMLQuantizationType.F32,
        )
    }
    path = str(tmp_path / "pooled.gguf")
    write_gguf(path, tensors, num_layers=1, extra={"llama.pooling_type": 7})
    with pytest.raises(ModelLoadError, match="pooling_type=7"):
        read_gguf(path)
