"""How a packed weight's tensors are made: an `Allocate` makes an uninitialized tensor of a shape and dtype.

The formats' helpers (models/quant.py) and the native converters write their outputs into tensors an Allocate
makes, so that the loader can pass its arena's (loader/weight_memory.py: weights on 2 MiB pages, made as the file
is read) and everything else the heap's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Allocate = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


def heap_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An Allocate on the heap: torch.empty."""
    return torch.empty(shape, dtype=dtype)
