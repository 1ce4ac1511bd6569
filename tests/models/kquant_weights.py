"""Random K-quant weights (models/kquant.py) of each kind, with sane scales: what the format's tests multiply."""

from __future__ import annotations

import torch

from tokenriver.models.kquant import KQuantWeight

KINDS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# The width each kind's records keep its scales and mins at, as the file's (models/kquant.py's pack_terms).
TERM_BITS = {"Q2_K": 4, "Q3_K": 6, "Q4_K": 6, "Q5_K": 6, "Q6_K": 8}


def random_kquant(rows: int, cols: int, kind: str, seed: int = 0, term_bits: int | None = None) -> KQuantWeight:
    """Q4_K / Q5_K: 6-bit scales and mins per 32 under float16 d and dmin per 256 (Q5_K with fifth bits); Q6_K:
    signed scales per 16, bits 4 and 5, codes centred on 32; Q3_K: 2-bit codes and a high bit, centred on 4, signed
    scales per 16; Q2_K: 2-bit codes, 4-bit scales and mins per 16. Their records keep the scales and mins at
    term_bits: the kind's own width unless given (8: a byte each, as a union of kinds has them)."""
    term_bits = TERM_BITS[kind] if term_bits is None else term_bits
    generator = torch.Generator().manual_seed(seed)

    def integers(high: int, shape: tuple[int, ...], low: int = 0) -> torch.Tensor:
        return torch.randint(low, high, shape, generator=generator)

    def halves(shape: tuple[int, ...], scale: float) -> torch.Tensor:
        return (torch.rand(shape, generator=generator) * scale + scale / 4).to(torch.float16)

    def words() -> torch.Tensor:
        return integers(2**32, (rows, cols // 32), low=0).to(torch.int64).to(torch.int32)

    low_bits = 2 if kind in ("Q2_K", "Q3_K") else 4
    qweight = integers(256, (rows, cols * low_bits // 8)).to(torch.uint8)
    supers = (rows, cols // 256)
    if kind in ("Q6_K", "Q3_K"):
        return KQuantWeight(
            qweight=qweight,
            scales=integers(128 if kind == "Q6_K" else 32, (rows, cols // 16), low=-128 if kind == "Q6_K" else -32).to(
                torch.int8
            ),
            d=halves(supers, 1e-3),
            offsets=torch.full((rows,), 32 if kind == "Q6_K" else 4, dtype=torch.uint8),
            scale_group=16,
            high1=words(),
            high2=words() if kind == "Q6_K" else None,
            low_bits=low_bits,
            term_bits=term_bits,
        )
    group, top = (16, 16) if kind == "Q2_K" else (32, 64)  # Q2_K: 4-bit scales and mins per 16; else 6-bit per 32
    return KQuantWeight(
        qweight=qweight,
        scales=integers(top, (rows, cols // group)).to(torch.int8),
        d=halves(supers, 1e-3),
        offsets=torch.zeros(rows, dtype=torch.uint8),
        scale_group=group,
        mins=integers(top, (rows, cols // group)).to(torch.uint8),
        dmin=halves(supers, 1e-3),
        high1=words() if kind == "Q5_K" else None,
        low_bits=low_bits,
        min_group=group,
        term_bits=term_bits,
    )
