"""Build and call the native CPU kernels: quantized GEMV (gemv.cpp) and GEMM (gemm.cpp), the small ops of a layer
(ops.cpp), paged decode attention (attention.cpp), and a whole decoder stack made of them (decoder.cpp: Llama, Qwen3
and Gemma layers).

PyTorch's own packed-weight CPU kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) stream the weights
of a one-row product far below memory speed on this class of machine (see benchmarks/results/kernels.md), so the
decode-shaped products run here instead. On a decode step the rest of a layer (norms, rotary, silu, attention over
a few hundred cached tokens) is a few microseconds of arithmetic behind ~40 PyTorch op dispatches, so those run
here too, one call each. The sources are compiled once per machine with the system C++ compiler
(`-O3 -march=native -fopenmp`) into one library in a cache folder keyed by the sources, the compiler and the CPU
flags, and called through ctypes: no PyTorch headers, so a build takes seconds, not minutes.

Contract: `load_kernels()` returns `NativeKernels`, or None when the CPU lacks AVX2/FMA/F16C or no compiler
works; the definitions then run as they are, computing the same thing (models/quant.py, layers.py,
attention.py). Nothing here knows about files or models: tensors in, tensors out, CPU only.

Every wrapper checks, before it calls into C++, that each tensor it hands over has the dtype, the layout and the
number of elements the kernel will read or write given the other arguments (rows, columns, group sizes), and raises
ValueError saying which one does not: a wrong call is an error, never a read past a buffer. The checks are shape
arithmetic, a few comparisons a call. What they do not do is read the data: indices inside tensors are checked where
they come from, or by the kernel itself, as each docstring says (paged attention checks its slots, block ids and
lengths; the greedy loop its token ids and positions). Callers that pick between these and the definitions (the fast
path, models/cpu/fast_path.py) ask first and get None where a call does not fit; these errors are for bugs.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenriver.kv.cache import head_dim_of
from tokenriver.models.buffers import Allocate, heap_empty
from tokenriver.models.cpu.tiles import TILE_ROWS, KTiles, Tiles

logger = logging.getLogger(__name__)

KERNELS_DIR = Path(__file__).parent / "csrc"
SOURCES = tuple(
    KERNELS_DIR / name
    for name in (
        "gemv.cpp",
        "gemm.cpp",
        "ops.cpp",
        "attention.cpp",
        "decoder.cpp",
        "convert.cpp",
        "kquant.cpp",
        "tiling.cpp",
    )
)
HEADERS = (KERNELS_DIR / "vec.h", KERNELS_DIR / "tiles.h", KERNELS_DIR / "kquant.h")
REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")
# KV pool dtypes the native paged attention reads (queries, keys, values and outputs are float32 either way), in the
# order of its kv_cache_format codes (0, 1, 2).
NATIVE_KV_CACHE_DTYPES = (torch.float32, torch.float16, torch.int8)
# How a product rounds its inputs (models/quant.py's rounded mode), in the order of decoder.cpp's codes (0, 1): exact
# float32, or activations to int8 per 32 columns.
ROUNDINGS = (None, "int8")
# GGUF type codes (gguf.GGMLQuantizationType) of the 5-bit types and the K-quants the converters take.
_Q5_0, _Q5_1, _Q2_K, _Q3_K, _Q4_K, _Q5_K, _Q6_K = 6, 7, 10, 11, 12, 13, 14
# Per row of a matrix: argmax [M] int64, max [M] float32, log-sum-exp [M] float32.
Reductions = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
# -ffp-contract=off: a * b - c * d rounds both products, as PyTorch's elementwise ops do (explicit FMAs stay).
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC", "-std=c++17")


def _cpu_flags() -> set[str]:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    for line in lines:
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _cache_dir() -> Path:
    return Path.home() / ".cache" / "tokenriver" / "kernels"


# Set to 0 to run without the native kernels: no compiler call (a GPU machine's CUDA path never uses them).
NATIVE_KERNELS_VARIABLE = "TOKENRIVER_NATIVE_KERNELS"
# Builds tried before running without the kernels, where a failure may be transient (_may_pass_on_retry).
BUILD_ATTEMPTS = 3


def _build(compiler: str, flags: set[str]) -> Path:
    """Compile the sources unless a build of these exact sources for this CPU and compiler is cached."""
    source = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(
        source + version.encode() + " ".join(COMPILE_FLAGS).encode() + " ".join(sorted(flags)).encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"tokenriver-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the target and rename: two processes building at once each publish a whole file.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / "tokenriver.so"
        subprocess.run(
            [compiler, *COMPILE_FLAGS, *map(str, SOURCES), "-o", str(built)], capture_output=True, text=True, check=True
        )
        os.replace(built, target)
    return target


def is_contiguous_f32(tensor: torch.Tensor) -> bool:
    """A float32 CPU tensor the kernels can read as one packed array."""
    return tensor.dtype == torch.float32 and tensor.is_cpu and tensor.is_contiguous()


def is_f32_rows(tensor: torch.Tensor) -> bool:
    """[T, heads, head_dim] float32 on the CPU, heads packed inside each row; rows may be views into wider rows
    (q, k and v as slices of the fused qkv projection)."""
    if tensor.dtype != torch.float32 or not tensor.is_cpu or tensor.dim() != 3:
        return False
    strides = tensor.stride()
    return strides[2] == 1 and strides[1] == tensor.shape[2]


def kv_cache_format(pool: torch.Tensor) -> int:
    """The attention kernel's code for a native pool's dtype (NATIVE_KV_CACHE_DTYPES)."""
    return NATIVE_KV_CACHE_DTYPES.index(pool.dtype)


def is_native_kv_pool(key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """A layer's key and value pools as the native attention reads them: contiguous CPU tensors of the same dtype,
    float32, float16 or int8 (kv/cache.py's formats)."""
    return (
        key_cache.dtype in NATIVE_KV_CACHE_DTYPES
        and value_cache.dtype == key_cache.dtype
        and key_cache.is_cpu
        and value_cache.is_cpu
        and key_cache.is_contiguous()
        and value_cache.is_contiguous()
    )


def _is_int64_array(tensor: torch.Tensor) -> bool:
    return tensor.dtype == torch.int64 and tensor.is_cpu and tensor.is_contiguous()


def _describe(tensor: torch.Tensor) -> str:
    layout = "contiguous" if tensor.is_contiguous() else f"strides {tuple(tensor.stride())}"
    return f"{str(tensor.dtype).removeprefix('torch.')} {tuple(tensor.shape)} ({layout}, on {tensor.device.type})"


def check_array(where: str, name: str, tensor: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """ValueError unless `tensor` is a contiguous CPU tensor of `dtype` and exactly `shape`: what a kernel reads as
    one packed array."""
    if tensor.dtype != dtype or not tensor.is_cpu or not tensor.is_contiguous() or tuple(tensor.shape) != shape:
        expected = f"{str(dtype).removeprefix('torch.')} {shape}"
        raise ValueError(f"{where}: {name} must be a contiguous CPU tensor {expected}, got {_describe(tensor)}")


def check_elements(where: str, name: str, tensor: torch.Tensor, dtype: torch.dtype, numel: int) -> None:
    """ValueError unless `tensor` is a contiguous CPU tensor of `dtype` with `numel` elements, of any shape (a
    [T, 1, d] view read as [T, d])."""
    if tensor.dtype != dtype or not tensor.is_cpu or not tensor.is_contiguous() or tensor.numel() != numel:
        expected = f"{str(dtype).removeprefix('torch.')} of {numel} elements"
        raise ValueError(f"{where}: {name} must be a contiguous CPU tensor, {expected}, got {_describe(tensor)}")


def _check_rows_of(where: str, name: str, tensor: torch.Tensor, num_rows: int, heads: int, head_dim: int) -> None:
    """[num_rows, heads, head_dim] float32 rows on the CPU, heads packed inside each row (is_f32_rows)."""
    if not is_f32_rows(tensor) or tuple(tensor.shape) != (num_rows, heads, head_dim):
        raise ValueError(
            f"{where}: {name} must be float32 rows ({num_rows}, {heads}, {head_dim}) on the CPU, each row's heads "
            f"packed, got {_describe(tensor)}"
        )


def check_tiles(tiles: Tiles, where: str = "packed weight") -> None:
    """ValueError unless the row tiles hold every element the products (and dequantize_rows) read for a weight of
    tiles.rows × tiles.cols in groups of tiles.group_size (tiles.h's layout): columns and groups in whole 32-column
    blocks; codes [ceil(N/16), K/32, words, 16, 4]; scales (and an int4 weight's mins, unless it is centred)
    [ceil(N/16), K/G, 16]; an int5 weight's masks [ceil(N/16), K/32, 2, 4]; sub-chain ends rising to K/32."""
    rows, cols, group_size = tiles.rows, tiles.cols, tiles.group_size
    if rows < 0 or cols <= 0 or cols % 32 or group_size <= 0 or group_size % 32 or cols % group_size:
        raise ValueError(
            f"{where}: {rows} x {cols} in groups of {group_size}: the columns and the group size must be positive "
            f"multiples of 32, the group size dividing the columns"
        )
    num_tiles, blocks, groups = -(-rows // TILE_ROWS), cols // 32, cols // group_size
    words = 4 if tiles.is_int4 else 8
    check_elements(where, "codes", tiles.codes, tiles.codes.dtype, num_tiles * blocks * words * 64)
    check_elements(where, "scales", tiles.scales, torch.float16, num_tiles * groups * TILE_ROWS)
    if tiles.is_int4 and tiles.mins is not None:
        check_elements(where, "mins", tiles.mins, torch.float16, num_tiles * groups * TILE_ROWS)
    if tiles.fifth is not None:
        check_elements(where, "fifth bits", tiles.fifth, torch.int64, num_tiles * blocks * 8)
    if tiles.chain_ends is not None:
        ends = tiles.chain_ends
        check_elements(where, "chain_ends", ends, torch.int64, ends.numel())
        values = ends.tolist()
        if not values or values != sorted(set(values)) or values[0] <= 0 or values[-1] != blocks:
            raise ValueError(f"{where}: chain_ends must rise from 1 to the {blocks} blocks of a row, got {values}")


def _valid_layout(layout: Any) -> bool:
    """Whether a RecordLayout is one kquant.h reads: scales and mins per 16 or 32 at a width it unpacks, 4-bit codes
    with up to two high bits or 2-bit codes with up to one."""
    return (
        layout.scale_group in (16, 32)
        and layout.min_group in (16, 32)
        and (layout.low_bits, layout.num_high) in ((4, 0), (4, 1), (4, 2), (2, 0), (2, 1))
        and layout.packs_terms()
    )


def check_ktiles(tiles: KTiles, where: str = "K-quant weight") -> None:
    """ValueError unless the tile records hold every byte kquant.h reads for a weight of tiles.rows × tiles.cols
    (columns in whole 256-column super-blocks, scales and mins per 16 or 32, 4-bit codes with up to two high bits or
    2-bit codes with up to one)."""
    rows, cols, layout = tiles.rows, tiles.cols, tiles.layout
    if rows < 0 or cols <= 0 or cols % 256 or not _valid_layout(layout):
        raise ValueError(
            f"{where}: {rows} x {cols} in {layout}: the columns must be a positive multiple of 256, the scales and "
            f"mins per 16 or 32, the codes 4 bits with up to two high bits or 2 bits with up to one"
        )
    num_tiles = -(-rows // TILE_ROWS)
    check_elements(where, "records", tiles.records, torch.uint8, num_tiles * cols // 256 * TILE_ROWS * layout.size)
    if tiles.offset_masks is not None:
        check_elements(where, "offset_masks", tiles.offset_masks, torch.int16, num_tiles)
    if tiles.chain_ends is not None:
        values = tiles.chain_ends.tolist()
        check_elements(where, "chain_ends", tiles.chain_ends, torch.int64, len(values))
        blocks = cols // 32
        if not values or values != sorted(set(values)) or values[0] <= 0 or values[-1] != blocks:
            raise ValueError(f"{where}: chain_ends must rise from 1 to the {blocks} blocks of a row, got {values}")


def _relayout_fields(layout: Any) -> ctypes.Array:
    """A RecordLayout as kquant.cpp's RowLayout: its byte offsets, then its groups and centre."""
    values = (layout.size, layout.high, layout.scales, layout.d, layout.low_bits, layout.num_high)
    values += (layout.scale_group, int(layout.has_mins), layout.min_group, layout.centre, layout.term_bits)
    return (_i64 * 11)(*values)


# decoder.cpp's structs, field for field. Pointers are raw addresses: whoever fills one keeps its tensors alive.
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class KQuantSpec(ctypes.Structure):
    """A K-quant weight in tile records (kquant.h's KQuantWeight); `tiles` keeps the tensors it points into alive."""

    _fields_ = [
        ("records", _ptr),
        ("offset_masks", _ptr),
        ("N", _i64),
        ("K", _i64),
        ("scale_group", _i64),
        ("record", _i64),
        ("num_high", ctypes.c_int32),
        ("has_mins", ctypes.c_int32),
        ("chain_ends", _ptr),
        ("low_bits", ctypes.c_int32),
        ("min_group", ctypes.c_int32),
        ("term_bits", ctypes.c_int32),
    ]

    @classmethod
    def of(cls, tiles: KTiles) -> KQuantSpec:
        layout = tiles.layout
        spec = cls(
            tiles.records.data_ptr(),
            None if tiles.offset_masks is None else tiles.offset_masks.data_ptr(),
            tiles.rows,
            tiles.cols,
            layout.scale_group,
            TILE_ROWS * layout.size,
            layout.num_high,
            int(layout.has_mins),
            None if tiles.chain_ends is None else tiles.chain_ends.data_ptr(),
            layout.low_bits,
            layout.min_group,
            layout.term_bits,
        )
        spec.tiles = tiles
        return spec


class LinearSpec(ctypes.Structure):
    """A quantized linear layer: weight pointers, sizes, and which product runs it (decoder.cpp's Linear)."""

    _fields_ = [
        ("qweight", _ptr),
        ("scales", _ptr),
        ("mins", _ptr),
        ("high_bits", _ptr),
        ("bias", _ptr),
        ("out_features", _i64),
        ("in_features", _i64),
        ("group_size", _i64),
        ("max_gemv_rows", _i64),
        ("is_int4", ctypes.c_int32),
        ("int8_activations", ctypes.c_int32),
        ("gemm_rounding", ctypes.c_int32),
        ("chain_ends", _ptr),
        ("kquant", ctypes.POINTER(KQuantSpec)),
        ("parts", _ptr),  # a LinearSpec array: a projection of parts run apart (models/stacked.py), or null
        ("num_parts", _i64),
    ]


class LayerSpec(ctypes.Structure):
    """One decoder layer's norm weights, projections and attention options (decoder.cpp's Layer; the parts after
    `down` are null or 0 where a layer has none)."""

    _fields_ = [
        ("input_norm", _ptr),
        ("pre_mlp_norm", _ptr),
        ("qkv", LinearSpec),
        ("o", LinearSpec),
        ("gate_up", LinearSpec),
        ("down", LinearSpec),
        ("q_norm", _ptr),
        ("k_norm", _ptr),
        ("attention_out_norm", _ptr),
        ("mlp_out_norm", _ptr),
        ("window", _i64),
        ("local_rope", ctypes.c_int32),
        ("moe", _ptr),
    ]


class MoeSpec(ctypes.Structure):
    """A mixture-of-experts MLP (decoder.cpp's Moe): float32 router and shared gate, per-expert projections as
    arrays of LinearSpec, the shared expert's as pointers to one each (null without one)."""

    _fields_ = [
        ("router", _ptr),
        ("num_experts", _i64),
        ("top_k", _i64),
        ("normalize", ctypes.c_int32),
        ("intermediate_size", _i64),
        ("gate_ups", _ptr),
        ("downs", _ptr),
        ("shared_gate_up", _ptr),
        ("shared_down", _ptr),
        ("shared_intermediate_size", _i64),
        ("shared_gate", _ptr),
    ]


class DecoderSpec(ctypes.Structure):
    """The stack: its layers and shapes (decoder.cpp's Decoder)."""

    _fields_ = [
        ("layers", ctypes.POINTER(LayerSpec)),
        ("num_layers", _i64),
        ("hidden_size", _i64),
        ("num_heads", _i64),
        ("num_kv_heads", _i64),
        ("head_dim", _i64),
        ("intermediate_size", _i64),
        ("rms_norm_eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("activation", ctypes.c_int32),
        ("rotary_dim", _i64),
        ("softcap", ctypes.c_float),
    ]


class StepSpec(ctypes.Structure):
    """One step's activations, positions, cache and attention metadata (decoder.cpp's Step)."""

    _fields_ = [
        ("hidden", _ptr),
        ("out", _ptr),
        ("residual", _ptr),
        ("num_tokens", _i64),
        ("cos", _ptr),
        ("sin", _ptr),
        ("local_cos", _ptr),
        ("local_sin", _ptr),
        ("slots", _ptr),
        ("block_tables", _ptr),
        ("num_requests", _i64),
        ("max_blocks", _i64),
        ("queries", _ptr),
        ("num_queries", _i64),
        ("chunks", _ptr),
        ("num_chunks", _i64),
        ("key_caches", _ptr),
        ("value_caches", _ptr),
        ("num_blocks", _i64),
        ("block_size", _i64),
        ("num_threads", ctypes.c_int32),
        ("kv_cache_format", ctypes.c_int32),
        ("threading", ctypes.c_int32),
    ]


class GreedyLoopSpec(ctypes.Structure):
    """Greedy passes of a multi-step decode: the embedding, rotary tables, final norm and output projection the
    passes run around the stack, their first tokens and positions, and their outputs (decoder.cpp's GreedyLoop)."""

    _fields_ = [
        ("table", ctypes.POINTER(LinearSpec)),
        ("float_table", _ptr),
        ("vocab_size", _i64),
        ("embed_scale", ctypes.c_float),
        ("cos_table", _ptr),
        ("sin_table", _ptr),
        ("local_cos_table", _ptr),
        ("local_sin_table", _ptr),
        ("num_positions", _i64),
        ("final_norm", _ptr),
        ("final_norm_eps", ctypes.c_float),
        ("lm_head", ctypes.POINTER(LinearSpec)),
        ("num_passes", _i64),
        ("first_tokens", _ptr),
        ("first_positions", _ptr),
        ("tokens", _ptr),
        ("max_logits", _ptr),
        ("log_normalizers", _ptr),
    ]


# A compiled function's ctypes signature: its argument types and its return type (None: void).
Signature = tuple[list[type], type | None]

_int, _float = ctypes.c_int, ctypes.c_float
_INT4_ARGS = [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _int]  # qweight, scales, mins, high bits...
_INT8_ARGS = [_ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _int]
# The int8-activation products take the weight's sub-chains (tiles.h's chain_ends) after its sizes.
_INT4_ROUNDED_ARGS = [*_INT4_ARGS[:7], _ptr, *_INT4_ARGS[7:]]
_INT8_ROUNDED_ARGS = [*_INT8_ARGS[:5], _ptr, *_INT8_ARGS[5:]]
# In the order NativeKernels.paged_attention passes them.
_PAGED_ATTENTION_ARGS = [
    *(_ptr, _i64, _i64),  # query, its row stride, num_tokens
    *(_ptr, _i64, _ptr, _i64),  # key and value, each with its row stride
    *(_ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64),  # slot_mapping, the two pools and their sizes
    *(_ptr, _i64, _i64),  # block_tables and its two dimensions
    *(_ptr, _i64, _ptr, _i64),  # queries and chunks, each with its count
    *(_float, _i64, _float),  # scale, window, softcap
    *(_ptr, _i64),  # out and its row stride
    *(_int, _int),  # threads, KV cache format
]
_SIGNATURES: dict[str, Signature] = {
    "int4_linear_f32": (_INT4_ARGS, None),
    "int4_linear_int8x": (_INT4_ROUNDED_ARGS, None),
    "int8_linear_f32": (_INT8_ARGS, None),
    "int8_linear_int8x": (_INT8_ROUNDED_ARGS, None),
    "int4_gemm_f32": (_INT4_ARGS, None),
    "int8_gemm_f32": (_INT8_ARGS, None),
    "int4_dequantize": ([_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _int], None),
    "int8_dequantize": ([_ptr, _ptr, _i64, _i64, _i64, _ptr, _int], None),
    "int4_dequantize_rows": ([_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _int], None),
    "int8_dequantize_rows": ([_ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _int], None),
    "rms_norm_f32": ([_ptr, _ptr, _ptr, _i64, _i64, _float, _ptr, _int], None),
    "rotary_f32": ([_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _int], None),
    "silu_mul_f32": ([_ptr, _i64, _i64, _ptr, _int], None),
    "gelu_tanh_mul_f32": ([_ptr, _i64, _i64, _ptr, _int], None),
    "argmax_logsumexp_f32": ([_ptr, _i64, _i64, _ptr, _ptr, _ptr, _int], _int),
    "paged_attention_supports": ([_i64], _int),
    "convert_to_int8_supports": ([_int], _int),
    "convert_to_int8": ([_ptr, _int, _i64, _i64, _ptr, _ptr, _int], _int),
    "convert_q4_k": ([_ptr, _i64, _i64, _ptr, _ptr, _ptr, _int], _int),
    "convert_q5_k": ([_ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _int], _int),
    "convert_q5": ([_ptr, _int, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _int], _int),
    "tile_rows_in_place": ([_ptr, _i64, _i64, _int, _int], _int),
    "tile_fifth_bits_in_place": ([_ptr, _i64, _i64, _int], None),
    "quantize_int8_groups": ([_ptr, _i64, _i64, _ptr, _ptr, _int], None),
    "convert_kquant": ([_ptr, _int, _i64, _i64, _ptr, _i64, _i64, _i64, _i64, _int], _int),
    "kquant_dequantize_rows": ([ctypes.POINTER(KQuantSpec), _ptr, _i64, _ptr, _int], None),
    "kquant_relayout": ([_ptr, _ptr, _i64, _i64, ctypes.POINTER(_i64), ctypes.POINTER(_i64), _ptr, _int], None),
    "kquant_tile_records": ([_ptr, _i64, _i64, _i64, _i64, _i64, _i64, _int, _int, _int, _int], None),
    "row_dots_f32": ([_ptr, _i64, _i64, _ptr, _i64, _ptr, _int], None),
    "moe_route_f32": ([_ptr, _i64, _i64, _i64, _int, _ptr, _ptr, _int], None),
    "sigmoid_gate_f32": ([_ptr, _i64, _i64, _ptr, _ptr, _int], None),
    "decoder_f32": ([ctypes.POINTER(DecoderSpec), ctypes.POINTER(StepSpec)], _int),
    "decoder_greedy_f32": (
        [ctypes.POINTER(DecoderSpec), ctypes.POINTER(StepSpec), ctypes.POINTER(GreedyLoopSpec)],
        _int,
    ),
    "paged_attention_window_f32": (_PAGED_ATTENTION_ARGS, _int),
    "release_thread_pool": ([], _int),
}
# Compiled only where the compiler targeted AVX512-VNNI (gemm.cpp).
_GEMM_INT8X_SIGNATURES: dict[str, Signature] = {
    "int4_gemm_int8x": (_INT4_ROUNDED_ARGS, None),
    "int8_gemm_int8x": (_INT8_ROUNDED_ARGS, None),
}
# The K-quant products (kquant.cpp, gemm.cpp), compiled where kquant_supported says.
_KQUANT_SIGNATURES: dict[str, Signature] = {
    "kquant_linear_int8x": ([ctypes.POINTER(KQuantSpec), _ptr, _i64, _ptr, _int], None),
    "kquant_gemm_int8x": ([ctypes.POINTER(KQuantSpec), _ptr, _i64, _ptr, _int], None),
}


def _bind(library: ctypes.CDLL, signatures: dict[str, Signature]) -> dict[str, Any]:
    """Look up each function once and give it its signature, so ctypes converts and checks every call's arguments."""
    functions = {}
    for name, (argtypes, restype) in signatures.items():
        function = getattr(library, name)
        function.argtypes = argtypes
        function.restype = restype
        functions[name] = function
    return functions


class NativeKernels:
    """Typed wrappers around the compiled functions; every tensor argument must be contiguous and on the CPU.

    A layer binds its weight once (`bind_int4` / `bind_int8`) and gets a function of the activations only: the
    weight's pointers and sizes are converted to C once, not on each of the ~200 calls of a decode step.
    """

    def __init__(self, library: ctypes.CDLL) -> None:
        self._functions = _bind(library, _SIGNATURES)
        # The int8-activation GEMM exists only where the compiler targeted AVX512-VNNI (gemm.cpp); elsewhere those
        # products of many rows run the GEMV, in the same arithmetic.
        library.gemm_int8x_supported.restype = ctypes.c_int
        self.gemm_int8 = bool(library.gemm_int8x_supported())
        if self.gemm_int8:
            self._functions.update(_bind(library, _GEMM_INT8X_SIGNATURES))
        # K-quant weights at their own size (kquant.cpp) need the same instructions; elsewhere the loader keeps them
        # in the int4/int8 layouts.
        library.kquant_supported.restype = ctypes.c_int
        self.kquant = bool(library.kquant_supported()) and self.gemm_int8
        if self.kquant:
            self._functions.update(_bind(library, _KQUANT_SIGNATURES))
        # Looked up once: these run ~10 times per layer per step.
        self._rms_norm = self._functions["rms_norm_f32"]
        self._rotary = self._functions["rotary_f32"]
        self._silu_mul = self._functions["silu_mul_f32"]
        self._gelu_tanh_mul = self._functions["gelu_tanh_mul_f32"]
        self._argmax_logsumexp = self._functions["argmax_logsumexp_f32"]
        self._paged_attention = self._functions["paged_attention_window_f32"]
        self._decoder = self._functions["decoder_f32"]
        # Head sizes paged_attention is compiled for.
        supports = self._functions["paged_attention_supports"]
        self.attention_head_dims = frozenset(size for size in range(8, 1025, 8) if supports(size))

    def _product(self, kind: str, rounding: str | None, many_rows: bool) -> Callable[..., None]:
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
        if many_rows and (rounding is None or self.gemm_int8):
            # Without AVX512-VNNI the int8 products of many rows run the GEMV: the same arithmetic (gemv.cpp).
            return self._functions[f"{kind}_gemm_{'int8x' if rounding else 'f32'}"]
        return self._functions[f"{kind}_linear_{'int8x' if rounding else 'f32'}"]

    def bind(
        self, tiles: Tiles, rounding: str | None = None, many_rows: bool = False
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """x [M, K] float32 ↦ x @ the dequantized weight [N, K]ᵀ, [M, N] float32, for a weight in row tiles
        (models/cpu/tiles.py: int4, int5 or int8).

        rounding "int8" rounds x to int8 per 32 columns first (llama.cpp's arithmetic): faster, less exact; K and
        the group size multiples of 32. many_rows picks the GEMM (gemm.cpp) over the GEMV: for more rows than a
        decode step has, where the product is bound by arithmetic rather than by reading the weights (with "int8",
        where gemm_int8 is True; elsewhere the GEMV, whose arithmetic per row is the same); with "int8" the tiles'
        chain_ends split each row's sum. The function keeps the tensors alive; bind again after moving or replacing
        them.
        """
        check_tiles(tiles, "bind")
        function = self._product("int4" if tiles.is_int4 else "int8", rounding, many_rows)
        weight = self._weight_arguments(tiles)
        if rounding is not None:
            weight = (*weight, None if tiles.chain_ends is None else tiles.chain_ends.data_ptr())
        out_features, in_features, f32 = tiles.rows, tiles.cols, torch.float32

        def linear(x: torch.Tensor) -> torch.Tensor:
            # The product reads x as M packed rows of K float32 values (its weight was checked when bound).
            if x.dtype != f32 or x.dim() != 2 or x.shape[1] != in_features or not x.is_contiguous() or not x.is_cpu:
                raise ValueError(
                    f"linear: x must be contiguous float32 rows [M, {in_features}] on the CPU, got {_describe(x)}"
                )
            y = torch.empty(x.shape[0], out_features, dtype=f32)  # [M, N]
            function(*weight, x.data_ptr(), x.shape[0], y.data_ptr(), torch.get_num_threads())
            return y

        linear.tiles = tiles  # the closure holds raw pointers: keep the tensors they point into alive
        return linear

    @staticmethod
    def _weight_arguments(tiles: Tiles) -> tuple:
        """The leading arguments of the products and dequantize_rows for a tiled weight."""
        if not tiles.is_int4:
            return tiles.codes.data_ptr(), tiles.scales.data_ptr(), tiles.rows, tiles.cols, tiles.group_size
        fifth = None if tiles.fifth is None else tiles.fifth.data_ptr()
        sizes = (tiles.rows, tiles.cols, tiles.group_size)
        mins = None if tiles.mins is None else tiles.mins.data_ptr()  # None: centred (tiles.py)
        return tiles.codes.data_ptr(), tiles.scales.data_ptr(), mins, fifth, *sizes

    def dequantize_rows(self, tiles: Tiles, row_ids: torch.Tensor) -> torch.Tensor:
        """Float32 rows [len(row_ids), K] of a weight in row tiles, decoded as the products decode them; row_ids
        int64, contiguous, each in [0, N).

        The ids are not read here: an embedding's lookup takes token ids that the engine checked against the
        vocabulary (prompts.check_prompt: every prompt id below config.vocab_size, the table's rows, which the loader
        checked) or that sampling drew from the output projection's rows (as many, loader/assemble.check_shapes)."""
        check_tiles(tiles, "dequantize_rows")
        if row_ids.dim() != 1:
            raise ValueError(f"dequantize_rows: row_ids must be one dimension of ids, got {_describe(row_ids)}")
        check_elements("dequantize_rows", "row_ids", row_ids, torch.int64, row_ids.shape[0])
        out = torch.empty(row_ids.shape[0], tiles.cols, dtype=torch.float32)
        function = self._functions["int4_dequantize_rows" if tiles.is_int4 else "int8_dequantize_rows"]
        function(
            *self._weight_arguments(tiles),
            row_ids.data_ptr(),
            row_ids.shape[0],
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out

    def bind_kquant(self, tiles: KTiles, many_rows: bool) -> Callable[[torch.Tensor], torch.Tensor]:
        """x [M, K] float32 ↦ x (rounded to int8 per 32 columns) @ the K-quant weight [N, K]ᵀ, [M, N] float32:
        the GEMV (kquant.cpp) or, for many_rows, the GEMM (gemm.cpp), one arithmetic per row either way."""
        check_ktiles(tiles, "bind_kquant")
        if not self.kquant:
            raise ValueError("bind_kquant: the K-quant products need a CPU with AVX512-VNNI (kquant_supported)")
        spec = KQuantSpec.of(tiles)
        function = self._functions["kquant_gemm_int8x" if many_rows else "kquant_linear_int8x"]
        out_features, in_features, f32 = tiles.rows, tiles.cols, torch.float32
        reference = ctypes.byref(spec)

        def linear(x: torch.Tensor) -> torch.Tensor:
            if x.dtype != f32 or x.dim() != 2 or x.shape[1] != in_features or not x.is_contiguous() or not x.is_cpu:
                raise ValueError(
                    f"linear: x must be contiguous float32 rows [M, {in_features}] on the CPU, got {_describe(x)}"
                )
            y = torch.empty(x.shape[0], out_features, dtype=f32)  # [M, N]
            function(reference, x.data_ptr(), x.shape[0], y.data_ptr(), torch.get_num_threads())
            return y

        linear.spec = spec  # the closure holds raw pointers: keep the tensors they point into alive
        return linear

    def kquant_relayout(
        self, records: torch.Tensor, offsets: torch.Tensor, layout: Any, union: Any, out: torch.Tensor, num_threads: int
    ) -> None:
        """Row records [N, K/256, layout.size] with their offsets [N] → the same values in the records `out`
        [N, K/256, union.size] of `union`, a layout that holds them (models/kquant.py's RecordLayout.union):
        concatenate_records' copy of a part, in one native pass."""
        num_rows, num_supers, size = records.shape
        check_array("kquant_relayout", "records", records, torch.uint8, (num_rows, num_supers, layout.size))
        check_array("kquant_relayout", "offsets", offsets, torch.uint8, (num_rows,))
        check_array("kquant_relayout", "out", out, torch.uint8, (num_rows, num_supers, union.size))
        fits = (
            _valid_layout(layout)
            and _valid_layout(union)
            and union.low_bits >= layout.low_bits
            and union.low_bits + union.num_high >= layout.low_bits + layout.num_high
            and union.scale_group <= layout.scale_group
            and (union.has_mins or not layout.has_mins)
            and (not layout.has_mins or union.min_group <= layout.min_group)
            and union.term_bits >= layout.term_bits
        )
        if not fits:
            raise ValueError(f"kquant_relayout: {union} does not hold the values of {layout}")
        fields = [_relayout_fields(layout), _relayout_fields(union)]
        self._functions["kquant_relayout"](
            records.data_ptr(), offsets.data_ptr(), num_rows, num_supers * 256, *fields, out.data_ptr(), num_threads
        )

    def tile_kquant_in_place(self, records: torch.Tensor, layout: Any, num_threads: int) -> None:
        """Row records [N, K/256, layout.size] rewritten as tile records over their own bytes (tiles.tile_kquant's
        result, in one native pass); N a multiple of 16."""
        num_rows, num_supers, size = records.shape
        if num_rows % TILE_ROWS or size != layout.size:
            raise ValueError(f"tile_kquant_in_place: {num_rows} rows of {size}-byte records, layout {layout}")
        check_elements("tile_kquant_in_place", "records", records, torch.uint8, num_rows * num_supers * size)
        self._functions["kquant_tile_records"](
            records.data_ptr(),
            num_rows,
            num_supers * 256,
            size,
            layout.high,
            layout.scales,
            layout.d,
            layout.num_high,
            int(layout.has_mins),
            layout.low_bits,
            num_threads,
        )

    def kquant_dequantize_rows(self, tiles: KTiles, row_ids: torch.Tensor) -> torch.Tensor:
        """Float32 rows [len(row_ids), K] of a K-quant weight in row tiles (dequantize_rows says whose ids)."""
        check_ktiles(tiles, "kquant_dequantize_rows")
        if row_ids.dim() != 1:
            raise ValueError(f"dequantize_rows: row_ids must be one dimension of ids, got {_describe(row_ids)}")
        check_elements("dequantize_rows", "row_ids", row_ids, torch.int64, row_ids.shape[0])
        out = torch.empty(row_ids.shape[0], tiles.cols, dtype=torch.float32)
        spec = KQuantSpec.of(tiles)
        self._functions["kquant_dequantize_rows"](
            ctypes.byref(spec), row_ids.data_ptr(), row_ids.shape[0], out.data_ptr(), torch.get_num_threads()
        )
        return out

    def convert_kquant(
        self, blocks: np.ndarray, gguf_type: int, in_features: int, layout: Any, num_threads: int, empty: Allocate
    ) -> torch.Tensor:
        """A K-quant matrix's GGUF bytes [N, row bytes] → its row records [N, K/256, layout.size] (kquant.cpp's
        convert_kquant; layout: models/kquant.py's RecordLayout of the type, whose record takes the block's
        bytes) in a tensor `empty` makes."""
        block_bytes = {_Q2_K: 84, _Q3_K: 110, _Q4_K: 144, _Q5_K: 176, _Q6_K: 210}[gguf_type]
        if layout.size != block_bytes or not _valid_layout(layout):
            raise ValueError(f"convert_kquant: {layout} is not GGUF type {gguf_type}'s record of {block_bytes} bytes")
        num_rows = _check_blocks("convert_kquant", blocks, in_features, 256, block_bytes)
        records = empty((num_rows, in_features // 256, layout.size), torch.uint8)
        check_elements("convert_kquant", "records", records, torch.uint8, num_rows * in_features // 256 * layout.size)
        status = self._functions["convert_kquant"](
            blocks.ctypes.data,
            gguf_type,
            num_rows,
            in_features,
            records.data_ptr(),
            layout.size,
            layout.high,
            layout.scales,
            layout.d,
            num_threads,
        )
        if status != 0:
            raise ValueError(f"convert_kquant: GGUF type {gguf_type} is not a K-quant it converts")
        return records

    def int4_dequantize(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor,
        group_size: int,
        high_bits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The float32 weight [N, K] of a row-major packing (the loader's, before tiling), decoded as the products
        decode it: qweight [N, K / 2] uint8, scales and mins [N, K / group_size] float16, high_bits None or
        [N, K / 32] int32."""
        if qweight.dim() != 2:
            raise ValueError(f"int4_dequantize: qweight must be [N, K / 2] uint8, got {_describe(qweight)}")
        out_features, in_features = qweight.shape[0], qweight.shape[1] * 2
        groups = _groups("int4_dequantize", in_features, group_size)
        check_array("int4_dequantize", "qweight", qweight, torch.uint8, (out_features, in_features // 2))
        check_array("int4_dequantize", "scales", scales, torch.float16, (out_features, groups))
        check_array("int4_dequantize", "mins", mins, torch.float16, (out_features, groups))
        if high_bits is not None:
            check_array("int4_dequantize", "high_bits", high_bits, torch.int32, (out_features, in_features // 32))
        out = torch.empty(out_features, in_features, dtype=torch.float32)  # [N, K]
        self._functions["int4_dequantize"](
            qweight.data_ptr(),
            scales.data_ptr(),
            mins.data_ptr(),
            None if high_bits is None else high_bits.data_ptr(),
            out_features,
            in_features,
            group_size,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out

    def int8_dequantize(self, qweight: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
        """The float32 weight [N, K] of qweight [N, K] int8 and scales [N, K / group_size] float16."""
        if qweight.dim() != 2:
            raise ValueError(f"int8_dequantize: qweight must be [N, K] int8, got {_describe(qweight)}")
        out_features, in_features = qweight.shape
        groups = _groups("int8_dequantize", in_features, group_size)
        check_array("int8_dequantize", "qweight", qweight, torch.int8, (out_features, in_features))
        check_array("int8_dequantize", "scales", scales, torch.float16, (out_features, groups))
        out = torch.empty(out_features, in_features, dtype=torch.float32)  # [N, K]
        self._functions["int8_dequantize"](
            qweight.data_ptr(),
            scales.data_ptr(),
            out_features,
            in_features,
            group_size,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out

    # GGUF blocks → packed weights (convert.cpp): the loader's fast path for loader/gguf_blocks.py's rules.

    def converts_to_int8(self, gguf_type: int) -> bool:
        """Whether convert_to_int8 takes this GGUF type code (Q8_0, Q2_K, Q3_K, Q6_K, IQ4_NL, IQ4_XS)."""
        return bool(self._functions["convert_to_int8_supports"](gguf_type))

    def convert_to_int8(
        self, blocks: np.ndarray, gguf_type: int, in_features: int, num_threads: int, empty: Allocate = heap_empty
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A GGUF matrix's bytes [N, row bytes] uint8 (C-contiguous, e.g. a view of the mapped file) → int8 codes
        [N, K] and float16 scales [N, K / 32], made by `empty`; None if a scale is not finite in float16."""
        if gguf_type not in _CONVERTED_BLOCKS or not self.converts_to_int8(gguf_type):
            raise ValueError(f"convert_to_int8: GGUF type {gguf_type} is not one it converts")
        num_rows = _check_blocks("convert_to_int8", blocks, in_features, *_CONVERTED_BLOCKS[gguf_type])
        q = empty((num_rows, in_features), torch.int8)  # [N, K]
        scales = empty((num_rows, in_features // 32), torch.float16)  # [N, K / 32]
        check_array("convert_to_int8", "the allocated codes", q, torch.int8, (num_rows, in_features))
        check_array("convert_to_int8", "the allocated scales", scales, torch.float16, (num_rows, in_features // 32))
        status = self._functions["convert_to_int8"](
            blocks.ctypes.data, gguf_type, num_rows, in_features, q.data_ptr(), scales.data_ptr(), num_threads
        )
        return None if status else (q, scales)

    # A mixture of experts' routing (ops.cpp), shared by the model page and the native decoder so that both pick
    # the same experts with the same weights. Float32 CPU tensors, contiguous.

    MAX_EXPERTS = 1024  # moe_route_f32's per-row buffer

    def row_dots(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ weight [N, K]ᵀ → [M, N] in one fixed summation order (a router's logits)."""
        if x.dim() != 2 or weight.dim() != 2:
            raise ValueError(f"row_dots: x and weight must be matrices, got {_describe(x)} and {_describe(weight)}")
        check_array("row_dots", "x", x, torch.float32, tuple(x.shape))
        check_array("row_dots", "weight", weight, torch.float32, (weight.shape[0], x.shape[1]))
        out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)  # [M, N]
        self._functions["row_dots_f32"](
            x.data_ptr(),
            x.shape[0],
            x.shape[1],
            weight.data_ptr(),
            weight.shape[0],
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out

    def moe_route(self, logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits [M, E] (E ≤ MAX_EXPERTS) → (experts [M, top_k] int64, weights [M, top_k] float32): the
        softmax's top_k, largest first, the chosen probabilities renormalized to sum to one if `normalize`."""
        if logits.dim() != 2:
            raise ValueError(f"moe_route: logits must be [M, E], got {_describe(logits)}")
        check_array("moe_route", "logits", logits, torch.float32, tuple(logits.shape))
        if not 0 < top_k <= logits.shape[1] <= self.MAX_EXPERTS:
            raise ValueError(f"moe_route: top_k {top_k} of {logits.shape[1]} experts (at most {self.MAX_EXPERTS})")
        experts = torch.empty(logits.shape[0], top_k, dtype=torch.int64)  # [M, top_k]
        weights = torch.empty(logits.shape[0], top_k, dtype=torch.float32)  # [M, top_k]
        self._functions["moe_route_f32"](
            logits.data_ptr(),
            logits.shape[0],
            logits.shape[1],
            top_k,
            int(normalize),
            experts.data_ptr(),
            weights.data_ptr(),
            torch.get_num_threads(),
        )
        return experts, weights

    def sigmoid_gate(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """sigmoid(x [M, K] . weight [K]) → [M, 1] (Qwen2-MoE's shared-expert gate)."""
        if x.dim() != 2:
            raise ValueError(f"sigmoid_gate: x must be [M, K], got {_describe(x)}")
        check_array("sigmoid_gate", "x", x, torch.float32, tuple(x.shape))
        check_elements("sigmoid_gate", "weight", weight, torch.float32, x.shape[1])
        out = torch.empty(x.shape[0], 1, dtype=torch.float32)  # [M, 1]
        self._functions["sigmoid_gate_f32"](
            x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), out.data_ptr(), torch.get_num_threads()
        )
        return out

    def quantize_int8_groups(self, weight: torch.Tensor, num_threads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Finite float32 rows [N, K] (contiguous, K a multiple of 32) → int8 codes [N, K] and float16 scales
        [N, K / 32]: quant.py's quantize_int8 with groups of 32, the same codes, without its passes over memory."""
        if weight.dim() != 2 or weight.shape[1] % 32:
            raise ValueError(
                f"quantize_int8_groups: weight must be [N, K] rows, K a multiple of 32, got {_describe(weight)}"
            )
        num_rows, in_features = weight.shape
        check_array("quantize_int8_groups", "weight", weight, torch.float32, (num_rows, in_features))
        q = torch.empty(num_rows, in_features, dtype=torch.int8)  # [N, K]
        scales = torch.empty(num_rows, in_features // 32, dtype=torch.float16)  # [N, K / 32]
        self._functions["quantize_int8_groups"](
            weight.data_ptr(), num_rows, in_features, q.data_ptr(), scales.data_ptr(), num_threads
        )
        return q, scales

    def convert_q4_k(
        self,
        blocks: np.ndarray,
        in_features: int,
        num_threads: int,
        empty: Allocate = heap_empty,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Q4_K bytes [N, K / 256 * 144] uint8 (C-contiguous) → nibbles [N, K / 2], float16 scales and mins
        [N, K / 32], made by `empty`; None if one is not finite in float16."""
        num_rows = _check_blocks("convert_q4_k", blocks, in_features, 256, 144)
        qweight = empty((num_rows, in_features // 2), torch.uint8)  # [N, K / 2]
        scales = empty((num_rows, in_features // 32), torch.float16)  # [N, K / 32]
        mins = empty((num_rows, in_features // 32), torch.float16)  # [N, K / 32]
        _check_int4_outputs("convert_q4_k", num_rows, in_features, qweight, scales, mins)
        status = self._functions["convert_q4_k"](
            blocks.ctypes.data,
            num_rows,
            in_features,
            qweight.data_ptr(),
            scales.data_ptr(),
            mins.data_ptr(),
            num_threads,
        )
        return None if status else (qweight, scales, mins)

    def convert_five_bit(
        self,
        blocks: np.ndarray,
        gguf_type: int,
        in_features: int,
        num_threads: int,
        empty: Allocate = heap_empty,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Q5_0, Q5_1 or Q5_K bytes [N, row bytes] uint8 (C-contiguous) → a 5-bit int4 packing: nibbles [N, K / 2],
        float16 scales and mins [N, K / 32] and the fifth bits [N, K / 32] int32, made by `empty`; None where a scale
        or min does not fit float16 (loader/gguf_blocks.py's numpy rule then decides)."""
        block_values, block_bytes = {_Q5_0: (32, 22), _Q5_1: (32, 24), _Q5_K: (256, 176)}[gguf_type]
        num_rows = _check_blocks("convert_five_bit", blocks, in_features, block_values, block_bytes)
        qweight = empty((num_rows, in_features // 2), torch.uint8)  # [N, K / 2]
        scales = empty((num_rows, in_features // 32), torch.float16)  # [N, K / 32]
        mins = empty((num_rows, in_features // 32), torch.float16)  # [N, K / 32]
        high_bits = empty((num_rows, in_features // 32), torch.int32)  # [N, K / 32]
        _check_int4_outputs("convert_five_bit", num_rows, in_features, qweight, scales, mins)
        groups = (num_rows, in_features // 32)
        check_array("convert_five_bit", "the allocated high bits", high_bits, torch.int32, groups)
        outputs = (qweight.data_ptr(), scales.data_ptr(), mins.data_ptr(), high_bits.data_ptr(), num_threads)
        if gguf_type == _Q5_K:
            status = self._functions["convert_q5_k"](blocks.ctypes.data, num_rows, in_features, *outputs)
        else:
            status = self._functions["convert_q5"](blocks.ctypes.data, gguf_type, num_rows, in_features, *outputs)
        return None if status else (qweight, scales, mins, high_bits)

    # Row tiles written over a row-major packing's bytes (tiling.cpp): tiles.py's tile_in_place in one pass.

    def tile_rows_in_place(self, tensor: torch.Tensor, num_threads: int) -> None:
        """A contiguous tensor [N, E] of 2- or 4-byte elements, N a multiple of 16, rewritten as [N / 16, E, 16]."""
        num_rows, elements = tensor.shape
        if num_rows % TILE_ROWS or tensor.element_size() not in (2, 4):
            raise ValueError(f"tile_rows_in_place: takes whole tiles of 2- or 4-byte elements, got {_describe(tensor)}")
        check_elements("tile_rows_in_place", "tensor", tensor, tensor.dtype, num_rows * elements)
        self._functions["tile_rows_in_place"](tensor.data_ptr(), num_rows, elements, tensor.element_size(), num_threads)

    def tile_fifth_bits_in_place(self, high_bits: torch.Tensor, num_threads: int) -> None:
        """Fifth-bit words [N, B] int32, N a multiple of 16, rewritten as tiles.py's masks [N / 16, B, 2, 4] int64."""
        num_rows, blocks = high_bits.shape
        if num_rows % TILE_ROWS:
            raise ValueError(f"tile_fifth_bits_in_place: takes whole tiles, got {_describe(high_bits)}")
        check_elements("tile_fifth_bits_in_place", "high_bits", high_bits, torch.int32, num_rows * blocks)
        self._functions["tile_fifth_bits_in_place"](high_bits.data_ptr(), num_rows, blocks, num_threads)

    # The small ops of a layer (ops.cpp). Float32 CPU tensors; "rows" may be views with a row stride, but the
    # values inside a row (heads and head dimensions) must be contiguous.

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """weight * x / sqrt(mean(x²) + eps) per row; x [M, K] and weight [K] contiguous.

        With residual (contiguous, like x): residual += x in place first, and the norm is of that sum.
        """
        if x.dim() != 2:
            raise ValueError(f"rms_norm: x must be [M, K], got {_describe(x)}")
        check_array("rms_norm", "x", x, torch.float32, tuple(x.shape))
        check_elements("rms_norm", "weight", weight, torch.float32, x.shape[1])
        if residual is not None:
            check_array("rms_norm", "residual", residual, torch.float32, tuple(x.shape))
        out = torch.empty_like(x)  # [M, K]
        self._rms_norm(
            x.data_ptr(),
            None if residual is None else residual.data_ptr(),
            weight.data_ptr(),
            x.shape[0],
            x.shape[1],
            eps,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out

    def rotary_(self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate query [T, num_heads, rotary_dim] and key [T, num_kv_heads, rotary_dim] in place (rotate_half
        layout): heads stride(1) floats apart, so a partial-rotary view (the first rotary_dim of each wider head)
        turns in place and the rest of each head stays.

        cos, sin: [T, rotary_dim // 2] values, contiguous (a [T, 1, rotary_dim // 2] view is fine).
        """
        _check_heads("rotary", "query", query)
        _check_heads("rotary", "key", key)
        num_tokens, rotary_dim = query.shape[0], query.shape[2]
        if (
            rotary_dim % 2
            or key.shape[0] != num_tokens
            or key.shape[2] != rotary_dim
            or key.stride(1) != query.stride(1)
        ):
            raise ValueError(
                f"rotary: query {_describe(query)} and key {_describe(key)} must have the same tokens, an even "
                f"rotary_dim and heads as far apart"
            )
        check_elements("rotary", "cos", cos, torch.float32, num_tokens * (rotary_dim // 2))
        check_elements("rotary", "sin", sin, torch.float32, num_tokens * (rotary_dim // 2))
        self._rotary(
            query.data_ptr(),
            query.stride(0),
            query.shape[1],
            key.data_ptr(),
            key.stride(0),
            key.shape[1],
            cos.data_ptr(),
            sin.data_ptr(),
            query.shape[0],
            query.stride(1),
            query.shape[2],
            torch.get_num_threads(),
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [M, 2I] contiguous (gate, then up) → silu(gate) * up, [M, I]."""
        _check_gate_up("silu_mul", gate_up)
        num_rows, width = gate_up.shape
        out = torch.empty(num_rows, width // 2, dtype=torch.float32)  # [M, I]
        self._silu_mul(gate_up.data_ptr(), num_rows, width // 2, out.data_ptr(), torch.get_num_threads())
        return out

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [M, 2I] contiguous (gate, then up) → gelu(gate, tanh approximation) * up, [M, I] (GeGLU)."""
        _check_gate_up("gelu_tanh_mul", gate_up)
        num_rows, width = gate_up.shape
        out = torch.empty(num_rows, width // 2, dtype=torch.float32)  # [M, I]
        self._gelu_tanh_mul(gate_up.data_ptr(), num_rows, width // 2, out.data_ptr(), torch.get_num_threads())
        return out

    def release_thread_pool(self) -> bool:
        """End the calling thread's OpenMP worker pool (ops.cpp: why a pool left behind slows other threads);
        whether it was released (not from inside parallel work)."""
        return self._functions["release_thread_pool"]() == 0

    def argmax_logsumexp(self, logits: torch.Tensor) -> Reductions | None:
        """Per row of float32 logits [N, V]: the argmax (first of equal maxima, as torch.argmax), the largest logit
        and log(sum(exp(row))), in one pass over the logits instead of PyTorch's separate reductions (each its own
        pass over a [64, 49152] tensor in a batched decode step). The largest logit minus the log-sum-exp
        is the argmax's logprob, so a greedy row needs nothing else. None, so that the caller takes PyTorch's path,
        for logits the kernel cannot read (not a contiguous float32 [N, V] CPU tensor) and when a row holds NaN or
        no finite value (cases PyTorch defines).
        """
        if not is_contiguous_f32(logits) or logits.dim() != 2:
            return None
        num_rows, vocab_size = logits.shape
        argmax = torch.empty(num_rows, dtype=torch.int64)  # [N]
        max_logits = torch.empty(num_rows, dtype=torch.float32)  # [N]
        lse = torch.empty(num_rows, dtype=torch.float32)  # [N]
        num_not_finite = self._argmax_logsumexp(
            logits.data_ptr(),
            num_rows,
            vocab_size,
            argmax.data_ptr(),
            max_logits.data_ptr(),
            lse.data_ptr(),
            torch.get_num_threads(),
        )
        return (argmax, max_logits, lse) if num_not_finite == 0 else None

    def paged_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        slot_mapping: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        queries: torch.Tensor | None,
        chunks: torch.Tensor | None,
        scale: float,
        out: torch.Tensor,
        window: int = 0,
        softcap: float | None = None,
    ) -> None:
        """Write this step's keys/values into their slots, then attend for the listed query tokens into out.

        query, out [T, num_heads, head_dim] and key, value [T, num_kv_heads, head_dim] are float32 rows (views into
        wider rows are fine); slot_mapping [T] int64; caches [num_blocks, block_size, num_kv_heads, entry_size]
        contiguous, both float32, float16 or int8 (kv/cache.py's formats); block_tables [num_requests, max_blocks]
        int64 contiguous. queries [n, 3] int64 contiguous, one row per single query token: (its row in query/out,
        its request's row in block_tables, how many tokens it sees); chunks [c, 4] int64 contiguous, one row per
        prompt chunk whose tokens attend causally: (its first row, its request's row, its number of tokens, the
        request's context length after it). Either may be None. Out's other rows are left untouched. window > 0:
        each token sees only the last `window` positions up to its own (sliding-window attention); 0: its whole
        context. softcap: the scores become softcap * tanh(scores / softcap) before the softmax (Gemma 2); None: as
        they are.
        """
        num_blocks, block_size, num_kv_heads, head_dim = _check_paged_attention(
            query, key, value, slot_mapping, key_cache, value_cache, block_tables, queries, chunks, out
        )
        num_tokens = query.shape[0]
        status = self._paged_attention(
            query.data_ptr(),
            query.stride(0),
            num_tokens,
            key.data_ptr(),
            key.stride(0),
            value.data_ptr(),
            value.stride(0),
            slot_mapping.data_ptr(),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            num_blocks,
            block_size,
            query.shape[1],
            num_kv_heads,
            head_dim,
            block_tables.data_ptr(),
            block_tables.shape[0],
            block_tables.shape[1],
            None if queries is None else queries.data_ptr(),
            0 if queries is None else queries.shape[0],
            None if chunks is None else chunks.data_ptr(),
            0 if chunks is None else chunks.shape[0],
            scale,
            window,
            softcap or 0.0,
            out.data_ptr(),
            out.stride(0),
            torch.get_num_threads(),
            kv_cache_format(key_cache),
        )
        _raise_for_attention_status(status, head_dim)

    def decoder(self, decoder: DecoderSpec, step: StepSpec) -> None:
        """Run every layer of the stack on one step (decoder.cpp): step.out and step.residual get the last layer's
        MLP output and the residual stream before it, as the model's decoder layer returns them.

        The caller has checked every pointer and shape (models/cpu/decoder.py); errors found by the attention
        kernel's own range checks are raised as paged_attention raises them.
        """
        _raise_for_attention_status(self._decoder(ctypes.byref(decoder), ctypes.byref(step)), decoder.head_dim)

    def decoder_greedy(self, decoder: DecoderSpec, step: StepSpec, loop: GreedyLoopSpec) -> int:
        """Run loop.num_passes greedy passes of the stack (decoder.cpp's decoder_greedy_f32) and return how many
        it finished; the caller has checked every pointer and shape and runs the passes left its own way."""
        return self._functions["decoder_greedy_f32"](ctypes.byref(decoder), ctypes.byref(step), ctypes.byref(loop))


# GGUF type code → (values, bytes) of one block, for the types convert_to_int8 takes (convert.cpp's block_bytes).
_CONVERTED_BLOCKS = {8: (32, 34), 10: (256, 84), 11: (256, 110), 14: (256, 210), 20: (32, 18), 23: (256, 136)}


def _groups(where: str, in_features: int, group_size: int) -> int:
    """Groups per row: the columns and the group size whole 32-column blocks, the group size dividing the columns."""
    if in_features <= 0 or in_features % 32 or group_size <= 0 or group_size % 32 or in_features % group_size:
        raise ValueError(
            f"{where}: {in_features} columns in groups of {group_size}: both must be positive multiples of 32, the "
            f"group size dividing the columns"
        )
    return in_features // group_size


def _check_blocks(where: str, blocks: np.ndarray, in_features: int, block_values: int, block_bytes: int) -> int:
    """blocks: a GGUF matrix's bytes, [N, K / block_values * block_bytes] uint8, C-contiguous; returns N."""
    if in_features <= 0 or in_features % block_values or in_features % 32:
        raise ValueError(f"{where}: {in_features} columns are not whole blocks of {block_values}")
    row_bytes = in_features // block_values * block_bytes
    if (
        not isinstance(blocks, np.ndarray)
        or blocks.dtype != np.uint8
        or blocks.ndim != 2
        or blocks.shape[1] != row_bytes
        or not blocks.flags.c_contiguous
    ):
        got = f"{blocks.dtype} {blocks.shape}" if isinstance(blocks, np.ndarray) else type(blocks).__name__
        raise ValueError(f"{where}: blocks must be C-contiguous uint8 [N, {row_bytes}], got {got}")
    return blocks.shape[0]


def _check_int4_outputs(
    where: str, num_rows: int, in_features: int, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> None:
    """What an allocator handed a K-quant conversion to write: an int4 packing of num_rows × in_features."""
    check_array(where, "the allocated codes", qweight, torch.uint8, (num_rows, in_features // 2))
    check_array(where, "the allocated scales", scales, torch.float16, (num_rows, in_features // 32))
    check_array(where, "the allocated mins", mins, torch.float16, (num_rows, in_features // 32))


def _check_heads(where: str, name: str, tensor: torch.Tensor) -> None:
    """[T, heads, d] float32 on the CPU, each head's d values contiguous and heads at least d apart."""
    if (
        tensor.dtype != torch.float32
        or not tensor.is_cpu
        or tensor.dim() != 3
        or tensor.stride(2) != 1
        or tensor.stride(1) < tensor.shape[2]
    ):
        raise ValueError(
            f"{where}: {name} must be float32 [T, heads, d], each head's values contiguous, got {_describe(tensor)}"
        )


def _check_gate_up(where: str, gate_up: torch.Tensor) -> None:
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"{where}: gate_up must be [M, 2I], got {_describe(gate_up)}")
    check_array(where, "gate_up", gate_up, torch.float32, tuple(gate_up.shape))


def _check_paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    queries: torch.Tensor | None,
    chunks: torch.Tensor | None,
    out: torch.Tensor,
) -> tuple[int, int, int, int]:
    """ValueError unless paged_attention's tensors hold what the kernel reads (its docstring's shapes and dtypes);
    returns the pools' (num_blocks, block_size, num_kv_heads, head_dim)."""
    num_tokens = query.shape[0]
    if not (key.shape[0] == value.shape[0] == slot_mapping.shape[0] == num_tokens):
        raise ValueError(
            f"paged attention: {num_tokens} query rows but {key.shape[0]} key, {value.shape[0]} "
            f"value rows and {slot_mapping.shape[0]} slots"
        )
    if not (
        _is_int64_array(slot_mapping)
        and _is_int64_array(block_tables)
        and (queries is None or _is_int64_array(queries))
        and (chunks is None or _is_int64_array(chunks))
    ):
        raise ValueError(
            "paged attention: slot_mapping, block_tables, queries and chunks must be contiguous int64 CPU tensors"
        )
    if not is_native_kv_pool(key_cache, value_cache):
        raise ValueError(
            f"paged attention: the pools must be contiguous CPU tensors, both float32, float16 or "
            f"int8, got {key_cache.dtype} and {value_cache.dtype}"
        )
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        raise ValueError(
            f"paged attention: the pools must be [num_blocks, block_size, num_kv_heads, entry] alike, got "
            f"{_describe(key_cache)} and {_describe(value_cache)}"
        )
    num_blocks, block_size, num_kv_heads = key_cache.shape[:3]
    head_dim = head_dim_of(key_cache)
    num_heads = query.shape[1] if query.dim() == 3 else 0
    if num_kv_heads < 1 or num_heads % num_kv_heads or head_dim < 1:
        raise ValueError(
            f"paged attention: {num_heads} query heads cannot share {num_kv_heads} key/value heads of {head_dim}"
        )
    _check_rows_of("paged attention", "query", query, num_tokens, num_heads, head_dim)
    _check_rows_of("paged attention", "out", out, num_tokens, num_heads, head_dim)
    _check_rows_of("paged attention", "key", key, num_tokens, num_kv_heads, head_dim)
    _check_rows_of("paged attention", "value", value, num_tokens, num_kv_heads, head_dim)
    # The kernel range-checks every slot, block id, row and context length it reads from these (status 1).
    if (
        slot_mapping.dim() != 1
        or block_tables.dim() != 2
        or (queries is not None and (queries.dim() != 2 or queries.shape[1] != 3))
        or (chunks is not None and (chunks.dim() != 2 or chunks.shape[1] != 4))
    ):
        raise ValueError(
            "paged attention: slot_mapping must be [T], block_tables [requests, max_blocks], queries [n, 3] and "
            "chunks [c, 4]"
        )
    return num_blocks, block_size, num_kv_heads, head_dim


def _raise_for_attention_status(status: int, head_dim: int) -> None:
    """paged attention's status codes as exceptions (0 is success)."""
    if status == 1:
        raise IndexError(
            "paged attention: a slot, query row, request index, context length or block id is out "
            "of range for the given tensors"
        )
    if status == 2:
        raise ValueError(f"paged attention: head_dim {head_dim} is not compiled in (see attention_head_dims)")


def kernels_for(tensor: torch.Tensor) -> NativeKernels | None:
    """load_kernels() where `tensor` lives on the CPU; None on any other device, where they never run (nor get
    built: a GPU machine need not compile CPU code it will not call)."""
    return load_kernels() if tensor.is_cpu else None


@functools.cache
def load_kernels() -> NativeKernels | None:
    """The compiled kernels, or None (with the reason logged once) where they cannot run or
    TOKENRIVER_NATIVE_KERNELS=0 turns them off (everything then runs the PyTorch definitions)."""
    if os.environ.get(NATIVE_KERNELS_VARIABLE, "1") == "0":
        logger.info("native kernels off: %s=0", NATIVE_KERNELS_VARIABLE)
        return None
    flags = _cpu_flags()
    missing = [flag for flag in REQUIRED_CPU_FLAGS if flag not in flags]
    if platform.machine() not in ("x86_64", "AMD64") or missing:
        logger.info("native kernels off: CPU %s lacks %s", platform.machine(), missing or "x86-64")
        return None
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        logger.info("native kernels off: no C++ compiler (c++ or g++) on PATH")
        return None
    attempt = 1
    while True:
        try:
            return NativeKernels(ctypes.CDLL(str(_build(compiler, flags))))
        except (OSError, subprocess.CalledProcessError) as error:
            detail = (getattr(error, "stderr", "") or str(error)).strip()[:2000]
            if attempt == BUILD_ATTEMPTS or not _may_pass_on_retry(error):
                logger.warning(
                    "native kernels off: build failed: %s. This process runs the PyTorch definitions: exact float32 "
                    "products, whose greedy text differs from the native int8 products' on the same prompt",
                    detail,
                )
                return None
            logger.warning("native kernel build attempt %d failed, retrying: %s", attempt, detail)
            attempt += 1


def _may_pass_on_retry(error: OSError | subprocess.CalledProcessError) -> bool:
    """A compiler killed by a signal (the out-of-memory killer on a busy machine) or a failed fork or file operation
    can pass the next time; a compile error cannot."""
    return isinstance(error, OSError) or error.returncode < 0
