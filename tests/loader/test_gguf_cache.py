"""The GGUF header cache: a load from the cached index equals a load that reads the header from the file, and any
cache entry that does not describe the file (stale, corrupt, unwritable) falls back to reading it."""

from __future__ import annotations

import json
import logging
import os

import gguf
import numpy as np
import pytest
import torch
from loader_gguf_writing import tiny_llama_tensors, write_gguf

from tokenriver.loader import gguf as gguf_loader
from tokenriver.loader import gguf_cache
from tokenriver.loader.gguf import SUPPORTED_TYPES, read_gguf
from tokenriver.loader.load import load_model
from tokenriver.models.quant import Int4Weight, Int8Weight

Q = gguf.GGMLQuantizationType
TEXTS = [
    "Hello, world!",
    "The capital of France is",
    "  spaces\tand\nnewlines 12345",
    "<|im_start|>user\nHi<|im_end|>",
    "naïve café — 東京 🚀",
]


class ReaderCalls:
    """Counts the reads of a header from the file (a load from the cache makes none)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        original = gguf_loader.read_header

        def counting(*args, **kwargs):
            self.count += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(gguf_loader, "read_header", counting)


@pytest.fixture
def reader_calls(monkeypatch) -> ReaderCalls:
    return ReaderCalls(monkeypatch)


def assert_same_weights(cached: dict, parsed: dict) -> None:
    assert cached.keys() == parsed.keys()
    for name, expected in parsed.items():
        got = cached[name]
        assert type(got) is type(expected), name
        if isinstance(expected, torch.Tensor):
            assert got.dtype == expected.dtype and torch.equal(got, expected), name
        else:
            assert got.group_size == expected.group_size, name
            parts = ("qweight", "scales", "mins") if isinstance(expected, Int4Weight) else ("qweight", "scales")
            for part in parts:
                assert torch.equal(getattr(got, part), getattr(expected, part)), f"{name}.{part}"


def tiny_model(path: str, name: str = "tiny test model A", seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    tensors = tiny_llama_tensors([Q.Q4_1, Q.Q8_0, Q.Q4_0, Q.F16], rng)
    write_gguf(path, tensors, num_layers=1, rng=rng, extra={"general.name": name})


@pytest.mark.parametrize("keep_quantized", [True, False], ids=["packed", "float"])
def test_cached_read_equals_parsed_read_of_the_embedded_model(
    default_model_path, tmp_path, reader_calls, keep_quantized
):
    parsed = read_gguf(default_model_path, keep_quantized=keep_quantized, cache_dir=str(tmp_path))
    assert reader_calls.count == 1
    assert os.path.isfile(gguf_cache.entry_path(default_model_path, str(tmp_path)))
    cached = read_gguf(default_model_path, keep_quantized=keep_quantized, cache_dir=str(tmp_path))
    assert reader_calls.count == 1, "the second read parsed the file instead of using the cached index"
    assert cached.config == parsed.config
    assert cached.tokenizer_fields == parsed.tokenizer_fields
    if keep_quantized:
        assert any(isinstance(w, Int4Weight) for w in parsed.weights.values())
        assert any(isinstance(w, Int8Weight) for w in parsed.weights.values())
    assert_same_weights(cached.weights, parsed.weights)


def test_cached_load_model_equals_parsed_load(default_model_path, tmp_path, reader_calls):
    parsed = load_model(default_model_path, cache_dir=str(tmp_path))
    cached = load_model(default_model_path, cache_dir=str(tmp_path))
    assert reader_calls.count == 1
    assert cached.config == parsed.config
    assert (cached.num_parameters, cached.num_bytes) == (parsed.num_parameters, parsed.num_bytes)
    expected_state = parsed.model.state_dict()
    got_state = cached.model.state_dict()
    assert got_state.keys() == expected_state.keys()
    for name, tensor in expected_state.items():
        assert torch.equal(got_state[name], tensor), name
    for text in TEXTS:
        assert cached.tokenizer.encode(text) == parsed.tokenizer.encode(text), text
    assert cached.tokenizer.eos_token_ids == parsed.tokenizer.eos_token_ids
    assert cached.tokenizer.chat_template == parsed.tokenizer.chat_template


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # random blocks may hold nan/inf scales
def test_cached_tensor_views_equal_ggufreaders_for_every_type(tmp_path):
    """The memory-map slicing gives, for every supported type, the very arrays GGUFReader gives."""
    rng = np.random.default_rng(3)
    tensors = tiny_llama_tensors(sorted(SUPPORTED_TYPES, key=lambda t: t.value), rng)
    path = str(tmp_path / "all_types.gguf")
    write_gguf(path, tensors, num_layers=len([n for n in tensors if n.endswith("attn_q.weight")]), rng=rng)
    read_gguf(path, cache_dir=str(tmp_path))
    index = gguf_cache.load_index(path, str(tmp_path))
    assert index is not None
    reader = gguf.GGUFReader(path)
    mapped = np.memmap(path, mode="r")
    assert [t.name for t in index.tensors] == [t.name for t in reader.tensors]
    for entry, expected in zip(index.tensors, reader.tensors):
        got = gguf_cache.tensor_array(mapped, entry)
        assert entry.tensor_type == expected.tensor_type, entry.name
        assert got.dtype == expected.data.dtype and got.shape == expected.data.shape, entry.name
        assert got.tobytes() == expected.data.tobytes(), entry.name
    expected = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    assert index.fields == expected  # GGUFReader's GGUF.* entries are the header's counts, not metadata


def test_a_modified_file_is_parsed_again(tmp_path, reader_calls, caplog):
    path = str(tmp_path / "model.gguf")
    tiny_model(path, seed=0)
    first = read_gguf(path, cache_dir=str(tmp_path))
    tiny_model(path, name="tiny test model B, longer", seed=1)
    with caplog.at_level(logging.INFO, logger="tokenriver.loader.gguf_cache"):
        second = read_gguf(path, cache_dir=str(tmp_path))
    assert reader_calls.count == 2
    assert "stale" in caplog.text
    assert second.config.name == "tiny test model B, longer" != first.config.name
    assert_same_weights(second.weights, read_gguf(path, cache_dir=str(tmp_path / "fresh")).weights)


def test_a_changed_header_with_the_same_size_and_mtime_is_detected(tmp_path, reader_calls, caplog):
    """Size and mtime can survive a copy (cp -p, rsync -a); the header's SHA-256 still tells the files apart."""
    path = str(tmp_path / "model.gguf")
    tiny_model(path, name="tiny test model A")
    stat = os.stat(path)
    read_gguf(path, cache_dir=str(tmp_path))
    tiny_model(path, name="tiny test model B")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.stat(path).st_size == stat.st_size
    with caplog.at_level(logging.INFO, logger="tokenriver.loader.gguf_cache"):
        checkpoint = read_gguf(path, cache_dir=str(tmp_path))
    assert reader_calls.count == 2
    assert "header bytes changed" in caplog.text
    assert checkpoint.config.name == "tiny test model B"


