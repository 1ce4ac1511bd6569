"""Random K-quant weights (models/kquant.py) of each kind, with sane scales: what the format's tests multiply."""

from __future__ import annotations

import torch

from tokenriver.models.kquant import CENTRED_OFFSET, KQuantWeight

KINDS = ("Q4_K", "Q5_K", "Q6_K")


def random_kquant(rows: int, cols: int, kind: str, seed: int = 0) -> KQuantWeight:
    """Q4_K / Q5_K: 6-bit scales and mins per 32 under float16 d and dmin per 256 (Q5_K with fifth bits); Q6_K:
    signed scales per 16, bits 4 and 5, codes centred on 32."""
    generator = torch.Generator().manual_seed(seed)

    def integers(high: int, shape: tuple[int, ...], low: int = 0) -> torch.Tensor:
        return torch.randint(low, high, shape, generator=generator)

    def halves(shape: tuple[int, ...], scale: float) -> torch.Tensor:
        return (torch.rand(shape, generator=generator) * scale + scale / 4).to(torch.float16)

    def words() -> torch.Tensor:
        return integers(2**32, (rows, cols // 32), low=0).to(torch.int64).to(torch.int32)

    qweight = integers(256, (rows, cols // 2)).to(torch.uint8)
    supers = (rows, cols // 256)
    if kind == "Q6_K":
        return KQuantWeight(
            qweight=qweight,
            scales=integers(128, (rows, cols // 16), low=-128).to(torch.int8),
            d=halves(supers, 1e-3),
            offsets=torch.full((rows,), CENTRED_OFFSET, dtype=torch.uint8),
            scale_group=16,
            bit4=words(),
            bit5=words(),
        )
    return KQuantWeight(
        qweight=qweight,
        scales=integers(64, (rows, cols // 32)).to(torch.int8),
        d=halves(supers, 1e-3),
        offsets=torch.zeros(rows, dtype=torch.uint8),
        scale_group=32,
        mins=integers(64, (rows, cols // 32)).to(torch.uint8),
        dmin=halves(supers, 1e-3),
        bit4=words() if kind == "Q5_K" else None,
    )
