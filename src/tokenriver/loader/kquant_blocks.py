"""GGUF's K-quant blocks → models/kquant.py's KQuantWeight: the readable rule (numpy), which the native converter
(models/cpu/csrc/kquant.cpp's convert_kquant) matches field for field and whose dequantization is gguf's own.

Q4_K and Q5_K keep their 6-bit sub-block scales and mins beside the super-block's d and dmin, and their nibbles
regrouped into quant.py's int4 order per 32 (Q4_K's run in 64-weight chunks); Q5_K's fifth bits and Q6_K's two
high bits become bit words per 32; Q6_K's int8 scales per 16 are kept as they are. Q2_K and Q3_K keep their two low
bits as crumbs (models/kquant.py's order), Q3_K's third bit as a word per 32, and their 4- and 6-bit scales (and
Q2_K's 4-bit mins). The records hold the scales and mins at their own width (models/kquant.py's pack_terms), so a
record takes the file's bytes.
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import torch

from tokenriver.errors import ModelLoadError
from tokenriver.models.kquant import KQuantWeight, RecordLayout
from tokenriver.models.quant import GGUF_BLOCK

Q = gguf.GGMLQuantizationType
# The GGUF types kept at their own size, and their bytes per 256 weights.
KQUANT_TYPES = {Q.Q2_K: 84, Q.Q3_K: 110, Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210}
# Each type's row record (models/kquant.py) and whether its codes are centred (offset by the layout's centre).
RECORD_LAYOUTS = {
    Q.Q2_K: (RecordLayout(num_high=0, scale_group=16, has_mins=True, low_bits=2, min_group=16, term_bits=4), False),
    Q.Q3_K: (RecordLayout(num_high=1, scale_group=16, has_mins=False, low_bits=2, term_bits=6), True),
    Q.Q4_K: (RecordLayout(num_high=0, scale_group=32, has_mins=True, term_bits=6), False),
    Q.Q5_K: (RecordLayout(num_high=1, scale_group=32, has_mins=True, term_bits=6), False),
    Q.Q6_K: (RecordLayout(num_high=2, scale_group=16, has_mins=False), True),
}


def _super_blocks(data: np.ndarray, tensor_type: gguf.GGMLQuantizationType) -> np.ndarray:
    """A matrix's bytes [N, row bytes] → [N, K // 256, block bytes] uint8, or a ModelLoadError naming the type."""
    block_bytes = KQUANT_TYPES[tensor_type]
    data = np.asarray(data)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] % block_bytes:
        raise ModelLoadError(
            f"{tensor_type.name} data must be [rows, a multiple of {block_bytes}] bytes, got {data.dtype} {data.shape}"
        )
    return data.reshape(data.shape[0], -1, block_bytes)


def _half(blocks: np.ndarray, at: int) -> torch.Tensor:
    """The float16 at byte `at` of each block, [N, K // 256]."""
    return torch.from_numpy(np.ascontiguousarray(blocks[:, :, at : at + 2]).view(np.float16)[:, :, 0].copy())


def _runs(low: np.ndarray) -> np.ndarray:
    """Codes [N, runs, 32] in 0..15 → nibbles [N, runs * 16] in quant.py's order (byte j: column j, j + 16 high)."""
    return (low[..., :16] | (low[..., 16:] << 4)).reshape(low.shape[0], -1)


def _crumbs(low: np.ndarray) -> np.ndarray:
    """Codes [N, runs, 32] in 0..3 → crumbs [N, runs * 8] (models/kquant.py's order: byte 4h + i of a run holds
    columns 16h + 4j + i at bits 2j)."""
    grid = low.reshape(*low.shape[:2], 2, 4, 4).astype(np.uint8)  # [N, runs, h, j, i]
    shifts = (2 * np.arange(4, dtype=np.uint8))[:, None]
    return np.bitwise_or.reduce(grid << shifts, axis=3).reshape(low.shape[0], -1)


def _words(bits: np.ndarray) -> torch.Tensor:
    """Bits [N, runs, 32] → int32 words [N, runs], bit j of a run's word its column j."""
    weights = np.left_shift(np.uint32(1), np.arange(32, dtype=np.uint32))
    return torch.from_numpy((bits.astype(np.uint32) * weights).sum(axis=-1, dtype=np.uint32).view(np.int32))


