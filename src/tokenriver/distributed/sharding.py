"""Cut a loaded Llama-family model into one rank's shard, after loading and without touching the model's code.

Megatron's split, per decoder layer:
- attention: rank r keeps a contiguous run of kv heads and the query heads that read them. qkv_proj is
  column-parallel (its output rows for those heads: q rows, then k rows, then v rows); o_proj is row-parallel
  (its input columns for those query heads), so each rank's o_proj output is a partial sum: one all-reduce.
- MLP: rank r keeps a contiguous run of the intermediate features. gate_up_proj keeps those gate rows and those
  up rows; down_proj keeps those input columns and its output is again a partial sum: one all-reduce.
Embedding, norms, rotary tables and the output head stay whole on every rank: after each all-reduce every rank
holds the same hidden state, so they compute the same logits and, from the same plan, sample the same tokens.

Heads need not divide evenly: the embedded model has 3 kv heads, so at 2 ranks one rank keeps 2 and the other 1.
Quantized weights (models/quant.py) are cut as packed blocks, never dequantized: rows of qweight/scales/mins for
a column-parallel layer; for a row-parallel layer the input columns at a multiple of the group size (32 columns
of a 4-bit weight are 16 bytes of nibbles), which also keeps the int8 activation rounding, per 32 columns, the same
as on one rank. A row-parallel bias is added on rank 0 only.
Sharded layers run the module path: the fused one-call decoder binds only whole quantized layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenriver.distributed.group import TensorParallelGroup
from tokenriver.errors import InvalidParameterError
from tokenriver.models.contract import CausalLM
from tokenriver.models.quant import Int4Linear, Int4Weight, Int8Linear, Int8Weight
from tokenriver.models.row_chains import BLOCK, feature_unit, partition, projection_runs, run_boundaries


class RowParallel(nn.Module):
    """A row-parallel projection: this rank's runs of input columns (models/row_chains.py), each a product of its
    own; every rank gathers all the runs' results and adds them in order, then the bias: one process's sum."""

    def __init__(
        self, runs: list[nn.Module], runs_per_rank: list[int], bias: torch.Tensor | None, group: TensorParallelGroup
    ) -> None:
        super().__init__()
        self.runs = nn.ModuleList(runs)
        self.runs_per_rank = runs_per_rank
        self.register_buffer("bias", bias)
        self.group = group
        self.in_features = sum(run.in_features for run in runs)
        self.out_features = runs[0].out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, this rank's in_features] → [T, out_features], the same on every rank."""
        partials, start = [], 0
        for run in self.runs:
            partials.append(run(x[..., start : start + run.in_features].contiguous()))
            start += run.in_features
        slots = max(self.runs_per_rank)
        partials += [torch.zeros_like(partials[0])] * (slots - len(partials))  # all_gather takes equal shapes
        gathered = self.group.all_gather(torch.stack(partials))  # [ranks, slots, T, out_features]
        results = [gathered[rank, i] for rank, count in enumerate(self.runs_per_rank) for i in range(count)]
        total = results[0]
        for result in results[1:]:
            total = total + result
        return total if self.bias is None else total + self.bias


def _quantized_like(
    layer: Int4Linear | Int8Linear, weight: Int4Weight | Int8Weight, bias: torch.Tensor | None
) -> Int4Linear | Int8Linear:
    cls = Int4Linear if isinstance(layer, Int4Linear) else Int8Linear
    shard = cls(
        weight, bias, backend=layer.backend, max_gemv_rows=layer.max_gemv_rows, int8_activations=layer.int8_activations
    )
    if shard.gemm_rounding != layer.gemm_rounding:
        shard.set_rounded_gemm(layer.gemm_rounding is not None)
    return shard


def take_rows(layer: nn.Module, runs: list[tuple[int, int]]) -> nn.Module:
    """A column-parallel shard: the output rows [start, end) of each run, in order, as one layer of the same kind."""
    index = torch.cat([torch.arange(start, end) for start, end in runs]).to(_weight_device(layer))  # [rows]
    bias = None if layer.bias is None else layer.bias.detach().index_select(0, index)
    if isinstance(layer, (Int4Linear, Int8Linear)):
        whole = layer.row_major_weight()
        if isinstance(whole, Int4Weight):
            high_bits = None if whole.high_bits is None else whole.high_bits.index_select(0, index)
            weight = Int4Weight(
                whole.qweight.index_select(0, index),
                whole.scales.index_select(0, index),
                whole.mins.index_select(0, index),
                whole.group_size,
                high_bits,
            )
        else:
            weight = Int8Weight(
                whole.qweight.index_select(0, index), whole.scales.index_select(0, index), whole.group_size
            )
        return _quantized_like(layer, weight, bias)
    if isinstance(layer, nn.Linear):
        return _linear(layer.weight.detach().index_select(0, index), bias)
    raise InvalidParameterError(
        f"tensor parallelism cannot shard a {type(layer).__name__}; it shards nn.Linear, Int4Linear and Int8Linear",
        param="tensor_parallel_size",
    )


