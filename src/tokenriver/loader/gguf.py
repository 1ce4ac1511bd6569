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

A damaged or mislabeled file is refused before any tensor is converted, with a ModelLoadError that names what is
wrong, in this order: the header's counts and lengths against the file (gguf_header.read_header); the tensors' data
laid out as llama.cpp lays it out (gguf_header.check_layout: a damaged dimension, type or offset shows as a tensor
that no longer meets the next); each metadata value the config takes of the kind and range it must have (sizes
positive integers, the layer count that of the layers the tensors are named for, the expert count that of the
stacked experts, the head count dividing the width); then every tensor's type and shape against the model the config
describes (assemble.check_shapes). What is converted after that fits what the kernels will read.
"""

from __future__ import annotations

import logging
import math
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
from tokenriver.loader.assemble import check_shapes, fused_groups
from tokenriver.loader.gguf_blocks import CONVERSIONS, FIVE_BIT, PackedWeight, native_layout, to_packed
from tokenriver.loader.gguf_header import GGUFHeaderError, check_layout, is_big_endian, read_header
from tokenriver.models.buffers import Allocate, heap_empty
from tokenriver.models.config import ModelConfig
from tokenriver.models.kquant import KQuantRecords, concatenate_records
from tokenriver.models.quant import Int4Weight, Int8Weight, concatenate
from tokenriver.models.registry import canonical_architecture

logger = logging.getLogger(__name__)

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


# Bytes of a quantized matrix converted at a time (_convert_in_chunks): the file pages resident during a load.
_CHUNK_BYTES = 4 * 2**20

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
_LAYER_INDEX = re.compile(r"blk\.(\d+)\.")
# Tensors the config reads a row count from: each must be a matrix.
_MATRICES_READ_BY_CONFIG = ("token_embd.weight", "output.weight", "token_types.weight", "cls.output.weight")


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
    opened: GGUFFile | None = None,
    kquant: bool = False,
) -> GGUFCheckpoint:
    """Parse a GGUF file; raise ModelLoadError saying what is wrong with it otherwise.

    keep_quantized: quantized matrices come back packed (loader/gguf_blocks.py) instead of dequantized.
    cache_dir: where the header index is cached (None: $XDG_CACHE_HOME/tokenriver or ~/.cache/tokenriver).
    empty: makes the packed tensors the model will hold (the loader's weight arena). The parts of a fused
    projection (q/k/v, gate/up) that convert to one packed format are converted straight into their rows of the
    whole, which build_model then takes without a copy; parts of mixed formats, which it re-packs, go to ordinary
    memory.
    opened: the file as open_gguf gave it (the loader reads the header first, to build the tokenizer before the
    weights); its tokenizer_fields are whatever it still holds.
    kquant: with keep_quantized, the K-quant (Q2_K to Q6_K) matrices stay at their own size (models/kquant.py).
    """
    opened = open_gguf(path, cache_dir) if opened is None else opened
    fields, tensor_list, mapped = opened.fields, opened.tensors, opened.mapped
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
    _check_tensors(path, config, named)
    groups = fused_groups(config.architecture, list(named)) if keep_quantized else []
    allocators = _fused_allocators(groups, named, empty, kquant)
    parts = {name for group in groups for name in group}
    weights, stored_types = {}, {}
    for name, tensor in named.items():
        stored_types[name] = tensor.tensor_type.name
        if keep_quantized and tensor.tensor_type in CONVERSIONS and len(tensor.shape) == 2:
            allocate = allocators.get(name, heap_empty if name in parts else empty)
            weights[name] = _repack(path, tensor, gguf_arch, config, allocate, mapped, kquant)
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
    return open_gguf(path, cache_dir).take_tokenizer_fields()


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
        """Drop the pages under `data` (a view of self.array), and every page before them, from resident memory.

        Why all before: a page fault on a file mapping maps the cached pages around the faulting one too ("fault
        around", 64 KiB or a whole large folio), so converting a tensor maps back some pages of the tensors before
        it. Tensors are converted in file order, and dropping a range whose pages are not mapped costs only the
        walk of its page tables."""
        start = data.ctypes.data - self.array.ctypes.data
        if start < 0 or start + data.nbytes > self.array.nbytes:
            return  # not a view of this file (a converted copy)
        self._map.madvise(mmap.MADV_DONTNEED, 0, start + data.nbytes)


# Tokenizer fields the model's config reads too (an encoder derives its token types from the [SEP] id).
_MODEL_TOKENIZER_FIELDS = frozenset({"tokenizer.ggml.seperator_token_id"})


@dataclass
class GGUFFile:
    """A GGUF file opened for reading: its metadata, and its tensors as views of the file's read-only mapping (which
    read_gguf releases as it converts them)."""

    # Every metadata key → plain Python value (field.contents()).
    fields: dict[str, Any]
    tensors: list[_Tensor]
    mapped: _MappedFile

    def take_tokenizer_fields(self) -> dict[str, Any]:
        """The tokenizer's fields (read_gguf's tokenizer_fields), taken out of `fields`: the vocabulary is most of
        a header, and a loader that builds the tokenizer first need not keep it while the weights load."""
        tokenizer_fields = _tokenizer_fields(self.fields, self.fields.get("general.architecture"))
        self.fields = {
            name: value
            for name, value in self.fields.items()
            if not name.startswith("tokenizer.") or name in _MODEL_TOKENIZER_FIELDS
        }
        return tokenizer_fields


def open_gguf(path: str, cache_dir: str | None = None) -> GGUFFile:
    """Metadata fields and tensors: from the cached index when it matches the file, else read from the file
    (loader/gguf_header.py) and cached."""
    _check_file(path)
    mapped = _MappedFile(path)
    index = gguf_cache.load_index(path, cache_dir)
    if index is None:
        index = _parse(path, mapped.array)
        header = mapped.array[: index.header_length].tobytes()
        gguf_cache.store_index(path, index, header, os.stat(path), cache_dir)
        mapped.release(mapped.array[: index.header_length])
    _check_index(path, index)
    tensors = [_Tensor(t.name, t.tensor_type, t.shape, gguf_cache.tensor_array(mapped.array, t)) for t in index.tensors]
    return GGUFFile(index.fields, tensors, mapped)


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


def _check_index(path: str, index: gguf_cache.GGUFIndex) -> None:
    """What the header parser cannot see alone (the index may come from the cache): the tensors' data laid out as
    llama.cpp lays it out (gguf_header.check_layout). A vocabulary with more tokens than the embedding has rows is
    only logged: the engine refuses a prompt holding an id past the rows (prompts.check_prompt), and files written
    for tests of the tokenizer alone carry such vocabularies."""
    try:
        check_layout(index)
    except GGUFHeaderError as error:
        raise ModelLoadError(
            f"{path}: the GGUF file is damaged ({error}); download or convert it again", path=path
        ) from error
    tokens = index.fields.get("tokenizer.ggml.tokens")
    embedding = next((tensor for tensor in index.tensors if tensor.name == "token_embd.weight"), None)
    if isinstance(tokens, list) and embedding is not None and len(embedding.shape) == 2:
        if len(tokens) > embedding.shape[1]:
            logger.warning(
                "%s: the vocabulary has %d tokens but token_embd.weight has %d rows: prompts holding a token id "
                "from %d on will be refused",
                path,
                len(tokens),
                embedding.shape[1],
                embedding.shape[1],
            )


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


class _Metadata:
    """A file's `{arch}.*` metadata, read with the checks a damaged file needs: each value present (or defaulted) and,
    for sizes and numbers, of the kind a config can hold; the error names the key and the file."""

    def __init__(self, path: str, fields: dict[str, Any], gguf_arch: str) -> None:
        self.path, self.fields, self.gguf_arch = path, fields, gguf_arch

    def get(self, key: str, default: Any = None) -> Any:
        value = self.fields.get(f"{self.gguf_arch}.{key}", default)
        if value is None:
            raise ModelLoadError(
                f"{self.path}: the GGUF metadata lacks {self.gguf_arch}.{key}; convert the model again with "
                f"a recent llama.cpp convert_hf_to_gguf.py",
                path=self.path,
            )
        return value

    def count(self, key: str, default: Any = None) -> int:
        """A size: an integer of at least 1 (a boolean is not one)."""
        value = self.get(key, default)
        if type(value) is not int or value < 1:
            raise ModelLoadError(
                f"{self.path}: the GGUF metadata says {self.gguf_arch}.{key}={value!r}, which is not a positive "
                f"integer; the file is damaged",
                path=self.path,
            )
        return value

    def number(self, key: str, default: Any = None, positive: bool = False) -> float:
        """A finite number, greater than 0 with `positive`, else at least 0."""
        value = self.get(key, default)
        if type(value) not in (int, float) or not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise ModelLoadError(
                f"{self.path}: the GGUF metadata says {self.gguf_arch}.{key}={value!r}, which is not a finite number "
                f"{'above' if positive else 'of at least'} 0; the file is damaged",
                path=self.path,
            )
        return value


def _config(
    path: str, fields: dict[str, Any], gguf_arch: str, architecture: str, tensors: dict[str, _Tensor]
) -> ModelConfig:
    """Translate `{arch}.*` metadata into a ModelConfig."""
    meta = _Metadata(path, fields, gguf_arch)
    _check_config_tensors(path, tensors)
    # Checked before anything is sized by it: a damaged count would otherwise build billions of layers or experts.
    num_layers = meta.count("block_count")
    _check_counts_against_tensors(path, fields, gguf_arch, num_layers, tensors)
    hidden_size, num_heads, head_dim, rope_dim = _head_sizes(meta)
    vocab_size = _vocab_size(path, fields, gguf_arch, tensors)
    context_length = meta.count("context_length")
    values = dict(
        architecture=architecture,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=meta.count("feed_forward_length"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=meta.count("attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rope_theta=meta.number("rope.freq_base", 10000.0, positive=True),
        rope_scaling=_rope_scaling(path, fields, gguf_arch, tensors, rope_dim, context_length),
        # An encoder's LayerNorms have their own epsilon (gguf_arch.config_fields); it has no RMSNorm.
        rms_norm_eps=meta.number(
            "attention.layer_norm_rms_epsilon", 1e-6 if gguf_arch in families.ENCODER_NAMES else None
        ),
        max_position_embeddings=context_length,
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        attention_out_bias="blk.0.attn_output.bias" in tensors,
        name=fields.get("general.name") or os.path.basename(path),
        partial_rotary_factor=rope_dim / head_dim,
        pooling=_pooling(path, meta.get("pooling_type", 0)),
    )
    values.update(families.config_fields(gguf_arch, meta.get, tensors))
    if gguf_arch in families.ENCODER_NAMES:
        values["sep_token_id"] = fields.get("tokenizer.ggml.seperator_token_id")  # llama.cpp's spelling
        _check_classification_head(path, tensors)
    if "blk.0.attn_qkv.weight" in tensors:
        values["attention_bias"] = "blk.0.attn_qkv.bias" in tensors
    try:
        return ModelConfig(**values)
    except ModelLoadError as error:
        raise ModelLoadError(f"{path}: {error.message}", path=path) from error


def _check_config_tensors(path: str, tensors: dict[str, _Tensor]) -> None:
    """The tensors the config is read from are matrices, and the embedding is there."""
    for name in _MATRICES_READ_BY_CONFIG:
        if name in tensors and len(tensors[name].shape) != 2:
            raise ModelLoadError(
                f"{path}: tensor {name} has shape {list(tensors[name].shape)}, but it must be a matrix; the file is "
                f"damaged",
                path=path,
            )
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(
            f"{path}: the GGUF file has no token_embd.weight tensor; it is not a complete model", path=path
        )


def _head_sizes(meta: _Metadata) -> tuple[int, int, int, int]:
    """(hidden size, query heads, head size, rotary dimensions), each checked against the others."""
    path, gguf_arch = meta.path, meta.gguf_arch
    hidden_size = meta.count("embedding_length")
    num_heads = meta.count("attention.head_count")
    if f"{gguf_arch}.attention.key_length" not in meta.fields and hidden_size % num_heads:
        raise ModelLoadError(
            f"{path}: {gguf_arch}.embedding_length={hidden_size} is not a multiple of {gguf_arch}.attention.head_count="
            f"{num_heads}, and the file has no attention.key_length to give the head size; the metadata is damaged",
            path=path,
        )
    head_dim = meta.count("attention.key_length", hidden_size // num_heads)
    rope_dim = meta.count("rope.dimension_count", head_dim)
    if rope_dim != head_dim and gguf_arch != "phi3":
        raise ModelLoadError(
            f"{path}: rope.dimension_count={rope_dim} differs from the head size {head_dim}, which tokenriver "
            f"supports (partial rotary embeddings) only for phi3, not {gguf_arch}; the file is damaged, or a "
            f"variant tokenriver does not run",
            path=path,
        )
    return hidden_size, num_heads, head_dim, rope_dim


def _vocab_size(path: str, fields: dict[str, Any], gguf_arch: str, tensors: dict[str, _Tensor]) -> int:
    """The embedding's rows, which the metadata's vocab_size (where it has one) must equal."""
    vocab_size = int(tensors["token_embd.weight"].shape[1])
    stated_vocab_size = fields.get(f"{gguf_arch}.vocab_size", vocab_size)
    if stated_vocab_size != vocab_size:
        raise ModelLoadError(
            f"{path}: the GGUF metadata says {gguf_arch}.vocab_size={stated_vocab_size!r}, but token_embd.weight has "
            f"{vocab_size} rows; the file is damaged",
            path=path,
        )
    return vocab_size


def _check_classification_head(path: str, tensors: dict[str, _Tensor]) -> None:
    """An encoder's classification head has its dense layer (llama.cpp's converter leaves out BERT's pooler)."""
    if "cls.output.weight" in tensors and "cls.weight" not in tensors:
        raise ModelLoadError(
            f"{path}: the classification head has no dense layer before its output (llama.cpp's converter "
            f"leaves out BERT's pooler), so its scores would not be the model's; load the Hugging Face folder "
            f"it was converted from instead",
            path=path,
        )


