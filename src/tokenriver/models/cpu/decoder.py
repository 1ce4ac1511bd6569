"""A decoder stack's step in one native call (models/cpu/csrc/decoder.cpp): Llama, Qwen3 (dense and mixtures of
experts), Phi-3 and Gemma layers.

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

What the C++ reads is checked before it runs, as the kernels' wrappers check theirs (models/cpu/kernels.py): at
build, every bound tensor against the stack's shapes (each projection's rows and columns and its row tiles, each
norm's width, a mixture's router and experts), raising ValueError where one does not fit; per cache, every layer's
pools (once per cache object); per step, the activations, rotary tables and attention metadata (a few comparisons:
`step_problem`, which `supports` answers from and a call raises). The indices inside the metadata (slots, block
ids, context lengths) are range-checked by the attention kernel itself, which the stack runs before it writes.
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
    check_elements,
    check_tiles,
    is_contiguous_f32,
    is_native_kv_pool,
    kv_cache_format,
    load_kernels,
)
from tokenriver.models.cpu.tiles import Tiles
from tokenriver.models.gemma import GemmaDecoderLayer
from tokenriver.models.kquant import KQuantLinear
from tokenriver.models.llama import LlamaDecoderLayer
from tokenriver.models.moe import SparseMoeBlock
from tokenriver.models.phi3 import Phi3DecoderLayer
from tokenriver.models.quant import Int4Linear, Int8Linear
from tokenriver.models.qwen3 import Qwen3DecoderLayer
from tokenriver.models.stacked import StackedLinear

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [T, 1, rotary_dim // 2]


def linear_spec(linear: nn.Module) -> LinearSpec | None:
    """The layer as decoder.cpp runs it, or None if it has no native kernel (not a quantized layer bound to the
    native products, whose binding moved its buffers into row tiles; a K-quant layer with exact float32
    activations). ValueError if its buffers do not hold what its shape says (kernels.check_tiles)."""
    if isinstance(linear, KQuantLinear):
        return _kquant_spec(linear)
    if isinstance(linear, StackedLinear):
        return _stacked_spec(linear)
    if (
        not isinstance(linear, (Int4Linear, Int8Linear))
        or linear.backend != "native"
        or not linear.qweight.is_cpu
        or linear.layout != "tiles"
    ):
        return None
    is_int4 = isinstance(linear, Int4Linear)
    high_bits = linear.high_bits if is_int4 else None
    tiles = Tiles(
        linear.qweight,
        linear.scales,
        linear.mins if is_int4 else None,
        high_bits,
        linear.out_features,
        linear.in_features,
        linear.group_size,
        linear.chain_ends,
    )
    check_tiles(tiles, f"a linear layer [{linear.out_features}, {linear.in_features}]")
    if linear.bias is not None:
        check_elements("a linear layer", "bias", linear.bias, torch.float32, linear.out_features)
    return LinearSpec(
        linear.qweight.data_ptr(),
        linear.scales.data_ptr(),
        linear.mins.data_ptr() if is_int4 and linear.mins is not None else None,
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


def _kquant_spec(linear: KQuantLinear) -> LinearSpec | None:
    """A K-quant layer's LinearSpec: its tiles (the binding's, checked there) in the kquant field, the rest sizes;
    None unless its products are the native int8-activation ones."""
    packed = linear.packed
    if not isinstance(packed, cpu_fast_path.NativeKQuantPacked) or packed.gemv is None or packed.gemm is None:
        return None
    if linear.bias is not None:
        check_elements("a linear layer", "bias", linear.bias, torch.float32, linear.out_features)
    spec = LinearSpec(
        bias=None if linear.bias is None else linear.bias.data_ptr(),
        out_features=linear.out_features,
        in_features=linear.in_features,
        group_size=linear.group_size,
        max_gemv_rows=linear.max_gemv_rows,
        int8_activations=1,
        gemm_rounding=ROUNDINGS.index("int8"),
        kquant=ctypes.pointer(packed.spec),  # the binding's, alive as long as the layer is bound
    )
    return spec


def _stacked_spec(linear: StackedLinear) -> LinearSpec | None:
    """A projection of parts run apart: the parts' LinearSpecs in an array the layer keeps (refreshed in place, so
    that every spec made of the layer points at its current parts), or None unless every part runs natively."""
    parts = [linear_spec(part) for part in linear.parts]
    if any(spec is None for spec in parts):
        return None
    if sum(spec.out_features for spec in parts) != linear.out_features or any(
        spec.in_features != linear.in_features for spec in parts
    ):
        raise ValueError(
            f"a stacked linear layer [{linear.out_features}, {linear.in_features}] has parts "
            f"{[(spec.out_features, spec.in_features) for spec in parts]}: their rows must add up, their columns agree"
        )
    array = getattr(linear, "native_parts", None)
    if array is None:
        array = linear.native_parts = (LinearSpec * len(parts))()
    for index, spec in enumerate(parts):
        array[index] = spec
    return LinearSpec(
        out_features=linear.out_features,
        in_features=linear.in_features,
        max_gemv_rows=max(part.max_gemv_rows for part in linear.parts),
        parts=ctypes.addressof(array),
        num_parts=len(parts),
    )


def _is_index_array(array: torch.Tensor) -> bool:
    return array.dtype == torch.int64 and array.is_cpu and array.is_contiguous()


@dataclass(frozen=True)
class StackShape:
    """The sizes every layer of a stack must have (decoder.cpp's Decoder): the C++ sizes its scratch and reads
    each layer's tensors by these."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # of the dense MLPs (0 where every layer is a mixture of experts)

    def check_linear(self, spec: LinearSpec, what: str, out_features: int, in_features: int) -> None:
        """ValueError unless the bound projection is [out_features, in_features]."""
        if (spec.out_features, spec.in_features) != (out_features, in_features):
            raise ValueError(
                f"native decoder: {what} is [{spec.out_features}, {spec.in_features}], the stack needs "
                f"[{out_features}, {in_features}]"
            )


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


def _moe_spec(moe: SparseMoeBlock, shape: StackShape, keep: list[object]) -> MoeSpec | None:
    """A mixture of experts as decoder.cpp runs it, or None if a part has no native form (gates the CPU's fast
    path routes, every expert projection a native quantized linear); the ctypes structures it points into go into
    `keep`. ValueError where a part's shape is not the stack's (every expert [2I, H] and [H, I] of one I)."""
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
    hidden = shape.hidden_size
    check_elements("native decoder", "the router", moe.gate.weight, torch.float32, len(moe.experts) * hidden)
    width = moe.experts[0].down_proj.in_features
    for gate_up, down in zip(gate_ups, downs):
        shape.check_linear(gate_up, "an expert's gate_up_proj", 2 * width, hidden)
        shape.check_linear(down, "an expert's down_proj", hidden, width)
    if shared:
        shared_width = moe.shared_expert.down_proj.in_features
        shape.check_linear(shared[0], "the shared expert's gate_up_proj", 2 * shared_width, hidden)
        shape.check_linear(shared[1], "the shared expert's down_proj", hidden, shared_width)
        check_elements(
            "native decoder", "the shared expert's gate", moe.shared_expert_gate.weight, torch.float32, hidden
        )
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


def _layer_spec(
    layer: nn.Module, parts: LayerParts, eps: float, shape: StackShape, computed: list[object]
) -> LayerSpec | None:
    """The layer as decoder.cpp runs it, or None if a part has no native kernel (or a dense MLP's width is not the
    stack's); norm weights it computes (Gemma's sums) and the ctypes structures a mixture of experts points into go
    into `computed`, which the decoder keeps alive. ValueError where a bound tensor's shape is not the stack's."""
    norms: dict[str, int | None] = {}
    for name, norm in parts.norms.items():
        if norm is None:
            norms[name] = None
            continue
        if not is_contiguous_f32(norm.weight) or norm.eps != eps:
            return None
        width = shape.head_dim if name in ("q_norm", "k_norm") else shape.hidden_size
        check_elements("native decoder", f"the {name} weight", norm.weight, torch.float32, width)
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
        moe = _moe_spec(mlp, shape, computed)
        if moe is None:
            return None
        projections = [linear_spec(attention.qkv_proj), linear_spec(attention.o_proj), LinearSpec(), LinearSpec()]
    else:
        projections = [
            linear_spec(module) for module in (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
        ]
    if any(spec is None for spec in projections):
        return None
    hidden, q_width = shape.hidden_size, shape.num_heads * shape.head_dim
    shape.check_linear(projections[0], "qkv_proj", q_width + 2 * shape.num_kv_heads * shape.head_dim, hidden)
    shape.check_linear(projections[1], "o_proj", hidden, q_width)
    if moe is None:
        if projections[3].in_features != shape.intermediate_size:
            return None  # the C++ runs every dense MLP at the stack's one width
        shape.check_linear(projections[2], "gate_up_proj", 2 * shape.intermediate_size, hidden)
        shape.check_linear(projections[3], "down_proj", hidden, shape.intermediate_size)
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
        shape: StackShape,
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
            shape.hidden_size,
            shape.num_heads,
            shape.num_kv_heads,
            shape.head_dim,
            shape.intermediate_size,
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
        # The last cache whose every layer's pools were found to fit the stack (cache_problem), held weakly too.
        self._fitting_cache: weakref.ref[KVCache] | None = None

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
        attention = layers[0].self_attn
        dense = [layer.mlp.down_proj.in_features for layer in layers if not isinstance(layer.mlp, SparseMoeBlock)]
        shape = StackShape(
            attention.o_proj.out_features,
            attention.num_heads,
            attention.num_kv_heads,
            attention.head_dim,
            max(dense, default=0),
        )
        specs: list[LayerSpec] = []
        computed: list[object] = []
        for layer in layers:
            parts = layout.parts(layer) if type(layer) is layer_type else None
            spec = None if parts is None else _layer_spec(layer, parts, eps, shape, computed)
            if spec is None:
                return None
            specs.append(spec)
        return cls(kernels, layers, specs, layout, shape, computed)

    def supports(
        self, hidden: torch.Tensor, rope: Rope | tuple[Rope, Rope], kv_cache: KVCache, metadata: AttentionMetadata
    ) -> bool:
        """Whether this step can run natively (see the module docstring)."""
        return self.step_problem(hidden, rope, kv_cache, metadata) is None

    def step_problem(
        self, hidden: torch.Tensor, rope: Rope | tuple[Rope, Rope], kv_cache: KVCache, metadata: AttentionMetadata
    ) -> str | None:
        """Why this step cannot run natively, or None: what the C++ reads of it, by shape (hidden [T, hidden_size]
        float32; rope tables of T × rotary_dim / 2 values; slots [T], block tables [requests, max_blocks], queries
        [n, 3] and chunks [c, 4], int64; the cache as cache_problem says), all contiguous on the CPU."""
        num_tokens = hidden.shape[0] if hidden.dim() == 2 else -1
        if num_tokens < 0 or not is_contiguous_f32(hidden) or hidden.shape[1] != self._decoder.hidden_size:
            return f"hidden must be contiguous float32 [T, {self._decoder.hidden_size}] on the CPU"
        half = self._decoder.rotary_dim // 2
        for pair in self._rope_tables(rope):
            for table in pair:
                if not is_contiguous_f32(table) or table.numel() != num_tokens * half:
                    return f"the rope tables must be contiguous float32 [{num_tokens}, {half}] on the CPU"
        slots, tables = metadata.slot_mapping, metadata.block_tables
        queries, chunks = metadata.kernel_queries, metadata.kernel_chunks
        if (
            not _is_index_array(slots)
            or tuple(slots.shape) != (num_tokens,)
            or not _is_index_array(tables)
            or tables.dim() != 2
            or (queries is not None and (not _is_index_array(queries) or queries.dim() != 2 or queries.shape[1] != 3))
            or (chunks is not None and (not _is_index_array(chunks) or chunks.dim() != 2 or chunks.shape[1] != 4))
        ):
            return (
                f"the attention metadata must be contiguous int64 on the CPU: slots [{num_tokens}], block tables "
                f"[requests, max_blocks], queries [n, 3], chunks [c, 4]"
            )
        return self.cache_problem(kv_cache)

    def supports_cache(self, kv_cache: KVCache) -> bool:
        """Whether a step can run on this cache (one native pool per layer, of the stack's heads), autograd off."""
        return self.cache_problem(kv_cache) is None

    def cache_problem(self, kv_cache: KVCache) -> str | None:
        """Why a step cannot run on this cache, or None: autograd on, or a layer's pools not the native attention's
        (contiguous CPU pools of one native dtype, [>= num_blocks, block_size, num_kv_heads, entry] of the stack's
        heads). Every layer is looked at the first time a cache is seen; later steps on it compare one pointer."""
        if torch.is_grad_enabled():
            return "autograd is on"
        if self._fitting_cache is not None and self._fitting_cache() is kv_cache:
            return None
        if len(kv_cache) != len(self._specs):
            return f"the cache has {len(kv_cache)} layers, the stack {len(self._specs)}"
        dtype = kv_cache[0][0].dtype
        for index, (key_cache, value_cache) in enumerate(kv_cache.layers):
            if (
                not is_native_kv_pool(key_cache, value_cache)
                or key_cache.dtype != dtype
                or key_cache.dim() != 4
                or value_cache.shape != key_cache.shape
                or key_cache.shape[0] < kv_cache.num_blocks
                or key_cache.shape[1] != kv_cache.block_size
                or key_cache.shape[2] != self._decoder.num_kv_heads
                or head_dim_of(key_cache) != self._decoder.head_dim
            ):
                return (
                    f"layer {index}'s pools ({key_cache.dtype} {tuple(key_cache.shape)}) are not contiguous CPU pools "
                    f"of {kv_cache.num_blocks} blocks of {kv_cache.block_size} tokens, {self._decoder.num_kv_heads} "
                    f"heads of {self._decoder.head_dim}, in the dtype of the first layer's"
                )
        self._fitting_cache = weakref.ref(kv_cache)
        return None

    def __call__(
        self, hidden: torch.Tensor, rope: Rope | tuple[Rope, Rope], kv_cache: KVCache, metadata: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, hidden_size] (the embeddings); rope as the model's embed returns it → (last layer's MLP
        output, residual stream before it). ValueError where the step does not fit (step_problem)."""
        problem = self.step_problem(hidden, rope, kv_cache, metadata)
        if problem is not None:
            raise ValueError(f"native decoder: {problem}")
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
        cache or the tables do not suit the stack).

        What the loop's own arrays hold is the caller's to guarantee: GreedyLoop.run makes its first tokens and
        positions, and the outputs, from the same B requests as the block tables, and its rotary tables for every
        position the passes reach. The C++ checks each token id against the embedding's rows and each position
        against the tables before it reads them, and stops there (a shorter count comes back)."""
        if not (self.supports_cache(kv_cache) and _is_index_array(block_tables) and block_tables.dim() == 2):
            return 0
        if loop.num_passes < 0 or loop.vocab_size <= 0 or loop.num_positions < 0:
            raise ValueError(
                f"native decoder: a greedy loop of {loop.num_passes} passes over {loop.vocab_size} rows and "
                f"{loop.num_positions} positions"
            )
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
