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

An architecture opts in by naming its layer layout (`layer_layout`, a class attribute of the model) among
NATIVE_LAYOUTS and by giving its decoder (`model.model`) `embed`, `layers`, `run_layers` and `final_norm`; any
other model runs its own `forward`.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenriver.kv.cache import KVCache
from tokenriver.models.attention_metadata import AttentionMetadata
from tokenriver.models.cpu.decoder import NativeDecoder
from tokenriver.models.cpu.greedy import GreedyLoop, PassReductions

# Layer layouts decoder.cpp runs (models/cpu/decoder.py's LAYOUTS): "llama" is LlamaDecoderLayer's pre-norm
# residual-stream block (fused qkv and gate/up projections, RMSNorm, SwiGLU); "qwen3" adds per-head q/k norms,
# sliding windows and, in the mixtures of experts, a router and per-expert MLPs; "phi3" is Llama's with a window
# and partial rotary; "gemma" adds norms on each block's output, GeGLU, per-layer rope tables and Gemma 2's
# soft-capped attention scores.
NATIVE_LAYOUTS = frozenset({"llama", "qwen3", "phi3", "gemma"})


class NativeStack:
    """Calls like the model's forward; binds the native decoder at the first step and again when the layers move."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        # (the layer list, its first layer's parameters and where their data was, its NativeDecoder or None where
        # some part has no native kernel): bound at the first step, once the loader has put the weights in; bound
        # again when the list is replaced or the weights moved (.to(), .share_memory_() give the parameters new
        # data; the decoder holds what it bound, so a missed move reads stale weights, never freed memory).
        self._binding: tuple[nn.ModuleList, list[nn.Parameter], list[int], NativeDecoder | None] | None = None
        # (the decoder and output projection address it was bound with, the greedy loop or None), bound at the
        # first multi-step pass and again with the decoder.
        self._greedy: tuple[NativeDecoder, int, GreedyLoop | None] | None = None

    @property
    def native(self) -> NativeDecoder | None:
        """The decoder the last step could use, or None (not bound yet, or some layer has no native kernel)."""
        return None if self._binding is None else self._binding[3]

    @torch.inference_mode()
    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] int64 → final-norm hidden states [num_tokens, hidden_size]."""
        decoder = self._decoder() if input_ids.is_cpu else None
        if decoder is None:
            return self.model(input_ids, positions, kv_cache, metadata)
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
        parts or the number of rows do not allow it. Each row's logits are those compute_logits gives."""
        decoder = self._decoder() if block_tables.is_cpu else None
        native = self._bind(decoder.layers) if decoder is not None else None
        if native is None:
            return None
        head = getattr(getattr(self.model, "lm_head", None), "qweight", None)
        address = head.data_ptr() if head is not None else 0
        if self._greedy is None or self._greedy[0] is not native or self._greedy[1] != address:
            self._greedy = (native, address, GreedyLoop.build(self.model, native))
        loop = self._greedy[2]
        if loop is None or len(token_ids) > loop.max_rows:
            return None
        return loop.run(num_passes, token_ids, positions, block_tables, kv_cache)

    def _decoder(self) -> nn.Module | None:
        if getattr(self.model, "layer_layout", None) not in NATIVE_LAYOUTS:
            return None
        decoder = getattr(self.model, "model", None)
        return decoder if isinstance(getattr(decoder, "layers", None), nn.ModuleList) else None

    def _bind(self, layers: nn.ModuleList) -> NativeDecoder | None:
        binding = self._binding
        if (
            binding is None
            or binding[0] is not layers
            or any(parameter.data_ptr() != address for parameter, address in zip(binding[1], binding[2]))
        ):
            parameters = list(layers[0].parameters()) if len(layers) else []
            binding = (
                layers,
                parameters,
                [parameter.data_ptr() for parameter in parameters],
                NativeDecoder.build(layers),
            )
            self._binding = binding
        return binding[3]
