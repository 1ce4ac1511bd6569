"""The cost of a token: what one forward pass of the loaded model computes and reads, counted from its weights.

What each number counts, so that the visualizer's roofline can place a pass from its rows alone:
- parameters: the loader's count (LoadedModel.num_parameters): every distinct weight once, a tied embedding once, a
  packed matrix as its rows × columns, not its bytes.
- multiply-adds per token: rows × columns of every weight matrix one token's row goes through: the decoder layers'
  projections (fused ones as one matrix) and the output layer. Not counted: the embedding lookup (a row copy), the
  norms, rotary embeddings and activations (a few per element, not per weight). A mixture of experts counts its
  router, its shared expert and `num_experts_per_tok` of its experts. The output layer's share is given apart: a
  prompt token that no logits are computed for skips it.
- attention multiply-adds per position: a token's query against one position of its context, q·k and the weighted
  value, summed over layers and heads: 2 × layers × heads × head width. They grow with the context, so a pass's
  are this times the positions its rows attend to (`attended_positions`).
- weight bytes per pass: every weight as it sits in memory, the packed quantized buffers the kernels stream (codes,
  scales, minimums), each tensor once; less the token-embedding table unless the output layer is that table (a
  tied embedding): a pass reads one row of it per token, left out.
- KV bytes per context token: the keys and values of one position in every layer, as the pool stores them; a pass
  reads those of each row's context once.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from tokenriver.loader.load import LoadedModel
from tokenriver.models.moe import SparseMoeBlock
from tokenriver.models.quant import QuantizedEmbedding, QuantizedLinear

# Modules a token only looks a row up in: their tables are not streamed by a pass.
_LOOKUPS = (nn.Embedding, QuantizedEmbedding)
_MATRICES = (nn.Linear, QuantizedLinear)
# The output layer's Hugging Face name (the loader fills "lm_head.weight").
_OUTPUT_LAYER = "lm_head"


@dataclass(frozen=True)
class TokenCost:
    """The loaded model's cost per token and per pass (module docstring)."""

    num_parameters: int
    # Multiply-adds of one generated token's row through the weight matrices, the output layer included.
    multiply_adds_per_token: int
    # Of those, the output layer's (one per row the pass computes logits for).
    output_multiply_adds: int
    # Attention's multiply-adds for one token against one position of its context.
    attention_multiply_adds_per_position: int
    weight_bytes_per_pass: int
    kv_bytes_per_token: int

    def pass_multiply_adds(self, num_tokens: int, num_logit_rows: int, num_attended_positions: int) -> int:
        """Multiply-adds of a pass that computes `num_tokens` tokens, logits for `num_logit_rows` of them, and
        attends to `num_attended_positions` (query, position) pairs."""
        layers = self.multiply_adds_per_token - self.output_multiply_adds
        return (
            num_tokens * layers
            + num_logit_rows * self.output_multiply_adds
            + num_attended_positions * self.attention_multiply_adds_per_position
        )

    def pass_bytes(self, num_context_tokens: int) -> int:
        """Bytes a pass reads: the weights once, and the K/V of `num_context_tokens` positions over its rows."""
        return self.weight_bytes_per_pass + num_context_tokens * self.kv_bytes_per_token


def attended_positions(num_tokens: int, num_context_tokens: int) -> int:
    """(query, position) pairs of a row computing its last `num_tokens` of `num_context_tokens` positions: token i
    of the row attends to every position up to its own (causal attention)."""
    first = num_context_tokens - num_tokens + 1  # the row's first token sees this many positions
    return num_tokens * first + num_tokens * (num_tokens - 1) // 2


def token_cost(loaded: LoadedModel, kv_bytes_per_token: int) -> TokenCost:
    """Count the loaded model's cost (module docstring) from its modules and config."""
    model = loaded.model
    config = loaded.config
    output = dict(model.named_children()).get(_OUTPUT_LAYER)
    return TokenCost(
        num_parameters=loaded.num_parameters,
        multiply_adds_per_token=round(_multiply_adds(model)),
        output_multiply_adds=round(_multiply_adds(output)) if output is not None else 0,
        attention_multiply_adds_per_position=2 * config.num_layers * config.num_heads * config.head_dim,
        weight_bytes_per_pass=sum(
            tensor.numel() * tensor.element_size() for tensor in _distinct(_streamed_tensors(model))
        ),
        kv_bytes_per_token=kv_bytes_per_token,
    )


def _multiply_adds(module: nn.Module) -> float:
    """Multiply-adds of one token's row through `module`'s weight matrices (lookups left out)."""
    if isinstance(module, _LOOKUPS):
        return 0
    if isinstance(module, _MATRICES):
        return module.in_features * module.out_features
    if isinstance(module, SparseMoeBlock):
        experts = sum(_multiply_adds(expert) for expert in module.experts)
        others = [module.shared_expert, *module.gates()]
        return experts * module.top_k / len(module.experts) + sum(_multiply_adds(m) for m in others if m is not None)
    return sum(_multiply_adds(child) for child in module.children())


def _streamed_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    """The weights a pass reads whole: every parameter and buffer outside a lookup table (a tied table is reached
    again through the output layer)."""
    if isinstance(module, _LOOKUPS):
        return
    yield from module.parameters(recurse=False)
    yield from (buffer for buffer in module.buffers(recurse=False) if buffer is not None)
    for child in module.children():
        yield from _streamed_tensors(child)


def _distinct(tensors: Iterator[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor once (a tied weight is one tensor held by two modules)."""
    seen: dict[tuple[int, int], torch.Tensor] = {}
    for tensor in tensors:
        seen.setdefault((tensor.data_ptr(), tensor.nbytes), tensor)
    return list(seen.values())