def _check_counts_against_tensors(
    path: str, fields: dict[str, Any], gguf_arch: str, num_layers: int, tensors: dict[str, _Tensor]
) -> None:
    """The layer count (block_count) is the number of layers the tensors are named for (blk.0 … blk.N-1), and an
    expert count the expert dimension of every stacked expert tensor. A file of no layer tensors at all (a test's
    file of its embedding alone, read for its config) has its layer count bounded by its tensor count."""
    layers = {int(match.group(1)) for name in tensors if (match := _LAYER_INDEX.match(name))}
    held = max(layers, default=-1) + 1
    if num_layers != held and (held > 0 or num_layers > len(tensors)):
        raise ModelLoadError(
            f"{path}: the GGUF metadata says {gguf_arch}.block_count={num_layers}, but the file holds the tensors of "
            f"{held} layers{f' (blk.0 to blk.{held - 1})' if held else ''}; the file is damaged",
            path=path,
        )
    num_experts = fields.get(f"{gguf_arch}.expert_count", 0)
    stacked = [tensor for name, tensor in tensors.items() if families.stacked_experts(name) is not None]
    if not stacked and not num_experts:
        return
    if not stacked or any(len(tensor.shape) != 3 or tensor.shape[2] != num_experts for tensor in stacked):
        shapes = ", ".join(f"{tensor.name} {list(tensor.shape)}" for tensor in stacked[:2]) or "no expert tensors"
        raise ModelLoadError(
            f"{path}: the GGUF metadata says {gguf_arch}.expert_count={num_experts!r}, which does not match the "
            f"stacked experts ({shapes}: experts last); the file is damaged",
            path=path,
        )