def corrupt_not_json(entry: dict, text: str) -> str:
    return text[: len(text) // 2]


def corrupt_offset(entry: dict, text: str) -> str:
    entry["tensors"][0][3] += 10**9
    return json.dumps(entry)


def corrupt_shape(entry: dict, text: str) -> str:
    entry["tensors"][0][2][0] *= 2
    return json.dumps(entry)


def corrupt_type(entry: dict, text: str) -> str:
    entry["tensors"][0][1] = 9999
    return json.dumps(entry)


def corrupt_format(entry: dict, text: str) -> str:
    entry["format"] = gguf_cache.FORMAT_VERSION + 1
    return json.dumps(entry)


def corrupt_fields(entry: dict, text: str) -> str:
    entry["fields"] = ["not", "a", "dict"]
    return json.dumps(entry)


def corrupt_list(entry: dict, text: str) -> str:
    return "[]"


@pytest.mark.parametrize(
    "corrupt",
    [corrupt_not_json, corrupt_offset, corrupt_shape, corrupt_type, corrupt_format, corrupt_fields, corrupt_list],
)
def test_a_corrupt_entry_falls_back_to_parsing_and_is_rewritten(tmp_path, reader_calls, caplog, corrupt):
    path = str(tmp_path / "model.gguf")
    tiny_model(path)
    parsed = read_gguf(path, cache_dir=str(tmp_path))
    cache_file = gguf_cache.entry_path(path, str(tmp_path))
    with open(cache_file, encoding="utf-8") as handle:
        text = handle.read()
    with open(cache_file, "w", encoding="utf-8") as handle:
        handle.write(corrupt(json.loads(text), text))
    with caplog.at_level(logging.INFO, logger="tokenriver.loader.gguf_cache"):
        fallback = read_gguf(path, cache_dir=str(tmp_path))
    assert reader_calls.count == 2
    assert "parsing the file" in caplog.text
    assert fallback.config == parsed.config
    assert_same_weights(fallback.weights, parsed.weights)
    read_gguf(path, cache_dir=str(tmp_path))
    assert reader_calls.count == 2, "the entry was not rewritten after the fallback"


def test_an_unwritable_cache_directory_is_logged_and_ignored(tmp_path, reader_calls, caplog):
    path = str(tmp_path / "model.gguf")
    tiny_model(path)
    not_a_directory = tmp_path / "cache_is_a_file"
    not_a_directory.write_text("")
    with caplog.at_level(logging.INFO, logger="tokenriver.loader.gguf_cache"):
        first = read_gguf(path, cache_dir=str(not_a_directory))
        second = read_gguf(path, cache_dir=str(not_a_directory))
    assert reader_calls.count == 2
    assert "could not cache" in caplog.text
    assert_same_weights(second.weights, first.weights)


def test_the_default_cache_directory_follows_xdg_cache_home(tmp_path, monkeypatch, reader_calls):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert gguf_cache.default_cache_dir() == str(tmp_path / "xdg" / "tokenriver")
    path = str(tmp_path / "model.gguf")
    tiny_model(path)
    read_gguf(path)
    assert os.path.dirname(gguf_cache.entry_path(path)) == str(tmp_path / "xdg" / "tokenriver" / "gguf")
    assert os.path.isfile(gguf_cache.entry_path(path))
    read_gguf(path)
    assert reader_calls.count == 1
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert gguf_cache.default_cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "tokenriver")
