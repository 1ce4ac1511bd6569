"""NativeStack: a model's forward pass, with its decoder layers run in one native call where they can be.

The model files (models/llama.py, qwen3.py, gemma.py) are plain PyTorch and define what a step computes. Run layer
by layer from Python, a small model's decode step spends about as long in module dispatch as in arithmetic, so the
runner calls the model through this wrapper: it embeds with the model's own modules, runs the layers through
models/cpu/decoder.py when that decoder can bind them and run the step, else through the model's own
`run_layers`, and ends with the model's final norm. Both paths give the same hidden states bit for bit
(tests/models/cpu/test_native_decoder.py).

A model on another device (a GPU) runs its own `forward`: the native decoder is CPU code.

`greedy_passes` runs the later passes of a multi-step decode in one native call (models/cpu/greedy.py): the
embedding, the stack, the final norm, the output layer and each row's argmax, pass after pass, with the same kernels
as the runner's own loop over `__call__` and the output layer.

An architecture opts in by naming its layer layout (`layer_layout`, a class attribute of every page) among
NATIVE_LAYOUTS; such a page is a causal one, whose decoder (`model.model`) is models/contract.py's DecoderStack. Any
other page runs its own `forward`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from tokenriver.kv.cache import KVCache
from tokenriver.models.attention_metadata import AttentionMetadata
from tokenriver.models.contract import CausalLM, ModelPage
from tokenriver.models.cpu.decoder import NativeDecoder
from tokenriver.models.cpu.greedy import GreedyLoop, PassReductions

# Layer layouts decoder.cpp runs (models/cpu/decoder.py's LAYOUTS): "llama" is LlamaDecoderLayer's pre-norm
# residual-stream block (fused qkv and gate/up projections, RMSNorm, SwiGLU); "qwen3" adds per-head q/k norms,
# sliding windows and, in the mixtures of experts, a router and per-expert MLPs; "phi3" is Llama's with a window
# and partial rotary; "gemma" adds norms on each block's output, GeGLU, per-layer rope tables and Gemma 2's
# soft-capped attention scores.
NATIVE_LAYOUTS = frozenset({"llama", "qwen3", "phi3", "gemma"})


@dataclass(frozen=True)
class _LayerBinding:
    """The native decoder bound to one layer list, and how to tell that the list or its weights changed since."""

    layers: nn.ModuleList
    # The first layer's parameters and where their data was when bound: .to() and .share_memory_() give them new
    # data; the decoder holds what it bound, so a missed move reads stale weights, never freed memory.
    parameters: list[nn.Parameter]
    addresses: tuple[int, ...]
    # None where some part of the layers has no native kernel.
    native: NativeDecoder | None

    def is_current(self, layers: nn.ModuleList) -> bool:
        """Whether this binding still describes `layers`: the same list, its weights where they were."""
        return self.layers is layers and all(
            parameter.data_ptr() == address for parameter, address in zip(self.parameters, self.addresses)
        )


@dataclass(frozen=True)
class _GreedyBinding:
    """The greedy loop bound to one native decoder and output projection (None where their parts do not allow it)."""

    native: NativeDecoder
    lm_head: nn.Module
    # Where the output projection's tensors were when bound.
    head_addresses: tuple[int, ...]
    loop: GreedyLoop | None

    def is_current(self, native: NativeDecoder, lm_head: nn.Module, head_addresses: tuple[int, ...]) -> bool:
        """Whether this binding was made for this decoder and this output projection, its weights where they are."""
        return self.native is native and self.lm_head is lm_head and self.head_addresses == head_addresses


def _addresses(module: nn.Module) -> tuple[int, ...]:
    """Where a module's parameters and buffers keep their data: new addresses mean the weights moved."""
    return tuple(tensor.data_ptr() for tensor in (*module.parameters(), *module.buffers()))


class NativeStack:
    """Calls like the model's forward; binds the native decoder at the first step and again when the layers move."""

    def __init__(self, model: ModelPage) -> None:
        self.model = model
        # Bound at the first step, once the loader has put the weights in; bound again when the layer list is
        # replaced or its weights moved.
        self._binding: _LayerBinding | None = None
        # Bound at the first multi-step pass, and again with the decoder or the output projection.
        self._greedy: _GreedyBinding | None = None

    @property
    def native(self) -> NativeDecoder | None:
        """The decoder the last step could use, or None (not bound yet, or some layer has no native kernel)."""
        return None if self._binding is None else self._binding.native

    @torch.inference_mode()
    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] int64 → final-norm hidden states [num_tokens, hidden_size]."""
        page = self._native_page() if input_ids.is_cpu else None
        if page is None:
            return self.model(input_ids, positions, kv_cache, metadata)
        decoder = page.model
        hidden, rope = decoder.embed(input_ids, positions)  # [T, hidden]; the model's rotary tables
        native = self._bind(decoder.layers)
        if native is not None and native.supports(hidden, rope, kv_cache, metadata):
            hidden, residual = native(hidden, rope, kv_cache, metadata)
        else:
            hidden, residual = decoder.run_layers(rope, hidden, kv_cache, metadata)
        return decoder.final_norm(hidden, residual)

    @torch.inference_mode()
    def greedy_passes(
        self, num_passes: int, token_ids: list[int], positions: list[int], block_tables: torch.Tensor, kv_cache: KVCache
    ) -> PassReductions | None:
        """The greedy passes of a multi-step decode in one native call (models/cpu/greedy.py): request b's pass p
        decodes token_ids[b] (p = 0) or its argmax of pass p - 1 at position positions[b] + p. Per pass and row,
        (argmax, largest logit, log-sum-exp) of the passes it finished, [finished, B] each; None where the model's
        parts do not allow it. Each row's logits are those compute_logits gives."""
        page = self._native_page() if block_tables.is_cpu else None
        native = self._bind(page.model.layers) if page is not None else None
        if page is None or native is None:
            return None
        loop = self._greedy_loop(page, native)
        if loop is None:
            return None
        return loop.run(num_passes, token_ids, positions, block_tables, kv_cache)

    def _native_page(self) -> CausalLM | None:
        """The page where its layer layout is one the native decoder runs, else None. Only causal pages name such
        a layout (models/contract.py; tests/models/test_model_contract.py checks it)."""
        return cast(CausalLM, self.model) if self.model.layer_layout in NATIVE_LAYOUTS else None

    def _bind(self, layers: nn.ModuleList) -> NativeDecoder | None:
        if self._binding is None or not self._binding.is_current(layers):
            parameters = list(layers[0].parameters()) if len(layers) else []
            self._binding = _LayerBinding(
                layers,
                parameters,
                tuple(parameter.data_ptr() for parameter in parameters),
                NativeDecoder.build(layers),
            )
        return self._binding.native

    def _greedy_loop(self, page: CausalLM, native: NativeDecoder) -> GreedyLoop | None:
        """The greedy loop over `native` and the page's output projection, bound again when either changed."""
        head = page.lm_head
        addresses = _addresses(head)
        binding = self._greedy
        if binding is None or not binding.is_current(native, head, addresses):
            binding = _GreedyBinding(native, head, addresses, GreedyLoop.build(page, native))
            self._greedy = binding
        return binding.loop
