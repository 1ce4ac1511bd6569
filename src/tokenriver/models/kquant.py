"""K-quant weights at their own size: GGUF's Q4_K, Q5_K and Q6_K kept as the file stores them, not widened.

A decode step reads every weight once, so its speed is the bytes it streams. Re-encoded into quant.py's formats,
Q6_K (6.56 bits a weight) became int8 (8.5) and Q4_K (4.5) int4 with a float16 scale and min per 32 (5.0); a
Q4_K_M file then streamed a fifth more than its own size. Kept here with the file's two-level scales, a weight
costs its own bits (Q6_K exactly, Q4_K 4.625 and Q5_K 5.625: the 6-bit sub-block scale and min take a byte each),
and its values are gguf's own dequantization, bit for bit.

Format (`KQuantWeight`, an [N, K] matrix, K a multiple of 256), per row n and column k:

    w[n, k] = d[n, k / 256] * sc[n, k / scale_group] * (q[n, k] - o[n]) - dmin[n, k / 256] * m[n, k / 32]

- q in 0..63: the nibble of `qweight` (quant.py's int4 order: in each run of 32, byte j holds column j low and
  j + 16 high), plus 16 where bit j of `bit4`'s word for the run is set (Q5_K, Q6_K), plus 32 for `bit5` (Q6_K);
- sc: int8 sub-block scales, one per 32 columns (Q4_K, Q5_K: 6-bit, 0..63) or per 16 (Q6_K: signed);
- d, dmin: float16 per 256 columns; m: uint8 sub-block mins per 32 (Q4_K, Q5_K; none for Q6_K);
- o: 32 for a row whose codes are centred (Q6_K stores q + 32), else 0.
Each product d * sc, its product with q - o, and dmin * m is exact in float32, so the one rounding is the
subtraction: gguf's order. A fused projection whose parts are of different K types (a Q4_K_M file keeps some
v projections at Q6_K beside Q4_K q and k) holds each part's values exactly: the union of their fields, the
fields a part lacks zero, scales per 16 where any part has them.

The layer (`KQuantLinear`) computes y = x @ dequantized(W)ᵀ with the activations rounded to int8 per 32 columns,
as the engine's default arithmetic does (quant.py's module docstring): on the CPU's fast path by the products of
models/cpu/csrc/kquant.h (one arithmetic per row, whatever the batch); elsewhere, and with exact float32
activations, by the reference: dequantize, then F.linear.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenriver.errors import InvalidParameterError
from tokenriver.models.buffers import Allocate, heap_empty
from tokenriver.models.quant import (
    DEFAULT_MAX_GEMV_ROWS,
    GGUF_BLOCK,
    Backend,
    QuantizedLinear,
    cat_rows,
    unpack_high_bits,
    unpack_int4,
)

SUPER_BLOCK = 256
# The offset of a centred row's codes (Q6_K stores q + 32).
CENTRED_OFFSET = 32


@dataclass(frozen=True)
class KQuantWeight:
    """A K-quant matrix at its own size, row after row (format in the module docstring)."""

    qweight: torch.Tensor  # [N, K // 2] uint8 nibbles
    scales: torch.Tensor  # [N, K // scale_group] int8
    d: torch.Tensor  # [N, K // 256] float16
    offsets: torch.Tensor  # [N] uint8: 32 for centred codes (Q6_K rows), 0 else
    scale_group: int  # 16 or 32
    mins: torch.Tensor | None = None  # [N, K // 32] uint8
    dmin: torch.Tensor | None = None  # [N, K // 256] float16, with mins
    bit4: torch.Tensor | None = None  # [N, K // 32] int32 words
    bit5: torch.Tensor | None = None  # [N, K // 32] int32 words

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.qweight.shape[1] * 2

    def fields(self) -> dict[str, torch.Tensor | None]:
        """The tensors by name (the layer's buffers)."""
        names = ("qweight", "scales", "d", "offsets", "mins", "dmin", "bit4", "bit5")
        return {name: getattr(self, name) for name in names}

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K]: gguf's dequantization of the file's blocks, bit for bit."""
        num_rows, num_columns = self.shape
        codes = unpack_int4(self.qweight).to(torch.int32)  # [N, K]
        for bits, value in ((self.bit4, 16), (self.bit5, 32)):
            if bits is not None:
                codes = codes + unpack_high_bits(bits).to(torch.int32) * value
        centred = (codes - self.offsets.to(torch.int32)[:, None]).float()  # [N, K]
        per_super = SUPER_BLOCK // self.scale_group
        scale = self.d.float().repeat_interleave(per_super, dim=1) * self.scales.float()  # [N, K // G]: exact
        weight = scale[:, :, None] * centred.reshape(num_rows, -1, self.scale_group)  # [N, K // G, G]: exact
        weight = weight.reshape(num_rows, num_columns)
        if self.mins is None:
            return weight
        mins = self.dmin.float().repeat_interleave(SUPER_BLOCK // GGUF_BLOCK, dim=1) * self.mins.float()  # [N, K // 32]
        return (weight.reshape(num_rows, -1, GGUF_BLOCK) - mins[:, :, None]).reshape(num_rows, num_columns)

    def rows(self, start: int, stop: int) -> KQuantWeight:
        """Rows [start, stop), as views."""
        picked = {name: None if t is None else t[start:stop] for name, t in self.fields().items()}
        return KQuantWeight(**picked, scale_group=self.scale_group)

    def index_rows(self, row_ids: torch.Tensor) -> KQuantWeight:
        """The rows row_ids, copied (an embedding's lookup)."""
        picked = {name: None if t is None else t.index_select(0, row_ids) for name, t in self.fields().items()}
        return KQuantWeight(**picked, scale_group=self.scale_group)

    def to(self, device: torch.device | str) -> KQuantWeight:
        moved = {name: None if t is None else t.to(device) for name, t in self.fields().items()}
        return KQuantWeight(**moved, scale_group=self.scale_group)


def concatenate_kquant(weights: list[KQuantWeight], empty: Allocate = heap_empty) -> KQuantWeight:
    """Stack K-quant matrices along out_features (q/k/v, gate/up; the chunks of one matrix), each row keeping its
    values: scales per 16 where any part has them (a part's per-32 scale repeated), the fields a part lacks zero.
    Parts converted into their rows of one whole (the loader's fused allocators) come back as views of it."""
    if len({w.shape[1] for w in weights}) > 1:
        raise InvalidParameterError("concatenate_kquant needs weights with equal in_features", param="weights")
    scale_group = min(w.scale_group for w in weights)
    num_blocks = weights[0].shape[1] // GGUF_BLOCK

    def stacked(name: str, columns: int, dtype: torch.dtype) -> torch.Tensor | None:
        tensors = [getattr(w, name) for w in weights]
        if all(t is None for t in tensors):
            return None
        zeros = [torch.zeros(w.shape[0], columns, dtype=dtype) if t is None else t for w, t in zip(weights, tensors)]
        return cat_rows(zeros, empty)

    scales = [w.scales.repeat_interleave(w.scale_group // scale_group, dim=1) for w in weights]
    return KQuantWeight(
        qweight=cat_rows([w.qweight for w in weights], empty),  # [sum N, K // 2]
        scales=cat_rows(scales, empty),  # [sum N, K // G]
        d=cat_rows([w.d for w in weights], empty),  # [sum N, K // 256]
        offsets=cat_rows([w.offsets for w in weights], empty),  # [sum N]
        scale_group=scale_group,
        mins=stacked("mins", num_blocks, torch.uint8),
        dmin=stacked("dmin", num_blocks // 8, torch.float16),
        bit4=stacked("bit4", num_blocks, torch.int32),
        bit5=stacked("bit5", num_blocks, torch.int32),
    )


@dataclass(frozen=True)
class RecordLayout:
    """Where a row's fields sit in its record of one super-block (256 columns), in bytes: the nibbles (128), the bit
    words of its 8 runs of 32 (block by block, bit 4's word then bit 5's), the scales (8 or 16 int8), the mins (8),
    d and dmin (float16). The CPU's row tiles (models/cpu/tiles.py) are 16 such records moved, byte for byte."""

    num_high: int  # bit words per run: 0, 1 (bit 4) or 2 (bits 4 and 5)
    scale_group: int  # 32 or 16
    has_mins: bool

    @property
    def high(self) -> int:
        return 128

    @property
    def scales(self) -> int:
        return self.high + 32 * self.num_high

    @property
    def mins(self) -> int:
        return self.scales + SUPER_BLOCK // self.scale_group

    @property
    def d(self) -> int:
        return self.mins + (8 if self.has_mins else 0)

    @property
    def size(self) -> int:
        return self.d + (4 if self.has_mins else 2)

    @staticmethod
    def of(weight: KQuantWeight) -> RecordLayout:
        num_high = 2 if weight.bit5 is not None else 1 if weight.bit4 is not None else 0
        return RecordLayout(num_high, weight.scale_group, weight.mins is not None)


@dataclass(frozen=True)
class KQuantRecords:
    """A K-quant matrix as its layer holds it: per row, one record per super-block (RecordLayout), and each row's
    code offset. The loader's converters write these; the fields (KQuantWeight) are read out of them."""

    records: torch.Tensor  # [N, K // 256, layout.size] uint8
    offsets: torch.Tensor  # [N] uint8
    layout: RecordLayout

    @property
    def shape(self) -> tuple[int, int]:
        return self.records.shape[0], self.records.shape[1] * SUPER_BLOCK

    def weight(self) -> KQuantWeight:
        """The fields, copied out of the records."""
        records, layout = self.records, self.layout
        num_rows, num_supers = records.shape[:2]

        def part(start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
            return records[:, :, start:stop].contiguous().view(dtype).reshape(num_rows, -1)

        words = part(layout.high, layout.scales, torch.int32).reshape(num_rows, num_supers * 8, -1)
        return KQuantWeight(
            qweight=part(0, layout.high, torch.uint8),
            scales=part(layout.scales, layout.mins, torch.int8),
            d=part(layout.d, layout.d + 2, torch.float16),
            offsets=self.offsets,
            scale_group=layout.scale_group,
            mins=part(layout.mins, layout.d, torch.uint8) if layout.has_mins else None,
            dmin=part(layout.d + 2, layout.d + 4, torch.float16) if layout.has_mins else None,
            bit4=words[:, :, 0].contiguous() if layout.num_high > 0 else None,
            bit5=words[:, :, 1].contiguous() if layout.num_high > 1 else None,
        )

    def dequantize(self) -> torch.Tensor:
        return self.weight().dequantize()

    def rows(self, start: int, stop: int) -> KQuantRecords:
        return KQuantRecords(self.records[start:stop], self.offsets[start:stop], self.layout)

    def to(self, device: torch.device | str) -> KQuantRecords:
        return KQuantRecords(self.records.to(device), self.offsets.to(device), self.layout)


def pack_records(weight: KQuantWeight, empty: Allocate = heap_empty) -> KQuantRecords:
    """A KQuantWeight's fields into records (RecordLayout) that `empty` makes."""
    layout = RecordLayout.of(weight)
    num_rows, num_columns = weight.shape
    num_supers = num_columns // SUPER_BLOCK
    records = empty((num_rows, num_supers, layout.size), torch.uint8)

    def put(start: int, tensor: torch.Tensor) -> None:
        values = tensor.contiguous().view(torch.uint8).reshape(num_rows, num_supers, -1)
        records[:, :, start : start + values.shape[2]] = values

    put(0, weight.qweight)
    if layout.num_high:
        planes = [weight.bit4 if weight.bit4 is not None else torch.zeros_like(weight.bit5)]
        planes += [weight.bit5] if layout.num_high > 1 else []
        put(layout.high, torch.stack(planes, dim=-1))  # [N, K // 32, num_high]: each run's words together
    put(layout.scales, weight.scales)
    if layout.has_mins:
        put(layout.mins, weight.mins)
        put(layout.d + 2, weight.dmin)
    put(layout.d, weight.d)
    return KQuantRecords(records, weight.offsets.contiguous(), layout)


def concatenate_records(parts: list[KQuantRecords], empty: Allocate = heap_empty) -> KQuantRecords:
    """Stack along out_features: the records themselves where the parts are laid out alike (a view where they lie
    one after the other), else each part's fields in the layout of them all (concatenate_kquant)."""
    if len({part.layout for part in parts}) == 1:
        records = cat_rows([part.records for part in parts], empty)
        return KQuantRecords(records, cat_rows([part.offsets for part in parts]), parts[0].layout)
    return pack_records(concatenate_kquant([part.weight() for part in parts]), empty)


_FIELD_DTYPES = {
    "qweight": torch.uint8,
    "scales": torch.int8,
    "d": torch.float16,
    "offsets": torch.uint8,
    "mins": torch.uint8,
    "dmin": torch.float16,
    "bit4": torch.int32,
    "bit5": torch.int32,
}


def _check_fields(weight: KQuantWeight) -> None:
    """InvalidParameterError unless every field has its dtype and the shape the weight's [N, K] gives it."""
    num_rows, num_columns = weight.shape
    if num_columns % SUPER_BLOCK or weight.scale_group not in (16, 32):
        raise InvalidParameterError(
            f"a K-quant weight needs in_features a multiple of {SUPER_BLOCK} and scales per 16 or 32 columns, "
            f"got {num_columns} and {weight.scale_group}",
            param="weight",
        )
    shapes = {
        "qweight": (num_rows, num_columns // 2),
        "scales": (num_rows, num_columns // weight.scale_group),
        "d": (num_rows, num_columns // SUPER_BLOCK),
        "offsets": (num_rows,),
        "mins": (num_rows, num_columns // GGUF_BLOCK),
        "dmin": (num_rows, num_columns // SUPER_BLOCK),
        "bit4": (num_rows, num_columns // GGUF_BLOCK),
        "bit5": (num_rows, num_columns // GGUF_BLOCK),
    }
    if (weight.mins is None) != (weight.dmin is None):
        raise InvalidParameterError("a K-quant weight's mins and dmin come together", param="weight")
    for name, tensor in weight.fields().items():
        if tensor is not None and (tensor.dtype != _FIELD_DTYPES[name] or tuple(tensor.shape) != shapes[name]):
            raise InvalidParameterError(
                f"a K-quant weight's {name} must be {_FIELD_DTYPES[name]} {list(shapes[name])}, "
                f"got {tensor.dtype} {list(tensor.shape)}",
                param="weight",
            )


class KQuantLinear(QuantizedLinear):
    """Linear layer over K-quant records (module docstring); its products round activations to int8 per 32 where
    the layer's int8_activations is on (the engine's default), and are exact float32 through the reference else.

    Buffers: `qweight`, the records (RecordLayout: row after row, or the CPU's row tiles once its fast path binds the
    layer), and `offsets`, each row's code offset."""

    packing = "kquant"

    def __init__(
        self,
        weight: KQuantRecords | KQuantWeight,
        bias: torch.Tensor | None = None,
        *,
        backend: Backend = "auto",
        max_gemv_rows: int = DEFAULT_MAX_GEMV_ROWS,
        int8_activations: bool = False,
    ) -> None:
        if isinstance(weight, KQuantWeight):
            _check_fields(weight)
            weight = pack_records(weight)
        out_features, in_features = weight.shape
        if in_features % SUPER_BLOCK or weight.layout.scale_group not in (16, 32):
            raise InvalidParameterError(
                f"a K-quant weight needs in_features a multiple of {SUPER_BLOCK} and scales per 16 or 32 columns, "
                f"got {in_features} and {weight.layout.scale_group}",
                param="weight",
            )
        super().__init__(
            in_features, out_features, bias, backend, max_gemv_rows, int8_activations, weight.records.device
        )
        # The activations' rounding runs 32 columns (quant.py's group_size is that of the scales; here two levels).
        self.group_size = GGUF_BLOCK
        self.record_layout = weight.layout
        self.register_buffer("qweight", weight.records.contiguous())  # [N, K // 256, record] uint8 (rows layout)
        self.register_buffer("offsets", weight.offsets.contiguous())  # [N] uint8
        self.rebind()

    def records(self) -> KQuantRecords:
        """The records row after row (a copy where the CPU's fast path holds them in row tiles)."""
        records = self.qweight if self.packed is None or self.layout == "rows" else self.packed.row_major()
        return KQuantRecords(records, self.offsets, self.record_layout)

    def row_major_weight(self) -> KQuantWeight:  # type: ignore[override]
        """The weight's fields (the definition's form)."""
        return self.records().weight()

    def _dequantize_rows(self, row_ids: torch.Tensor) -> torch.Tensor:
        records = self.records()
        picked = KQuantRecords(records.records.index_select(0, row_ids), records.offsets[row_ids], records.layout)
        return picked.dequantize()