def _check_tensors(path: str, config: ModelConfig, named: dict[str, _Tensor]) -> None:
    """Before any tensor is converted: each one's type is one tokenriver reads, and its shape the one the model the
    config describes takes (assemble.check_shapes), named as the file names it."""
    for tensor in named.values():
        if tensor.tensor_type not in SUPPORTED_TYPES:
            _refuse_type(path, tensor)
    shapes = {name: families.hf_shape(name, tuple(int(d) for d in reversed(t.shape))) for name, t in named.items()}
    check_shapes(config, shapes, path, {name: tensor.name for name, tensor in named.items()})


def _refuse_type(path: str, tensor: _Tensor) -> None:
    supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
    raise ModelLoadError(
        f"{path}: tensor {tensor.name} is stored as {tensor.tensor_type.name}, which tokenriver "
        f"cannot dequantize (supported: {supported}); re-quantize the model with llama.cpp's "
        f"llama-quantize, e.g. to Q8_0 or Q4_K_M",
        path=path,
    )


def _pooling(path: str, pooling_type: Any) -> str | None:
    """`<arch>.pooling_type` (llama.cpp's enum) → ModelConfig.pooling."""
    if type(pooling_type) is not int or pooling_type not in families.POOLING_TYPES:
        raise ModelLoadError(
            f"{path}: pooling_type={pooling_type} is not one tokenriver knows (0 none, 1 mean, 2 cls, 3 last, 4 rank)",
            path=path,
        )
    return families.POOLING_TYPES[pooling_type]


