"""SmolLM2 in Q4_K_M, Q5_K_M and Q6_K: made by llama.cpp's own quantizer (benchmarks/model_files.py) where
llama-cpp-python is installed (the bench extra), else written here in the same type mix. And a small random model
with SmolLM2's tokenizer, 256 wide so every matrix is whole super-blocks, in Q3_K_M's and Q2_K's mixes of 2- and
3-bit K-quants (SmolLM2's 576-wide matrices never take them).

llama.cpp's mix for this model (read from its files): 576-column matrices are not whole 256-wide super-blocks, so
they fall back to Q5_0 (Q4_K_M), Q5_1 (Q5_K_M) or Q8_0 (Q6_K), as do some attn_v; ffn_down (1536 columns) takes the
K-quant, or Q6_K on the layers llama.cpp gives more bits; token_embd Q8_0. Written here, Q4_K blocks encode the
embedded model's weights (tests/loader/loader_gguf_writing.py's encoder) while Q5_K and Q6_K blocks hold random
codes with sane scales (that writer has no encoder for them): the text means less, the formats' arithmetic is the
same, and that is what the exactness checks exercise.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
Q = gguf.GGMLQuantizationType
# ftype: (llama.cpp's ftype code, the fallback type of other matrices, ffn_down's K-quant)
MIXES = {"Q4_K_M": (15, Q.Q5_0, Q.Q4_K), "Q5_K_M": (17, Q.Q5_1, Q.Q5_K), "Q6_K": (18, Q.Q8_0, Q.Q6_K)}


def smollm_kquant_file(ftype: str, directory: Path) -> Path:
    """The file for `ftype`: llama.cpp's where it can make one, else this module's."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import model_files

    try:
        import llama_cpp  # noqa: F401  (the bench extra)
    except ImportError:
        return write_mix(model_files, ftype, directory / f"smollm2-135m-{ftype}-tests.gguf")
    return model_files.smollm_file(ftype)


def _more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose ffn_down (and attn_v) get Q6_K (Q8_0) in a _M mix."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


def _tensor_type(name: str, ftype: str, num_layers: int) -> gguf.GGMLQuantizationType:
    _, fallback, kquant = MIXES[ftype]
    if name == "token_embd.weight":
        return Q.Q8_0
    layer = int(name.split(".")[1])
    if ftype != "Q6_K" and _more_bits(layer, num_layers):
        if name.endswith("ffn_down.weight"):
            return Q.Q6_K
        if name.endswith("attn_v.weight"):
            return Q.Q8_0
    return kquant if name.endswith("ffn_down.weight") else fallback


# A small model whose matrices are whole 256-wide super-blocks (benchmarks/model_files.py's shape keys).
SMALL_SHAPE = dict(arch="llama", name="random llama 256", hidden=256, layers=2, heads=4, kv_heads=2, ffn=512, tied=True)
# Per low-bit mix: llama.cpp's ftype code and each matrix's type (by the name's ending), after llama.cpp's
# Q3_K_M and Q2_K mixes: the embedding (tied to the output layer) and v, o and down projections at more bits.
LOW_BIT_MIXES = {
    "Q3_K_M": (
        12,
        {"token_embd.weight": Q.Q6_K, "attn_v.weight": Q.Q5_K, "attn_output.weight": Q.Q4_K, "ffn_down.weight": Q.Q5_K},
        Q.Q3_K,
    ),
    "Q2_K": (
        10,
        {"token_embd.weight": Q.Q2_K, "attn_v.weight": Q.Q3_K, "attn_output.weight": Q.Q3_K, "ffn_down.weight": Q.Q3_K},
        Q.Q2_K,
    ),
}


def low_bit_file(ftype: str, directory: Path) -> Path:
    """The small random model (SMALL_SHAPE) in LOW_BIT_MIXES[ftype]."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import model_files

    target = directory / f"random-llama-256-{ftype}.gguf"
    if target.exists():
        return target
    code, types, default = LOW_BIT_MIXES[ftype]
    source = model_files.write_random_model(
        model_files.embedded_model_path(), directory / "random-llama-256-f16.gguf", SMALL_SHAPE
    )

    def tensor_type(name: str) -> gguf.GGMLQuantizationType:
        return next((t for ending, t in types.items() if name.endswith(ending)), default)

    return _reencode(model_files, str(source), code, tensor_type, target)


def write_mix(model_files, ftype: str, target: Path) -> Path:
    """The embedded model's weights, dequantized, re-encoded in llama.cpp's mix for `ftype`."""
    if target.exists():
        return target
    reader = gguf.GGUFReader(model_files.embedded_model_path())
    num_layers = int(reader.fields["llama.block_count"].contents())
    return _reencode(
        model_files,
        model_files.embedded_model_path(),
        MIXES[ftype][0],
        lambda name: _tensor_type(name, ftype, num_layers),
        target,
    )


def _reencode(
    model_files: ModuleType,
    source: str,
    file_type: int,
    tensor_type: Callable[[str], gguf.GGMLQuantizationType],
    target: Path,
) -> Path:
    """Every tensor of `source`, dequantized, re-encoded as tensor_type(name) says (1-D tensors stay float)."""
    sys.path.insert(0, str(ROOT / "tests" / "loader"))
    from loader_gguf_writing import encode

    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(str(target.with_suffix(".partial")), "llama")
    model_files.copy_metadata(reader, writer, {"general.file_type": file_type})
    rng = np.random.default_rng(0)
    for tensor in reader.tensors:
        values = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        values = values.reshape(tuple(int(d) for d in reversed(tensor.shape)))
        if values.ndim == 1:
            writer.add_tensor(tensor.name, values)
            continue
        qtype = tensor_type(tensor.name)
        writer.add_tensor(tensor.name, encode(values, qtype, rng), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    target.with_suffix(".partial").rename(target)
    return target
