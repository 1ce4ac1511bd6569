"""Checkpoint tensors (Hugging Face names) → a model instance: fusing, quantizing, placing the weights.

Readers hand over plain float tensors, or GGUF weights of any quantized type already repacked into
models/quant.py's formats (loader/gguf_blocks.py). Here they become the model the engine runs:
- projections the model fuses (q/k/v, gate/up: the class's `fused_projections`) are stacked into one weight;
- with quantization "int8" or "int4", every matrix is brought to that format now; the output projection goes to int8 in
  both modes (it is the largest matrix of a small model and the most sensitive one, as in llama.cpp's
  Q4_K_M files, which keep it at 6 bits);
- each quantized weight replaces its nn.Linear with an Int4Linear/Int8Linear, and a quantized token embedding
  becomes a QuantizedEmbedding reading the same matrix (no float copy of the vocabulary table); the other embedding
  tables (an encoder's position and token-type tables) stay float when quantizing at load;
- the remaining float tensors are assigned in place of the meta-device parameters, after checking that every
  one the model needs is there with the right shape.

`check_shapes` makes the same comparison before any of that, on the shapes alone: a reader calls it before it
converts a tensor, so that a file whose tensors do not fit its config is refused naming the tensor, its shape and
the one expected, not by a failure deep inside a conversion or a product reading past a buffer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from tokenriver.errors import InvalidParameterError, ModelLoadError
from tokenriver.loader.weight_memory import release_freed_heap
from tokenriver.models.buffers import Allocate, heap_empty
from tokenriver.models.config import ModelConfig
from tokenriver.models.kquant import KQuantLinear, KQuantRecords, concatenate_records
from tokenriver.models.quant import (
    Int4Linear,
    Int4Weight,
    Int8Linear,
    Int8Weight,
    QuantizedEmbedding,
    cat_rows,
    concatenate,
    dequantize_packed,
    exact_int8,
    quantize_int4,
    quantize_int8,
)
from tokenriver.models.registry import model_class
from tokenriver.models.row_chains import split_row_chains
from tokenriver.models.stacked import KQuantStack, StackedLinear

QuantWeight = Int4Weight | Int8Weight | KQuantRecords | KQuantStack
Weight = torch.Tensor | QuantWeight
# "auto": keep what the file stores (GGUF quantized types stay packed, float stays float); "none": everything float
# (the reference the tests compare with transformers); "int8"/"int4": also quantize float matrices at load.
QUANTIZATIONS = ("auto", "none", "int8", "int4")
INT4_GROUP_SIZE = 32
INT8_GROUP_SIZE = 32
_EMBEDDING = "model.embed_tokens.weight"
_OUTPUT = "lm_head.weight"
# A mixture of experts' router and shared-expert gate: small, and they decide which experts run, so they stay float
# in every quantization mode, as llama.cpp keeps them (and the native decoder routes with float gates).
_ROUTERS = (".mlp.gate.weight", ".mlp.shared_expert_gate.weight")
# Weights of a packed matrix re-packed at a time when parts of different formats meet as int8 (_int8_pieces).
_CHUNK_ELEMENTS = 1 << 18
# Bytes of weights made after which a build hands the heap it freed back to the OS (_Trimmer).
_TRIM_EVERY_BYTES = 4 * 2**20


def check_quantization(quantization: str) -> None:
    """Refuse an unknown quantization mode, naming the ones there are."""
    if quantization not in QUANTIZATIONS:
        raise InvalidParameterError(
            f"quantization={quantization!r} is not supported: use one of {', '.join(QUANTIZATIONS)}",
            param="quantization",
        )


def build_model(
    config: ModelConfig,
    weights: dict[str, Weight],
    device: str | torch.device,
    path: str = "",
    quantization: str = "auto",
    dtype: torch.dtype = torch.float32,
    empty: Allocate = heap_empty,
    consume: bool = False,
) -> nn.Module:
    """Instantiate config.architecture's class without a random init and give it `weights` (HF names).

    empty: makes the fused projections (the loader's weight arena).
    consume: empty `weights` at once, so that what the model does not keep (the parts of a fused projection that
    stacking copies) is freed as the build goes rather than after it.
    """
    check_quantization(quantization)
    cls = model_class(config.architecture)
    given, weights = weights, dict(weights)
    if consume:
        given.clear()
    if config.tie_word_embeddings and _EMBEDDING in weights:
        weights[_OUTPUT] = weights[_EMBEDDING]
    weights = _fuse(weights, getattr(cls, "fused_projections", {}), empty)
    for name in [n for n in weights if n.endswith(_ROUTERS) and not isinstance(weights[n], torch.Tensor)]:
        weights[name] = dequantize_packed(weights[name])
    model = _meta_model(config)
    # Embedding tables are looked up, not multiplied: quantizing one at load would turn it into a linear layer.
    tables = {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, nn.Embedding)}
    if quantization in ("int8", "int4"):
        weights = _quantize_all(weights, quantization, tables)
    _install_quantized(model, weights, device, dtype, lambda problem: _misfit(config, path, [problem]), tables)
    floats = {
        name: tensor.to(device=device, dtype=dtype)
        for name, tensor in weights.items()
        if isinstance(tensor, torch.Tensor)
    }
    if config.tie_word_embeddings and _EMBEDDING in floats:
        floats[_OUTPUT] = floats[_EMBEDDING]  # One storage for both names.
    _check_fit(model, floats, config, path)
    model.load_state_dict(floats, assign=True, strict=False)
    model.requires_grad_(False)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if isinstance(layers, nn.ModuleList):
        split_row_chains(layers)  # so that tensor parallelism sums as one process does (models/row_chains.py)
    return model.eval()


def check_shapes(
    config: ModelConfig, shapes: dict[str, tuple[int, ...]], path: str, file_names: dict[str, str] | None = None
) -> None:
    """Refuse checkpoint tensors (`shapes`: Hugging Face name → shape in PyTorch's [out, in] order) that build_model
    would refuse for their shapes or names, before any of them is converted; file_names: the name each has in the
    file, for the message. Tensors that are missing are left to build_model, which names them after fusing."""
    expected = expected_shapes(config)
    problems = []
    for name, shape in shapes.items():
        want = expected.get(name)
        label = (file_names or {}).get(name, name)
        if want is None:
            problems.append(f"unexpected: {label}")
        elif len(shape) != len(want) or any(w not in (-1, s) for s, w in zip(shape, want)):
            shown = tuple("any" if w == -1 else w for w in want)
            problems.append(f"wrong shape: {label} {shape} (expected {shown if -1 in want else want})")
    if problems:
        raise _misfit(config, path, problems[:5] + (["..."] if len(problems) > 5 else []))


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight the model of `config` takes from a checkpoint, Hugging Face name → shape ([out, in]); the
    parts of a fused projection under their own names too, as a checkpoint stores them (q/k/v: the heads' rows,
    num_heads and num_kv_heads times head_dim; other groups: equal shares; -1 where the rows cannot be told, for
    parts whose in_features alone are known)."""
    model = _meta_model(config)
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    for target, parts in getattr(type(model), "fused_projections", {}).items():
        for kind in ("weight", "bias"):
            suffix = f".{target}.{kind}"
            for name in [n for n in expected if n.endswith(suffix)]:
                prefix, whole = name[: -len(suffix)], expected[name]
                for part, rows in zip(parts, _part_rows(config, len(parts), whole[0])):
                    expected[f"{prefix}.{part}.{kind}"] = (rows, *whole[1:])
    return expected


def _part_rows(config: ModelConfig, num_parts: int, total: int) -> tuple[int, ...]:
    """The rows of each part of a fused projection of `total` rows: q, k, v for three parts, equal shares else."""
    if num_parts == 3:
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        if q + 2 * kv == total:
            return (q, kv, kv)
    if total % num_parts == 0:
        return (total // num_parts,) * num_parts
    return (-1,) * num_parts


def _meta_model(config: ModelConfig) -> nn.Module:
    """config.architecture's class on the meta device: shapes without storage, and no random init."""
    with SkipInitOnMeta(), torch.device("meta"):
        return model_class(config.architecture)(config)


class SkipInitOnMeta(TorchFunctionMode):
    """Makes torch.nn.init functions no-ops on meta tensors (which hold no values to initialize).

    Why: the model is created on the meta device, and nn.Embedding's normal_ on a meta tensor runs through
    torch._refs, whose first call imports torch._dynamo (and sympy): seconds of start-up for nothing, as every
    parameter is replaced by a checkpoint tensor right after.
    """

    _INIT_FUNCTIONS = frozenset(
        getattr(nn.init, name)
        for name in (
            "uniform_",
            "normal_",
            "trunc_normal_",
            "constant_",
            "ones_",
            "zeros_",
            "eye_",
            "dirac_",
            "xavier_uniform_",
            "xavier_normal_",
            "kaiming_uniform_",
            "kaiming_normal_",
            "orthogonal_",
            "sparse_",
        )
    )

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in self._INIT_FUNCTIONS:
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


def fused_groups(architecture: str, names: list[str]) -> list[list[str]]:
    """The weights (HF names, from `names`) that build_model stacks into each fused projection, in stacking order:
    one list per layer (and expert) that has all of its parts."""
    names_present = set(names)
    groups = []
    for parts in getattr(model_class(architecture), "fused_projections", {}).values():
        suffix = f".{parts[0]}.weight"
        for name in names:
            if name.endswith(suffix):
                group = [f"{name[: -len(suffix)]}.{part}.weight" for part in parts]
                if all(part in names_present for part in group):
                    groups.append(group)
    return groups


def _fuse(weights: dict[str, Weight], fused: dict[str, tuple[str, ...]], empty: Allocate) -> dict[str, Weight]:
    """Stack each fused module's parts (weights and biases) in every layer that has them all. Where stacking
    copies, the parts and the scratch of re-packing them are handed back to the OS at once, so that the copies do
    not add to a load's peak memory."""
    for target, parts in fused.items():
        suffix = f".{parts[0]}.weight"
        for name in [n for n in weights if n.endswith(suffix)]:
            prefix = name[: -len(suffix)]
            for kind in ("weight", "bias"):
                names = [f"{prefix}.{part}.{kind}" for part in parts]
                if all(n in weights for n in names):
                    popped = [weights.pop(n) for n in names]
                    stacked = _stack(popped, empty)
                    weights[f"{prefix}.{target}.{kind}"] = stacked
                    copied = _storage(stacked) != _storage(popped[0])
                    del popped
                    if copied and kind == "weight":
                        release_freed_heap()
    return weights


def _storage(weight: Weight) -> int:
    if isinstance(weight, KQuantStack):
        weight = weight.parts[0]
    if isinstance(weight, KQuantRecords):
        return weight.records.untyped_storage().data_ptr()
    return (weight if isinstance(weight, torch.Tensor) else weight.qweight).untyped_storage().data_ptr()


class _Trimmer:
    """Hands the heap a build freed back to the OS (release_freed_heap) after every _TRIM_EVERY_BYTES of weights
    made: glibc keeps freed pages otherwise, and they would count in the load's peak."""

    def __init__(self) -> None:
        self._made = 0

    def made(self, weight: Weight) -> None:
        """Count `weight`, made just now (its scratch, or the parts it was made of, freed)."""
        if isinstance(weight, KQuantStack):
            tensors = [part.records for part in weight.parts]
        elif isinstance(weight, KQuantRecords):
            tensors = [weight.records]
        else:
            tensors = [weight] if isinstance(weight, torch.Tensor) else [weight.qweight, weight.scales]
        self._made += sum(tensor.nbytes for tensor in tensors)
        if self._made >= _TRIM_EVERY_BYTES:
            release_freed_heap()
            self._made = 0


def _stack(parts: list[Weight], empty: Allocate) -> Weight:
    """Concatenate along out_features. Parts stored alike stay as they are. K-quant parts of different types (a
    Q4_K_M file keeps q and k at Q4_K and v at Q6_K in some layers) stay apart, each at its own size (a
    KQuantStack: models/stacked.py). Other parts in different formats meet as int8 per 32, the packed format that
    holds each of them closest, so the fused projection stays packed."""
    first = parts[0]
    if all(isinstance(p, torch.Tensor) for p in parts):
        return cat_rows(parts, empty)
    if all(isinstance(p, KQuantRecords) for p in parts):
        if len({p.layout for p in parts}) > 1:
            return KQuantStack(tuple(parts))
        return concatenate_records(parts, empty)
    if all(
        isinstance(p, (Int4Weight, Int8Weight)) and type(p) is type(first) and p.group_size == first.group_size
        for p in parts
    ):
        return concatenate(parts, empty)
    return concatenate([piece for part in parts for piece in _int8_pieces(part)], empty)


def _as_int8(weight: Weight) -> Int8Weight:
    pieces = _int8_pieces(weight)
    return pieces[0] if len(pieces) == 1 else concatenate(pieces)


def _int8_pieces(weight: Weight) -> list[Int8Weight]:
    """`weight` as int8 per 32, in pieces of rows (of about _CHUNK_ELEMENTS weights each, so that a float copy of a
    large matrix is never whole): its codes where they are exactly int8 under the same scales, else dequantized
    and rounded again. Each row is converted alone, so the pieces are the rows of one conversion of the whole."""
    if isinstance(weight, Int8Weight) and weight.group_size == INT8_GROUP_SIZE:
        return [weight]
    if isinstance(weight, torch.Tensor):
        return [quantize_int8(weight.float(), INT8_GROUP_SIZE)]
    rows = max(1, _CHUNK_ELEMENTS // weight.shape[1])
    chunks = [_rows(weight, start, start + rows) for start in range(0, weight.shape[0], rows)]
    if isinstance(weight, Int4Weight):
        exact = [exact_int8(chunk) for chunk in chunks]
        if all(piece is not None for piece in exact):  # exact for every row: exact for the whole
            return exact
    return [
        quantize_int8(
            (chunk.dequantize() if isinstance(chunk, KQuantRecords) else dequantize_packed(chunk)).float(),
            INT8_GROUP_SIZE,
        )
        for chunk in chunks
    ]


def _rows(weight: QuantWeight, start: int, stop: int) -> QuantWeight:
    """Rows [start, stop) of a packed weight (row-major layout), as views."""
    if isinstance(weight, KQuantRecords):
        return weight.rows(start, stop)
    if isinstance(weight, Int8Weight):
        return Int8Weight(weight.qweight[start:stop], weight.scales[start:stop], weight.group_size)
    high_bits = None if weight.high_bits is None else weight.high_bits[start:stop]
    return Int4Weight(
        weight.qweight[start:stop], weight.scales[start:stop], weight.mins[start:stop], weight.group_size, high_bits
    )


def _quantize_all(weights: dict[str, Weight], quantization: str, tables: set[str]) -> dict[str, Weight]:
    """Bring every linear matrix to the requested format: float ones are quantized, packed ones of the other
    format dequantized and quantized again; the output projection (and a tied embedding with it) goes to int8.
    Embedding tables (`tables`) keep their format."""
    out = dict(weights)
    for name, weight in weights.items():
        if (
            name == _EMBEDDING
            or name in tables
            or name.endswith(_ROUTERS)
            or (isinstance(weight, torch.Tensor) and weight.dim() != 2)
        ):
            continue
        target = Int8Weight if name == _OUTPUT or quantization == "int8" else Int4Weight
        if isinstance(weight, target) or weight.shape[1] % INT4_GROUP_SIZE:
            continue
        matrix = weight if isinstance(weight, torch.Tensor) else weight.dequantize()
        out[name] = quantize_int8(matrix) if target is Int8Weight else quantize_int4(matrix, INT4_GROUP_SIZE)
    if _EMBEDDING in weights and weights[_EMBEDDING] is weights.get(_OUTPUT):
        out[_EMBEDDING] = out[_OUTPUT]
    return out


def _install_quantized(
    model: nn.Module,
    weights: dict[str, Weight],
    device: str | torch.device,
    dtype: torch.dtype,
    misfit: Callable[[str], ModelLoadError],
    tables: set[str],
) -> None:
    """Swap in an Int4Linear/Int8Linear for each nn.Linear whose weight is quantized, popping the weight (and
    its bias) from `weights`; a quantized embedding reads its rows from the output layer when the two are tied.
    Another quantized embedding table (`tables`: an encoder's word embeddings in a GGUF file) becomes a
    QuantizedEmbedding of its own. Each weight's shape must be the module's (the native kernels trust it): else
    misfit's error."""
    embedding = weights.get(_EMBEDDING)
    for name in sorted(tables - {_EMBEDDING}):
        table = weights.get(name)
        if table is None or isinstance(table, torch.Tensor):
            continue
        del weights[name]
        module_name = name.removesuffix(".weight")
        _check_shape(model, module_name, table, misfit)
        model.set_submodule(module_name, QuantizedEmbedding(_quantized_linear(table, None, device), dtype))
    installed: dict[int, nn.Module] = {}  # id(weight) → its layer
    trim = _Trimmer()
    for name in [n for n, w in weights.items() if not isinstance(w, torch.Tensor) and n != _EMBEDDING]:
        module_name = name.removesuffix(".weight")
        weight = weights.pop(name)
        _check_shape(model, module_name, weight, misfit)
        layer = _quantized_linear(weight, weights.pop(f"{module_name}.bias", None), device)
        installed[id(weight)] = layer
        trim.made(weight)  # the scratch of laying it out for the kernels
        model.set_submodule(module_name, layer)
    if embedding is not None and not isinstance(embedding, torch.Tensor):
        del weights[_EMBEDDING]
        _check_shape(model, "model.embed_tokens", embedding, misfit)
        table = installed.get(id(embedding)) or _quantized_linear(embedding, None, device)
        model.set_submodule("model.embed_tokens", QuantizedEmbedding(table, dtype))


def _check_shape(
    model: nn.Module, module_name: str, weight: QuantWeight, misfit: Callable[[str], ModelLoadError]
) -> None:
    try:
        expected = tuple(model.get_submodule(module_name).weight.shape)
    except AttributeError:
        raise misfit(f"unexpected: {module_name}.weight") from None
    if tuple(weight.shape) != expected:
        raise misfit(f"wrong shape: {module_name}.weight {tuple(weight.shape)} (expected {expected})")


def _quantized_linear(
    weight: QuantWeight, bias: torch.Tensor | None, device: str | torch.device
) -> Int4Linear | Int8Linear | KQuantLinear | StackedLinear:
    bias = None if bias is None else bias.to(device)
    if isinstance(weight, KQuantStack):
        return StackedLinear(weight.to(device), bias)
    if isinstance(weight, KQuantRecords):
        return KQuantLinear(weight.to(device), bias)
    if isinstance(weight, Int4Weight) and weight.high_bits is not None and torch.device(device).type != "cpu":
        # The GPU kernel reads 4-bit codes: 5-bit ones (Q5_0) go there as the int8 codes they equal.
        weight = _as_int8(weight)
    if isinstance(weight, Int4Weight):
        high_bits = None if weight.high_bits is None else weight.high_bits.to(device)
        return Int4Linear(
            Int4Weight(
                weight.qweight.to(device),
                weight.scales.to(device),
                weight.mins.to(device),
                weight.group_size,
                high_bits,
            ),
            bias,
        )
    return Int8Linear(Int8Weight(weight.qweight.to(device), weight.scales.to(device), weight.group_size), bias)


def _check_fit(model: nn.Module, floats: dict[str, torch.Tensor], config: ModelConfig, path: str) -> None:
    """Every parameter still on the meta device must come from the checkpoint, with its shape; nothing else may."""
    expected = {name: tensor for name, tensor in model.state_dict().items() if tensor.is_meta}
    missing = sorted(set(expected) - set(floats))
    unexpected = sorted(set(floats) - set(expected))
    mismatched = [
        f"{name} {tuple(floats[name].shape)} (expected {tuple(expected[name].shape)})"
        for name in sorted(set(expected) & set(floats))
        if floats[name].shape != expected[name].shape
    ]
    if missing or unexpected or mismatched:
        problems = [
            f"{label}: {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}"
            for label, names in (("missing", missing), ("unexpected", unexpected), ("wrong shape", mismatched))
            if names
        ]
        raise _misfit(config, path, problems)


def _misfit(config: ModelConfig, path: str, problems: list[str]) -> ModelLoadError:
    """The error for weights that do not fit the model the config describes."""
    return ModelLoadError(
        f"{path}: the weights do not fit a {config.architecture} model with this config "
        f"({'; '.join(problems)}); the file is incomplete or mislabeled",
        path=path,
    )