def _rope_scaling(
    path: str, fields: dict[str, Any], gguf_arch: str, tensors: dict[str, _Tensor], rotary_dim: int, context_length: int
) -> dict | None:
    """Rope scaling as ModelConfig expects it: from rope.scaling.* keys or llama.cpp's rope_freqs tensor. Factor
    tensors hold one positive divisor per rotated pair (rotary_dim / 2); scalar factors are positive numbers."""

    def factors(name: str) -> list[float]:
        tensor = tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"{path}: the GGUF file has rope_factors_long.weight but no {name}", path=path)
        if tensor.tensor_type not in SUPPORTED_TYPES:
            _refuse_type(path, tensor)
        values = [float(f) for f in np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type)).reshape(-1)]
        if len(values) != rotary_dim // 2 or not all(math.isfinite(f) and f > 0 for f in values):
            raise ModelLoadError(
                f"{path}: tensor {name} must hold {rotary_dim // 2} positive rope factors (one per rotated pair), "
                f"it holds {len(values)} values{'' if len(values) != rotary_dim // 2 else ' not all positive'}; "
                f"the file is damaged",
                path=path,
            )
        return values

    def number(key: str, default: Any) -> float:
        value = fields.get(f"{gguf_arch}.{key}", default)
        if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
            raise ModelLoadError(
                f"{path}: the GGUF metadata says {gguf_arch}.{key}={value!r}, which is not a positive number; the "
                f"file is damaged",
                path=path,
            )
        return value

    if "rope_factors_long.weight" in tensors:
        # Phi-3 LongRoPE: per-frequency divisors for short and long contexts, and the attention factor.
        scaling = {
            "rope_type": "longrope",
            "long_factor": factors("rope_factors_long.weight"),
            "short_factor": factors("rope_factors_short.weight"),
            "original_max_position_embeddings": number("rope.scaling.original_context_length", context_length),
        }
        if f"{gguf_arch}.rope.scaling.attn_factor" in fields:
            scaling["attention_factor"] = float(number("rope.scaling.attn_factor", None))
        return scaling
    if "rope_freqs.weight" in tensors:
        # Llama 3.x: the converter stores per-frequency divisors instead of the llama3 formula's parameters.
        return {"rope_type": "freq_factors", "factors": factors("rope_freqs.weight")}
    scaling_type = fields.get(f"{gguf_arch}.rope.scaling.type", "none")
    if scaling_type == "none":
        return None
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": number("rope.scaling.factor", None)}
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
        _refuse_type(path, tensor)
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
    mapped: _MappedFile,
    kquant: bool,
) -> PackedWeight:
    """One quantized matrix → packed weight, rows in PyTorch's order. Rows the q/k permutation moved are put back
    before converting: groups run along a row, so moving whole rows of the file's blocks leaves every block intact."""
    data = np.asarray(tensor.data)
    heads = _permuted_heads(tensor.name, gguf_arch, config)
    if heads is not None:
        data = data[_unpermute_rope_rows(torch.arange(data.shape[0]), heads).numpy()]  # [N, row bytes], a copy
        mapped.release(tensor.data)
    try:
        return _convert_in_chunks(data, tensor.tensor_type, empty, mapped, kquant)
    except ModelLoadError as error:
        raise ModelLoadError(f"{path}: tensor {tensor.name}: {error.message}", path=path) from error


