"""A decoder stack's step in one native call (models/cpu/csrc/decoder.cpp): Llama, dense Qwen3, Phi-3 and Gemma
layers.

A single-stream decode step is ~240 small operations; run layer by layer from Python, each pays module dispatch,
argument checks, an output allocation and a ctypes call, which together cost about as much as the arithmetic.
This runs the same operations, through the same kernels in the same order, from one call: the results equal
the module path's bit for bit.

Which parts a layer has is read off its type, one small function per layout (`LAYOUTS`): Llama's pre-norm block;
Qwen3's adds q/k norms, a per-layer sliding window and, in its mixtures of experts (Qwen3-MoE, Qwen2-MoE, Mixtral),
a router and per-expert MLPs in place of the MLP; Phi-3's is Llama's with a window and, in Phi-4-mini, partial
rotary (the first rotary_dim values of each head turn); Gemma's adds norms on the attention and MLP outputs, GeGLU,
its (1 + weight) norms (bound as those sums, computed here once), Gemma 2's soft-capped attention scores and, on
Gemma 3's sliding layers, the local rope tables (Gemma's `rope` is a (global, local) pair of tables).

Contract: `NativeDecoder.build(layers)` returns None unless every layer can run natively (layers of one layout,
every projection a quantized linear on the native backend, float32 norm weights, one eps, a head size the attention
kernel is compiled for; a mixture of experts with a float32 router and shared gate). `supports(...)` says whether one
step can: float32 activations, a float32, float16 or int8 cache, all on the CPU, autograd off
(decodes, verification and prompt chunks alike: the attention kernel takes them all). The caller runs the modules
otherwise. The weights' pointers are taken at build time: the owner drops this object when its buffers move
(Gemma's norm sums are copies: weights changed in place after binding are not seen).

How the threads share a step (`threading`, decoder.cpp's runs_in_row_groups): "auto" splits every operation across
them unless, in a decode step of enough rows, they turn out not to share a cache; then each thread runs a group of
the rows through the whole stack. "split" and "row_groups" force one way (where the step allows it); all three
give the same results.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from tokenriver.kv.cache import KVCache, head_dim_of
from tokenriver.models.attention_metadata import AttentionMetadata
from tokenriver.models.cpu import fast_path as cpu_fast_path
from tokenriver.models.cpu.kernels import (
    ROUNDINGS,
    DecoderSpec,
    GreedyLoopSpec,
    LayerSpec,
    LinearSpec,
    MoeSpec,
    NativeKernels,
    StepSpec,
    is_contiguous_f32,
    is_native_kv_pool,
    kv_cache_format,
    load_kernels,
)
from tokenriver.models.gemma import GemmaDecoderLayer
from tokenriver.models.llama import LlamaDecoderLayer
from tokenriver.models.moe import SparseMoeBlock
from tokenriver.models.phi3 import Phi3DecoderLayer
from tokenriver.models.quant import Int4Linear, Int8Linear
from tokenriver.models.qwen3 import Qwen3DecoderLayer

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [T, 1, rotary_dim // 2]


def linear_spec(linear: nn.Module) -> LinearSpec | None:
    """The layer as decoder.cpp runs it, or None if it has no native kernel."""
    if not isinstance(linear, (Int4Linear, Int8Linear)) or linear.backend != "native" or not linear.qweight.is_cpu:
        return None
    is_int4 = isinstance(linear, Int4Linear)
    high_bits = linear.high_bits if is_int4 else None
    return LinearSpec(
        linear.qweight.data_ptr(),
        linear.scales.data_ptr(),
        linear.mins.data_ptr() if is_int4 else None,
        None if high_bits is None else high_bits.data_ptr(),
        None if linear.bias is None else linear.bias.data_ptr(),
        linear.out_features,
        linear.in_features,
        linear.group_size,
        linear.max_gemv_rows,
        int(is_int4),
        int(linear.int8_activations),
        ROUNDINGS.index(linear.gemm_rounding),
        None if linear.chain_ends is None else linear.chain_ends.data_ptr(),
    )


def _is_index_array(array: torch.Tensor) -> bool:
    return array.dtype == torch.int64 and array.is_cpu and array.is_contiguous()


THREADINGS = ("auto", "split", "row_groups")  # decoder.cpp's Step.threading codes 0, 1, 2
ACTIVATIONS = ("silu", "gelu_tanh")  # decoder.cpp's Decoder.activation codes: SwiGLU, GeGLU


@dataclass
class LayerParts:
    """What decoder.cpp runs of one layer beyond its four projections: norms by LayerSpec field (None where the
    layer has none), what its norms add to their weights, and its attention's window and rope tables."""

    norms: dict[str, nn.Module | None] = field(default_factory=dict)
    norm_offset: float = 0.0  # Gemma's norms multiply by (1 + weight)
    window: int = 0
    local_rope: bool = False


