"""Inspection: one position of one context, layer by layer, for the visualizer's "inside the forward pass".

The contract:
- It runs the model's own parts (`embed`, each decoder layer, `final_norm`, `compute_logits`) over a fresh KV cache
  of its own, never the engine's cache, so the result depends on the context alone. The cache stores what the
  engine's pool stores (`kv_dtype`: int8 by default on the CPU, kv/cache.py), so the view is the engine's own
  arithmetic: the last layer's lens is the distribution the engine drew from. Without a kv_dtype it is the compute
  dtype, the modules' view with keys and values unrounded.
- Each decoder layer runs over the whole context in one call, as a plain forward pass runs it, and the position's
  row of the residual stream is read off between two layers. On the CPU a layer runs on the native decoder bound to
  it alone (models/cpu/decoder.py: the kernels of the engine's own prefill, equal to the module bit for bit); it
  falls back to the layer's module, the definition, wherever that does not apply: another device (a GPU's forward
  pass is the modules, on its own kernels), a layer with a part the native decoder has no kernel for (float
  weights, a bfloat16 model), a step or cache it does not take. Either way the view is the modules' over the whole
  context, bit for bit (tests/engine/test_inspection.py). The position is not run alone after its prefix: a row's
  bits can depend on how many rows share a product (the GEMV/GEMM switch of float32 activations), so its row comes
  from the same products as the whole context's.
- Only the context up to and including `position` is run: what comes after it cannot change that position.
- Keys and values an engine already holds are not computed again: `cached_prefix` copies those of the longest
  prefix of the context in the engine's prefix cache out of its pool, and the pass starts after them, as a chunked
  prefill would. The engine's products are batch- and chunk-invariant (its exact default numerics), so the view is
  the same bit for bit as with no prefix (tests/engine/test_inspection.py), and an inspection of a step the engine
  just ran costs about one decode step of the position instead of a prefill of its context.
- Per layer it returns
  (a) the logit lens: the top-k of softmax(compute_logits(final_norm(residual stream after this layer))) at the
      position, so the last layer's lens is the model's next-token distribution there;
  (b) the attention of the position over its context: softmax(scale * q·k) per head (soft-capped where the layer
      caps scores, zero outside a sliding window), from the query the layer computes and the keys it stored in
      the cache; None with a reason for an attention module this file does not know;
  (c) the L2 norms of the residual stream's update by attention and by the MLP at the position.
- Bounded cost: at most one forward pass over MAX_INSPECT_TOKENS tokens (less the cached prefix), one product of
  the output layer for all the layers' lenses together and, per layer, the position's query and attention weights;
  longer contexts are refused. benchmarks/inspection.py measures it against the engine's own prefill of the context.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from tokenriver.errors import InvalidParameterError
from tokenriver.kv.block_manager import BlockManager
from tokenriver.kv.cache import KVCache, decode_entries, entry_size
from tokenriver.loader.load import LoadedModel
from tokenriver.models.attention_metadata import AttentionMetadata
from tokenriver.models.config import ModelConfig
from tokenriver.models.cpu.decoder import NativeDecoder
from tokenriver.models.gemma import GemmaAttention, GemmaDecoderLayer
from tokenriver.models.layers import apply_rotary
from tokenriver.models.llama import LlamaAttention
from tokenriver.models.phi3 import Phi3Attention
from tokenriver.models.qwen3 import Qwen3Attention

# Longest context one inspection runs (one forward pass of this many tokens, one KV cache of its own).
MAX_INSPECT_TOKENS = 1024
MAX_TOP_K = 20
BLOCK_SIZE = 16
# Attention modules whose query this file recomputes (the queries are not kept by the forward pass).
KNOWN_ATTENTION = (LlamaAttention, Qwen3Attention, GemmaAttention, Phi3Attention)


def check_request(token_ids: list[int], position: int, top_k: int, vocab_size: int) -> None:
    """Refuse what cannot be inspected, naming the parameter and the limit."""
    if not token_ids:
        raise InvalidParameterError("token_ids must hold at least one token", param="token_ids")
    if not 0 <= position < len(token_ids):
        raise InvalidParameterError(
            f"position {position} is outside the context of {len(token_ids)} tokens (0..{len(token_ids) - 1})",
            param="position",
        )
    if position + 1 > MAX_INSPECT_TOKENS:
        raise InvalidParameterError(
            f"inspecting position {position} runs a context of {position + 1} tokens; the limit is "
            f"{MAX_INSPECT_TOKENS}",
            param="position",
        )
    if not 1 <= top_k <= MAX_TOP_K:
        raise InvalidParameterError(f"top_k must be between 1 and {MAX_TOP_K}, got {top_k}", param="top_k")
    bad = [t for t in token_ids[: position + 1] if not 0 <= t < vocab_size]
    if bad:
        raise InvalidParameterError(
            f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})", param="token_ids"
        )


@torch.inference_mode()
def inspect_position(
    loaded: LoadedModel,
    token_ids: list[int],
    position: int,
    top_k: int = 5,
    *,
    modules_only: bool = False,
    kv_dtype: torch.dtype | None = None,
    prefix: CachedPrefix | None = None,
) -> dict[str, Any]:
    """The per-layer view of `position` in the context `token_ids` (module docstring: what each field means).

    modules_only: run every layer through its module, the definition the native layers stand in for (the view is
    the same bit for bit), where by default a layer runs natively wherever it can.
    kv_dtype: what the inspection's KV cache stores, the engine's pool dtype to see the engine's arithmetic; None:
    the compute dtype (or the prefix's).
    prefix: keys and values of the context's first tokens (cached_prefix), the pass starting after them."""
    model, config, tokenizer = loaded.model, loaded.config, loaded.tokenizer
    check_request(token_ids, position, top_k, config.vocab_size)
    context = token_ids[: position + 1]
    if prefix is not None and prefix.num_tokens > position:
        raise ValueError(f"a prefix of {prefix.num_tokens} tokens leaves position {position} nothing to compute")
    taps = run_layers(model, context, position, modules_only, kv_dtype, prefix)
    lenses = logit_lens(model, torch.cat(taps.normed_streams), top_k, tokenizer)
    layers = [
        {
            "logit_lens": lens,
            "attention": attention,
            "attention_update_norm": attention_norm,
            "mlp_update_norm": mlp_norm,
        }
        for lens, attention, (attention_norm, mlp_norm) in zip(lenses, taps.attentions, taps.update_norms)
    ]
    return {
        "token_ids": context,
        "tokens": [tokenizer.token_text(t) for t in context],
        "position": position,
        "num_layers": len(layers),
        "layers": layers,
    }


@dataclass
class LayerTaps:
    """What the layers left at the position, one entry per layer in order."""

    # The residual stream after the layer, final-normed: [1, hidden] each, the logit lens's input.
    normed_streams: list[torch.Tensor]
    # attention_of's view of the layer.
    attentions: list[dict[str, Any]]
    # L2 norms of the attention's and the MLP's updates to the stream.
    update_norms: list[tuple[float, float]]


@dataclass(frozen=True)
class CachedPrefix:
    """Keys and values of a context's first `num_tokens` tokens, as an engine's pool stores them: per layer (keys,
    values), [num_tokens, num_kv_heads, entry_size] each."""

    num_tokens: int
    layers: list[tuple[torch.Tensor, torch.Tensor]]


def cached_prefix(block_manager: BlockManager, kv_cache: KVCache, token_ids: list[int]) -> CachedPrefix | None:
    """The keys and values of the longest prefix of token_ids in the engine's prefix cache, copied out of its pool
    (a lookup: the cache is left as it was), or None where no whole block of them is cached."""
    block_hashes: list[bytes] = []
    block_manager.extend_block_hashes(block_hashes, token_ids)
    block_ids = block_manager.find_cached_blocks(block_hashes)
    if not block_ids:
        return None
    ids = torch.tensor(block_ids, dtype=torch.int64, device=kv_cache[0][0].device)
    layers = []
    for keys, values in kv_cache.layers:  # [num_blocks, block_size, num_kv_heads, entry_size] each
        layers.append(tuple(pool[ids].flatten(0, 1) for pool in (keys, values)))
    return CachedPrefix(len(block_ids) * kv_cache.block_size, layers)


def run_layers(
    model: torch.nn.Module,
    context: list[int],
    position: int,
    modules_only: bool,
    kv_dtype: torch.dtype | None,
    prefix: CachedPrefix | None,
) -> LayerTaps:
    """The context through every decoder layer, each over all its tokens at once (module docstring), tapping the
    position's row between layers; the KV cache in kv_dtype (None: the compute dtype); with a prefix, its tokens'
    keys and values are stored first and the layers run the tokens after them."""
    stack = model.model
    device = next(model.parameters()).device
    num_tokens = len(context)
    start = 0 if prefix is None else prefix.num_tokens
    row = position - start  # the position's row among the rows the layers run
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    ids = torch.tensor(context[start:], dtype=torch.int64, device=device)
    hidden, rope = stack.embed(ids, torch.arange(start, num_tokens, device=device))  # [T - start, hidden]
    if prefix is not None:
        kv_dtype = prefix.layers[0][0].dtype
    cache = ContextCache.allocate(model.config, num_blocks, kv_dtype or hidden.dtype, device)
    if prefix is not None:
        cache.store_prefix(prefix)
    metadata = AttentionMetadata.build(
        [num_tokens - start], [num_tokens], [list(range(num_blocks))], BLOCK_SIZE, device
    )
    # Per layer, its pools seen as a cache of that layer alone, what a native decoder bound to that layer reads.
    caches = [cache.of_layer(layer.self_attn.layer_idx) for layer in stack.layers]
    natives = [None] * len(caches) if modules_only else native_layers(stack.layers, hidden, rope, caches, metadata)
    residual = None
    taps = LayerTaps([], [], [])
    for layer, native, layer_cache in zip(stack.layers, natives, caches):
        # The residual stream entering the layer at the position, x: [hidden] (the previous layer's output not yet
        # added); the other positions' streams are the layer's business only.
        stream_in = hidden[row].clone() if residual is None else residual[row] + hidden[row]
        layer_rope = rope_of(layer, rope)
        if native is None:
            hidden, residual = layer(layer_rope, hidden, residual, cache, metadata)
        else:
            # The native layer takes the stream whole: x = residual + hidden, the sum the module's input norm forms
            # (both add in float32, row by row), made in the residual's buffer: the last layer's taps copied theirs.
            stream = hidden if residual is None else residual.add_(hidden)  # [T - start, hidden]
            hidden, residual = native(stream, rope, layer_cache, metadata)
        # The layer left residual = x + attention update; it returns the MLP update as `hidden`.
        attention_update = residual[row] - stream_in  # [hidden]
        mlp_update = hidden[row]  # [hidden]
        # The stream after the layer, final-normed: the lens's input. The norm adds in place, so it gets copies.
        taps.normed_streams.append(stack.final_norm(hidden[row : row + 1].clone(), residual[row : row + 1].clone()))
        taps.attentions.append(attention_of(layer, stream_in, rope_row(layer_rope, row), cache, position))
        taps.update_norms.append((float(attention_update.float().norm()), float(mlp_update.float().norm())))
    return taps


class ContextCache(KVCache):
    """The KV pools of one inspection: plain tensors from the allocator, where a KVCache maps fresh pages that fault
    one by one on first touch (an engine allocates its pool once; an inspection allocates one per call, and the
    faults would cost more than its taps). `of_layer` sees one layer's pools as a cache of that layer alone."""

    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor]], num_blocks: int, block_size: int) -> None:
        # Not KVCache.__init__, which allocates: these pools exist.
        self.num_blocks, self.block_size, self.padding_slot = num_blocks, block_size, None
        self.layers = layers

    @classmethod
    def allocate(cls, config: ModelConfig, num_blocks: int, dtype: torch.dtype, device: torch.device) -> ContextCache:
        """Zeroed pools for every layer in dtype (kv/cache.py's entries: an int8 one carries its scale): a slot
        past the context in its last block is read (masked) by attention, and garbage times a zero weight could be
        NaN."""
        shape = (num_blocks, BLOCK_SIZE, config.num_kv_heads, entry_size(config.head_dim, dtype))
        pools = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(config.num_layers)
        ]  # (keys, values) per layer, [num_blocks, block_size, num_kv_heads, entry_size] each
        return cls(pools, num_blocks, BLOCK_SIZE)

    def store_prefix(self, prefix: CachedPrefix) -> None:
        """The prefix's keys and values into the first prefix.num_tokens slots of every layer (the blocks of a
        context are 0, 1, ... in order)."""
        for pools, cached in zip(self.layers, prefix.layers):
            for pool, entries in zip(pools, cached):
                pool.flatten(0, 1)[: prefix.num_tokens].copy_(entries)

    def of_layer(self, layer_idx: int) -> ContextCache:
        """Layer `layer_idx`'s pools as a cache of one layer: what a native decoder bound to that layer reads."""
        return ContextCache([self.layers[layer_idx]], self.num_blocks, self.block_size)


