"""GGUF block formats → the two packed layouts the native kernels run (models/quant.py's Int4Weight, Int8Weight).

Why re-encode rather than write a kernel per format: every GGUF type is "a few bits per weight, a scale (and
maybe a minimum) per run of 16-32 weights", and the kernels already stream 4-bit groups with a scale and a
minimum, and 8-bit groups with a scale, at memory speed, in decode GEMVs, batched GEMMs and the int8-activation
VNNI path. So each type is mapped once, at load, onto one of those, rows kept, with no float copy:

| GGUF type              | becomes                     | how                                                       |
|------------------------|-----------------------------|-----------------------------------------------------------|
| Q4_0, Q4_1, Q8_0       | Int4 / Int8, groups of 32   | byte copy (as models/quant.py's repack_*): exact          |
| Q5_0, Q5_1             | Int4 + fifth bits (5-bit)   | byte copy (Q5_0's min -16·d): exact                       |
| Q5_K                   | Int4 + fifth bits (5-bit)   | regrouped as Q4_K, scale d·sc and min -dmin·m as float16  |
| IQ4_NL                 | Int8, groups of 32          | values widened to int8 under the block's own scale: exact |
| Q4_K                   | Int4, groups of 32          | sub-block scale d·sc and minimum -dmin·m as float16       |
| IQ4_XS                 | Int8, groups of 32          | table values as int8, sub-block scale d·(ls - 32) as f16  |
| Q2_K, Q3_K,            | Int8, groups of 32          | dequantized, then rounded to int8 per 32 (max|w| / 127)   |
| Q6_K, other IQ types   |                             |                                                           |

"float16" rows: the product of two stored factors is rounded once to float16 (relative error at most 2^-11 of
the scale, far below the format's own step). With `kquant` (the loader's default where the CPU kernels run them,
loader/load.py), the K-quants Q2_K to Q6_K instead stay at their own size and exact (models/kquant.py;
`to_kquant`).
"Dequantized, then rounded": the types whose groups are 16 wide do not fit either layout exactly; rounding their
values to int8 per 32 adds at most half a step of max|w| / 127 per group (benchmarks/results/gguf_types.md measures
the perplexity of each). `CONVERSIONS` says which rule each type gets; the loader logs it at startup.
"""

from __future__ import annotations

from collections.abc import Callable

import gguf
import numpy as np
import torch

from tokenriver.errors import ModelLoadError
from tokenriver.loader.kquant_blocks import KQUANT_TYPES, RECORD_LAYOUTS, unpack_kquant
from tokenriver.models.buffers import Allocate, heap_empty
from tokenriver.models.cpu import convert
from tokenriver.models.kquant import KQuantRecords, pack_records
from tokenriver.models.quant import Int4Weight, Int8Weight, repack_q8_0