def _llama_parts(layer: LlamaDecoderLayer) -> LayerParts:
    return LayerParts({"input_norm": layer.input_layernorm, "pre_mlp_norm": layer.post_attention_layernorm})


def _qwen3_parts(layer: Qwen3DecoderLayer) -> LayerParts | None:
    attention = layer.self_attn
    return LayerParts(
        {
            "input_norm": layer.input_layernorm,
            "pre_mlp_norm": layer.post_attention_layernorm,
            "q_norm": attention.q_norm,
            "k_norm": attention.k_norm,
        },
        window=attention.window,
    )


def _phi3_parts(layer: Phi3DecoderLayer) -> LayerParts:
    return LayerParts(
        {"input_norm": layer.input_layernorm, "pre_mlp_norm": layer.post_attention_layernorm},
        window=layer.self_attn.window,
    )


def _gemma_parts(layer: GemmaDecoderLayer) -> LayerParts | None:
    attention = layer.self_attn
    return LayerParts(
        {
            "input_norm": layer.input_layernorm,
            "pre_mlp_norm": layer.pre_feedforward_layernorm,
            "q_norm": attention.q_norm,
            "k_norm": attention.k_norm,
            "attention_out_norm": layer.post_attention_layernorm,
            "mlp_out_norm": layer.post_feedforward_layernorm,
        },
        norm_offset=1.0,
        window=attention.window,
        local_rope=layer.is_sliding,
    )


@dataclass(frozen=True)
class Layout:
    """A layer type decoder.cpp runs: how to read its parts, its MLP's activation, and whether the model's `rope`
    is a (global, local) pair of tables rather than one table."""

    parts: Callable[..., LayerParts | None]
    activation: str
    has_local_rope: bool = False


LAYOUTS: dict[type[nn.Module], Layout] = {
    LlamaDecoderLayer: Layout(_llama_parts, "silu"),
    Qwen3DecoderLayer: Layout(_qwen3_parts, "silu"),
    GemmaDecoderLayer: Layout(_gemma_parts, "gelu_tanh", has_local_rope=True),
    Phi3DecoderLayer: Layout(_phi3_parts, "silu"),
}


def _moe_spec(moe: SparseMoeBlock, keep: list[object]) -> MoeSpec | None:
    """A mixture of experts as decoder.cpp runs it, or None if a part has no native form (gates the CPU's fast
    path routes, every expert projection a native quantized linear); the ctypes structures it points into go into
    `keep`."""
    fast = cpu_fast_path.load()
    if fast is None or not fast.routes_moe(moe.gates(), len(moe.experts)):
        return None
    gate_ups = [linear_spec(expert.gate_up_proj) for expert in moe.experts]
    downs = [linear_spec(expert.down_proj) for expert in moe.experts]
    shared = (
        []
        if moe.shared_expert is None
        else [linear_spec(moe.shared_expert.gate_up_proj), linear_spec(moe.shared_expert.down_proj)]
    )
    if any(spec is None for spec in (*gate_ups, *downs, *shared)):
        return None
    arrays = [(LinearSpec * len(gate_ups))(*gate_ups), (LinearSpec * len(downs))(*downs), *shared]
    keep.extend(arrays)
    spec = MoeSpec(
        moe.gate.weight.data_ptr(),
        len(moe.experts),
        moe.top_k,
        int(moe.norm_topk_prob),
        moe.experts[0].down_proj.in_features,
        ctypes.addressof(arrays[0]),
        ctypes.addressof(arrays[1]),
    )
    if moe.shared_expert is not None:
        spec.shared_gate_up, spec.shared_down = ctypes.addressof(arrays[2]), ctypes.addressof(arrays[3])
        spec.shared_intermediate_size = moe.shared_expert.down_proj.in_features
        spec.shared_gate = moe.shared_expert_gate.weight.data_ptr()
    keep.append(spec)
    return spec