@dataclass(frozen=True)
class _LayerBindings:
    """Native decoders bound to a stack's layers one by one, and where the layers' tensors were when bound."""

    addresses: tuple[int, ...]
    # Per layer, its decoder, or None where some part of it has no native kernel.
    natives: list[NativeDecoder | None]


# Per decoder stack, its layers' native decoders. Binding checks every weight of a layer in Python, which costs more
# than all the taps of an inspection, so a stack is bound once, as the runner's NativeStack binds its own, and again
# when its weights move. Keyed by the layer list, held weakly: the decoders hold the layers and their tensors, never
# the list, so a model that is dropped takes its entry with it.
_BINDINGS: weakref.WeakKeyDictionary[torch.nn.ModuleList, _LayerBindings] = weakref.WeakKeyDictionary()


def bind_layers(layers: torch.nn.ModuleList) -> list[NativeDecoder | None]:
    """Per layer, the native decoder bound to that layer alone, or None where the decoder has no kernel for some
    part of it (the module runs it then)."""
    addresses = tuple(tensor.data_ptr() for tensor in (*layers.parameters(), *layers.buffers()))
    bound = _BINDINGS.get(layers)
    if bound is None or bound.addresses != addresses:
        natives = [NativeDecoder.build(torch.nn.ModuleList([layer])) for layer in layers]
        bound = _LayerBindings(addresses, natives)
        _BINDINGS[layers] = bound
    return bound.natives