def _scale_min_k4(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of 6-bit (scale, min) pairs → scales, mins [..., 8] (ggml's get_scale_min_k4)."""
    scales = np.concatenate([packed[..., 0:4] & 63, (packed[..., 8:12] & 0x0F) | ((packed[..., 0:4] >> 6) << 4)], -1)
    mins = np.concatenate([packed[..., 4:8] & 63, (packed[..., 8:12] >> 4) | ((packed[..., 4:8] >> 6) << 4)], -1)
    return scales, mins


def unpack_q4_k(data: np.ndarray, tensor_type: gguf.GGMLQuantizationType = Q.Q4_K) -> KQuantWeight:
    """Q4_K (144 bytes per 256: d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles) or Q5_K (the same
    header, 32 bytes of fifth bits, then the nibbles). The nibbles run in 64-weight chunks, a chunk's low nibbles one
    sub-block of 32 and its high nibbles the next; fifth bit of value l of sub-block g: bit g of byte l."""
    blocks = _super_blocks(data, tensor_type)
    num_rows, num_supers = blocks.shape[:2]
    has_fifth = tensor_type == Q.Q5_K
    scales, mins = _scale_min_k4(blocks[:, :, 4:16])  # [N, B, 8] each
    chunks = blocks[:, :, 48 if has_fifth else 16 :].reshape(num_rows, num_supers, 4, 32)  # [N, B, chunk, byte]
    low = np.stack((chunks & 0x0F, chunks >> 4), axis=3).reshape(num_rows, num_supers * 8, 32)  # [N, runs, 32]
    fifth = None
    if has_fifth:
        bits = blocks[:, :, 16:48, None] >> np.arange(8, dtype=np.uint8) & 1  # [N, B, byte l, sub-block g]
        fifth = _words(bits.transpose(0, 1, 3, 2).reshape(num_rows, num_supers * 8, 32))
    return KQuantWeight(
        qweight=torch.from_numpy(np.ascontiguousarray(_runs(low))),
        scales=torch.from_numpy(scales.reshape(num_rows, -1).astype(np.int8)),
        d=_half(blocks, 0),
        offsets=torch.zeros(num_rows, dtype=torch.uint8),
        scale_group=GGUF_BLOCK,
        mins=torch.from_numpy(np.ascontiguousarray(mins.reshape(num_rows, -1))),
        dmin=_half(blocks, 2),
        high1=fifth,
    )


def unpack_q6_k(data: np.ndarray) -> KQuantWeight:
    """Q6_K (210 bytes per 256: 128 bytes of low nibbles, 64 of two high bits, 16 int8 scales per 16, d). Value l of
    run g (32 values): the low nibble of byte 64 (g // 4) + 32 (g % 2) + l (the high nibble where g % 4 >= 2), its
    bits 4-5 bits 2 (g % 4) .. of byte 128 + 32 (g // 4) + l; stored as q + 32."""
    blocks = _super_blocks(data, Q.Q6_K)
    num_rows, num_supers = blocks.shape[:2]
    low_bytes = blocks[:, :, :128].reshape(num_rows, num_supers, 2, 2, 32)  # [N, B, g // 4, g % 2, l]
    low = np.stack(
        [low_bytes[:, :, :, j % 2] >> np.uint8(4 * (j // 2)) & 0x0F for j in range(4)], axis=3
    )  # [N, B, 2, 4, l]
    high_bytes = blocks[:, :, 128:192].reshape(num_rows, num_supers, 2, 1, 32)  # [N, B, g // 4, 1, l]
    high = high_bytes >> (2 * np.arange(4, dtype=np.uint8))[:, None] & 3  # [N, B, 2, 4, l]
    runs = num_supers * 8
    return KQuantWeight(
        qweight=torch.from_numpy(np.ascontiguousarray(_runs(low.reshape(num_rows, runs, 32)))),
        scales=torch.from_numpy(np.ascontiguousarray(blocks[:, :, 192:208]).view(np.int8).reshape(num_rows, -1).copy()),
        d=_half(blocks, 208),
        offsets=torch.full((num_rows,), 32, dtype=torch.uint8),
        scale_group=16,
        high1=_words((high & 1).reshape(num_rows, runs, 32)),
        high2=_words((high >> 1).reshape(num_rows, runs, 32)),
    )


def unpack_q3_k(data: np.ndarray) -> KQuantWeight:
    """Q3_K (110 bytes per 256: 32 bytes of high-bit masks, 64 of two low bits, 12 of 6-bit scales per 16, d):
    w = d * (sc - 32) * q with q = low - 4 (high bit clear) or low (set), in -4..3, kept as the centred codes
    q + 4 = low + 4 high: the crumbs and a word of high bits per 32. Value e: its two low bits at bit
    2 ((e % 128) // 32) of byte 32 + 32 (e // 128) + e % 32, its high bit at bit e // 32 of byte e % 32; scale i's
    low 4 bits in byte 96 + i % 8 (high nibble for i >= 8), its top 2 in byte 104 + i % 4 at bit 2 (i // 4)."""
    blocks = _super_blocks(data, Q.Q3_K)
    num_rows, num_supers = blocks.shape[:2]
    runs = num_supers * 8
    shifts = (2 * np.arange(4, dtype=np.uint8))[:, None]  # [4 runs of a half, 1]
    low = blocks[:, :, 32:96].reshape(num_rows, num_supers, 2, 1, 32) >> shifts & 3  # [N, B, half, run, l]
    high = blocks[:, :, 0:32, None] >> np.arange(8, dtype=np.uint8) & 1  # [N, B, l, run of 8]
    packed = blocks[:, :, 96:108]
    nibbles = np.concatenate([packed[..., 0:8] & 0x0F, packed[..., 0:8] >> 4], axis=-1)  # [N, B, 16]
    tops = (packed[..., 8:12, None] >> (2 * np.arange(4, dtype=np.uint8)) & 3).transpose(0, 1, 3, 2)  # [N, B, 4, 4]
    scales = (nibbles | (tops.reshape(num_rows, num_supers, 16) << 4)).astype(np.int16) - 32  # [N, B, 16]
    return KQuantWeight(
        qweight=torch.from_numpy(np.ascontiguousarray(_crumbs(low.reshape(num_rows, runs, 32)))),
        scales=torch.from_numpy(scales.astype(np.int8).reshape(num_rows, -1)),
        d=_half(blocks, 108),
        offsets=torch.full((num_rows,), 4, dtype=torch.uint8),
        scale_group=16,
        high1=_words(high.transpose(0, 1, 3, 2).reshape(num_rows, runs, 32)),
        low_bits=2,
    )


def unpack_q2_k(data: np.ndarray) -> KQuantWeight:
    """Q2_K (84 bytes per 256: 16 bytes of 4-bit (scale, min) pairs per 16, 64 of two-bit codes, d, dmin):
    w = d * sc * q - dmin * m with q in 0..3. Value e: its two bits at bit 2 ((e % 128) // 32) of byte
    16 + 32 (e // 128) + e % 32; its sub-block's pair in byte e // 16, the scale the low nibble."""
    blocks = _super_blocks(data, Q.Q2_K)
    num_rows, num_supers = blocks.shape[:2]
    shifts = (2 * np.arange(4, dtype=np.uint8))[:, None]
    low = blocks[:, :, 16:80].reshape(num_rows, num_supers, 2, 1, 32) >> shifts & 3  # [N, B, half, run, l]
    pairs = blocks[:, :, 0:16].reshape(num_rows, -1)
    return KQuantWeight(
        qweight=torch.from_numpy(np.ascontiguousarray(_crumbs(low.reshape(num_rows, num_supers * 8, 32)))),
        scales=torch.from_numpy((pairs & 0x0F).astype(np.int8)),
        d=_half(blocks, 80),
        offsets=torch.zeros(num_rows, dtype=torch.uint8),
        scale_group=16,
        mins=torch.from_numpy(np.ascontiguousarray(pairs >> 4)),
        dmin=_half(blocks, 82),
        low_bits=2,
        min_group=16,
    )


_UNPACK = {Q.Q2_K: unpack_q2_k, Q.Q3_K: unpack_q3_k, Q.Q6_K: unpack_q6_k}


def unpack_kquant(data: np.ndarray, tensor_type: gguf.GGMLQuantizationType) -> KQuantWeight:
    """Any of KQUANT_TYPES' bytes → KQuantWeight, by the numpy rules above, its scales and mins at the type's width."""
    unpack = _UNPACK.get(tensor_type, lambda blocks: unpack_q4_k(blocks, tensor_type))
    return dataclasses.replace(unpack(data), term_bits=RECORD_LAYOUTS[tensor_type][0].term_bits)
