"""Shared builders for the sampling tests."""

from __future__ import annotations

import torch

from tokenriver.params import SamplingParams
from tokenriver.sampling.sampler import SamplingState


def make_state(
    params: SamplingParams | None = None,
    *,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    seed: int | None = None,
    eos: list[int] | None = None,
) -> SamplingState:
    """One batch row; a seed gives the row its own generator, as the runner does for seeded requests."""
    params = params or SamplingParams()
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingState(
        params=params,
        prompt_token_ids=list(prompt or []),
        output_token_ids=list(output or []),
        generator=generator,
        eos_token_ids=list(eos or []),
    )


def random_logits(num_rows: int, vocab_size: int, *, scale: float = 3.0, seed: int = 0) -> torch.Tensor:
    """[num_rows, vocab_size] float32 logits without ties, reproducible."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab_size, generator=generator) * scale
