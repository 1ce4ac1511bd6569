"""K-quant weights at their own size: GGUF's Q2_K, Q3_K, Q4_K, Q5_K and Q6_K kept as the file stores them.

A decode step reads every weight once, so its speed is the bytes it streams. Re-encoded into quant.py's formats,
Q6_K (6.56 bits a weight) became int8 (8.5), Q4_K (4.5) int4 with a float16 scale and min per 32 (5.0), and Q2_K
and Q3_K int8 rounded away from the file's values. Kept here with the file's two-level scales, packed at their own
width (`pack_terms`), a weight costs the file's own bits (Q2_K 2.625, Q3_K 3.4375, Q4_K 4.5, Q5_K 5.5, Q6_K
6.5625), and its values are gguf's own dequantization, bit for bit.

Format (`KQuantWeight`, an [N, K] matrix, K a multiple of 256), per row n and column k:

    w[n, k] = d[n, k / 256] * sc[n, k / scale_group] * (q[n, k] - o[n]) - dmin[n, k / 256] * m[n, k / min_group]

- q, the code: its low bits from `qweight`, then `high1`'s bit at 2^low_bits and `high2`'s at 2^(low_bits + 1):
  - low_bits 4 (nibbles; quant.py's int4 order: in each run of 32, byte j holds column j low and j + 16 high);
  - low_bits 2 (crumbs: in each run of 32, byte c holds columns 16 (c // 4) + c % 4 + 4 i at bits 2i, i = 0..3,
    the order in which the CPU's tiles read them);
  - `high1` and `high2`: int32 words per run of 32, bit j that of column j;
- sc: int8 sub-block scales, one per 32 columns (Q4_K, Q5_K: 6-bit, 0..63) or per 16 (Q6_K signed, Q3_K 6-bit
  minus 32, Q2_K 4-bit);
- d, dmin: float16 per 256 columns; m: uint8 sub-block mins per min_group columns (32: Q4_K, Q5_K; 16: Q2_K; none
  for Q3_K and Q6_K);
- `term_bits`, the width a super-block's scales and mins are stored at in its record: 6 (Q4_K, Q5_K, Q3_K: 16
  values), 4 (Q2_K: 32) or 8 (Q6_K, and a fused projection of parts of different types);
- o: `centre` (2^(code bits - 1)) for a row whose codes are centred (Q6_K stores q + 32, Q3_K q + 4), else 0.
Each product d * sc, its product with q - o, and dmin * m is exact in float32, so the one rounding is the
subtraction: gguf's order. A fused projection whose parts are of different K types (a Q4_K_M file keeps some
v projections at Q6_K beside Q4_K q and k) holds each part's values exactly: the union of their fields, the
fields a part lacks zero, codes as wide as the widest part's, scales and mins per 16 where any part has them.

The layer (`KQuantLinear`) computes y = x @ dequantized(W)ᵀ with the activations rounded to int8 per 32 columns,
as the engine's default arithmetic does (quant.py's module docstring), or per super-block of 256 where the codes
have 2 low bits (Q2_K, Q3_K, and fused projections of only those): there a row's super-block sum is one exact
integer, each code times its scale folded into a byte (so their scales must lie in -32..31 and an uncentred row's
codes in 0..3, as the file's do). On the CPU's fast path by the products of models/cpu/csrc/kquant.h (one
arithmetic per row, whatever the batch); elsewhere, and with exact float32 activations, by the reference:
dequantize, then F.linear.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenriver.errors import InvalidParameterError
from tokenriver.models.buffers import Allocate, heap_empty
from tokenriver.models.fast_path import fast_path_for
from tokenriver.models.quant import (
    DEFAULT_MAX_GEMV_ROWS,
    GGUF_BLOCK,
    Backend,
    QuantizedLinear,
    cat_rows,
    pack_int4,
    unpack_high_bits,
    unpack_int4,
)

SUPER_BLOCK = 256


def unpack_crumbs(qweight: torch.Tensor) -> torch.Tensor:
    """Crumbs [N, K // 4] uint8 → values [N, K] uint8 in column order (the module docstring's order)."""
    num_rows = qweight.shape[0]
    runs = qweight.reshape(num_rows, -1, 2, 1, 4)  # [N, K // 32, half, 1, byte i of the half]
    shifts = (2 * torch.arange(4, dtype=torch.uint8, device=qweight.device)).reshape(4, 1)  # [crumb, 1]
    return ((runs >> shifts) & 3).reshape(num_rows, -1)  # [N, K // 32, half, crumb, i] → columns in order


def pack_crumbs(values: torch.Tensor) -> torch.Tensor:
    """Values [N, K] in 0..3 → crumbs [N, K // 4] uint8; the inverse of unpack_crumbs."""
    num_rows = values.shape[0]
    grid = values.to(torch.uint8).reshape(num_rows, -1, 2, 4, 4)  # [N, K // 32, half, crumb, i]
    shifts = (2 * torch.arange(4, dtype=torch.uint8, device=values.device)).reshape(4, 1)
    return (grid << shifts).sum(dim=3, dtype=torch.uint8).reshape(num_rows, -1)  # distinct bits: the sum ORs


def _unpack_low(qweight: torch.Tensor, low_bits: int) -> torch.Tensor:
    return unpack_int4(qweight) if low_bits == 4 else unpack_crumbs(qweight)


def _pack_low(values: torch.Tensor, low_bits: int) -> torch.Tensor:
    return pack_int4(values) if low_bits == 4 else pack_crumbs(values)


def _words(bits: torch.Tensor) -> torch.Tensor:
    """Bits [N, K] (0 or 1) → int32 words [N, K // 32], bit j of a word its run's column j."""
    shifts = torch.arange(GGUF_BLOCK, dtype=torch.int32, device=bits.device)
    runs = bits.to(torch.int32).reshape(bits.shape[0], -1, GGUF_BLOCK) << shifts
    return runs.sum(dim=-1, dtype=torch.int32)  # distinct bits: the sum ORs (bit 31 wraps into the sign)


def pack_terms(values: torch.Tensor, term_bits: int) -> torch.Tensor:
    """A super-block's scales then mins, values [..., V] (each fitting term_bits, two's complement where signed) →
    their record bytes [..., V * term_bits // 8] uint8. At 8 bits a byte each. At 4 or 6, value 4q + i's low nibble
    at bits 4 (q % 2) of byte 4 (q // 2) + i, and at 6 (V = 16) its top two bits at bits 2q of byte 8 + i: stored
    as the CPU's tiles store a record's bytes (byte j of its 16 rows side by side), a shift and a mask then give
    four values of all 16 rows (csrc/kquant.h's KQuantTerms)."""
    if term_bits == 8:
        return values.to(torch.int8).view(torch.uint8)
    v = values.to(torch.int32) & 0xFF
    quads = (v & 15).reshape(*v.shape[:-1], -1, 2, 4)  # [..., q // 2, q % 2, i]
    parts = [(quads[..., 0, :] | (quads[..., 1, :] << 4)).flatten(-2)]
    if term_bits == 6:
        tops = (v >> 4 & 3).reshape(*v.shape[:-1], 4, 4) << (2 * torch.arange(4, dtype=torch.int32))[:, None]
        parts.append(tops.sum(dim=-2))  # [..., i]: distinct bits, so the sum ORs
    return torch.cat(parts, dim=-1).to(torch.uint8)


def unpack_terms(packed: torch.Tensor, term_bits: int, signed: bool) -> torch.Tensor:
    """pack_terms' inverse: record bytes [..., bytes] → values [..., V] int32 (sign-extended where signed)."""
    if term_bits == 8:
        return (packed.view(torch.int8) if signed else packed).to(torch.int32)
    b = packed.to(torch.int32)
    low_bytes = b[..., : b.shape[-1] * 4 // term_bits].reshape(*b.shape[:-1], -1, 4)  # [..., q // 2, i]
    values = torch.stack([low_bytes & 15, low_bytes >> 4], dim=-2).flatten(-3)  # [..., V]: 4q + i
    if term_bits == 6:
        tops = b[..., 8:12, None] >> (2 * torch.arange(4, dtype=torch.int32)) & 3  # [..., i, q]
        values = values | (tops.transpose(-1, -2).flatten(-2) << 4)
    if signed:
        sign = 1 << (term_bits - 1)
        values = (values ^ sign) - sign
    return values


@dataclass(frozen=True)
class KQuantWeight:
    """A K-quant matrix at its own size, row after row (format in the module docstring)."""

    qweight: torch.Tensor  # [N, K * low_bits // 8] uint8: the codes' low bits
    scales: torch.Tensor  # [N, K // scale_group] int8
    d: torch.Tensor  # [N, K // 256] float16
    offsets: torch.Tensor  # [N] uint8: `centre` for centred codes (Q6_K, Q3_K rows), 0 else
    scale_group: int  # 16 or 32
    mins: torch.Tensor | None = None  # [N, K // min_group] uint8
    dmin: torch.Tensor | None = None  # [N, K // 256] float16, with mins
    high1: torch.Tensor | None = None  # [N, K // 32] int32 words: the codes' bit low_bits
    high2: torch.Tensor | None = None  # [N, K // 32] int32 words: the codes' bit low_bits + 1
    low_bits: int = 4  # 4 (nibbles) or 2 (crumbs)
    min_group: int = 32  # 32 or 16
    term_bits: int = 8  # 8, 6 or 4: the records' width of a scale or min (module docstring)

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.qweight.shape[1] * 8 // self.low_bits

    @property
    def num_high(self) -> int:
        return 2 if self.high2 is not None else 1 if self.high1 is not None else 0

    @property
    def centre(self) -> int:
        """The offset of a centred row's codes: half the codes' range."""
        return 1 << (self.low_bits + self.num_high - 1)

    def fields(self) -> dict[str, torch.Tensor | None]:
        """The tensors by name (the layer's buffers)."""
        names = ("qweight", "scales", "d", "offsets", "mins", "dmin", "high1", "high2")
        return {name: getattr(self, name) for name in names}

    def codes(self) -> torch.Tensor:
        """The codes q [N, K] uint8, 0 .. 2^(low_bits + num_high) - 1."""
        codes = _unpack_low(self.qweight, self.low_bits)
        for position, bits in enumerate((self.high1, self.high2)):
            if bits is not None:
                codes = codes | (unpack_high_bits(bits) << (self.low_bits + position))
        return codes

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K]: gguf's dequantization of the file's blocks, bit for bit."""
        num_rows, num_columns = self.shape
        centred = (self.codes().to(torch.int32) - self.offsets.to(torch.int32)[:, None]).float()  # [N, K]
        per_super = SUPER_BLOCK // self.scale_group
        scale = self.d.float().repeat_interleave(per_super, dim=1) * self.scales.float()  # [N, K // G]: exact
        weight = scale[:, :, None] * centred.reshape(num_rows, -1, self.scale_group)  # [N, K // G, G]: exact
        if self.mins is None:
            return weight.reshape(num_rows, num_columns)
        per_super = SUPER_BLOCK // self.min_group
        mins = self.dmin.float().repeat_interleave(per_super, dim=1) * self.mins.float()  # [N, K // min_group]
        weight = weight.reshape(num_rows, -1, self.min_group) - mins[:, :, None]
        return weight.reshape(num_rows, num_columns)

    def rows(self, start: int, stop: int) -> KQuantWeight:
        """Rows [start, stop), as views."""
        return self._with(lambda t: t[start:stop])

    def index_rows(self, row_ids: torch.Tensor) -> KQuantWeight:
        """The rows row_ids, copied (an embedding's lookup)."""
        return self._with(lambda t: t.index_select(0, row_ids))

    def to(self, device: torch.device | str) -> KQuantWeight:
        return self._with(lambda t: t.to(device))

    def _with(self, change: Callable[[torch.Tensor], torch.Tensor]) -> KQuantWeight:
        """The same weight with `change` applied to every tensor field."""
        changed = {name: None if t is None else change(t) for name, t in self.fields().items()}
        return dataclasses.replace(self, **changed)


def _union_part(weight: KQuantWeight, layout: RecordLayout) -> dict[str, torch.Tensor | None]:
    """One part's fields in the union's layout: scales and mins repeated to the union's groups, absent fields zero,
    and its codes as they are where the union's low bits and (for centred codes) centre are the part's, else
    re-centred on the union's centre and split into low bits and high words."""
    num_rows, num_columns = weight.shape
    centred = weight.offsets != 0
    fields = {
        "scales": weight.scales.repeat_interleave(weight.scale_group // layout.scale_group, dim=1),
        "d": weight.d,
        "offsets": centred.to(torch.uint8) * layout.centre,
    }
    if weight.low_bits == layout.low_bits and (weight.centre == layout.centre or not bool(centred.any())):
        zeros = torch.zeros(num_rows, num_columns // GGUF_BLOCK, dtype=torch.int32)
        high = [weight.high1, weight.high2][: layout.num_high]
        fields["qweight"] = weight.qweight
        fields["high1"], fields["high2"] = ([zeros if h is None else h for h in high] + [None, None])[:2]
    else:
        codes = weight.codes() + centred.to(torch.uint8)[:, None] * (layout.centre - weight.centre)  # <= 63
        high = [_words((codes >> bit) & 1) for bit in range(layout.low_bits, layout.low_bits + layout.num_high)]
        fields["qweight"] = _pack_low(codes & ((1 << layout.low_bits) - 1), layout.low_bits)
        fields["high1"], fields["high2"] = (high + [None, None])[:2]
    if layout.has_mins and weight.mins is None:
        fields["mins"] = torch.zeros(num_rows, num_columns // layout.min_group, dtype=torch.uint8)
        fields["dmin"] = torch.zeros(num_rows, num_columns // SUPER_BLOCK, dtype=torch.float16)
    elif layout.has_mins:
        fields["mins"] = weight.mins.repeat_interleave(weight.min_group // layout.min_group, dim=1)
        fields["dmin"] = weight.dmin
    return fields


def concatenate_kquant(weights: list[KQuantWeight], empty: Allocate = heap_empty) -> KQuantWeight:
    """Stack K-quant matrices along out_features (q/k/v, gate/up; the chunks of one matrix), each row keeping its
    values, in the layout that holds them all (RecordLayout.union)."""
    if len({w.shape[1] for w in weights}) > 1:
        raise InvalidParameterError("concatenate_kquant needs weights with equal in_features", param="weights")
    layout = RecordLayout.union([RecordLayout.of(w) for w in weights])
    parts = [_union_part(w, layout) if RecordLayout.of(w) != layout else w.fields() for w in weights]
    fields = {
        name: None if parts[0][name] is None else cat_rows([part[name] for part in parts], empty) for name in parts[0]
    }
    return KQuantWeight(**fields, **layout.groups())


@dataclass(frozen=True)
class RecordLayout:
    """Where a row's fields sit in its record of one super-block (256 columns), in bytes: the codes' low bits
    (32 * low_bits), the high words of its 8 runs of 32 (run by run, high1's word then high2's), the scales (8 or
    16) then the mins (8 or 16) packed at term_bits (pack_terms), d and dmin (float16). The CPU's row tiles
    (models/cpu/tiles.py) are 16 such records moved, byte for byte."""

    num_high: int  # high words per run: 0, 1 or 2
    scale_group: int  # 32 or 16
    has_mins: bool
    low_bits: int = 4  # 4 or 2
    min_group: int = 32  # 32 or 16 (where has_mins)
    term_bits: int = 8  # 8, 6 (16 values) or 4 (32 values)

    @property
    def high(self) -> int:
        return 32 * self.low_bits

    @property
    def scales(self) -> int:
        """Where the scales and mins (the terms) start."""
        return self.high + 32 * self.num_high

    @property
    def num_scales(self) -> int:
        return SUPER_BLOCK // self.scale_group

    @property
    def num_terms(self) -> int:
        """Scales and mins of a super-block."""
        return self.num_scales + (SUPER_BLOCK // self.min_group if self.has_mins else 0)

    @property
    def d(self) -> int:
        return self.scales + self.num_terms * self.term_bits // 8

    @property
    def size(self) -> int:
        return self.d + (4 if self.has_mins else 2)

    @property
    def centre(self) -> int:
        return 1 << (self.low_bits + self.num_high - 1)

    @property
    def signed_scales(self) -> bool:
        """Whether the scales are signed: a layout's without mins (Q6_K, Q3_K; Q3_K's are 6-bit minus 32)."""
        return not self.has_mins

    def packs_terms(self) -> bool:
        """Whether term_bits is one the records hold: 8, 6 for 16 terms, 4 for 32 (pack_terms)."""
        return self.term_bits == 8 or (self.term_bits, self.num_terms) in ((6, 16), (4, 32))

    def groups(self) -> dict[str, int]:
        """The KQuantWeight arguments that are not tensors."""
        return {
            "scale_group": self.scale_group,
            "low_bits": self.low_bits,
            "min_group": self.min_group,
            "term_bits": self.term_bits,
        }

    @staticmethod
    def of(weight: KQuantWeight) -> RecordLayout:
        return RecordLayout(
            weight.num_high,
            weight.scale_group,
            weight.mins is not None,
            weight.low_bits,
            weight.min_group,
            weight.term_bits,
        )

    @staticmethod
    def union(layouts: list[RecordLayout]) -> RecordLayout:
        """The layout that holds every part's values: codes as wide as the widest (nibbles where any part has
        them), scales and mins per 16 where any part has them, mins where any part has them, and a byte per scale
        and min unless every part is laid out alike."""
        low_bits = max(layout.low_bits for layout in layouts)
        code_bits = max(layout.low_bits + layout.num_high for layout in layouts)
        with_mins = [layout.min_group for layout in layouts if layout.has_mins]
        return RecordLayout(
            num_high=code_bits - low_bits,
            scale_group=min(layout.scale_group for layout in layouts),
            has_mins=bool(with_mins),
            low_bits=low_bits,
            min_group=min(with_mins, default=32),
            term_bits=layouts[0].term_bits if len(set(layouts)) == 1 else 8,
        )


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
        packed = records[:, :, layout.scales : layout.d]
        terms = unpack_terms(packed, layout.term_bits, layout.signed_scales)  # [N, S, num_terms]
        scales, mins = terms[:, :, : layout.num_scales], terms[:, :, layout.num_scales :]
        return KQuantWeight(
            qweight=part(0, layout.high, torch.uint8),
            scales=scales.to(torch.int8).reshape(num_rows, -1),
            d=part(layout.d, layout.d + 2, torch.float16),
            offsets=self.offsets,
            mins=mins.to(torch.uint8).reshape(num_rows, -1) if layout.has_mins else None,
            dmin=part(layout.d + 2, layout.d + 4, torch.float16) if layout.has_mins else None,
            high1=words[:, :, 0].contiguous() if layout.num_high > 0 else None,
            high2=words[:, :, 1].contiguous() if layout.num_high > 1 else None,
            **layout.groups(),
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
        values = tensor.flatten().view(torch.uint8).reshape(num_rows, num_supers, -1)
        records[:, :, start : start + values.shape[2]] = values

    put(0, weight.qweight)
    if layout.num_high:
        words = [weight.high1, weight.high2][: layout.num_high]
        put(layout.high, torch.stack(words, dim=-1))  # [N, K // 32, num_high]: each run's words together
    terms = [weight.scales.reshape(num_rows, num_supers, -1)]
    if layout.has_mins:
        terms.append(weight.mins.reshape(num_rows, num_supers, -1))
        put(layout.d + 2, weight.dmin)
    put(layout.scales, pack_terms(torch.cat([t.to(torch.int32) for t in terms], dim=2), layout.term_bits))
    put(layout.d, weight.d)
    return KQuantRecords(records, weight.offsets.contiguous(), layout)


def concatenate_records(parts: list[KQuantRecords], empty: Allocate = heap_empty) -> KQuantRecords:
    """Stack along out_features: the records themselves where the parts are laid out alike (a view where they lie
    one after the other), else each part's fields in the layout of them all (concatenate_kquant)."""
    if len({part.layout for part in parts}) == 1:
        records = cat_rows([part.records for part in parts], empty)
        return KQuantRecords(records, cat_rows([part.offsets for part in parts]), parts[0].layout)
    relaid = _relayout_natively(parts, empty)
    if relaid is not None:
        return relaid
    return pack_records(concatenate_kquant([part.weight() for part in parts]), empty)


def _relayout_natively(parts: list[KQuantRecords], empty: Allocate) -> KQuantRecords | None:
    """concatenate_records' union of parts laid out differently, each part's records rewritten in the union's layout
    by the device's fast path; None where it has none (the definition then unpacks and repacks the fields)."""
    fast = fast_path_for(parts[0].records.device)
    if fast is None or len({part.shape[1] for part in parts}) > 1:
        return None
    union = RecordLayout.union([part.layout for part in parts])
    num_rows, num_columns = sum(part.shape[0] for part in parts), parts[0].shape[1]
    records = empty((num_rows, num_columns // SUPER_BLOCK, union.size), torch.uint8)
    start = 0
    for part in parts:
        if not fast.relayout_kquant(part, union, records[start : start + part.shape[0]]):
            return None
        start += part.shape[0]
    offsets = torch.cat([(part.offsets != 0).to(torch.uint8) * union.centre for part in parts])
    return KQuantRecords(records, offsets, union)


_FIELD_DTYPES = {
    "qweight": torch.uint8,
    "scales": torch.int8,
    "d": torch.float16,
    "offsets": torch.uint8,
    "mins": torch.uint8,
    "dmin": torch.float16,
    "high1": torch.int32,
    "high2": torch.int32,
}


def _check_layout(layout: RecordLayout, num_columns: int) -> None:
    """InvalidParameterError unless the layout is one the products run (KQuantWeight's docstring)."""
    if (
        num_columns % SUPER_BLOCK
        or layout.scale_group not in (16, 32)
        or layout.min_group not in (16, 32)
        or (layout.low_bits, layout.num_high) not in ((4, 0), (4, 1), (4, 2), (2, 0), (2, 1))
        or not layout.packs_terms()
    ):
        raise InvalidParameterError(
            f"a K-quant weight needs in_features a multiple of {SUPER_BLOCK}, scales and mins per 16 or 32 columns, "
            f"4-bit codes with up to two high bits or 2-bit codes with up to one, and its scales and mins 8 bits "
            f"wide, 6 for 16 of them a super-block or 4 for 32, got {num_columns} columns, {layout}",
            param="weight",
        )


def _terms_fit(weight: KQuantWeight) -> bool:
    """Whether every scale and min fits the weight's term_bits (signed scales where it has no mins)."""
    top = 1 << weight.term_bits
    low, high = (-top // 2, top // 2 - 1) if weight.mins is None else (0, top - 1)
    scales_fit = bool(((weight.scales >= low) & (weight.scales <= high)).all())
    return scales_fit and (weight.mins is None or bool((weight.mins < top).all()))


def _check_fields(weight: KQuantWeight) -> None:
    """InvalidParameterError unless every field has its dtype and the shape the weight's [N, K] gives it."""
    if weight.low_bits not in (2, 4):
        raise InvalidParameterError(
            f"a K-quant weight's codes have 2 or 4 low bits, got {weight.low_bits}", param="weight"
        )
    num_rows, num_columns = weight.shape
    _check_layout(RecordLayout.of(weight), num_columns)
    shapes = {
        "qweight": (num_rows, num_columns * weight.low_bits // 8),
        "scales": (num_rows, num_columns // weight.scale_group),
        "d": (num_rows, num_columns // SUPER_BLOCK),
        "offsets": (num_rows,),
        "mins": (num_rows, num_columns // weight.min_group),
        "dmin": (num_rows, num_columns // SUPER_BLOCK),
        "high1": (num_rows, num_columns // GGUF_BLOCK),
        "high2": (num_rows, num_columns // GGUF_BLOCK),
    }
    if (weight.mins is None) != (weight.dmin is None) or (weight.high2 is not None and weight.high1 is None):
        raise InvalidParameterError("a K-quant weight's mins and dmin come together, high2 with high1", param="weight")
    for name, tensor in weight.fields().items():
        if tensor is not None and (tensor.dtype != _FIELD_DTYPES[name] or tuple(tensor.shape) != shapes[name]):
            raise InvalidParameterError(
                f"a K-quant weight's {name} must be {_FIELD_DTYPES[name]} {list(shapes[name])}, "
                f"got {tensor.dtype} {list(tensor.shape)}",
                param="weight",
            )
    if not bool(((weight.offsets == 0) | (weight.offsets == weight.centre)).all()):
        raise InvalidParameterError(
            f"a K-quant weight's offsets are 0 or its codes' centre {weight.centre}", param="weight"
        )
    if weight.term_bits != 8 and not _terms_fit(weight):
        raise InvalidParameterError(
            f"a K-quant weight's scales and mins must fit its term_bits ({weight.term_bits}: signed scales where it "
            f"has no mins)",
            param="weight",
        )
    if weight.low_bits == 2 and not _folds(weight):
        raise InvalidParameterError(
            "a K-quant weight with 2-bit codes has scales in -32..31 and no high bits in its uncentred rows "
            "(Q2_K's and Q3_K's: each code times its scale then fits a byte, models/cpu/csrc/gemm.cpp)",
            param="weight",
        )


def _folds(weight: KQuantWeight) -> bool:
    """Whether each code minus its row's offset times its scale lies in -127..128 (Q2_K's and Q3_K's fields)."""
    scales_fit = bool(((weight.scales >= -32) & (weight.scales <= 31)).all())
    uncentred = weight.offsets == 0
    return scales_fit and (weight.high1 is None or not bool(weight.high1[uncentred].any()))


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
        _check_layout(weight.layout, in_features)
        super().__init__(
            in_features, out_features, bias, backend, max_gemv_rows, int8_activations, weight.records.device
        )
        # The activations' rounding runs (module docstring): a run per super-block for 2-bit codes, else 32 columns.
        # quant.py's group_size is that of the scales, two levels here: the run is the unit a row's sum is cut in.
        self.activation_run = SUPER_BLOCK if weight.layout.low_bits == 2 else GGUF_BLOCK
        self.group_size = self.activation_run
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
