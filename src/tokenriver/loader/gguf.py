"""GGUF file → ModelConfig, Hugging Face-named weight tensors, raw tokenizer fields.

The only module that knows llama.cpp's naming: metadata keys
(`llama.attention.head_count`, ...) become ModelConfig fields, tensor names
(`blk.3.attn_q.weight`, ...) become Hugging Face parameter names; what other
architectures (Gemma, Qwen3, Phi-3, mixture-of-experts, the BERT encoders) name
or store differently is in loader/gguf_arch.py. Quantized matrices of every type can
stay packed (loader/gguf_blocks.py re-encodes each GGUF block format into
models/quant.py's formats); every other tensor is dequantized by
`gguf.quants.dequantize`.
The file is memory-mapped and parsed, never unpickled.

One subtlety: for llama-architecture models llama.cpp's converter reorders
the rows of attn_q/attn_k so each head's rotary pairs are interleaved
(x0,x1),(x2,x3),... as its "normal" rope expects. Our model uses Hugging Face's
rotate_half layout, pairing (x_i, x_{i+d/2}), so those rows are put back in
their original order here (as transformers' GGUF loader does).

The header (metadata and tensor table) is read in one pass (loader/gguf_header.py)
the first time a file is seen and indexed in a small JSON cache (loader/gguf_cache.py);
later loads take the index from there. Either way the tensors are sliced out of a
memory map and handed to the same repack/dequantize code below.
"""

from __future__ import annotations

import mmap
import os
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

import gguf
import numpy as np
import torch

from tokenriver.errors import ModelLoadError
from tokenriver.loader import gguf_arch as families
from tokenriver.loader import gguf_cache
from tokenriver.loader.assemble import fused_groups
from tokenriver.loader.gguf_blocks import CONVERSIONS, native_layout, to_packed
from tokenriver.loader.gguf_header import GGUFHeaderError, is_big_endian, read_header
from tokenriver.models.buffers import Allocate, heap_empty
from tokenriver.models.config import ModelConfig
from tokenriver.models.quant import Int4Weight, Int8Weight
from tokenriver.models.registry import canonical_architecture

Q = gguf.GGMLQuantizationType
# Tensor types tokenriver dequantizes (all through gguf.quants.dequantize).
SUPPORTED_TYPES: frozenset[gguf.GGMLQuantizationType] = frozenset(
    {
        Q.F32,
        Q.F16,
        Q.BF16,
        Q.Q4_0,
        Q.Q4_1,
        Q.Q5_0,
        Q.Q5_1,
        Q.Q8_0,
        Q.Q2_K,
        Q.Q3_K,
        Q.Q4_K,
        Q.Q5_K,
        Q.Q6_K,
        Q.IQ1_S,
        Q.IQ1_M,
        Q.IQ2_XXS,
        Q.IQ2_XS,
        Q.IQ2_S,
        Q.IQ3_XXS,
        Q.IQ3_S,
        Q.IQ4_NL,
        Q.IQ4_XS,
    }
)


# GGUF architectures whose converter permuted attn_q/attn_k rows for interleaved rope.
_PERMUTED_QK_ARCHITECTURES = frozenset({"llama"})

# llama.cpp tensor name → Hugging Face parameter name ("{i}" is the layer index).
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass
class GGUFCheckpoint:
    """Everything tokenriver takes from a GGUF file."""

    config: ModelConfig
    # Hugging Face parameter name → tensor in the requested dtype, on CPU (or a packed Int4Weight/Int8Weight).
    weights: dict[str, torch.Tensor | Int4Weight | Int8Weight]
    # Every "tokenizer.*" metadata key → plain Python value (str, int, float, bool or a list of them).
    tokenizer_fields: dict[str, Any]
    # Hugging Face parameter name → the GGUF type the file stores it in (e.g. "Q4_K"), for the startup log.
    stored_types: dict[str, str]