def _convert_in_chunks(
    data: np.ndarray, tensor_type: gguf.GGMLQuantizationType, empty: Allocate, mapped: _MappedFile, kquant: bool
) -> PackedWeight:
    """to_packed over chunks of rows of at most _CHUNK_BYTES, each converted into its rows of the whole and its
    pages of the file dropped then, so that a large matrix (a vocabulary's embedding) never has all of its file
    pages resident at once. Every rule converts rows independently, so the result is that of one call."""
    rows_per_chunk = max(1, _CHUNK_BYTES // max(1, data.shape[-1]))
    if data.ndim != 2 or data.shape[0] <= rows_per_chunk:
        return to_packed(data, tensor_type, empty=empty, kquant=kquant)
    starts = range(0, data.shape[0], rows_per_chunk)
    whole = _FusedRows([min(rows_per_chunk, data.shape[0] - start) for start in starts], empty)
    parts = []
    for index, start in enumerate(starts):
        chunk = data[start : start + rows_per_chunk]
        parts.append(to_packed(chunk, tensor_type, empty=whole.allocator(index), kquant=kquant))
        mapped.release(chunk)
    if len({(type(part), getattr(part, "high_bits", None) is None) for part in parts}) > 1:
        # A rule that picks its format from the values (Q5_0 keeps int8 codes where a scale is huge) picked
        # differently for some chunks: the whole matrix at once, as one call picks.
        return to_packed(data, tensor_type, empty=empty, kquant=kquant)
    if isinstance(parts[0], KQuantRecords):
        return concatenate_records(parts, empty)
    return concatenate(parts, empty)


def _fused_allocators(
    groups: list[list[str]], named: dict[str, _Tensor], empty: Allocate, kquant: bool
) -> dict[str, Allocate]:
    """For each fused projection (`groups`: its parts' names) whose parts all convert natively to one packed format
    over the same in_features (K-quants at their own size: of one type, whose fields are alike): the allocator each
    part converts with, handing it its rows of the whole."""
    allocators: dict[str, Allocate] = {}
    for names in groups:
        parts = [named[name] for name in names]
        layouts = {native_layout(part.tensor_type, kquant) for part in parts}
        if (
            None in layouts
            or len(layouts) > 1
            or (KQuantRecords in layouts and len({part.tensor_type for part in parts}) > 1)
            or any(len(part.shape) != 2 for part in parts)
            or len({part.shape[0] for part in parts}) > 1
        ):  # GGUF order: shape[0] is in_features
            continue
        # Where 4-bit parts meet 5-bit ones, stacking makes the fifth bits anew (zeros for the 4-bit parts).
        five_bit = {part.tensor_type in FIVE_BIT for part in parts}
        whole = _FusedRows([int(part.shape[1]) for part in parts], empty, num_shared=3 if len(five_bit) > 1 else None)
        for index, name in enumerate(names):
            allocators[name] = whole.allocator(index)
    return allocators


class _FusedRows:
    """The tensors of one fused projection (qweight, scales, mins: as many as the converter asks for), made when
    the first part asks, and handed out to each part as its rows.

    A part whose native conversion declines (a scale float16 cannot hold) is made elsewhere, and build_model then
    copies the parts as it would otherwise; its rows here stay unused. num_shared: tensors past the first
    num_shared (the fifth bits of 5-bit parts beside 4-bit ones, which stacking makes anew) are made on the heap.
    """

    def __init__(self, rows: list[int], empty: Allocate, num_shared: int | None = None) -> None:
        self._starts = [sum(rows[:index]) for index in range(len(rows))]
        self._total = sum(rows)
        self._empty = empty
        self._num_shared = num_shared
        self._tensors: list[torch.Tensor] = []

    def allocator(self, index: int) -> Allocate:
        """The allocator of part `index`: its k-th call returns the part's rows of the k-th tensor."""
        calls = 0

        def allocate(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            nonlocal calls
            if self._num_shared is not None and calls >= self._num_shared:
                return heap_empty(shape, dtype)
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
