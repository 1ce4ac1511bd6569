"""The GGUF files the real-models benchmark runs, made here without a download.

- The embedded SmolLM2-135M-Instruct, its Q4_1 weights dequantized into an F16 GGUF (same metadata, tokenizer and
  tensor layout), then quantized by llama.cpp's own quantizer (llama-cpp-python's `llama_model_quantize`) into the
  types people download: Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q3_K_M, Q2_K, IQ4_XS, IQ4_NL. Real weights, so perplexities
  mean something.
- A 0.8B-parameter llama-architecture model with random weights (SmolLM2's tokenizer; hidden 1536, 28 layers,
  GQA 4:1), quantized to Q4_K_M: about 500 MB, the size of the 0.5B-class files users run first; and to Q3_K_M and
  Q2_K, llama.cpp's mixes of 2- and 3-bit K-quants. Its text is noise; its load time, memory and speed are those
  of any file of its shape.
- The same for Qwen2.5-0.5B-Instruct's shape (qwen2 architecture, q/k/v biases, hidden 896, 24 layers, GQA 7:1,
  a 151,936-token vocabulary tied to the output layer; SmolLM2's tokenizer padded with unused tokens), in Q4_K_M:
  the file the most popular small instruct model comes in.
- The same for Qwen2.5-1.5B-Instruct's shape (hidden 1536, 28 layers, GQA 6:1, the same tied vocabulary), in
  Q4_K_M: about 1 GB, where decode is bound by memory bandwidth on any CPU.

Files are written once into --models-dir (default: ~/.cache/tokenriver/bench-models) and reused.

    python benchmarks/model_files.py [--models-dir DIR]   # make them all and list them
"""

from __future__ import annotations

import argparse
import ctypes
import os
from pathlib import Path

import gguf
import numpy as np

DEFAULT_DIR = Path.home() / ".cache" / "tokenriver" / "bench-models"
# llama.cpp's LLAMA_FTYPE_* codes (llama.h).
FTYPES = {
    "Q4_0": 2,
    "Q4_1": 3,
    "Q8_0": 7,
    "Q5_0": 8,
    "Q5_1": 9,
    "Q2_K": 10,
    "Q3_K_M": 12,
    "Q4_K_M": 15,
    "Q5_K_M": 17,
    "Q6_K": 18,
    "IQ4_NL": 25,
    "IQ4_XS": 30,
}
SMOLLM_TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q3_K_M", "Q2_K", "IQ4_XS", "IQ4_NL")
LARGE_SHAPE = dict(arch="llama", name="random llama 0.8B", hidden=1536, layers=28, heads=24, kv_heads=6, ffn=4608)
# Qwen2.5-0.5B-Instruct's shape: its 151,936-token vocabulary (tied to the output layer) is a third of its weights.
QWEN_SHAPE = dict(
    arch="qwen2",
    name="random qwen2 0.5B",
    hidden=896,
    layers=24,
    heads=14,
    kv_heads=2,
    ffn=4864,
    vocab=151936,
    tied=True,
    qkv_bias=True,
    keys={"rope.freq_base": 1000000.0, "attention.layer_norm_rms_epsilon": 1e-6},
)


def embedded_model_path() -> str:
    from tokenriver.loader.load import default_model_path

    return default_model_path()


def copy_metadata(
    reader: gguf.GGUFReader, writer: gguf.GGUFWriter, overrides: dict[str, object], rename: tuple[str, str] = ("", "")
) -> set[str]:
    """Every key of the source but the header's own and general.architecture (the writer sets those); a key
    starting with rename[0] is written under rename[1] instead (another architecture's prefix). Returns the
    names written."""
    old_prefix, new_prefix = rename
    written = set()
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if old_prefix and name.startswith(old_prefix):
            name = new_prefix + name[len(old_prefix) :]
        value_type = field.types[0]
        value = overrides.get(name, field.contents())
        sub_type = field.types[1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, value_type, sub_type)
        written.add(name)
    return written


def write_f16_copy(source: str, target: Path) -> Path:
    """Dequantize every tensor of `source` into an F16 GGUF (norms and other 1-D tensors stay F32)."""
    if target.exists():
        return target
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    scratch = target.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(scratch), arch)
    copy_metadata(reader, writer, {"general.file_type": 1})
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        shape = tuple(int(d) for d in reversed(tensor.shape))
        values = np.asarray(values, dtype=np.float32).reshape(shape)
        writer.add_tensor(tensor.name, values.astype(np.float16) if values.ndim == 2 else values)
    _finish(writer)
    os.replace(scratch, target)
    return target