def _layer_spec(layer: nn.Module, parts: LayerParts, eps: float, computed: list[object]) -> LayerSpec | None:
    """The layer as decoder.cpp runs it, or None if a part has no native kernel; norm weights it computes (Gemma's
    sums) and the ctypes structures a mixture of experts points into go into `computed`, which the decoder keeps
    alive."""
    norms: dict[str, int | None] = {}
    for name, norm in parts.norms.items():
        if norm is None:
            norms[name] = None
            continue
        if not is_contiguous_f32(norm.weight) or norm.eps != eps:
            return None
        weight = norm.weight.detach()
        if parts.norm_offset:
            weight = parts.norm_offset + weight  # as the module computes it each call
            computed.append(weight)
        norms[name] = weight.data_ptr()
    if (norms.get("q_norm") is None) != (norms.get("k_norm") is None):
        return None
    attention, mlp = layer.self_attn, layer.mlp
    moe = None
    if isinstance(mlp, SparseMoeBlock):
        moe = _moe_spec(mlp, computed)
        if moe is None:
            return None
        projections = [linear_spec(attention.qkv_proj), linear_spec(attention.o_proj), LinearSpec(), LinearSpec()]
    else:
        projections = [
            linear_spec(module) for module in (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
        ]
    if any(spec is None for spec in projections):
        return None
    return LayerSpec(
        norms["input_norm"],
        norms["pre_mlp_norm"],
        *projections,
        q_norm=norms.get("q_norm"),
        k_norm=norms.get("k_norm"),
        attention_out_norm=norms.get("attention_out_norm"),
        mlp_out_norm=norms.get("mlp_out_norm"),
        window=parts.window,
        local_rope=int(parts.local_rope),
        moe=None if moe is None else ctypes.addressof(moe),
    )


class NativeDecoder:
    """The layers' weights bound once; each call runs one step of all of them."""

    threading: str = "auto"  # one of THREADINGS (module docstring)

    def __init__(
        self,
        kernels: NativeKernels,
        layers: nn.ModuleList,
        specs: list[LayerSpec],
        layout: Layout,
        computed: list[object],
    ) -> None:
        self._kernels = kernels
        self._layers = layers
        # Every tensor the specs point into, held by its storage (the computed norm weights too): a layer whose
        # weights move after binding leaves this decoder stale (its owner binds again), never pointing into freed
        # memory.
        self._tensors = [tensor.detach() for layer in layers for tensor in (*layer.parameters(), *layer.buffers())]
        self._tensors += computed  # and the ctypes structures of mixtures of experts
        self._specs = (LayerSpec * len(specs))(*specs)
        self._has_local_rope = layout.has_local_rope
        first = layers[0]
        attention = first.self_attn
        self._decoder = DecoderSpec(
            self._specs,
            len(specs),
            attention.o_proj.out_features,
            attention.num_heads,
            attention.num_kv_heads,
            attention.head_dim,
            max(
                (layer.mlp.down_proj.in_features for layer in layers if not isinstance(layer.mlp, SparseMoeBlock)),
                default=0,
            ),
            first.input_layernorm.eps,
            attention.scale,
            ACTIVATIONS.index(layout.activation),
            getattr(attention, "rotary_dim", attention.head_dim),
            getattr(attention, "softcap", None) or 0.0,
        )
        self._step = StepSpec()
        # The cache the pointers below belong to, held weakly: binding a model must not keep an engine's pool alive.
        self._cache: weakref.ref[KVCache] | None = None
        self._cache_pointers: tuple[ctypes.Array, ctypes.Array] | None = None

    @classmethod
    def build(cls, layers: nn.ModuleList) -> NativeDecoder | None:
        """Bind a model's layers (all of one type in LAYOUTS), or None if one of them has a part without a native
        kernel."""
        kernels = load_kernels()
        if kernels is None or len(layers) == 0:
            return None
        layer_type = type(layers[0])
        layout = LAYOUTS.get(layer_type)
        if layout is None or layers[0].self_attn.head_dim not in kernels.attention_head_dims:
            return None
        eps = layers[0].input_layernorm.eps
        specs: list[LayerSpec] = []
        computed: list[object] = []
        for layer in layers:
            parts = layout.parts(layer) if type(layer) is layer_type else None
            spec = None if parts is None else _layer_spec(layer, parts, eps, computed)
            if spec is None:
                return None
            specs.append(spec)
        return cls(kernels, layers, specs, layout, computed)

    def supports(
        self, hidden: torch.Tensor, rope: Rope | tuple[Rope, Rope], kv_cache: KVCache, metadata: AttentionMetadata
    ) -> bool:
        """Whether this step can run natively (see the module docstring)."""
        tables = [table for pair in self._rope_tables(rope) for table in pair]
        index_arrays = [metadata.slot_mapping, metadata.block_tables]
        index_arrays += [a for a in (metadata.kernel_queries, metadata.kernel_chunks) if a is not None]
        return (
            hidden.dim() == 2
            and is_contiguous_f32(hidden)
            and all(map(is_contiguous_f32, tables))
            and all(table.numel() == hidden.shape[0] * (self._decoder.rotary_dim // 2) for table in tables)
            and metadata.slot_mapping.shape[0] == hidden.shape[0]
            and all(_is_index_array(a) for a in index_arrays)
            and self.supports_cache(kv_cache)
        )

    def supports_cache(self, kv_cache: KVCache) -> bool:
        """Whether a step can run on this cache (one native pool per layer, of the stack's heads), autograd off."""
        key_cache, value_cache = kv_cache[0]
        return (
            not torch.is_grad_enabled()
            and len(kv_cache) == len(self._specs)
            and is_native_kv_pool(key_cache, value_cache)
            and key_cache.shape[2] == self._decoder.num_kv_heads
            and head_dim_of(key_cache) == self._decoder.head_dim
        )

    def __call__(
        self, hidden: torch.Tensor, rope: Rope | tuple[Rope, Rope], kv_cache: KVCache, metadata: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, hidden_size] (the embeddings); rope as the model's embed returns it → (last layer's MLP
        output, residual stream before it)."""
        out = torch.empty_like(hidden)  # [T, hidden]
        residual = torch.empty_like(hidden)  # [T, hidden]
        (cos, sin), (local_cos, local_sin) = self._rope_tables(rope)
        queries, chunks = metadata.kernel_queries, metadata.kernel_chunks
        step = self._cache_step(self._step, kv_cache, metadata.block_tables)
        step.hidden, step.out, step.residual = hidden.data_ptr(), out.data_ptr(), residual.data_ptr()
        step.num_tokens = hidden.shape[0]
        step.cos, step.sin = cos.data_ptr(), sin.data_ptr()
        step.local_cos, step.local_sin = local_cos.data_ptr(), local_sin.data_ptr()
        step.slots = metadata.slot_mapping.data_ptr()
        step.queries, step.num_queries = (None, 0) if queries is None else (queries.data_ptr(), queries.shape[0])
        step.chunks, step.num_chunks = (None, 0) if chunks is None else (chunks.data_ptr(), chunks.shape[0])
        self._kernels.decoder(self._decoder, step)
        return out, residual

    def greedy_passes(self, loop: GreedyLoopSpec, kv_cache: KVCache, block_tables: torch.Tensor) -> int:
        """loop.num_passes greedy passes (models/cpu/greedy.py) of block_tables.shape[0] one-token requests,
        block_tables [B, max_blocks] int64 covering every pass's position: how many passes finished (0 where the
        cache or the tables do not suit the stack)."""
        if not (self.supports_cache(kv_cache) and _is_index_array(block_tables) and block_tables.dim() == 2):
            return 0
        step = self._cache_step(StepSpec(), kv_cache, block_tables)
        return self._kernels.decoder_greedy(self._decoder, step, loop)

    def _cache_step(self, step: StepSpec, kv_cache: KVCache, block_tables: torch.Tensor) -> StepSpec:
        """step with its cache, block tables and threads filled in."""
        keys, values = self._pointers(kv_cache)
        step.block_tables, step.num_requests = block_tables.data_ptr(), block_tables.shape[0]
        step.max_blocks = block_tables.shape[1]
        step.key_caches, step.value_caches = ctypes.addressof(keys), ctypes.addressof(values)
        step.num_blocks, step.block_size = kv_cache.num_blocks, kv_cache.block_size
        step.num_threads = torch.get_num_threads()
        step.kv_cache_format = kv_cache_format(kv_cache[0][0])
        if self.threading not in THREADINGS:
            raise ValueError(f"NativeDecoder.threading must be one of {THREADINGS}, got {self.threading!r}")
        step.threading = THREADINGS.index(self.threading)
        return step

    def _rope_tables(self, rope: Rope | tuple[Rope, Rope]) -> tuple[Rope, Rope]:
        """(global, local) tables: Gemma's embed gives both, the other layouts one table for every layer."""
        return rope if self._has_local_rope else (rope, rope)

    def _pointers(self, kv_cache: KVCache) -> tuple[ctypes.Array, ctypes.Array]:
        """Each layer's key and value pool addresses (a KVCache allocates its pools once, contiguous)."""
        if self._cache is None or self._cache() is not kv_cache:
            pointers = ctypes.c_void_p * len(kv_cache)
            self._cache_pointers = (
                pointers(*(key.data_ptr() for key, _ in kv_cache.layers)),
                pointers(*(value.data_ptr() for _, value in kv_cache.layers)),
            )
            self._cache = weakref.ref(kv_cache)
        return self._cache_pointers