class _Tensor(NamedTuple):
    """One tensor of the file, with the attributes of gguf's ReaderTensor that this module reads."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    # GGUF order: innermost dimension first.
    shape: tuple[int, ...]
    # A read-only view of the mapped file, as GGUFReader gives it (typed for float types, bytes for quantized).
    data: np.ndarray


def read_gguf(
    path: str,
    dtype: torch.dtype = torch.float32,
    keep_quantized: bool = False,
    cache_dir: str | None = None,
    empty: Allocate = heap_empty,
) -> GGUFCheckpoint:
    """Parse a GGUF file; raise ModelLoadError saying what is wrong with it otherwise.

    keep_quantized: quantized matrices come back packed (loader/gguf_blocks.py) instead of dequantized.
    cache_dir: where the header index is cached (None: $XDG_CACHE_HOME/tokenriver or ~/.cache/tokenriver).
    empty: makes the packed tensors the model will hold (the loader's weight arena). The parts of a fused
    projection (q/k/v, gate/up) that convert to one packed format are converted straight into their rows of the
    whole, which build_model then takes without a copy; parts of mixed formats, which it re-packs, go to ordinary
    memory.
    """
    fields, tensor_list, mapped = _read_header(path, cache_dir)
    gguf_arch = fields.get("general.architecture")
    if not isinstance(gguf_arch, str):
        raise ModelLoadError(
            f"{path}: the GGUF metadata has no general.architecture; the file is incomplete, "
            f"convert the model again with llama.cpp's convert_hf_to_gguf.py",
            path=path,
        )
    architecture = canonical_architecture(families.architecture_key(gguf_arch, fields), path)
    tensors = {tensor.name: tensor for tensor in tensor_list}
    config = _config(path, fields, gguf_arch, architecture, tensors)
    named = {
        _hf_name(path, tensor.name, gguf_arch): tensor
        for tensor in _split_stacked_experts(tensor_list)
        if tensor.name not in families.CONFIG_TENSORS
    }  # those are folded into config.rope_scaling
    groups = fused_groups(config.architecture, list(named)) if keep_quantized else []
    allocators = _fused_allocators(groups, named, empty)
    parts = {name for group in groups for name in group}
    weights, stored_types = {}, {}
    for name, tensor in named.items():
        stored_types[name] = tensor.tensor_type.name
        if keep_quantized and tensor.tensor_type in CONVERSIONS and len(tensor.shape) == 2:
            allocate = allocators.get(name, heap_empty if name in parts else empty)
            weights[name] = _repack(path, tensor, gguf_arch, config, allocate)
        else:
            weights[name] = families.as_hf_shape(name, _dequantize(path, tensor, gguf_arch, config).to(dtype))
            if families.stores_norm_plus_one(gguf_arch, tensor.name):
                weights[name] -= 1.0  # Gemma: the file holds 1 + w, the model's parameter is w.
        mapped.release(tensor.data)
    return GGUFCheckpoint(
        config=config, weights=weights, tokenizer_fields=_tokenizer_fields(fields, gguf_arch), stored_types=stored_types
    )


def read_tokenizer_fields(path: str, cache_dir: str | None = None) -> dict[str, Any]:
    """A GGUF file's tokenizer metadata as read_gguf gives it, without reading a tensor (a front end that only
    tokenizes needs no weights)."""
    fields, _, _ = _read_header(path, cache_dir)
    return _tokenizer_fields(fields, fields.get("general.architecture"))


def _tokenizer_fields(fields: dict[str, Any], gguf_arch: str | None) -> dict[str, Any]:
    """Every "tokenizer.*" field, plus the architecture's chat template where the file carries none."""
    tokenizer_fields = {name: value for name, value in fields.items() if name.startswith("tokenizer.")}
    template = families.default_chat_template(gguf_arch) if isinstance(gguf_arch, str) else None
    if template is not None and "tokenizer.ggml.tokens" in tokenizer_fields:
        tokenizer_fields.setdefault("tokenizer.chat_template", template)
    return tokenizer_fields


class _MappedFile:
    """The file mapped read-only. Every tensor is copied into its packed or float form at load, so once one is
    converted its pages are dropped from this process's resident memory (they stay in the page cache): a load
    then peaks at the converted weights plus one tensor, not the whole file on top of them."""

    def __init__(self, path: str) -> None:
        with open(path, "rb") as file:
            self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        self.array = np.frombuffer(self._map, dtype=np.uint8)  # [file_size] uint8, read-only

    def release(self, data: np.ndarray) -> None:
        """Drop the pages under `data` (a view of self.array) from resident memory."""
        start = data.ctypes.data - self.array.ctypes.data
        if start < 0 or start + data.nbytes > self.array.nbytes:
            return  # not a view of this file (a converted copy)
        first = start // mmap.PAGESIZE * mmap.PAGESIZE
        self._map.madvise(mmap.MADV_DONTNEED, first, start + data.nbytes - first)


def _read_header(path: str, cache_dir: str | None) -> tuple[dict[str, Any], list[_Tensor], _MappedFile]:
    """Metadata fields and tensors (views of the mapping, which read_gguf releases as it converts them): from the
    cached index when it matches the file, else read from the file (loader/gguf_header.py) and cached."""
    _check_file(path)
    mapped = _MappedFile(path)
    index = gguf_cache.load_index(path, cache_dir)
    if index is None:
        index = _parse(path, mapped.array)
        header = mapped.array[: index.header_length].tobytes()
        gguf_cache.store_index(path, index, header, os.stat(path), cache_dir)
    tensors = [_Tensor(t.name, t.tensor_type, t.shape, gguf_cache.tensor_array(mapped.array, t)) for t in index.tensors]
    return index.fields, tensors, mapped