def native_layers(
    layers: torch.nn.ModuleList,
    hidden: torch.Tensor,
    rope: Any,
    caches: list[ContextCache],
    metadata: AttentionMetadata,
) -> list[NativeDecoder | None]:
    """Per layer, its native decoder where that runs this step over the layer's cache, else None (the module runs
    it): off the CPU, a layer with a part the decoder has no kernel for, a step or a cache it does not take."""
    if not hidden.is_cpu:
        return [None] * len(layers)
    return [
        native if native is not None and native.supports(hidden, rope, cache, metadata) else None
        for native, cache in zip(bind_layers(layers), caches)
    ]


def rope_of(layer: torch.nn.Module, rope: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables this layer turns with: Gemma's stack carries (global, local) and picks per layer."""
    if isinstance(layer, GemmaDecoderLayer):
        rope_global, rope_local = rope
        return rope_local if layer.is_sliding else rope_global
    return rope


def rope_row(rope: tuple[torch.Tensor, torch.Tensor], row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables (cos, sin) of one row, [1, 1, rotary_dim // 2] each."""
    return rope[0][row : row + 1], rope[1][row : row + 1]


def logit_lens(model: torch.nn.Module, normed: torch.Tensor, top_k: int, tokenizer: Any) -> list[list[dict[str, Any]]]:
    """Per layer, the top-k next tokens if the model stopped there: the output layer on each layer's final-normed
    stream, [num_layers, hidden], in one product, so the output layer's weights (the model's largest matrix) are
    read once rather than once per layer."""
    probs = torch.softmax(model.compute_logits(normed).float(), dim=-1)  # [num_layers, vocab]
    top = torch.topk(probs, top_k)  # values, indices: [num_layers, top_k]
    return [
        [{"token_id": int(t), "text": tokenizer.token_text(int(t)), "prob": float(p)} for p, t in zip(values, indices)]
        for values, indices in zip(top.values, top.indices)
    ]


def attention_of(
    layer: torch.nn.Module,
    stream_in: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    cache: KVCache,
    position: int,
) -> dict[str, Any]:
    """The position's attention weights over its context, per head and averaged over heads (rope: the position's
    rotary tables, rope_row).

    The query is recomputed as the layer computes it (input norm, q projection, q_norm where the layer has one,
    rotary on the first rotary_dim values of each head); the keys are those the layer stored in the cache, so they
    are exactly the ones it attended to.
    """
    attn = layer.self_attn
    if not isinstance(attn, KNOWN_ATTENTION):
        return {"weights": None, "reason": f"attention weights are not implemented for {type(attn).__name__}"}
    head_dim, num_heads, num_kv_heads = attn.head_dim, attn.num_heads, attn.num_kv_heads
    x = layer.input_layernorm(stream_in[None])  # [1, hidden]
    query = attn.qkv_proj(x).view(1, -1, head_dim)[:, :num_heads]  # [1, num_heads, head_dim]
    q_norm = getattr(attn, "q_norm", None)  # Qwen3 and Gemma 3 normalize each query head before rotary
    if q_norm is not None:
        query = q_norm(query.reshape(-1, head_dim)).view(1, num_heads, head_dim)
    rotary_dim = getattr(attn, "rotary_dim", head_dim)
    cos, sin = rope  # [1, 1, rotary_dim // 2] each: the position's
    query = torch.cat((apply_rotary(query[..., :rotary_dim], cos, sin), query[..., rotary_dim:]), dim=-1)
    key_pool = cache[attn.layer_idx][0]
    entry = key_pool.shape[3]
    # [position + 1, num_kv_heads, head_dim] → [num_heads, position + 1, head_dim], each kv head shared by its group.
    keys = decode_entries(key_pool.view(-1, num_kv_heads, entry)[: position + 1], torch.float32)
    keys = keys.transpose(0, 1).repeat_interleave(num_heads // num_kv_heads, dim=0)
    scores = torch.einsum("hd,hsd->hs", query[0].float(), keys) * attn.scale  # [num_heads, position + 1]
    softcap = getattr(attn, "softcap", None)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    window = getattr(attn, "window", 0)
    if window > 0:
        # A sliding layer sees the last `window` positions up to its own.
        outside = torch.arange(position + 1, device=scores.device) <= position - window
        scores = scores.masked_fill(outside, float("-inf"))
    weights = torch.softmax(scores, dim=-1)  # [num_heads, position + 1]
    return {
        "weights": weights.tolist(),
        "mean": weights.mean(0).tolist(),
        "window": window,
        "reason": None,
    }
