"""Where the row-parallel projections split a row's sum, so that tensor parallelism gives one process's bits.

Tensor parallelism (distributed/sharding.py) cuts o_proj and down_proj by input columns: a rank multiplies its
columns, and the ranks' partial sums are added. One process sums a row's 32-column blocks in one chain
(models/cpu/csrc/gemv.cpp, "one arithmetic per row"), which no split reproduces: a rank's partial starts from zero.
So one process sums these two products' rows in sub-chains instead, one per run of columns between the boundaries
that any of 2, 4 and 8 ranks would draw, and adds the runs' results in order. A rank computes each of its runs as a
product of its own; the ranks gather every run's result and each adds them in the same order (RowParallel), which
is what one process computed. This holds for the int8-activation products (the default); with float32 activations
the ranks agree with one process to float rounding.

The runs follow the model's own units: kv heads (with their query heads) for o_proj, groups of 32 columns (or of
the weight's quantization group) of the MLP's features for down_proj.
"""

from __future__ import annotations

from torch import nn

from tokenriver.models.quant import QuantizedLinear

# The rank counts whose boundaries the runs include. Other counts run too, adding their ranks' partial sums.
EXACT_TENSOR_PARALLEL_SIZES = (2, 4, 8)
BLOCK = 32  # columns a product's block sums (the int8 activation rounding's run)


def partition(num_units: int, world_size: int, rank: int) -> tuple[int, int]:
    """The [start, end) run of num_units that rank keeps: contiguous, sizes differing by at most one."""
    base, extra = divmod(num_units, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def run_boundaries(num_units: int) -> list[int]:
    """The ends of the runs, in units: every boundary a supported rank count draws, and num_units."""
    ends = {num_units}
    for world_size in EXACT_TENSOR_PARALLEL_SIZES:
        if world_size <= num_units:
            ends |= {partition(num_units, world_size, rank)[1] for rank in range(world_size)}
    return sorted(ends)


def feature_unit(down_proj: nn.Module) -> int:
    """The columns of down_proj a rank's share is counted in: whole quantization groups, at least 32."""
    group_size = getattr(down_proj, "group_size", BLOCK)
    return BLOCK if group_size == down_proj.in_features else max(group_size, BLOCK)


def projection_runs(layer: nn.Module) -> dict[str, tuple[int, int]]:
    """{"o_proj": (units, columns per unit), "down_proj": (...)} of a Llama-family decoder layer (a fused qkv_proj
    and gate_up_proj, as sharding.py takes them), or {} for any other."""
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    needs = ("qkv_proj", "o_proj", "num_heads", "num_kv_heads", "head_dim")
    if not all(hasattr(attention, name) for name in needs) or not all(
        hasattr(mlp, name) for name in ("gate_up_proj", "down_proj")
    ):
        return {}
    heads_per_kv = attention.num_heads // attention.num_kv_heads
    unit = feature_unit(mlp.down_proj)
    return {
        "o_proj": (attention.num_kv_heads, heads_per_kv * attention.head_dim),
        "down_proj": (mlp.down_proj.in_features // unit, unit),
    }


def split_row_chains(layers: nn.ModuleList) -> None:
    """Give every layer's quantized o_proj and down_proj their runs as sub-chains (module docstring); where a
    boundary does not fall on a block of 32 columns, the product keeps one chain (no rank count splits it there)."""
    for layer in layers:
        for name, (num_units, unit_columns) in projection_runs(layer).items():
            owner = layer.self_attn if name == "o_proj" else layer.mlp
            projection = getattr(owner, name)
            if not isinstance(projection, QuantizedLinear) or unit_columns % BLOCK:
                continue
            ends = run_boundaries(num_units)
            projection.split_row_chains(None if len(ends) == 1 else [end * unit_columns // BLOCK for end in ends])