Q = gguf.GGMLQuantizationType
PackedWeight = Int4Weight | Int8Weight | KQuantRecords
GROUP = 32
FLOAT16_MAX = 65504.0
# Rows dequantized at a time by the re-quantizing conversions: bounds the float32 scratch to a few MiB.
_CHUNK_ELEMENTS = 1 << 21
# IQ4_NL / IQ4_XS: the 16 values a 4-bit index selects (ggml-common.h's kvalues_iq4nl).
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def _blocks(data: np.ndarray, block_bytes: int, kind: str) -> np.ndarray:
    """Raw tensor bytes [N, blocks * block_bytes] uint8 → [N, blocks, block_bytes]."""
    data = np.asarray(data)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] % block_bytes:
        raise ModelLoadError(
            f"{kind} data must be uint8 [out_features, blocks * {block_bytes} bytes], got "
            f"{data.dtype} {tuple(data.shape)}; the tensor is damaged"
        )
    return data.reshape(data.shape[0], -1, block_bytes)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of every block, as float32 [N, blocks, 1]."""
    return np.ascontiguousarray(blocks[:, :, start : start + 2]).view(np.float16).astype(np.float32)


def _to_float16(values: np.ndarray, kind: str) -> torch.Tensor:
    """Scales or minimums as float16 [N, groups], refusing values float16 cannot hold."""
    if not np.isfinite(values).all() or np.abs(values).max(initial=0.0) > FLOAT16_MAX:
        raise ModelLoadError(f"{kind} block scale is not finite or too large for float16; the file is damaged")
    return torch.from_numpy(np.ascontiguousarray(values.reshape(values.shape[0], -1).astype(np.float16)))


def _int8_weight(values: np.ndarray, scales: np.ndarray, kind: str) -> Int8Weight:
    """int8 values [N, K] and per-32 scales [N, K // 32] → Int8Weight."""
    qweight = torch.from_numpy(np.ascontiguousarray(values.reshape(values.shape[0], -1)))
    return Int8Weight(qweight, _to_float16(scales, kind), GROUP)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Runs of 16 bytes, low nibbles the first 16 values and high nibbles the next 16 (Q4_0's order) → the 32
    values [..., 32] uint8."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1)


def repack_q4_0(data: np.ndarray, empty: Allocate = heap_empty) -> Int4Weight:
    """Q4_0 (18 bytes per 32: f16 d, 16 bytes of nibbles; w = d * (q - 8)) → Int4Weight with scale d and min -8 d
    (exact: a power-of-two multiple), the bytes copied straight from the blocks into tensors `empty` makes (the
    values of models/quant.py's repack_q4_0)."""
    words = _block_words(data, 18, "Q4_0")  # [N, B, 9]: d, then 8 words of nibbles
    qweight, scales, mins = _int4_tensors(words.shape[0], words.shape[1], empty)
    _words_of(scales, words.shape[1])[...] = words[:, :, 0:1]
    if bool((scales.float().abs() * 8 > FLOAT16_MAX).any()):
        raise ModelLoadError("Q4_0 block scale too large: -8 * scale does not fit float16; the file is damaged")
    torch.mul(scales, -8, out=mins)
    _words_of(qweight, words.shape[1])[...] = words[:, :, 1:9]
    return Int4Weight(qweight, scales, mins, GROUP)


def repack_q4_1(data: np.ndarray, empty: Allocate = heap_empty) -> Int4Weight:
    """Q4_1 (20 bytes per 32: f16 d, f16 m, 16 bytes of nibbles; w = d * q + m) → Int4Weight with scale d and min m,
    the bytes copied straight from the blocks into tensors `empty` makes: exact."""
    words = _block_words(data, 20, "Q4_1")  # [N, B, 10]: d, m, then 8 words of nibbles
    qweight, scales, mins = _int4_tensors(words.shape[0], words.shape[1], empty)
    _words_of(qweight, words.shape[1])[...] = words[:, :, 2:10]
    _words_of(scales, words.shape[1])[...] = words[:, :, 0:1]
    _words_of(mins, words.shape[1])[...] = words[:, :, 1:2]
    return Int4Weight(qweight, scales, mins, GROUP)


def _block_words(data: np.ndarray, block_bytes: int, kind: str) -> np.ndarray:
    """Raw tensor bytes [N, blocks * block_bytes] → [N, blocks, block_bytes // 2] uint16: these blocks are whole
    16-bit words (an f16 header, then the nibbles), and copying words moves half the elements bytes would."""
    blocks = _blocks(data, block_bytes, kind)
    if blocks.strides[1:] != (block_bytes, 1) or blocks.ctypes.data % 2:
        blocks = np.ascontiguousarray(blocks)
    return blocks.view(np.uint16)


def _int4_tensors(num_rows: int, num_groups: int, empty: Allocate) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An int4 packing's qweight [N, 16 per 32] uint8, scales and mins [N, K // 32] float16, made by `empty` in the
    order the native converters ask for them, so that the parts of a fused projection share one set of tensors
    (loader/gguf.py's _FusedRows)."""
    qweight = empty((num_rows, 16 * num_groups), torch.uint8)
    scales = empty((num_rows, num_groups), torch.float16)
    mins = empty((num_rows, num_groups), torch.float16)
    return qweight, scales, mins


def _words_of(tensor: torch.Tensor, num_groups: int) -> np.ndarray:
    """A contiguous tensor [N, ...]'s bytes as a writable numpy view of 16-bit words [N, num_groups, words per
    group]."""
    return tensor.numpy().view(np.uint8).view(np.uint16).reshape(tensor.shape[0], num_groups, -1)


def repack_q5_0(data: np.ndarray, empty: Allocate = heap_empty) -> Int4Weight | Int8Weight:
    """Q5_0 (22 bytes per 32: f16 d, 32 high bits, 16 bytes of low nibbles; w = d * (q - 16)) → 5-bit Int4Weight:
    the nibbles and high-bit words as stored, scale d, min -16 d (exact: a power-of-two multiple), in tensors
    `empty` makes. A scale too large for its min to fit in float16 keeps int8 q - 16 under d."""
    blocks = _blocks(data, 22, "Q5_0")
    scales = _f16(blocks, 0)  # [N, B, 1]
    if np.abs(scales).max(initial=0.0) * 16 > FLOAT16_MAX:
        high_words = np.ascontiguousarray(blocks[:, :, 2:6]).view("<u4")  # [N, B, 1]
        high = ((high_words >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [N, B, 32]
        values = (_nibbles(blocks[:, :, 6:22]) | (high << 4)).astype(np.int8) - np.int8(16)  # [N, B, 32]
        return _int8_weight(values, scales, "Q5_0")
    return _int5_weight(
        blocks[:, :, 6:22], _to_float16(scales, "Q5_0"), _to_float16(-16 * scales, "Q5_0"), blocks[:, :, 2:6], empty
    )


def repack_q5_1(data: np.ndarray, empty: Allocate = heap_empty) -> Int4Weight:
    """Q5_1 (24 bytes per 32: f16 d, f16 m, 32 high bits, 16 bytes of low nibbles; w = d * q + m) → 5-bit
    Int4Weight with scale d and min m: the bytes as stored, exact."""
    blocks = _blocks(data, 24, "Q5_1")
    return _int5_weight(
        blocks[:, :, 8:24],
        _to_float16(_f16(blocks, 0), "Q5_1"),
        _to_float16(_f16(blocks, 2), "Q5_1"),
        blocks[:, :, 4:8],
        empty,
    )


def repack_q5_k(data: np.ndarray, empty: Allocate = heap_empty) -> Int4Weight:
    """Q5_K (176 bytes per 256: f16 d, f16 dmin, 12 bytes of 6-bit sub-block scales and mins, 32 bytes of high
    bits, 128 bytes of nibbles; w = d * sc * q - dmin * m per 32) → 5-bit Int4Weight, scale d * sc and min
    -dmin * m per 32 (Q4_K's rule). Byte l of the high bits holds bit 4 of value l of each sub-block i in its bit i."""
    blocks = _blocks(data, 176, "Q5_K")
    nibbles, scales, mins = _k_quant_runs(blocks, 48, "Q5_K")
    planes = blocks[:, :, None, 16:48] >> np.arange(8, dtype=np.uint8)[:, None] & 1  # [N, B, sub-block, 32]
    words = np.packbits(planes, axis=-1, bitorder="little")  # [N, B, 8, 4]: each sub-block's word, little-endian
    return _int5_weight(nibbles, scales, mins, words, empty)


def _int5_weight(
    nibbles: np.ndarray, scales: torch.Tensor, mins: torch.Tensor, high_words: np.ndarray, empty: Allocate
) -> Int4Weight:
    """Nibbles in Q4_0's order [N, ..., 16 per 32], float16 scales and mins [N, K // 32] and the fifth-bit words
    as little-endian bytes [N, ..., 4 per 32] → an Int4Weight with high_bits, in tensors `empty` makes."""
    num_rows, num_groups = scales.shape
    fields = (
        (nibbles, (num_rows, 16 * num_groups), torch.uint8),
        (scales, (num_rows, num_groups), torch.float16),
        (mins, (num_rows, num_groups), torch.float16),
        (np.ascontiguousarray(high_words).view("<i4"), (num_rows, num_groups), torch.int32),
    )
    tensors = []
    for values, shape, dtype in fields:
        tensor = empty(shape, dtype)
        tensor.copy_(torch.as_tensor(np.ascontiguousarray(values)).reshape(shape))
        tensors.append(tensor)
    qweight, scale_tensor, min_tensor, high_bits = tensors
    return Int4Weight(qweight, scale_tensor, min_tensor, GROUP, high_bits)


def repack_iq4_nl(data: np.ndarray) -> Int8Weight:
    """IQ4_NL (18 bytes per 32: f16 d, 16 bytes of table indices; w = d * table[q]) → int8 table values."""
    blocks = _blocks(data, 18, "IQ4_NL")
    return _int8_weight(IQ4_VALUES[_nibbles(blocks[:, :, 2:18])], _f16(blocks, 0), "IQ4_NL")


def repack_iq4_xs(data: np.ndarray) -> Int8Weight:
    """IQ4_XS (136 bytes per 256: f16 d, 6-bit sub-block scales ls split over 2 + 4 bytes, 8 × 16 bytes of table
    indices; w = d * (ls - 32) * table[q]) → int8 table values, scale d * (ls - 32) per 32."""
    blocks = _blocks(data, 136, "IQ4_XS")
    num_rows, num_blocks = blocks.shape[:2]
    high = np.ascontiguousarray(blocks[:, :, 2:4]).view("<u2")  # [N, B, 1]
    high = (high >> (2 * np.arange(8, dtype=np.uint16))) & 3  # [N, B, 8]
    low = blocks[:, :, 4:8, None] >> np.array([0, 4], dtype=np.uint8)  # [N, B, 4, 2]
    low = low.reshape(num_rows, num_blocks, 8) & 0x0F  # [N, B, 8]
    sub_scales = (low | (high.astype(np.uint8) << 4)).astype(np.float32) - 32  # [N, B, 8]
    values = IQ4_VALUES[_nibbles(blocks[:, :, 8:136].reshape(num_rows, num_blocks, 8, 16))]  # [N, B, 8, 32]
    return _int8_weight(values, _f16(blocks, 0) * sub_scales, "IQ4_XS")


def k_quant_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of 6-bit (scale, min) pairs for 8 sub-blocks → scales, mins [..., 8] uint8
    (ggml's get_scale_min_k4: the first four pairs sit in the low 6 bits of bytes 0-7, the last four in the
    nibbles of bytes 8-11 with their top 2 bits in the high bits of bytes 0-7)."""
    scales = np.empty(packed.shape[:-1] + (8,), dtype=np.uint8)
    mins = np.empty_like(scales)
    scales[..., :4] = packed[..., 0:4] & 63
    mins[..., :4] = packed[..., 4:8] & 63
    scales[..., 4:] = (packed[..., 8:12] & 0x0F) | ((packed[..., 0:4] >> 6) << 4)
    mins[..., 4:] = (packed[..., 8:12] >> 4) | ((packed[..., 4:8] >> 6) << 4)
    return scales, mins


def repack_q4_k(data: np.ndarray) -> Int4Weight:
    """Q4_K (144 bytes per 256: f16 d, f16 dmin, 12 bytes of 6-bit sub-block scales and mins, 128 bytes of
    nibbles; w = d * sc * q - dmin * m per 32) → Int4 with scale d * sc and min -dmin * m per 32.

    Q4_K's nibbles run in 64-weight chunks (the low nibbles of 32 bytes are one sub-block, the high nibbles the
    next); Int4Weight wants each 32-run as Q4_0 stores it, so the nibbles are regrouped, not changed.
    """
    blocks = _blocks(data, 144, "Q4_K")
    nibbles, scales, mins = _k_quant_runs(blocks, 16, "Q4_K")
    return Int4Weight(torch.from_numpy(nibbles), scales, mins, GROUP)


def _k_quant_runs(blocks: np.ndarray, nibbles_at: int, kind: str) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K blocks [N, B, bytes] → nibbles in Q4_0's order [N, K // 2] and the float16 scales d * sc and
    mins -dmin * m per 32 [N, K // 32]."""
    num_rows, num_blocks = blocks.shape[:2]
    sub_scales, sub_mins = k_quant_scales(blocks[:, :, 4:16])  # [N, B, 8] each
    scales = _f16(blocks, 0) * sub_scales  # [N, B, 8]
    mins = -_f16(blocks, 2) * sub_mins  # [N, B, 8]
    chunks = blocks[:, :, nibbles_at : nibbles_at + 128].reshape(num_rows, num_blocks, 4, 32)  # [N, B, chunk, byte]
    low, high = chunks & 0x0F, chunks >> 4  # each [N, B, 4, 32]: sub-blocks 2c and 2c + 1
    # Q4_0 order within a 32-run: byte j holds value j (low nibble) and value j + 16 (high nibble).
    runs = np.stack((low[..., :16] | (low[..., 16:] << 4), high[..., :16] | (high[..., 16:] << 4)), axis=3)
    nibbles = np.ascontiguousarray(runs.reshape(num_rows, -1))  # [N, K // 2]
    return nibbles, _to_float16(scales, kind), _to_float16(mins, kind)


def requantize_int8(data: np.ndarray, tensor_type: gguf.GGMLQuantizationType) -> Int8Weight:
    """Any type gguf dequantizes → Int8 per 32 (quant.py's quantize_int8 rule: float16 scale max|w| / 127 first,
    then q = round(w / scale)), a few rows at a time so that no float copy of the matrix is ever whole."""
    data = np.asarray(data)
    num_rows = data.shape[0]
    rows_per_chunk = max(1, _CHUNK_ELEMENTS // max(1, data.shape[1]))
    values, scales = [], []
    for start in range(0, num_rows, rows_per_chunk):
        weights = gguf.quants.dequantize(data[start : start + rows_per_chunk], tensor_type)  # [rows, K] float32
        groups = weights.reshape(weights.shape[0], -1, GROUP)  # [rows, K // 32, 32]
        scale = (np.abs(groups).max(axis=-1, keepdims=True) / 127).astype(np.float16)  # [rows, K // 32, 1]
        safe = np.where(scale > 0, scale.astype(np.float32), np.float32(1))
        values.append(np.clip(np.round(groups / safe), -127, 127).astype(np.int8).reshape(weights.shape[0], -1))
        scales.append(scale.reshape(weights.shape[0], -1).astype(np.float32))
    return _int8_weight(np.concatenate(values), np.concatenate(scales), tensor_type.name)


def _requantizer(tensor_type: gguf.GGMLQuantizationType) -> Callable[[np.ndarray], Int8Weight]:
    return lambda data: requantize_int8(data, tensor_type)


EXACT = "exact"
SCALES_FLOAT16 = "exact values, scales rounded to float16"
REQUANTIZED = "re-quantized to int8 per 32"
# GGUF type → (its conversion to a packed weight, what the conversion keeps).
CONVERSIONS: dict[gguf.GGMLQuantizationType, tuple[Callable[[np.ndarray], PackedWeight], str]] = {
    Q.Q4_0: (repack_q4_0, EXACT),  # these two copy bytes; models/quant.py's repack_* are the reference
    Q.Q4_1: (repack_q4_1, EXACT),
    Q.Q8_0: (repack_q8_0, EXACT),
    Q.Q5_0: (repack_q5_0, EXACT),
    Q.Q5_1: (repack_q5_1, EXACT),
    Q.IQ4_NL: (repack_iq4_nl, EXACT),
    Q.Q4_K: (repack_q4_k, SCALES_FLOAT16),
    Q.Q5_K: (repack_q5_k, SCALES_FLOAT16),
    Q.IQ4_XS: (repack_iq4_xs, SCALES_FLOAT16),
    **{
        t: (_requantizer(t), REQUANTIZED)
        for t in (Q.Q2_K, Q.Q3_K, Q.Q6_K, Q.IQ1_S, Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S)
    },
}
# The 5-bit types: kept as Int4Weight with fifth bits, written into the tensors the loader's allocator hands out.
FIVE_BIT: dict[gguf.GGMLQuantizationType, Callable[[np.ndarray, Allocate], PackedWeight]] = {
    Q.Q5_0: repack_q5_0,
    Q.Q5_1: repack_q5_1,
    Q.Q5_K: repack_q5_k,
}
# The numpy rules that write into the tensors the loader's allocator hands out: the 5-bit types and the byte copies.
ALLOCATED: dict[gguf.GGMLQuantizationType, Callable[[np.ndarray, Allocate], PackedWeight]] = {
    Q.Q4_0: repack_q4_0,
    Q.Q4_1: repack_q4_1,
    **FIVE_BIT,
}


def to_packed(
    data: np.ndarray,
    tensor_type: gguf.GGMLQuantizationType,
    native: bool = True,
    empty: Allocate = heap_empty,
    kquant: bool = False,
) -> PackedWeight:
    """One quantized matrix's raw bytes [N, row bytes] → its packed weight [N, K] (rows in the file's order).

    native: take models/cpu/csrc/convert.cpp's version of the rule where it has one (the same values, bit for
    bit, in one pass over the bytes); the numpy one otherwise.
    empty: makes the output tensors (the loader's weight arena) of the native rules and of ALLOCATED's; the other
    numpy rules make their own.
    kquant: the K-quants (Q2_K to Q6_K) stay at their own size (models/kquant.py) instead of the table's conversions.
    """
    if kquant and tensor_type in KQUANT_TYPES:
        return to_kquant(data, tensor_type, native, empty)
    layout = native_layout(tensor_type) if native else None
    converter = convert.load()
    data = np.asarray(data)
    if (
        tensor_type in FIVE_BIT
        and native
        and converter is not None
        and data.dtype == np.uint8
        and data.ndim == 2
        and data.flags.c_contiguous
        and data.shape[1] > 0
        and data.shape[1] % gguf.GGML_QUANT_SIZES[tensor_type][1] == 0
    ):
        block_size, block_bytes = gguf.GGML_QUANT_SIZES[tensor_type]
        converted = converter.five_bit(data, int(tensor_type), data.shape[1] // block_bytes * block_size, empty)
        if converted is not None:
            qweight, scales, mins, high_bits = converted
            return Int4Weight(qweight, scales, mins, GROUP, high_bits)
    if tensor_type in ALLOCATED:
        return ALLOCATED[tensor_type](data, empty)
    if (
        layout is not None
        and converter is not None
        and data.dtype == np.uint8
        and data.ndim == 2
        and data.flags.c_contiguous
    ):
        block_size, block_bytes = gguf.GGML_QUANT_SIZES[tensor_type]
        in_features = data.shape[1] // block_bytes * block_size
        if data.shape[1] % block_bytes == 0:
            if layout is Int4Weight:
                converted = converter.q4_k(data, in_features, empty)
                if converted is not None:
                    return Int4Weight(*converted, GROUP)
            else:
                converted = converter.to_int8(data, int(tensor_type), in_features, empty)
                if converted is not None:
                    return Int8Weight(*converted, GROUP)
            # A scale float16 cannot hold: the numpy rule raises the error that names it.
    return CONVERSIONS[tensor_type][0](data)


def to_kquant(
    data: np.ndarray, tensor_type: gguf.GGMLQuantizationType, native: bool = True, empty: Allocate = heap_empty
) -> KQuantRecords:
    """A K-quant matrix's bytes → its row records (models/kquant.py): models/cpu/csrc/kquant.cpp's converter, into a
    tensor `empty` makes, where it runs; models/kquant.py's numpy rule packed else (the same bytes)."""
    data = np.asarray(data)
    layout, centred = RECORD_LAYOUTS[tensor_type]
    converter = convert.load() if native else None
    block_bytes = KQUANT_TYPES[tensor_type]
    records = None
    if (
        converter is not None
        and data.dtype == np.uint8
        and data.ndim == 2
        and data.flags.c_contiguous
        and data.shape[1] % block_bytes == 0
        and data.shape[1] > 0
    ):
        records = converter.kquant(data, int(tensor_type), data.shape[1] // block_bytes * 256, layout, empty)
    if records is None:
        return pack_records(unpack_kquant(data, tensor_type), empty)
    offsets = torch.full((data.shape[0],), layout.centre if centred else 0, dtype=torch.uint8)
    return KQuantRecords(records, offsets, layout)


def native_layout(
    tensor_type: gguf.GGMLQuantizationType, kquant: bool = False
) -> type[Int4Weight] | type[Int8Weight] | type[KQuantRecords] | None:
    """The packed weight that to_packed makes of this GGUF type into the tensors its allocator hands out, in groups
    of 32 with float16 scales (Q4_0, Q4_1, Q4_K: int4, Q5_0: int4 with fifth bits; the types convert_to_int8
    takes: int8); with kquant, the K-quants at their own size; None where a numpy rule makes its own tensors, or,
    for the native converters' types, there are no native kernels."""
    if kquant and tensor_type in KQUANT_TYPES:
        converter = convert.load()
        return KQuantRecords if converter is not None and converter.kernels.kquant else None
    if tensor_type in (Q.Q4_0, Q.Q4_1):
        return Int4Weight
    converter = convert.load()
    if converter is None:
        return None
    if tensor_type == Q.Q4_K or tensor_type in FIVE_BIT:  # the 5-bit types: their fields kept as stored
        return Int4Weight
    return Int8Weight if converter.converts_to_int8(tensor_type) else None


def conversion_of(type_name: str, kquant: bool = False) -> str:
    """How a stored GGUF type is kept in memory, for the startup log ("float" for unquantized types); kquant: as
    to_packed's kquant keeps it."""
    tensor_type = Q.__members__.get(type_name)
    if kquant and tensor_type in KQUANT_TYPES:
        return "at its own size, exact"
    return CONVERSIONS[tensor_type][1] if tensor_type in CONVERSIONS else "float"