def write_random_model(source: str, target: Path, shape: dict, seed: int = 0) -> Path:
    """A model of `shape` (architecture, sizes, vocabulary) with random F16 weights and the source's tokenizer. A
    vocabulary larger than the source's is padded with unused tokens, which no text encodes to."""
    if target.exists():
        return target
    reader = gguf.GGUFReader(source)
    arch, hidden, heads, kv_heads, ffn = (shape[key] for key in ("arch", "hidden", "heads", "kv_heads", "ffn"))
    head_dim = hidden // heads
    tokens = list(reader.fields["tokenizer.ggml.tokens"].contents())
    vocab = shape.get("vocab", len(tokens))
    token_types = list(reader.fields["tokenizer.ggml.token_type"].contents())
    unused = int(gguf.TokenType.UNUSED)
    sizes = {
        "block_count": shape["layers"],
        "embedding_length": hidden,
        "feed_forward_length": ffn,
        "attention.head_count": heads,
        "attention.head_count_kv": kv_heads,
        "rope.dimension_count": head_dim,
        "vocab_size": vocab,
        **shape.get("keys", {}),
    }
    overrides = {
        "general.file_type": 1,
        **{f"{arch}.{key}": value for key, value in sizes.items()},
        "tokenizer.ggml.tokens": tokens + [f"<unused_{i}>" for i in range(len(tokens), vocab)],
        "tokenizer.ggml.token_type": token_types + [unused] * (vocab - len(tokens)),
    }
    scratch = target.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(scratch), arch)
    written = copy_metadata(reader, writer, overrides, rename=("llama.", f"{arch}."))
    for name in overrides.keys() - written:
        writer.add_key_value(name, overrides[name], _value_type(overrides[name]))
    writer.add_string("general.name", shape["name"])
    rng = np.random.default_rng(seed)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    writer.add_tensor("token_embd.weight", matrix(vocab, hidden))
    if not shape.get("tied", False):
        writer.add_tensor("output.weight", matrix(vocab, hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for layer in range(shape["layers"]):
        prefix = f"blk.{layer}."
        writer.add_tensor(prefix + "attn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(prefix + "ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        for name, rows, cols in (
            ("attn_q", hidden, hidden),
            ("attn_k", kv_heads * head_dim, hidden),
            ("attn_v", kv_heads * head_dim, hidden),
            ("attn_output", hidden, hidden),
            ("ffn_gate", ffn, hidden),
            ("ffn_up", ffn, hidden),
            ("ffn_down", hidden, ffn),
        ):
            writer.add_tensor(prefix + name + ".weight", matrix(rows, cols))
            if shape.get("qkv_bias") and name in ("attn_q", "attn_k", "attn_v"):
                writer.add_tensor(prefix + name + ".bias", rng.standard_normal(rows, dtype=np.float32) * 0.02)
    _finish(writer)
    os.replace(scratch, target)
    return target


def _value_type(value: object) -> gguf.GGUFValueType:
    return gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else gguf.GGUFValueType.UINT32


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def quantize(source: Path, target: Path, ftype: str, threads: int = 2) -> Path:
    """llama.cpp's quantizer: `source` (F16) → `target` in llama.cpp's mix for `ftype` (e.g. Q4_K_M)."""
    if target.exists():
        return target
    import llama_cpp  # the `bench` extra

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    params.nthread = threads
    scratch = target.with_suffix(".partial")
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(scratch).encode(), ctypes.byref(params))
    if status != 0:
        raise RuntimeError(f"llama_model_quantize({source} → {ftype}) failed with status {status}")
    os.replace(scratch, target)
    return target


# Qwen2.5-1.5B-Instruct's shape.
QWEN_1_5B_SHAPE = {**QWEN_SHAPE, "name": "random qwen2 1.5B", "hidden": 1536, "layers": 28, "heads": 12, "ffn": 8960}


def smollm_file(ftype: str, models_dir: Path = DEFAULT_DIR) -> Path:
    """SmolLM2-135M-Instruct in `ftype`, from the embedded file's weights."""
    models_dir.mkdir(parents=True, exist_ok=True)
    f16 = write_f16_copy(embedded_model_path(), models_dir / "smollm2-135m-f16.gguf")
    return quantize(f16, models_dir / f"smollm2-135m-{ftype}.gguf", ftype)


def large_file(models_dir: Path = DEFAULT_DIR, ftype: str = "Q4_K_M") -> Path:
    """The 0.8B random-weights llama in `ftype` (Q4_K_M: about 500 MB)."""
    return _random_file(models_dir, "random-llama-0.8b", LARGE_SHAPE, ftype)


def qwen_file(models_dir: Path = DEFAULT_DIR) -> Path:
    """A random-weights model of Qwen2.5-0.5B's shape in Q4_K_M (about 400 MB)."""
    return _random_file(models_dir, "random-qwen2-0.5b", QWEN_SHAPE)


def qwen_1_5b_file(models_dir: Path = DEFAULT_DIR) -> Path:
    """A random-weights model of Qwen2.5-1.5B's shape in Q4_K_M (about 1 GB)."""
    return _random_file(models_dir, "random-qwen2-1.5b", QWEN_1_5B_SHAPE)


def _random_file(models_dir: Path, stem: str, shape: dict, ftype: str = "Q4_K_M") -> Path:
    models_dir.mkdir(parents=True, exist_ok=True)
    f16 = models_dir / f"{stem}-f16.gguf"
    target = models_dir / f"{stem}-{ftype}.gguf"
    if not target.exists():
        write_random_model(embedded_model_path(), f16, shape)  # the same seed: the same weights for every ftype
        quantize(f16, target, ftype)
        f16.unlink()  # about 1 GB per 0.5B parameters, needed only once
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models-dir", type=Path, default=DEFAULT_DIR)
    args = parser.parse_args()
    for ftype in SMOLLM_TYPES:
        path = smollm_file(ftype, args.models_dir)
        print(f"{path}  {path.stat().st_size / 2**20:.1f} MiB")
    random_files = [large_file(args.models_dir, ftype) for ftype in ("Q4_K_M", "Q3_K_M", "Q2_K")]
    for path in (*random_files, qwen_file(args.models_dir), qwen_1_5b_file(args.models_dir)):
        print(f"{path}  {path.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
