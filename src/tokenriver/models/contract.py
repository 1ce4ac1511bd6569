"""What a model page offers the code around it: declared here, so the runner reads attributes instead of probing.

Every page (models/registry.py's classes) is a `ModelPage`: called like `forward(input_ids, positions, kv_cache,
metadata)` it returns the final hidden states of a ragged batch, and it names its config, the checkpoint tensors the
loader stacks (`fused_projections`) and its layer layout. Beyond that a page is one of two kinds:

- a `CausalLM` (the decoder pages: llama, qwen3, gemma, phi3, moe) continues text. Its decoder (`model`, Hugging
  Face's `model.` prefix) is a `DecoderStack`: embedding, layers and final norm as three steps, so that a runner can
  run the layers another way (runner/native_stack.py), cut them short (decoding/draft_model.py) or shard them
  (distributed/sharding.py). `compute_logits` turns chosen rows into logits; `lm_head` is the output projection
  (an nn.Linear, or a packed layer of models/quant.py) for code that binds it natively.
- a `PoolingModel` (the encoder pages: bert, nomic_bert) embeds or scores text and generates nothing: its rows are
  pooled (runner/pooling.py), and `score` applies its classification head (or refuses, where it has none).

Optional parts are attributes with a stated default, never missing: `layer_layout` is None on a page whose layers
no native decoder runs. tests/models/test_model_contract.py checks every registered class against these.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from tokenriver.kv.cache import KVCache
from tokenriver.models.attention_metadata import AttentionMetadata
from tokenriver.models.config import ModelConfig


@runtime_checkable
class ModelPage(Protocol):
    """What every page offers: a forward pass over a ragged batch, its config, and how the loader fills it."""

    config: ModelConfig
    # Fused module → the checkpoint modules whose weights it stacks, in output order (the loader reads it).
    fused_projections: dict[str, tuple[str, ...]]
    # The layout of its decoder layers among runner/native_stack.py's NATIVE_LAYOUTS, or None: no native decoder
    # runs its layers, and the runner calls the page itself.
    layer_layout: str | None

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions [num_tokens] int64 → final hidden states [num_tokens, hidden_size]."""
        ...


@runtime_checkable
class DecoderStack(Protocol):
    """A causal page's decoder: its forward pass is final_norm(run_layers(embed(...))), each step callable alone.

    `rope` is whatever the page's `embed` returns for its layers (cos and sin tables; Gemma's global and local
    pairs), handed back unchanged to `run_layers`.
    """

    layers: nn.ModuleList

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """[T] token ids and positions → (embeddings [T, hidden], the rotary tables the layers take)."""
        ...

    def run_layers(
        self, rope: Any, hidden: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer in turn: (last layer's output, the residual stream before it is added), [T, hidden] each."""
        ...

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Adds the last layer's output to the residual stream and normalizes: [T, hidden]."""
        ...


@runtime_checkable
class CausalLM(ModelPage, Protocol):
    """A page that continues text: its decoder in three steps, and logits for the rows that pick a token."""

    model: DecoderStack
    lm_head: nn.Module

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden_size] → [num_rows, vocab_size] float32 logits."""
        ...


@runtime_checkable
class PoolingModel(ModelPage, Protocol):
    """A page that embeds or scores text (an encoder): its rows are pooled, its head scores a pair."""

    def score(self, pooled: torch.Tensor) -> torch.Tensor:
        """[N, hidden_size], each request's first-token hidden state → [N, num_labels] float32 logits; raises
        InvalidParameterError naming the model where it has no classification head."""
        ...