def take_columns(layer: nn.Module, start: int, end: int, keep_bias: bool) -> nn.Module:
    """A row-parallel shard: the input columns [start, end); the bias only where keep_bias (one rank adds it)."""
    bias = layer.bias.detach() if keep_bias and layer.bias is not None else None
    if isinstance(layer, (Int4Linear, Int8Linear)):
        per_channel = layer.group_size == layer.in_features
        unit = BLOCK if per_channel else layer.group_size
        if start % unit or end % unit:
            raise InvalidParameterError(
                f"a rank's share of {layer.in_features} input columns, [{start}, {end}), does not fall on the "
                f"weight's groups of {unit}: use a tensor_parallel_size that splits the heads at such a boundary",
                param="tensor_parallel_size",
            )
        whole = layer.row_major_weight()
        # Per-channel scales ([N, 1]) stay whole; the shard's one group is its own columns.
        scales = whole.scales if per_channel else whole.scales[:, start // unit : end // unit]
        group_size = end - start if per_channel else layer.group_size
        if isinstance(whole, Int4Weight):
            # Within each 32-column run, byte j holds columns j and j + 16: a run of 32 columns is 16 whole bytes.
            mins = whole.mins if per_channel else whole.mins[:, start // unit : end // unit]
            # The fifth bits are a word per 32 columns, and unit is a multiple of 32.
            high_bits = None if whole.high_bits is None else whole.high_bits[:, start // 32 : end // 32].contiguous()
            weight = Int4Weight(
                whole.qweight[:, start // 2 : end // 2].contiguous(),
                scales.contiguous(),
                mins.contiguous(),
                group_size,
                high_bits,
            )
        else:
            weight = Int8Weight(whole.qweight[:, start:end].contiguous(), scales.contiguous(), group_size)
        return _quantized_like(layer, weight, bias)
    if isinstance(layer, nn.Linear):
        return _linear(layer.weight.detach()[:, start:end].contiguous(), bias)
    raise InvalidParameterError(
        f"tensor parallelism cannot shard a {type(layer).__name__}; it shards nn.Linear, Int4Linear and Int8Linear",
        param="tensor_parallel_size",
    )


def _weight_device(layer: nn.Module) -> torch.device:
    weight = layer.qweight if isinstance(layer, (Int4Linear, Int8Linear)) else layer.weight
    return weight.device


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An nn.Linear around given tensors (no fresh initialization to overwrite)."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta", dtype=weight.dtype)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias, requires_grad=False)
    return layer


@dataclass(frozen=True)
class ShardLayout:
    """What one rank keeps of every layer (the same for all layers)."""

    # Query heads [start, end) and kv heads [start, end) of this rank.
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    # MLP intermediate features [start, end) of this rank.
    intermediate: tuple[int, int]

    @property
    def num_kv_heads(self) -> int:
        """kv heads this rank's KV cache holds."""
        return self.kv_heads[1] - self.kv_heads[0]


def shard_layout(
    num_heads: int, num_kv_heads: int, intermediate_size: int, world_size: int, rank: int, unit: int = BLOCK
) -> ShardLayout:
    """Split kv heads (with their query heads) and the MLP's features (in runs of `unit`) across world_size ranks."""
    if num_kv_heads < world_size:
        raise InvalidParameterError(
            f"tensor_parallel_size={world_size} exceeds the model's {num_kv_heads} kv heads: every rank needs at "
            f"least one; use at most {num_kv_heads}",
            param="tensor_parallel_size",
        )
    if intermediate_size % unit or intermediate_size // unit < world_size:
        raise InvalidParameterError(
            f"the MLP's {intermediate_size} features do not split into {world_size} runs of whole {unit}-column "
            f"groups; use a smaller tensor_parallel_size",
            param="tensor_parallel_size",
        )
    group = num_heads // num_kv_heads
    kv_start, kv_end = partition(num_kv_heads, world_size, rank)
    feature_start, feature_end = partition(intermediate_size // unit, world_size, rank)
    return ShardLayout(
        (kv_start * group, kv_end * group), (kv_start, kv_end), (feature_start * unit, feature_end * unit)
    )


def shard_decoder_layers(layers: nn.ModuleList, group: TensorParallelGroup) -> ShardLayout:
    """Replace, in place, every layer's attention and MLP projections with this rank's shards (module docstring).

    Takes Llama-family layers: `self_attn` with a fused `qkv_proj` and `o_proj` and head counts, `mlp` with a fused
    `gate_up_proj` and `down_proj`. Anything else is refused with a clear error.
    """
    first = layers[0]
    if not projection_runs(first):  # what models/row_chains.py calls a Llama-family layer
        raise InvalidParameterError(
            f"tensor parallelism shards Llama-family layers (fused qkv_proj / gate_up_proj); "
            f"{type(first).__name__} is not one",
            param="tensor_parallel_size",
        )
    attention, mlp = first.self_attn, first.mlp
    intermediate_size = mlp.down_proj.in_features
    layout = shard_layout(
        attention.num_heads,
        attention.num_kv_heads,
        intermediate_size,
        group.world_size,
        group.rank,
        feature_unit(mlp.down_proj),
    )
    for layer in layers:
        runs = projection_runs(layer)
        _shard_attention(layer.self_attn, layout, runs["o_proj"], group)
        _shard_mlp(layer.mlp, layout, intermediate_size, runs["down_proj"], group)
    return layout


def rank_runs(num_units: int, world_size: int) -> list[list[tuple[int, int]]]:
    """Each rank's runs of units, [start, end): models/row_chains.py's runs, cut also where this world size draws
    a rank's boundary (for 2, 4 and 8 ranks it draws none of its own, so the sums are one process's)."""
    ends = sorted(set(run_boundaries(num_units)) | {partition(num_units, world_size, r)[1] for r in range(world_size)})
    runs = list(zip([0, *ends[:-1]], ends, strict=True))
    shares = [partition(num_units, world_size, rank) for rank in range(world_size)]
    return [[(start, end) for start, end in runs if low <= start and end <= high] for low, high in shares]


def row_parallel(layer: nn.Module, units: tuple[int, int], group: TensorParallelGroup) -> RowParallel:
    """This rank's RowParallel of a row-parallel projection cut in (number of units, columns per unit)."""
    num_units, unit_columns = units
    runs = rank_runs(num_units, group.world_size)
    shards = [take_columns(layer, start * unit_columns, end * unit_columns, False) for start, end in runs[group.rank]]
    bias = None if layer.bias is None else layer.bias.detach()
    return RowParallel(shards, [len(share) for share in runs], bias, group)


def _shard_attention(
    attention: nn.Module, layout: ShardLayout, o_units: tuple[int, int], group: TensorParallelGroup
) -> None:
    head_dim, num_heads, num_kv_heads = attention.head_dim, attention.num_heads, attention.num_kv_heads
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    (h_start, h_end), (kv_start, kv_end) = layout.heads, layout.kv_heads
    # qkv_proj's output rows: [q of all heads | k of all kv heads | v of all kv heads].
    attention.qkv_proj = take_rows(
        attention.qkv_proj,
        [
            (h_start * head_dim, h_end * head_dim),
            (q_size + kv_start * head_dim, q_size + kv_end * head_dim),
            (q_size + kv_size + kv_start * head_dim, q_size + kv_size + kv_end * head_dim),
        ],
    )
    attention.o_proj = row_parallel(attention.o_proj, o_units, group)
    attention.num_heads = h_end - h_start
    attention.num_kv_heads = kv_end - kv_start
    attention.q_size = attention.num_heads * head_dim


def _shard_mlp(
    mlp: nn.Module,
    layout: ShardLayout,
    intermediate_size: int,
    down_units: tuple[int, int],
    group: TensorParallelGroup,
) -> None:
    start, end = layout.intermediate
    # gate_up_proj's output rows: [gate of all features | up of all features].
    mlp.gate_up_proj = take_rows(mlp.gate_up_proj, [(start, end), (intermediate_size + start, intermediate_size + end)])
    mlp.down_proj = row_parallel(mlp.down_proj, down_units, group)


def shard_model(model: nn.Module, group: TensorParallelGroup) -> ShardLayout:
    """Shard a loaded causal LM (its `model.layers`) for this rank, in place, and drop any binding the fast path
    made of the old weights."""
    if not isinstance(model, CausalLM) or len(model.model.layers) == 0:
        raise InvalidParameterError(
            f"tensor parallelism needs a decoder with `model.layers`; {type(model).__name__} has none",
            param="tensor_parallel_size",
        )
    layout = shard_decoder_layers(model.model.layers, group)
    # .to() the device it is on: a no-op for the weights, but every module's _apply hook forgets what it bound.
    device = next(model.parameters()).device
    model.to(device)
    return layout