def _parse(path: str, data: np.ndarray) -> gguf_cache.GGUFIndex:
    if is_big_endian(data):
        raise ModelLoadError(
            f"{path}: the GGUF file is big-endian, which only a big-endian machine can run (as with llama.cpp); "
            f"convert the model again without --bigendian",
            path=path,
        )
    try:
        return read_header(data)
    except GGUFHeaderError as error:
        raise ModelLoadError(
            f"{path}: the GGUF file is truncated or damaged ({len(data)} bytes; reading its header failed: "
            f"{error}); download or convert it again",
            path=path,
        ) from error


def _check_file(path: str) -> None:
    """The file exists and starts with the GGUF magic."""
    if not os.path.isfile(path):
        raise ModelLoadError(
            f"{path}: no such file; pass the path of a .gguf file or of a Hugging Face model folder", path=path
        )
    with open(path, "rb") as file:
        magic = file.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(
            f"{path}: not a GGUF file (it starts with {magic!r}, a GGUF file starts with b'GGUF'); "
            f"pass a .gguf file, or a Hugging Face folder with config.json and *.safetensors",
            path=path,
        )


def _config(
    path: str, fields: dict[str, Any], gguf_arch: str, architecture: str, tensors: dict[str, _Tensor]
) -> ModelConfig:
    """Translate `{arch}.*` metadata into a ModelConfig."""

    def get(key: str, default: Any = None) -> Any:
        value = fields.get(f"{gguf_arch}.{key}", default)
        if value is None:
            raise ModelLoadError(
                f"{path}: the GGUF metadata lacks {gguf_arch}.{key}; convert the model again with "
                f"a recent llama.cpp convert_hf_to_gguf.py",
                path=path,
            )
        return value

    if "token_embd.weight" not in tensors:
        raise ModelLoadError(
            f"{path}: the GGUF file has no token_embd.weight tensor; it is not a complete model", path=path
        )
    hidden_size = get("embedding_length")
    num_heads = get("attention.head_count")
    head_dim = get("attention.key_length", hidden_size // num_heads)
    rope_dim = get("rope.dimension_count", head_dim)
    if rope_dim != head_dim and gguf_arch != "phi3":
        raise ModelLoadError(
            f"{path}: partial rotary embeddings (rope.dimension_count={rope_dim} < head_dim="
            f"{head_dim}) are not supported for {gguf_arch}",
            path=path,
        )
    values = dict(
        architecture=architecture,
        vocab_size=int(tensors["token_embd.weight"].shape[1]),
        hidden_size=hidden_size,
        intermediate_size=get("feed_forward_length"),
        num_layers=get("block_count"),
        num_heads=num_heads,
        num_kv_heads=get("attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rope_theta=get("rope.freq_base", 10000.0),
        rope_scaling=_rope_scaling(path, fields, gguf_arch, tensors),
        # An encoder's LayerNorms have their own epsilon (gguf_arch.config_fields); it has no RMSNorm.
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-6 if gguf_arch in families.ENCODER_NAMES else None),
        max_position_embeddings=get("context_length"),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        attention_out_bias="blk.0.attn_output.bias" in tensors,
        name=fields.get("general.name") or os.path.basename(path),
        partial_rotary_factor=rope_dim / head_dim,
        pooling=_pooling(path, get("pooling_type", 0)),
    )
    values.update(families.config_fields(gguf_arch, get, tensors))
    if gguf_arch in families.ENCODER_NAMES:
        values["sep_token_id"] = fields.get("tokenizer.ggml.seperator_token_id")  # llama.cpp's spelling
        if "cls.output.weight" in tensors and "cls.weight" not in tensors:
            raise ModelLoadError(
                f"{path}: the classification head has no dense layer before its output (llama.cpp's converter "
                f"leaves out BERT's pooler), so its scores would not be the model's; load the Hugging Face folder "
                f"it was converted from instead",
                path=path,
            )
    if "blk.0.attn_qkv.weight" in tensors:
        values["attention_bias"] = "blk.0.attn_qkv.bias" in tensors
    try:
        return ModelConfig(**values)
    except ModelLoadError as error:
        raise ModelLoadError(f"{path}: {error.message}", path=path) from error


def _pooling(path: str, pooling_type: int) -> str | None:
    """`<arch>.pooling_type` (llama.cpp's enum) → ModelConfig.pooling."""
    if pooling_type not in families.POOLING_TYPES:
        raise ModelLoadError(
            f"{path}: pooling_type={pooling_type} is not one tokenriver knows (0 none, 1 mean, 2 cls, 3 last, 4 rank)",
            path=path,
        )
    return families.POOLING_TYPES[pooling_type]


def _rope_scaling(path: str, fields: dict[str, Any], gguf_arch: str, tensors: dict[str, _Tensor]) -> dict | None:
    """Rope scaling as ModelConfig expects it: from rope.scaling.* keys or llama.cpp's rope_freqs tensor."""
    if "rope_factors_long.weight" in tensors:
        # Phi-3 LongRoPE: per-frequency divisors for short and long contexts, and the attention factor.
        def factors(name: str) -> list[float]:
            values = gguf.quants.dequantize(tensors[name].data, tensors[name].tensor_type)
            return [float(f) for f in np.asarray(values).reshape(-1)]

        scaling = {
            "rope_type": "longrope",
            "long_factor": factors("rope_factors_long.weight"),
            "short_factor": factors("rope_factors_short.weight"),
            "original_max_position_embeddings": fields.get(
                f"{gguf_arch}.rope.scaling.original_context_length", fields[f"{gguf_arch}.context_length"]
            ),
        }
        if f"{gguf_arch}.rope.scaling.attn_factor" in fields:
            scaling["attention_factor"] = float(fields[f"{gguf_arch}.rope.scaling.attn_factor"])
        return scaling
    if "rope_freqs.weight" in tensors:
        # Llama 3.x: the converter stores per-frequency divisors instead of the llama3 formula's parameters.
        factors = gguf.quants.dequantize(tensors["rope_freqs.weight"].data, tensors["rope_freqs.weight"].tensor_type)
        return {"rope_type": "freq_factors", "factors": [float(f) for f in np.asarray(factors).reshape(-1)]}
    scaling_type = fields.get(f"{gguf_arch}.rope.scaling.type", "none")
    if scaling_type == "none":
        return None
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": fields[f"{gguf_arch}.rope.scaling.factor"]}
    raise ModelLoadError(
        f"{path}: rope scaling type {scaling_type!r} is not supported (tokenriver supports linear and Llama 3 scaling)",
        path=path,
    )


def _hf_name(path: str, name: str, gguf_arch: str) -> str:
    """llama.cpp tensor name → Hugging Face parameter name (per-expert names come from _split_stacked_experts)."""
    if gguf_arch in families.ENCODER_NAMES:
        hf_name = families.encoder_name(gguf_arch, name)
    elif name in _GLOBAL_NAMES:
        hf_name = _GLOBAL_NAMES[name]
    elif name.startswith("model.layers."):
        hf_name = name
    else:
        hf_name = _decoder_layer_name(name, gguf_arch)
    if hf_name is None:
        raise ModelLoadError(
            f"{path}: tensor {name!r} has no place in a {gguf_arch} model; the file holds a "
            f"different architecture than its metadata says",
            path=path,
        )
    return hf_name


def _decoder_layer_name(name: str, gguf_arch: str) -> str | None:
    """A decoder layer's tensor ("blk.3.attn_q.weight") → its Hugging Face name, or None."""
    match = _LAYER_TENSOR.fullmatch(name)
    if match is None:
        return None
    layer, part, kind = match.groups()
    module = families.layer_name(gguf_arch, part) or _LAYER_NAMES.get(part)
    return None if module is None else f"model.layers.{layer}.{module}.{kind}"


def _split_stacked_experts(tensors: list[_Tensor]) -> list[_Tensor]:
    """Each stacked expert tensor ([n_expert, out, in]) as one tensor per expert, named as Hugging Face names it;
    every other tensor as it is. The slices are views of the file's data, so packed blocks stay intact."""
    out = []
    for tensor in tensors:
        stacked = families.stacked_experts(tensor.name)
        if stacked is None:
            out.append(tensor)
            continue
        layer, template = stacked
        for expert in range(tensor.shape[2]):
            out.append(
                _Tensor(
                    f"model.layers.{layer}.{template.format(e=expert)}.weight",
                    tensor.tensor_type,
                    tensor.shape[:2],
                    tensor.data[expert],
                )
            )
    return out


def _dequantize(path: str, tensor: _Tensor, gguf_arch: str, config: ModelConfig) -> torch.Tensor:
    """One GGUF tensor → float32 torch tensor in PyTorch's [out_features, in_features] order."""
    if tensor.tensor_type not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise ModelLoadError(
            f"{path}: tensor {tensor.name} is stored as {tensor.tensor_type.name}, which tokenriver "
            f"cannot dequantize (supported: {supported}); re-quantize the model with llama.cpp's "
            f"llama-quantize, e.g. to Q8_0 or Q4_K_M",
            path=path,
        )
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dimensions innermost first.
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    # A writable float32 copy only where needed (F32 tensors come back as read-only views of the mapped file).
    weights = torch.from_numpy(np.require(values, dtype=np.float32, requirements=["C", "W"]).reshape(shape))
    heads = _permuted_heads(tensor.name, gguf_arch, config)
    return weights if heads is None else _unpermute_rope_rows(weights, heads)


def _repack(
    path: str,
    tensor: _Tensor,
    gguf_arch: str,
    config: ModelConfig,
    empty: Allocate,
) -> Int4Weight | Int8Weight:
    """One quantized matrix → packed weight, rows in PyTorch's order. Rows the q/k permutation moved are put back
    before converting: groups run along a row, so moving whole rows of the file's blocks leaves every block intact."""
    data = np.asarray(tensor.data)
    heads = _permuted_heads(tensor.name, gguf_arch, config)
    if heads is not None:
        data = data[_unpermute_rope_rows(torch.arange(data.shape[0]), heads).numpy()]  # [N, row bytes], a copy
    try:
        return to_packed(data, tensor.tensor_type, empty=empty)
    except ModelLoadError as error:
        raise ModelLoadError(f"{path}: tensor {tensor.name}: {error.message}", path=path) from error


def _fused_allocators(groups: list[list[str]], named: dict[str, _Tensor], empty: Allocate) -> dict[str, Allocate]:
    """For each fused projection (`groups`: its parts' names) whose parts all convert natively to one packed format
    over the same in_features: the allocator each part converts with, handing it its rows of the whole."""
    allocators: dict[str, Allocate] = {}
    for names in groups:
        parts = [named[name] for name in names]
        layouts = {native_layout(part.tensor_type) for part in parts}
        if (
            None in layouts
            or len(layouts) > 1
            or any(len(part.shape) != 2 for part in parts)
            or len({part.shape[0] for part in parts}) > 1
        ):  # GGUF order: shape[0] is in_features
            continue
        whole = _FusedRows([int(part.shape[1]) for part in parts], empty)
        for index, name in enumerate(names):
            allocators[name] = whole.allocator(index)
    return allocators


class _FusedRows:
    """The tensors of one fused projection (qweight, scales, mins: as many as the converter asks for), made when
    the first part asks, and handed out to each part as its rows.

    A part whose native conversion declines (a scale float16 cannot hold) is made elsewhere, and build_model then
    copies the parts as it would otherwise; its rows here stay unused.
    """

    def __init__(self, rows: list[int], empty: Allocate) -> None:
        self._starts = [sum(rows[:index]) for index in range(len(rows))]
        self._total = sum(rows)
        self._empty = empty
        self._tensors: list[torch.Tensor] = []

    def allocator(self, index: int) -> Allocate:
        """The allocator of part `index`: its k-th call returns the part's rows of the k-th tensor."""
        calls = 0

        def allocate(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            nonlocal calls
            if calls == len(self._tensors):
                self._tensors.append(self._empty((self._total, *shape[1:]), dtype))
            whole = self._tensors[calls]
            calls += 1
            if whole.dtype != dtype or whole.shape[1:] != tuple(shape[1:]):
                return heap_empty(shape, dtype)
            return whole[self._starts[index] : self._starts[index] + shape[0]]

        return allocate


def _permuted_heads(name: str, gguf_arch: str, config: ModelConfig) -> int | None:
    """Heads of a q/k matrix whose rows llama.cpp's converter permuted; None for every other tensor."""
    if gguf_arch not in _PERMUTED_QK_ARCHITECTURES:
        return None
    if ".attn_q." in name:
        return config.num_heads
    if ".attn_k." in name:
        return config.num_kv_heads
    return None


def _unpermute_rope_rows(weights: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: per head, rows (0, d/2, 1, d/2+1, ...) back to (0, 1, ..., d-1).

    The converter did w.reshape(heads, 2, d/2, ...).swapaxes(1, 2); this is its inverse.
    """
    rows_per_head = weights.shape[0] // num_heads
    rest = weights.shape[1:]
    # [num_heads, head_dim // 2, 2, ...] → [num_heads, 2, head_dim // 2, ...] → back to [out_features, ...]
    return weights.reshape(num_heads, rows_per_head // 2, 2, *rest).transpose(1, 2).reshape(weights.shape).contiguous()
